"""Attention over variable-length sequences laid end to end ("varlen"), as a transformers attention backend.

Packed training rows and unpadded batches hold several sequences in one row; each token may only
see the earlier tokens of its own sequence. transformers' sdpa backend expresses that as a dense
``[rows, 1, L, L]`` block-diagonal mask, which rules out the flash kernel and costs memory and time
quadratic in the row length. Here the sequences are given instead by their boundaries
(``cu_seq_lens`` = cumulative lengths, the flash-attention convention) and attention runs:

* on CUDA, in torch's own flash-attention varlen kernel (``torch.nn.attention.varlen``): no mask,
  no padding, work proportional to sum(len_i^2);
* elsewhere (CPU, or a torch without that module), as sdpa over the sequences gathered into a
  padded batch - the same numbers, and the work of a padded batch.

:func:`register` installs the backend under :data:`ATTN_NAME` for ``attn_implementation``. A forward
that passes :func:`varlen_kwargs` (``cu_seq_lens_q/k``, ``max_length_q/k``, the keyword names
transformers' own flash backend reads, and a placeholder mask) gets varlen attention; any other
forward (a right-padded batch with a 2-D mask, a KV-cache forward) is handed to transformers' sdpa
backend with the mask sdpa would have had, so a model loaded with this backend behaves exactly like
an sdpa one there.
Attention dropout goes through the padded path; sliding windows are refused.
"""

from __future__ import annotations

import inspect
import logging
import math
from functools import cache
from typing import Any

import torch

logger = logging.getLogger(__name__)
ATTN_NAME = "streamrl_varlen"


def register() -> str:
    """Register the varlen backend (and sdpa's mask builder for it) with transformers; returns its name."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if ATTN_NAME not in ALL_ATTENTION_FUNCTIONS:
        ALL_ATTENTION_FUNCTIONS.register(ATTN_NAME, varlen_attention_forward)
        ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_NAME, sdpa_mask)
    return ATTN_NAME


def varlen_kwargs(
    cu_seqlens: torch.Tensor, max_seqlen: int, device: torch.device, attn_implementation: str | None = ATTN_NAME
) -> dict[str, Any]:
    """Model keyword arguments that select varlen attention over the sequences ``cu_seqlens`` delimits.

    For a model on this backend (``attn_implementation``) they include a 4-D placeholder
    ``attention_mask``, which transformers passes through as is: without it, it would derive the
    sequences from the restarting position ids and build a dense ``[n, n]`` mask, with host syncs,
    that this backend does not read. Another backend (sdpa, eager) gets no placeholder: it needs
    that mask. flash-attention 2 reads the boundaries as given."""
    cu = cu_seqlens.to(device=device, dtype=torch.int32)
    kwargs: dict[str, Any] = {
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": max_seqlen,
        "max_length_k": max_seqlen,
    }
    if attn_implementation == ATTN_NAME:
        kwargs["attention_mask"] = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=device)
    return kwargs


def varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The transformers attention-backend entry point: ``query`` ``[B, Hq, L, D]``, ``key``/``value``
    ``[B, Hkv, L, D]``; returns ``([B, L, Hq, D], None)``."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            sliding_window=sliding_window,
            **kwargs,
        )
    if sliding_window is not None:
        raise ValueError("varlen attention does not implement sliding windows: use attn_implementation = 'sdpa'")
    batch, heads, length, dim = query.shape
    max_len = int(kwargs.get("max_length_q") or length)
    scale = scaling if scaling is not None else dim**-0.5
    q = query.transpose(1, 2).reshape(batch * length, heads, dim)
    k = key.transpose(1, 2).reshape(batch * length, key.shape[1], dim)
    v = value.transpose(1, 2).reshape(batch * length, value.shape[1], dim)
    if q.is_cuda and dropout == 0.0 and _flash_varlen() is not None:
        out = _flash(q, k, v, cu, max_len, scale)
    else:
        out = padded_varlen_attention(q, k, v, cu, max_len, scale, dropout if module.training else 0.0)
    return out.reshape(batch, length, heads, dim), None


def _expand_kv(k: torch.Tensor, heads: int) -> torch.Tensor:
    return k if k.shape[1] == heads else k.repeat_interleave(heads // k.shape[1], dim=1)


def padded_varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    scale: float,
    dropout: float = 0.0,
) -> torch.Tensor:
    """Causal attention of ``[n, H, D]`` tokens within the sequences of ``cu_seqlens``, through sdpa on the
    sequences gathered into a padded ``[sequences, H, max_seqlen, D]`` batch (work as for padded rows)."""
    cu = cu_seqlens.to(q.device, torch.int64)
    lengths = cu[1:] - cu[:-1]
    steps = torch.arange(max_seqlen, device=q.device)
    valid = steps[None, :] < lengths[:, None]  # [S, max_seqlen]
    index = (cu[:-1, None] + steps[None, :]).clamp(max=q.shape[0] - 1)
    heads = q.shape[1]

    def padded(x: torch.Tensor) -> torch.Tensor:
        return _expand_kv(x, heads)[index].transpose(1, 2)  # [S, H, max_seqlen, D]

    mask = valid[:, None, None, :] & (steps[None, :] <= steps[:, None])[None, None]
    out = torch.nn.functional.scaled_dot_product_attention(
        padded(q), padded(k), padded(v), attn_mask=mask, dropout_p=dropout, scale=scale
    )
    return out.transpose(1, 2)[valid]  # [n, H, D]


@cache
def _flash_varlen() -> Any:
    """torch's flash-attention varlen entry point and its keyword names, or None when this torch lacks it."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        logger.warning("this torch has no torch.nn.attention.varlen: varlen attention falls back to masked sdpa")
        return None
    return varlen_attn, set(inspect.signature(varlen_attn).parameters)


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int, scale: float) -> Any:
    varlen_attn, params = _flash_varlen()
    kwargs: dict[str, Any] = {}
    if "is_causal" in params:  # the first releases of the API
        kwargs["is_causal"] = True
    else:
        kwargs["window_size"] = (-1, 0)
    if "enable_gqa" in params:
        kwargs["enable_gqa"] = k.shape[1] != q.shape[1]
    else:  # older releases check for equal head counts: repeat the key/value heads instead
        k, v = _expand_kv(k, q.shape[1]), _expand_kv(v, q.shape[1])
    if "scale" in params:
        kwargs["scale"] = scale
    elif not math.isclose(scale, q.shape[-1] ** -0.5):
        q = q * (scale * q.shape[-1] ** 0.5)
    return varlen_attn(q, k, v, cu, cu, max_len, max_len, **kwargs)
