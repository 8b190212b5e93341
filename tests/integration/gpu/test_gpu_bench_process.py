"""bench/gpu.py and bench/gpu_pipeline.py with child processes: the GPU memory poller reads a stand-in nvidia-smi,
and the driver's report records each part and the machine's facts (platform and nvidia-smi probes)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import gpu
import gpu_pipeline as pipeline
import pytest
from test_gpu_bench import fake_part


def test_gpu_memory_reads_first_and_peak_per_gpu() -> None:
    fake = [sys.executable, "-c", "print('0, 100'); print('1, 7'); print('junk'); print('0, 900'); print('0, 300')"]
    memory = pipeline.GpuMemory(command=fake)
    with memory:
        assert memory._proc is not None
        memory._proc.wait(10)
    assert memory.summary() == {
        "peak_mib": {"0": 900, "1": 7},
        "before_mib": {"0": 100, "1": 7},
        "peak_minus_before_mib": {"0": 800, "1": 0},
    }


def test_main_records_each_part_and_a_failure_does_not_stop_the_others(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def broken(args: argparse.Namespace) -> dict[str, Any]:
        raise RuntimeError("no GPU here")

    fake_part(monkeypatch, "gpu_test_a", broken)
    fake_part(monkeypatch, "gpu_test_b", lambda args: {"tokens_per_s": 1.0, "out": args.out_dir})
    fake_part(monkeypatch, "gpu_test_c", lambda args: {"errors": ["trl: exit code 1"]})
    monkeypatch.setattr(gpu, "PARTS", {"a": "gpu_test_a", "b": "gpu_test_b", "c": "gpu_test_c"})
    code = gpu.main(["--out", str(tmp_path), "--typo-steps=3"])
    assert code == 1
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    (written,) = tmp_path.glob("gpu-*.json")
    assert json.loads(written.read_text()) == last
    parts = last["parts"]
    assert not parts["a"]["ok"] and "RuntimeError: no GPU here" in parts["a"]["error"]
    assert parts["b"]["ok"] and parts["b"]["result"] == {"tokens_per_s": 1.0, "out": str(tmp_path)}
    assert not parts["c"]["ok"]
    assert last["command"] == f"python bench/gpu.py --out {tmp_path} --typo-steps=3"
    assert last["ignored_args"] == ["--typo-steps=3"]
    assert last["machine"]["cpu_count"] >= 1 and "torch" in last["machine"]
