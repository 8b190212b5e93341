"""A slot-based KV-cache decoder over a Hugging Face Llama-family model's own modules.

The transformers engine's fast path (:mod:`streamrl.rollout.engines.hf_engine`). It runs the model's own
layers (embeddings, norms, projections, MLPs, rotary embedding, head: the loaded ``nn.Module``s and
their parameters, so a weight update is a copy into them) and replaces only the attention's cache
handling:

* The KV cache is preallocated: per layer ``[slots, capacity, kv_heads, head_dim]`` for K and V. A
  sequence owns one slot; its token at position ``p`` lives at ``[slot, p]``. Slots are independent,
  so sequences of different lengths and ages decode side by side (continuous batching) and a slot
  freed by a finished sequence takes a new one. The cache grows (re-allocated, doubling) when a batch
  needs more slots or positions, up to ``max_slots`` x ``max_len``.
* Prefill runs each distinct prompt once (right-padded, causal attention) and copies its K/V into the
  slots of its samples.
* A decode step feeds one token per slot ``0..B-1`` at its own position: it writes K/V there and
  attends over positions ``0..L-1`` masked to each slot's ``<= position``. The grouped query heads
  of one KV head attend as a group (no repeated K/V).
* On CUDA a decode step is captured as a CUDA graph per (batch bucket, length bucket) and replayed:
  the step costs its kernels, not Python and launch overhead. Buckets are powers of two for the batch
  and multiples of ``LENGTH_BUCKET`` for the attended length.

Supported: ``llama``, ``qwen2``, ``qwen3``, ``mistral`` without a sliding window (checked structurally
as well); :func:`unsupported_reason` says why another model is not, and the engine then uses the
model's plain forward.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from torch.nn import functional

logger = logging.getLogger(__name__)

SUPPORTED_TYPES = ("llama", "qwen2", "qwen3", "mistral")
LENGTH_BUCKET = 128
"""Attended length of a captured decode step is a multiple of this (tokens)."""


def unsupported_reason(model: Any) -> str | None:
    """None when :class:`KVDecoder` can run ``model``, else why not."""
    config = model.config
    if config.model_type not in SUPPORTED_TYPES:
        return f"model_type {config.model_type!r} is not one of {SUPPORTED_TYPES}"
    inner = getattr(model, "model", None)
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    if inner is None or any(not hasattr(inner, n) for n in needed) or not hasattr(model, "lm_head"):
        return "the model lacks the Llama module layout (model.embed_tokens / layers / norm / rotary_emb, lm_head)"
    for layer in inner.layers:
        attn = layer.self_attn
        if any(not hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling")):
            return f"layer attention {type(attn).__name__} lacks q/k/v/o projections"
        if getattr(attn, "sliding_window", None) is not None:
            return "sliding-window attention is not supported by the KV decoder"
    if getattr(config, "rope_scaling", None) and "dynamic" in str(config.rope_scaling):
        return "dynamic rope scaling changes with the length: not supported by the KV decoder"
    return None


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _bucket_batch(n: int, limit: int) -> int:
    return min(limit, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


class KVDecoder:
    """See the module docstring. Not thread-safe: one driver thread owns it."""

    def __init__(self, model: Any, max_slots: int, max_len: int, cuda_graphs: bool) -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(reason)
        self.model = model
        inner = model.model
        self._embed, self._layers, self._norm, self._rotary = (
            inner.embed_tokens,
            inner.layers,
            inner.norm,
            inner.rotary_emb,
        )
        attn = self._layers[0].self_attn
        config = model.config
        self.head_dim = int(attn.head_dim)
        self.num_heads = int(config.num_attention_heads)
        self.num_kv_heads = int(config.num_key_value_heads)
        self.device = model.lm_head.weight.device
        self.dtype = model.lm_head.weight.dtype
        self.max_slots = max_slots
        self.max_len = max_len
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda"
        self.slots = 0
        self.capacity = 0
        self._k: list[torch.Tensor] = []
        self._v: list[torch.Tensor] = []
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool: Any = None
        self._ids = torch.zeros(max_slots, dtype=torch.long, device=self.device)
        self._pos = torch.zeros(max_slots, dtype=torch.long, device=self.device)

    # ----------------------------------------------------------------- cache

    def reserve(self, slots: int, length: int) -> None:
        """Make room for ``slots`` sequences of up to ``length`` positions (keeps the cached K/V)."""
        if slots > self.max_slots or length > self.max_len:
            raise ValueError(f"{slots} sequences x {length} positions exceed {self.max_slots} x {self.max_len}")
        if slots <= self.slots and length <= self.capacity:
            return
        new_slots = min(self.max_slots, max(_bucket_batch(slots, self.max_slots), 2 * self.slots))
        new_len = min(self.max_len, max(length, 2 * self.capacity, LENGTH_BUCKET))
        shape = (new_slots, new_len, self.num_kv_heads, self.head_dim)
        k = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self._layers]
        v = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self._layers]
        for old, new in zip(self._k + self._v, k + v, strict=False):  # nothing to keep the first time
            new[: self.slots, : self.capacity] = old
        self._k, self._v = k, v
        self.slots, self.capacity = new_slots, new_len
        self.drop_graphs()  # they captured the old cache's addresses
        logger.info("KV cache: %d slots x %d positions (%.2f GiB)", new_slots, new_len, self.cache_bytes / 2**30)

    def release(self) -> None:
        """Free the KV cache and the captured graphs (no sequence may be live); :meth:`reserve` allocates again."""
        self._k, self._v = [], []
        self.slots = self.capacity = 0
        self.drop_graphs()

    def drop_graphs(self) -> None:
        """Forget the captured decode steps (after the cache or the parameters moved in memory)."""
        self._graphs.clear()
        self._pool = None  # a pool whose graphs are all gone cannot take a new capture

    @property
    def cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._k + self._v)

    def move(self, src: torch.Tensor, dst: torch.Tensor, length: int) -> None:
        """Copy slots ``src`` to slots ``dst`` (positions ``< length``)."""
        for cache in self._k + self._v:
            cache[dst, :length] = cache[src, :length]

    # ----------------------------------------------------------------- forward

    def _project(self, layer: Any, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q [B, T, H, D], k and v [B, T, Hkv, D] of normalised hidden states ``h`` [B, T, hidden]."""
        attn = layer.self_attn
        shape = (*h.shape[:2], -1, self.head_dim)
        q, k, v = attn.q_proj(h).view(shape), attn.k_proj(h).view(shape), attn.v_proj(h).view(shape)
        if hasattr(attn, "q_norm"):
            q, k = attn.q_norm(q), attn.k_norm(k)
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin, v

    def prefill(self, prompts: list[list[int]], slots: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        """Run each prompt once; slot ``slots[i]`` gets the K/V of prompt ``source[i]``.

        Returns the float32 logits [len(slots), V] of each slot's last prompt token.
        """
        width = max(len(p) for p in prompts)
        ids = torch.zeros((len(prompts), width), dtype=torch.long)
        for b, prompt in enumerate(prompts):
            ids[b, : len(prompt)] = torch.tensor(prompt)
        ids = ids.to(self.device)
        positions = torch.arange(width, device=self.device).expand(len(prompts), width)
        slots, source = slots.to(self.device), source.to(self.device)
        h = self._embed(ids)
        cos, sin = self._rotary(h, positions)
        groups = self.num_heads // self.num_kv_heads
        for i, layer in enumerate(self._layers):
            attn = layer.self_attn
            q, k, v = self._project(layer, layer.input_layernorm(h), cos, sin)
            self._k[i][slots, :width] = k[source]
            self._v[i][slots, :width] = v[source]
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            if groups > 1:
                k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
            out = functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.scaling)
            h = h + attn.o_proj(out.transpose(1, 2).reshape(*h.shape[:2], -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        last = torch.tensor([len(p) - 1 for p in prompts], device=self.device)
        h = self._norm(h[torch.arange(len(prompts), device=self.device), last])
        return self.model.lm_head(h).float()[source]

    def _step(self, batch: int, length: int) -> torch.Tensor:
        """One decode step of slots ``0..batch-1`` over positions ``< length`` (graph-capturable)."""
        ids, pos = self._ids[:batch], self._pos[:batch]
        rows = torch.arange(batch, device=self.device)
        h = self._embed(ids[:, None])
        cos, sin = self._rotary(h, pos[:, None])
        visible = torch.arange(length, device=self.device)[None, :] <= pos[:, None]
        mask = visible[:, None, None, :]  # [B, 1, 1, L]: the query group of a KV head shares it
        groups = self.num_heads // self.num_kv_heads
        for i, layer in enumerate(self._layers):
            attn = layer.self_attn
            q, k, v = self._project(layer, layer.input_layernorm(h), cos, sin)
            self._k[i][rows, pos] = k[:, 0]
            self._v[i][rows, pos] = v[:, 0]
            q = q.view(batch, self.num_kv_heads, groups, self.head_dim)
            keys = self._k[i][:batch, :length].transpose(1, 2)
            values = self._v[i][:batch, :length].transpose(1, 2)
            out = functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=attn.scaling)
            h = h + attn.o_proj(out.reshape(batch, 1, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.model.lm_head(self._norm(h[:, 0]))

    def decode(self, ids: torch.Tensor, positions: torch.Tensor, max_position: int) -> torch.Tensor:
        """Feed token ``ids[s]`` at ``positions[s]`` for slots ``0..n-1``; return float32 logits [n, V].

        ``max_position`` (host int) bounds ``positions`` (it picks the attended length).
        """
        n = ids.shape[0]
        self._ids[:n] = ids
        self._pos[:n] = positions
        if not self.cuda_graphs:
            return self._step(n, max_position + 1).float()
        batch = _bucket_batch(n, self.slots)
        length = min(self.capacity, -(-(max_position + 1) // LENGTH_BUCKET) * LENGTH_BUCKET)
        if batch > n:  # padding rows write to free slots at position 0; their output is ignored
            self._ids[n:batch] = 0
            self._pos[n:batch] = 0
        graph = self._graphs.get((batch, length))
        if graph is None:
            graph = self._graphs[(batch, length)] = self._capture(batch, length)
        graph[0].replay()
        return graph[1][:n].float()

    def _capture(self, batch: int, length: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up: the same writes the step itself makes
            self._step(batch, length)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self._step(batch, length)
        logger.info("captured a CUDA graph for %d sequences x %d positions", batch, length)
        return graph, out
