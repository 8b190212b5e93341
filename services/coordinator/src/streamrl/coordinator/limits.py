"""What a run's settings ask of Redis, checked at start (pure): settings that validate one by one but
would break a run together fail with an error naming them.

* **Entries in flight vs ``redis.maxlen``.** Admission (``admission.py``) lets the groups of the batches
  up to ``version + max_staleness + prefetch_steps`` be in flight at once: ``(max_staleness +
  prefetch_steps + 1) x prompts_per_step`` groups of ``group_size`` trajectories, plus an evaluation
  round's ``eval.num_prompts``. All of them can sit unread in one stream (the reward tier is down, or
  slow); a stream capped below that (``maxlen`` is every stream's hard cap) trims entries nobody has
  read, and their groups are lost until ``group_timeout_s``.

(A training batch is not bounded here: it travels by reference, a manifest split into parts of at most 1 MiB,
its payloads read by the learner in bounded replies - ``batches.py``.)
"""

from __future__ import annotations


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
