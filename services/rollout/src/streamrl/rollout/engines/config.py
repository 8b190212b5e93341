"""Configuration of the rollout generation engine (torch-free: parsed before any heavy import)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from streamrl.common.config import BaseConfig

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM accepts for ``max_lora_rank``."""


class EngineConfig(BaseConfig):
    """Which generation engine a rollout worker runs, and how it is built."""

    type: Literal["vllm", "hf"] = "vllm"
    """``vllm`` (production) or ``hf`` (plain transformers: small models, debugging, machines without vLLM)."""
    model: str
    """Model folder or hub id (weights as safetensors)."""
    tokenizer: str | None = None
    """Tokenizer folder or hub id; None = the model's."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Compute dtype. On CPU, bfloat16 needs AMX / AVX512-BF16 to be fast (~10x slower without); else float32."""
    max_model_len: int = Field(4096, ge=16)
    """Longest prompt + response the engine accepts (tokens)."""
    max_num_seqs: int = Field(256, ge=1)
    """Sequences decoded together in one engine step (vLLM, and the hf engine's KV-cache slots)."""
    gpu_memory_utilization: float = Field(0.9, gt=0.0, le=1.0)
    """Fraction of GPU memory vLLM may use (weights + KV cache)."""
    kv_cache_gib: float | None = Field(None, gt=0.0)
    """Explicit KV cache size (GiB); None = from gpu_memory_utilization on GPU, VLLM_CPU_KVCACHE_SPACE or 2 GiB on CPU."""
    tensor_parallel_size: int = Field(1, ge=1)
    """GPUs one vLLM engine spans (tensor parallel)."""
    enable_prefix_caching: bool = True
    """Reuse the KV cache of shared prompt prefixes (the n samples of a group share their prompt)."""
    enforce_eager: bool = False
    """Disable CUDA graphs / torch.compile in vLLM (faster start; on GPU slower decode). On CPU with a
    weight update every step, compiled decoding was seen to slow down run after run: prefer True there."""
    partial_rollout: bool = False
    """A weight update lands between two decode steps even while requests are running, and they go
    on under the new weights; each sample records the version of every token. vLLM preempts them and
    recomputes their KV cache with the new weights; the hf engine keeps the cache computed under the
    old ones (as in-flight updates do). False: the update waits until the running requests finish,
    and requests submitted after it wait for it (every sample comes from one version)."""
    cpu_weight_packing: bool = True
    """vLLM on CPU: repack linear weights for oneDNN (vLLM's default). Every weight update then
    re-runs that processing through vLLM's reload path (~45 ms per update for the 0.66M demo model
    here). False: linears compute with torch's F.linear on the live parameters (about as fast for
    small models here) and an update copies into them in place (~3 ms). Needs the engine in this
    process (tensor_parallel_size 1, VLLM_ENABLE_V1_MULTIPROCESSING=0, the default on CPU)."""
    sleep_between_versions: bool = False
    """Colocated synchronous runs (``coordinator.max_staleness = 0``, ``learner.weights_transport =
    "ipc"``: checked by ``streamrl up``): the engine gives its GPU memory back while it has no work for
    the current version, and takes it back when the next version's weights arrive (wake, then
    update, then generate); it sleeps once no prompt has been in it for 0.2 s. Both engines free
    their CUDA IPC staging buffers. vLLM: built with sleep mode, ``LLM.sleep(level=1)`` (KV cache
    freed, weights offloaded to host memory) - needs CUDA (vLLM's CPU build refuses it at start).
    hf: its KV cache and captured CUDA graphs are freed (the weights stay; the cache is reallocated
    at the next batch)."""
    batch_wait_ms: float = Field(5.0, ge=0)
    """hf engine: once a request arrives, collect others for this long and decode them as one batch."""
    seed: int = 0
    """Engine seed; a request's own seed (SamplingParams.seed) takes precedence for its samples."""
    cuda_graphs: bool = True
    """hf engine on CUDA: capture each decode step as a CUDA graph (per batch and length bucket) and
    replay it; False = eager kernels (slower: the step is then bound by Python and launch overhead)."""
    max_images_per_prompt: int = Field(4, ge=1)
    """Vision-language models: images one request may hold (the prompt's and, in multi-turn episodes,
    the environment's so far); vLLM reserves memory for this many."""
    max_lora_rank: int | None = Field(None, ge=1)
    """Serve LoRA adapters up to this rank (a LoRA run with ``learner.lora.sync = "adapter"``): each version
    is an adapter on top of ``model``. vLLM is built with ``enable_lora`` (vLLM takes 1, 8, 16, 32, 64, 128,
    256, 320 or 512); the transformers engine adds peft LoRA layers. None = full weights only: an adapter
    version is refused, naming this field."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Device of the hf engine (auto = cuda when available)."""
    trust_remote_code: bool = False
    """Allow model code from the model folder (needed by some architectures)."""

    @model_validator(mode="after")
    def _check(self) -> EngineConfig:
        if self.type == "hf" and self.tensor_parallel_size != 1:
            raise ValueError("tensor_parallel_size > 1 needs type='vllm'")
        if self.type == "vllm" and self.max_lora_rank is not None:
            if self.max_lora_rank not in VLLM_LORA_RANKS:
                raise ValueError(f"max_lora_rank = {self.max_lora_rank}: vLLM takes one of {VLLM_LORA_RANKS}")
            if self.partial_rollout:
                raise ValueError(
                    "max_lora_rank with partial_rollout: a vLLM request keeps the adapter it started with, so "
                    "an adapter cannot land mid-request; set partial_rollout = false (or use type = 'hf')"
                )
        return self
