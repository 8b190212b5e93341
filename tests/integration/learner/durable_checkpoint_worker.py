"""Run by test_durable_checkpoint_process.py in its own process (DeepSpeed never runs in the pytest process).

``python durable_checkpoint_worker.py OUT``: trains one step of a tiny Qwen2 and checkpoints it, with
:func:`streamrl.learner.durable.fsync` and the rename of ``latest`` recorded; prints the record as JSON
(``["fsync", path]`` / ``["replace", src, dst]``, paths relative to OUT/ckpt, in order).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from streamrl.learner import durable
from streamrl.learner.ds_config import DeepSpeedConfig
from streamrl.learner.engine import ModelEngine
from streamrl.torchkit.testing import build_tiny_qwen2


def main(out: Path) -> list[list[str]]:
    model = build_tiny_qwen2(out / "model", hidden_size=64, vocab_size=384)
    cfg = DeepSpeedConfig(zero_stage=0, dtype="fp32", lr=1e-2, scheduler="constant", micro_batch_size=2)
    engine = ModelEngine.from_config(str(model), cfg)
    ids = torch.randint(3, 300, (2, 8), generator=torch.Generator().manual_seed(0))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    root = out / "ckpt"
    record: list[list[str]] = []
    real_fsync, real_replace = durable.fsync, os.replace

    def fsync(path: Path) -> None:
        record.append(["fsync", os.path.relpath(path, root)])
        real_fsync(path)

    def replace(src: str | Path, dst: str | Path) -> None:
        record.append(["replace", os.path.relpath(src, root), os.path.relpath(dst, root)])
        real_replace(src, dst)

    durable.fsync = fsync  # type: ignore[assignment]
    durable.os.replace = replace  # type: ignore[assignment]
    engine.save_checkpoint(root, {"step": 1})
    durable.os.replace = real_replace  # type: ignore[assignment]
    files = sorted(os.path.relpath(p, root) for p in root.rglob("*") if p.is_file())
    return [*record, ["files", *files]]


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]))))
