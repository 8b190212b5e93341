"""vLLM on CPU always gets an explicit KV cache size (else it demands 90% of host memory free)."""

from __future__ import annotations

import pytest

from streamrl.rollout.engines.vllm_engine import CPU_KV_CACHE_GIB, kv_cache_bytes

GIB = 2**30


def test_configured_size_wins_everywhere() -> None:
    assert kv_cache_bytes(0.25, on_cpu=True, env={"VLLM_CPU_KVCACHE_SPACE": "8"}) == GIB // 4
    assert kv_cache_bytes(3.0, on_cpu=False, env={}) == 3 * GIB


def test_cpu_uses_the_environment_then_a_default() -> None:
    assert kv_cache_bytes(None, on_cpu=True, env={"VLLM_CPU_KVCACHE_SPACE": "1"}) == GIB
    assert kv_cache_bytes(None, on_cpu=True, env={}) == int(CPU_KV_CACHE_GIB * GIB)
    assert kv_cache_bytes(None, on_cpu=True, env={"VLLM_CPU_KVCACHE_SPACE": "0"}) == int(CPU_KV_CACHE_GIB * GIB)


def test_gpu_sizes_from_memory_utilization() -> None:
    assert kv_cache_bytes(None, on_cpu=False, env={"VLLM_CPU_KVCACHE_SPACE": "1"}) is None


def test_a_bad_environment_value_is_named() -> None:
    with pytest.raises(ValueError, match="VLLM_CPU_KVCACHE_SPACE='lots'"):
        kv_cache_bytes(None, on_cpu=True, env={"VLLM_CPU_KVCACHE_SPACE": "lots"})
