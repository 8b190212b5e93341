"""What a run's settings ask of Redis, checked at start (pure): settings that validate one by one but
would break a run together fail with an error naming them.

* **Entries in flight vs ``redis.maxlen``.** Admission (``admission.py``) lets the groups of the batches
  up to ``version + max_staleness + prefetch_steps`` be in flight at once: ``(max_staleness +
  prefetch_steps + 1) x prompts_per_step`` groups of ``group_size`` trajectories, plus an evaluation
  round's ``eval.num_prompts``. All of them can sit unread in one stream (the reward tier is down, or
  slow); a stream capped below that (``maxlen`` is every stream's hard cap) trims entries nobody has
  read, and their groups are lost until ``group_timeout_s``.
* **A training batch vs Redis's largest argument.** A batch is one stream entry, and Redis refuses an
  argument over ``proto-max-bulk-len`` (512 MiB by default). A batch holds ``prompts_per_step x
  group_size`` samples of at most ``tokens`` tokens each, about :data:`BYTES_PER_TOKEN` bytes a
  token encoded. ``tokens`` is the rollout engine's ``max_model_len`` (it bounds prompt and response)
  when the recipe gives it, else at least ``sampling.max_new_tokens``.
"""

from __future__ import annotations

PROTO_MAX_BULK_LEN = 512 * 2**20
"""Redis's default ``proto-max-bulk-len``: the largest argument (here: a batch entry) it accepts (bytes)."""
BYTES_PER_TOKEN = 13
"""Encoded bytes of one token of a sample: its id (int32), behaviour log-prob (float32), loss mask (uint8)
and its share of the prompt and response text (~4 bytes)."""


def entries_in_flight(
    *, prompts_per_step: int, group_size: int, max_staleness: int, prefetch_steps: int, eval_prompts: int
) -> int:
    """Most entries one stream can hold unread: the trajectories of every group admission lets be in
    flight, and one evaluation round's prompts."""
    return (max_staleness + prefetch_steps + 1) * prompts_per_step * group_size + eval_prompts


def maxlen_problem(
    *, maxlen: int, prompts_per_step: int, group_size: int, max_staleness: int, prefetch_steps: int, eval_prompts: int
) -> str | None:
    """Why ``redis.maxlen`` is too small for the entries in flight, or None."""
    needed = entries_in_flight(
        prompts_per_step=prompts_per_step,
        group_size=group_size,
        max_staleness=max_staleness,
        prefetch_steps=prefetch_steps,
        eval_prompts=eval_prompts,
    )
    if maxlen >= needed:
        return None
    evals = f" + eval.num_prompts {eval_prompts}" if eval_prompts else ""
    return (
        f"redis.maxlen ({maxlen}) is below the entries a stream can hold in flight: (max_staleness {max_staleness} "
        f"+ prefetch_steps {prefetch_steps} + 1) x prompts_per_step {prompts_per_step} x group_size {group_size}"
        f"{evals} = {needed}; unread entries would be trimmed and their groups lost. Raise redis.maxlen to at "
        f"least {needed} or lower those"
    )


def batch_bytes(*, prompts_per_step: int, group_size: int, tokens: int) -> int:
    """Largest encoded size of one training batch (bytes, approximate)."""
    return prompts_per_step * group_size * tokens * BYTES_PER_TOKEN


def batch_size_problem(*, prompts_per_step: int, group_size: int, tokens: int, tokens_field: str) -> str | None:
    """Why a batch could outgrow Redis's largest argument, or None; ``tokens_field`` names where the
    bound on a sample's tokens comes from."""
    size = batch_bytes(prompts_per_step=prompts_per_step, group_size=group_size, tokens=tokens)
    if size <= PROTO_MAX_BULK_LEN:
        return None
    return (
        f"a training batch can reach ~{size / 2**20:,.0f} MiB (prompts_per_step {prompts_per_step} x group_size "
        f"{group_size} x {tokens_field} {tokens} tokens x ~{BYTES_PER_TOKEN} bytes), over Redis's largest argument "
        f"(proto-max-bulk-len, {PROTO_MAX_BULK_LEN // 2**20} MiB): the batch could never be published. Lower "
        f"prompts_per_step, group_size or {tokens_field}"
    )
