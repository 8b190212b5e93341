"""Run by test_safe_checkpoint_process.py in its own process (DeepSpeed never runs in the pytest process).

``python safe_checkpoint_worker.py OUT ZERO_STAGE``: trains one step of a tiny Qwen2 and checkpoints
it; a fresh engine resumes from the checkpoint; then every file of the checkpoint in turn is replaced
by one holding a pickle that would touch ``OUT/MARKER`` when unpickled, and a fresh engine tries to
resume from it. Prints one JSON object: what the resume restored and the error of each refused file.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from streamrl.learner.ds_config import DeepSpeedConfig
from streamrl.learner.engine import ModelEngine
from streamrl.learner.safe_checkpoint import UnsafeCheckpointError
from streamrl.torchkit.testing import build_tiny_qwen2


class TouchMarker:
    """Unpickling it creates a file: what a malicious checkpoint could do with any other command."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (Path.touch, (self.marker,))


def main(out: Path, stage: int) -> dict[str, object]:
    model = build_tiny_qwen2(out / "model", hidden_size=64, vocab_size=384)
    cfg = DeepSpeedConfig(zero_stage=stage, dtype="fp32", lr=1e-2, scheduler="constant", micro_batch_size=2)
    trained = ModelEngine.from_config(str(model), cfg)
    ids = torch.randint(3, 300, (2, 8), generator=torch.Generator().manual_seed(0))
    trained.backward(trained(input_ids=ids, labels=ids).loss)
    trained.step()
    trained.save_checkpoint(out / "ckpt", {"batch_index": 3})
    weights = dict(trained.iter_full_params())

    resumed = ModelEngine.from_config(str(model), cfg)
    state = resumed.load_checkpoint(out / "ckpt")
    restored = dict(resumed.iter_full_params())
    same = restored.keys() == weights.keys() and all(torch.equal(weights[n], restored[n]) for n in weights)
    initial = load_file(model / "model.safetensors")
    moved = any(not torch.equal(initial[n], weights[n]) for n in weights if n in initial)
    report: dict[str, object] = {
        "client_state": state,
        "global_steps": resumed.global_steps,
        "trained_weights_restored": same and moved,
    }

    tag = (out / "ckpt" / "latest").read_text().strip()
    refused = {}
    for victim in sorted((out / "ckpt" / tag).glob("*.pt")):
        saved = victim.with_suffix(".orig")
        shutil.copy(victim, saved)
        torch.save({"module": weights, "x": TouchMarker(out / "MARKER")}, victim)
        try:
            ModelEngine.from_config(str(model), cfg).load_checkpoint(out / "ckpt")
            refused[victim.name] = ""
        except UnsafeCheckpointError as e:
            refused[victim.name] = str(e)
        shutil.move(saved, victim)
    report["refused"] = refused
    report["marker_written"] = (out / "MARKER").exists()
    return report


if __name__ == "__main__":
    print("REPORT " + json.dumps(main(Path(sys.argv[1]), int(sys.argv[2]))))
