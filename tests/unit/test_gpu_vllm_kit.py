"""The vLLM kit's device-side installer (scripts/gpu_vllm_install.sh) and bench/gpu_vllm.py's
reference log-probs, on the CPU."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _install(repo: Path, stash: Path, mode: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "VLLMKIT_STASH": str(stash), "VLLMKIT_SITE": str(stash / "site")}
    script = repo / "scripts" / "gpu_vllm_install.sh"
    return subprocess.run(["bash", str(script), mode], cwd=repo, env=env, capture_output=True, text=True)


def test_parts_are_stashed_across_calls_and_a_damaged_set_is_refused(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    (repo / "scripts" / "gpu_vllm_install.sh").write_bytes((ROOT / "scripts" / "gpu_vllm_install.sh").read_bytes())
    parts = repo / ".vllmkit" / "parts"
    parts.mkdir(parents=True)
    blobs = {"part0": b"first half", "part1": b"second half"}
    (parts / "SHA256SUMS").write_text("".join(f"{hashlib.sha256(b).hexdigest()}  {n}\n" for n, b in blobs.items()))
    stash = tmp_path / "stash"
    (parts / "part0").write_bytes(blobs["part0"])  # the first call carries part0
    assert _install(repo, stash, "stash").returncode == 0
    (parts / "part0").unlink()
    (parts / "part1").write_bytes(b"second half, damaged")  # the second call carries part1
    done = _install(repo, stash, "install")
    assert (stash / "part0").read_bytes() == blobs["part0"]
    assert done.returncode == 1 and "a part is missing or damaged" in done.stderr


def test_reference_logprobs_are_the_tempered_log_softmax(tmp_path: Path) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    spec = importlib.util.spec_from_file_location("gpu_vllm", ROOT / "bench" / "gpu_vllm.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    sys.modules["gpu_vllm"] = bench
    spec.loader.exec_module(bench)
    torch.manual_seed(0)
    config = Qwen2Config(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=50,
    )
    model = Qwen2ForCausalLM(config).eval()
    prompt, tokens = [3, 4, 5], [6, 7]
    got = bench.reference_logprobs(model, prompt, tokens, temperature=0.5)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0]
    want = [torch.log_softmax(logits[2 + i] / 0.5, -1)[t].item() for i, t in enumerate(tokens)]
    assert got == pytest.approx(want, abs=1e-6)
