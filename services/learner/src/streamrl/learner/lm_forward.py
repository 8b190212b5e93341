"""Training forwards of a causal LM: unpadded (varlen) decoder body, then a fused log-prob head.

Every learner path that needs per-token log-probs of a causal LM goes through here: the SFT job
(packed or single-sample rows), DPO (chosen and rejected responses) and the RL step (prompt +
response rows). The rows are laid end to end as one row with no padding
(:func:`streamrl.learner.packing.flatten_rows`, or :func:`flatten_padded` for right-padded
tensors) and the decoder body runs once over it with varlen attention
(:mod:`streamrl.learner.varlen_attention`: each sequence attends only to itself). Then only the
positions that have a target go through the output head, fused with the log-softmax
(:mod:`streamrl.learner.fused_head`) unless ``logprob_head = "full"`` or the head cannot be fused
(a bias, a ZeRO-3 partitioned weight), in which case the head module's logits are used.

The body and head are called directly, not through the DeepSpeed engine's forward: ZeRO-1/2 hook
gradients, not forwards. Under ZeRO-3 that gave wrong gradients (a 1-rank RL step's gradient norm
1.56 instead of 2.60), so there the flat row goes through the engine's forward as one whole model
call (varlen attention still) and the picked positions' logits are used.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from streamrl.learner.ds_config import DeepSpeedConfig
from streamrl.learner.fused_head import fusable, linear_logprobs, linear_nll
from streamrl.learner.logprobs import IGNORE_INDEX, entropy, token_logprobs
from streamrl.learner.packing import Row, flatten_rows, unflatten
from streamrl.learner.varlen_attention import varlen_kwargs

if TYPE_CHECKING:
    from streamrl.learner.model_batch import RLBatch


Engine = Any
"""A :class:`~streamrl.learner.engine.ModelEngine`, or a plain (Hugging Face / peft) causal LM."""


def _model(engine: Engine) -> Any:
    return getattr(engine, "module", engine)


def lm_parts(engine: Engine) -> tuple[Any, Any]:
    """``(decoder body, output head)`` of the engine's causal LM (through a peft wrapper if any)."""
    model = _model(engine)
    base = model.get_base_model() if hasattr(model, "peft_config") else model
    body = getattr(base, getattr(base, "base_model_prefix", "model"), None)
    head = base.get_output_embeddings()
    if body is None or head is None:
        raise ValueError(f"{type(base).__name__} is not a causal LM with a decoder body and an output head")
    return body, head


def body_hidden(
    engine: Engine, input_ids: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int
) -> torch.Tensor:
    """``[n, H]`` final hidden states of one flat row ``[1, n]`` of sequences delimited by ``cu_seqlens``."""
    body, _ = lm_parts(engine)
    device = next(_model(engine).parameters()).device
    attn = getattr(body.config, "_attn_implementation", None)
    out = body(
        input_ids=to_device(input_ids, device),
        position_ids=to_device(position_ids, device),
        **varlen_kwargs(to_device(cu_seqlens, device), max_seqlen, device, attn),
    )
    return out.last_hidden_state[0]


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without waiting for the GPU: a plain ``.to(cuda)`` of pageable memory
    synchronizes the stream, so the host would stop queueing work until the GPU caught up."""
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def head_logprobs(
    engine: Engine,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    cfg: DeepSpeedConfig,
    temperature: torch.Tensor | None = None,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs ``[m]`` (float32) of ``targets`` from hidden states ``[m, H]`` at a per-token
    ``temperature`` (None = 1), and optionally the entropies; fused unless the config or the head says not."""
    _, head = lm_parts(engine)
    targets = to_device(targets, hidden.device)
    if temperature is not None:
        temperature = to_device(temperature.float(), hidden.device)
    if zero3(engine):  # ``hidden`` are the logits already (:func:`features`)
        logits = hidden
    elif cfg.logprob_head == "fused" and fusable(head):
        return linear_logprobs(hidden, head.weight, targets, temperature, with_entropy, cfg.head_chunk_tokens)
    else:
        logits = head(hidden)
    if temperature is not None:
        logits = logits / temperature[:, None]
    return token_logprobs(logits, targets), (entropy(logits) if with_entropy else None)


def zero3(engine: Engine) -> bool:
    """Whether the engine's parameters are ZeRO-3 partitioned."""
    return hasattr(next(_model(engine).parameters()), "ds_id")


def features(
    engine: Engine, input_ids: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int
) -> torch.Tensor:
    """``[n, H]`` final hidden states of one flat row; under ZeRO-3 ``[n, V]`` logits of the whole model
    called through the engine (see the module docstring). :func:`head_logprobs` takes either."""
    if not zero3(engine):
        return body_hidden(engine, input_ids, position_ids, cu_seqlens, max_seqlen)
    device = next(_model(engine).parameters()).device
    attn = getattr(_model(engine).config, "_attn_implementation", None)
    out = engine(
        input_ids=to_device(input_ids, device),
        position_ids=to_device(position_ids, device),
        **varlen_kwargs(to_device(cu_seqlens, device), max_seqlen, device, attn),
    )
    return out.logits[0]


def _flat_targets(engine: Engine, rows: Sequence[Row]) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """Features (:func:`features`) of the positions of ``rows`` that have a target, those targets, and the layout."""
    flat = flatten_rows(rows)
    hidden = features(engine, flat.input_ids, flat.position_ids, flat.cu_seqlens, flat.max_seqlen)
    picked = (flat.targets != IGNORE_INDEX).nonzero().squeeze(-1)
    return hidden[to_device(picked, hidden.device)], flat.targets[picked], (flat, picked)


def rows_logprobs(engine: Engine, rows: Sequence[Row], cfg: DeepSpeedConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """``[rows, longest]`` per-token log-probs of the next-token targets of ``rows`` (0 where none) and
    the mask of positions that have a target."""
    hidden, targets, (flat, picked) = _flat_targets(engine, rows)
    logp, _ = head_logprobs(engine, hidden, targets, cfg)
    full = torch.zeros(flat.targets.shape[0], dtype=torch.float32, device=logp.device)
    full = full.index_put((to_device(picked, logp.device),), logp)
    mask = to_device(flat.targets != IGNORE_INDEX, logp.device)
    return unflatten(full, flat.row_lengths), unflatten(mask, flat.row_lengths, fill=False)


def rows_nll(engine: Engine, rows: Sequence[Row], cfg: DeepSpeedConfig) -> tuple[torch.Tensor, int]:
    """Token-mean negative log-likelihood of the targets of ``rows`` and the number of target tokens."""
    hidden, targets, _ = _flat_targets(engine, rows)
    count = int(targets.numel())
    _, head = lm_parts(engine)
    if cfg.logprob_head == "fused" and fusable(head) and not zero3(engine):
        weights = torch.full((count,), 1.0 / max(count, 1), dtype=torch.float32, device=hidden.device)
        loss, _ = linear_nll(hidden, head.weight, to_device(targets, hidden.device), weights, cfg.head_chunk_tokens)
        return loss, count
    logp, _ = head_logprobs(engine, hidden, targets, cfg)
    return -logp.sum() / max(count, 1), count


def flatten_padded(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Right-padded rows ``[b, L]`` laid end to end: ``(ids [1, n], positions [1, n], cu_seqlens, row starts [b])``."""
    keep = attention_mask.bool()
    lengths = keep.sum(dim=1)
    if not bool((keep == (torch.arange(keep.shape[1])[None, :] < lengths[:, None])).all()):
        raise ValueError("rows must be right-padded: the attention mask is 1 for a prefix of each row")
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.int32)
    cu[1:] = lengths.cumsum(0)
    positions = torch.arange(keep.shape[1]).expand_as(keep)[keep]
    return input_ids[keep][None, :], positions[None, :], cu, cu[:-1].long()


def rl_response_logprobs(
    engine: Engine, mb: RLBatch, cfg: DeepSpeedConfig, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``[b, T]`` log-probs of each response token at its sample's temperature (0 after the response),
    and the entropies when asked: the RL step's policy / reference pass, unpadded and fused."""
    ids, positions, cu, starts = flatten_padded(mb.input_ids, mb.attention_mask)
    lengths = cu[1:].long() - starts
    response_lens = lengths - mb.prompt_lens
    width = mb.response_ids.shape[1]
    if bool(((mb.prompt_lens < 1) & (response_lens > 0)).any()):
        raise ValueError("every sample with a response needs a prompt of at least one token")
    steps = torch.arange(width)[None, :]
    inside = steps < response_lens[:, None]
    where = (starts + mb.prompt_lens - 1)[:, None] + steps  # flat position whose output predicts response token t
    hidden = features(engine, ids, positions, cu, int(lengths.max()))
    device = hidden.device
    temperature = mb.temperatures[:, None].expand(-1, width)[inside]
    logp, ent = head_logprobs(
        engine, hidden[to_device(where[inside], device)], mb.response_ids[inside], cfg, temperature, with_entropy
    )
    inside = to_device(inside, device)
    out = torch.zeros(inside.shape, dtype=torch.float32, device=device).index_put((inside,), logp)
    ent_out = None if ent is None else torch.zeros_like(out).index_put((inside,), ent)
    return out, ent_out
