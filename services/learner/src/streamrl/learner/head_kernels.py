"""Row-wise softmax statistics and gradients of one chunk of output-head logits, in one pass each.

The fused log-prob head (:mod:`streamrl.learner.fused_head`) multiplies a chunk of hidden states
by the output embedding into a ``[rows, V]`` logits buffer and hands it here. With ``y = z * inv_t``
(``inv_t`` = 1 / temperature of each row)::

    lse      = log sum_j exp(y_j)
    logp     = y[target] - lse                       (0 where target < 0, i.e. ignored)
    entropy  = lse - sum_j p_j y_j                   (p = softmax(y))

and, for upstream gradients ``g_lp`` (of logp) and ``g_ent`` (of entropy), the gradient with
respect to the logits ``z``, written over the buffer in place::

    dz_j = inv_t * ( g_lp * (1[j = target] - p_j)  -  g_ent * p_j * (y_j - lse + entropy) )

Two implementations with one contract: Triton kernels on CUDA (one program per row, an online
softmax over the vocabulary in blocks: the bf16 logits are read once for the statistics, and read
and overwritten once for the gradient, never upcast as a whole) and plain torch ops everywhere
else (CPU, or CUDA without Triton). Statistics are float32.
"""

from __future__ import annotations

import torch

try:  # Triton ships with CUDA torch; on CPU-only installs it is absent and the torch ops are used
    import triton
    import triton.language as tl
except ImportError:
    triton = None

_BLOCK = 4096


def triton_available(device: torch.device) -> bool:
    """True when the Triton kernels can run on ``device``."""
    return triton is not None and device.type == "cuda"


def chunk_stats(
    z: torch.Tensor, targets: torch.Tensor, inv_t: torch.Tensor, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(lse, logp, entropy or None)`` of each row of the logits ``z`` ``[rows, V]`` (float32, ``[rows]``)."""
    if triton_available(z.device):
        return _stats_triton(z, targets, inv_t, with_entropy)
    return _stats_torch(z, targets, inv_t, with_entropy)


def chunk_grad_(
    z: torch.Tensor,
    targets: torch.Tensor,
    inv_t: torch.Tensor,
    lse: torch.Tensor,
    g_lp: torch.Tensor,
    entropy: torch.Tensor | None = None,
    g_ent: torch.Tensor | None = None,
) -> torch.Tensor:
    """Overwrite the logits ``z`` with d(loss)/dz for per-row upstream gradients; returns ``z``."""
    if (entropy is None) != (g_ent is None):
        raise ValueError("entropy and g_ent go together")
    if triton_available(z.device):
        return _grad_triton(z, targets, inv_t, lse, g_lp, entropy, g_ent)
    return _grad_torch(z, targets, inv_t, lse, g_lp, entropy, g_ent)


# ------------------------------------------------------------------------------------- torch ops
def _stats_torch(
    z: torch.Tensor, targets: torch.Tensor, inv_t: torch.Tensor, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    y = z.float() * inv_t[:, None]
    lse = torch.logsumexp(y, dim=-1)
    valid = targets >= 0
    picked = y.gather(-1, targets.clamp(min=0)[:, None]).squeeze(-1)
    logp = torch.where(valid, picked - lse, torch.zeros_like(lse))
    entropy = lse - (torch.softmax(y, dim=-1) * y).sum(-1) if with_entropy else None
    return lse, logp, entropy


def _grad_torch(
    z: torch.Tensor,
    targets: torch.Tensor,
    inv_t: torch.Tensor,
    lse: torch.Tensor,
    g_lp: torch.Tensor,
    entropy: torch.Tensor | None,
    g_ent: torch.Tensor | None,
) -> torch.Tensor:
    y = z.float() * inv_t[:, None]
    p = torch.exp(y - lse[:, None])
    valid = targets >= 0
    g_lp = torch.where(valid, g_lp.float(), torch.zeros_like(lse))
    grad = -g_lp[:, None] * p
    if entropy is not None and g_ent is not None:
        grad -= g_ent.float()[:, None] * p * (y - lse[:, None] + entropy[:, None])
    grad.scatter_add_(-1, targets.clamp(min=0)[:, None], g_lp[:, None])
    z.copy_(grad * inv_t[:, None])
    return z


# ---------------------------------------------------------------------------------------- Triton
if triton is not None:

    @triton.jit
    def _stats_kernel(
        z_ptr,
        z_stride,
        tgt_ptr,
        invt_ptr,
        lse_ptr,
        logp_ptr,
        ent_ptr,
        vocab,
        block: tl.constexpr,
        entropy_on: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        base = z_ptr + row * z_stride
        invt = tl.load(invt_ptr + row)
        m = float("-inf")
        s = 0.0
        a = 0.0
        for start in range(0, vocab, block):
            cols = start + tl.arange(0, block)
            inside = cols < vocab
            y = tl.load(base + cols, mask=inside, other=float("-inf")).to(tl.float32) * invt
            new_m = tl.maximum(m, tl.max(y, axis=0))
            e = tl.exp(y - new_m)
            corr = tl.exp(m - new_m)
            s = s * corr + tl.sum(e, axis=0)
            if entropy_on:
                a = a * corr + tl.sum(tl.where(inside, e * y, 0.0), axis=0)
            m = new_m
        lse = m + tl.log(s)
        tl.store(lse_ptr + row, lse)
        tgt = tl.load(tgt_ptr + row)
        valid = tgt >= 0
        picked = tl.load(base + tl.where(valid, tgt, 0)).to(tl.float32) * invt
        tl.store(logp_ptr + row, tl.where(valid, picked - lse, 0.0))
        if entropy_on:
            tl.store(ent_ptr + row, lse - a / s)

    @triton.jit
    def _grad_kernel(
        z_ptr,
        z_stride,
        tgt_ptr,
        invt_ptr,
        lse_ptr,
        glp_ptr,
        ent_ptr,
        gent_ptr,
        vocab,
        block: tl.constexpr,
        entropy_on: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        base = z_ptr + row * z_stride
        invt = tl.load(invt_ptr + row)
        lse = tl.load(lse_ptr + row)
        tgt = tl.load(tgt_ptr + row)
        glp = tl.where(tgt >= 0, tl.load(glp_ptr + row).to(tl.float32), 0.0)
        if entropy_on:
            ent = tl.load(ent_ptr + row)
            gent = tl.load(gent_ptr + row).to(tl.float32)
        for start in range(0, vocab, block):
            cols = start + tl.arange(0, block)
            inside = cols < vocab
            y = tl.load(base + cols, mask=inside, other=0.0).to(tl.float32) * invt
            p = tl.exp(y - lse)
            g = -glp * p
            if entropy_on:
                g -= gent * p * (y - lse + ent)
            g = tl.where(cols == tgt, g + glp, g)
            tl.store(base + cols, (g * invt).to(z_ptr.dtype.element_ty), mask=inside)


def _stats_triton(
    z: torch.Tensor, targets: torch.Tensor, inv_t: torch.Tensor, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    rows, vocab = z.shape
    if z.stride(1) != 1:
        raise ValueError("the logits chunk must be contiguous along the vocabulary")
    lse = torch.empty(rows, dtype=torch.float32, device=z.device)
    logp = torch.empty_like(lse)
    entropy = torch.empty_like(lse) if with_entropy else lse  # a placeholder pointer when unused
    if rows:
        _stats_kernel[(rows,)](
            z,
            z.stride(0),
            targets.contiguous(),
            inv_t.float().contiguous(),
            lse,
            logp,
            entropy,
            vocab,
            block=_BLOCK,
            entropy_on=with_entropy,
            num_warps=16,
        )
    return lse, logp, entropy if with_entropy else None


def _grad_triton(
    z: torch.Tensor,
    targets: torch.Tensor,
    inv_t: torch.Tensor,
    lse: torch.Tensor,
    g_lp: torch.Tensor,
    entropy: torch.Tensor | None,
    g_ent: torch.Tensor | None,
) -> torch.Tensor:
    rows, vocab = z.shape
    if z.stride(1) != 1:
        raise ValueError("the logits chunk must be contiguous along the vocabulary")
    with_entropy = entropy is not None and g_ent is not None
    if rows:
        _grad_kernel[(rows,)](
            z,
            z.stride(0),
            targets.contiguous(),
            inv_t.float().contiguous(),
            lse.contiguous(),
            g_lp.float().contiguous(),
            entropy.contiguous() if entropy is not None and with_entropy else lse,
            g_ent.float().contiguous() if g_ent is not None and with_entropy else lse,
            vocab,
            block=_BLOCK,
            entropy_on=with_entropy,
            num_warps=16,
        )
    return z
