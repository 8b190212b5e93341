"""A DeepSpeed checkpoint (written by durable_checkpoint_worker.py in its own process) is fsynced whole before
latest names it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("durable_checkpoint_worker.py")


@pytest.mark.slow
def test_a_checkpoint_is_fsynced_whole_before_latest_names_it(tmp_path: Path, worker_env: dict[str, str]) -> None:
    done = subprocess.run(
        [sys.executable, str(WORKER), str(tmp_path)], capture_output=True, text=True, env=worker_env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(done.stdout.strip().splitlines()[-1])
    *events, (_, *files) = record
    renamed = events.index(["replace", "latest.tmp", "latest"])
    before = [e[1] for e in events[:renamed] if e[0] == "fsync"]
    checkpoint_files = [f for f in files if f.startswith("step_1/")]
    assert checkpoint_files and set(checkpoint_files) <= set(before), "a file of the checkpoint was not fsync'ed"
    assert {"step_1", ".", "latest.tmp"} <= set(before)  # its folder, the checkpoints folder, the new marker
    assert ["fsync", "."] in events[renamed + 1 :]  # the rename made durable
