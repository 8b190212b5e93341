"""LoRA RL through ``streamrl up`` (the smoke recipe with ``[learner.lora]`` and the vLLM engine's
``max_lora_rank``): every version is the adapter alone, signed, and the engine serves it - the behaviour
log-probs of batch k are those of the learner's merged version-k export. Then the run is started again
with more steps: the learner resumes from its checkpoint and serves the adapter it restored, and the new
rollout worker (a late joiner: base from its model folder, the adapter from the learner) generates with it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis
import torch
from recipe_run import check_finished, trained_batches
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from streamrl.common.messages import TrainingBatch
from streamrl.common.streams import StreamNames

pytestmark = pytest.mark.slow
ENV = {
    **os.environ,
    "STREAMRL_REDIS__RETAIN_CONSUMED_S": "86400",
    "STREAMRL_REDIS__PAYLOAD_RETENTION_S": "86400",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "OMP_NUM_THREADS": "2",
    "TOKENIZERS_PARALLELISM": "false",
}
LORA = ["--learner.lora.rank=8", "--learner.lora.alpha=16", "--rollout.engine.max_lora_rank=8"]


def _up(recipe: Path, run_id: str, key: str, *overrides: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "streamrl.ops.cli", "up", str(recipe), f"--run_id={run_id}", *LORA, *overrides],
        env={**ENV, "STREAMRL_WEIGHTS_KEY": key},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]


def _served_by(batch: TrainingBatch, folder: Path, other: Path) -> None:
    """The behaviour log-probs of ``batch`` are those of the weights in ``folder``, not ``other``'s."""
    current = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    before = AutoModelForCausalLM.from_pretrained(other, dtype=torch.float32).eval()
    for s in batch.samples[:4]:
        t = s.trajectory
        prompt, response = t.prompt_ids.tolist(), t.response_ids.tolist()
        ids = torch.tensor([prompt + response])
        engine = torch.tensor(t.logprobs.tolist())
        with torch.no_grad():
            for model, should_match in ((current, True), (before, False)):
                logits = model(ids).logits[0, len(prompt) - 1 : -1] / t.sampling.temperature
                logp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]
                close = torch.allclose(logp, engine, atol=2e-3)
                assert close == should_match, f"batch {batch.index} {t.id}: engine vs {folder.name} log-probs"


def _adapter_bytes(model: Path, rank: int) -> int:
    """fp32 bytes of an all-linear LoRA adapter of ``rank`` on the Llama at ``model``: ``rank x (in + out)``
    per projection (q, k, v, o, gate, up, down) and layer."""
    c = json.loads((model / "config.json").read_text())
    hidden, mlp, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    kv = c["num_key_value_heads"] * c.get("head_dim", hidden // c["num_attention_heads"])
    per_layer = 2 * (hidden + hidden) + 2 * (hidden + kv) + 3 * (hidden + mlp)
    return rank * per_layer * layers * 4


def test_lora_run_serves_each_adapter_and_resumes(
    tiny_task: Path, tmp_path: Path, redis_url: str, run_id: str, write_recipe
) -> None:  # type: ignore[no-untyped-def]
    run_dir = tmp_path / "run"
    recipe = write_recipe(tiny_task, run_dir, redis_url, dense_reward=True)
    key = f"weights-key-{run_id}"
    _up(recipe, run_id, key)
    client = redis.Redis.from_url(redis_url)
    names = StreamNames(run_id)
    trained = check_finished(client, names, steps=4)
    full_bytes = sum(
        t.numel() * t.element_size() for t in load_file(tiny_task / "model" / "model.safetensors").values()
    )
    for w in trained:
        assert w.payload == "lora" and w.lora is not None and w.lora.rank == 8 and w.signature
        assert w.num_bytes == _adapter_bytes(tiny_task / "model", rank=8), f"version {w.version}: not the adapter alone"
    print(f"adapter versions: {trained[0].num_bytes} bytes each; full weights {full_bytes} bytes")
    exports = run_dir / "exports"
    batches = trained_batches(client, names)
    for b in batches[1:]:
        _served_by(
            b, exports / f"step-{b.index}", tiny_task / "model" if b.index == 1 else exports / f"step-{b.index - 1}"
        )

    # again, two more steps: the learner resumes at step 4 and serves that adapter to a new rollout worker
    _up(recipe, run_id, key, "--total_steps=6")
    check_finished(client, names, steps=6)
    resumed = {b.index: b for b in trained_batches(client, names)}
    _served_by(resumed[4], exports / "step-4", exports / "step-3")
    _served_by(resumed[5], exports / "step-5", exports / "step-4")
