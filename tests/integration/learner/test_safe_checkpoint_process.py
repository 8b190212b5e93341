"""A DeepSpeed checkpoint (ZeRO 2 and 3, written and resumed by safe_checkpoint_worker.py in its own process)
resumes exactly, and a tampered file of it is refused."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("safe_checkpoint_worker.py")


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [2, 3])
def test_a_checkpoint_resumes_and_a_tampered_file_of_it_is_refused(
    tmp_path: Path, zero_stage: int, worker_env: dict[str, str]
) -> None:
    done = subprocess.run(
        [sys.executable, str(WORKER), str(tmp_path), str(zero_stage)],
        env={**worker_env, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("REPORT ")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(lines[0].removeprefix("REPORT "))
    assert report["client_state"] == {"batch_index": 3} and report["global_steps"] == 1
    assert report["trained_weights_restored"]
    refused = report["refused"]
    assert len(refused) == 3, "model states, optimizer states and RNG states"
    for name, error in refused.items():
        assert f"refusing to load checkpoint file {tmp_path / 'ckpt' / 'step_1' / name}: " in error
    assert report["marker_written"] is False
