"""A coordinator whose start-up is slower than its lease's TTL, with a standby waiting.

The training dataset lives on "slow storage": a named pipe that the scenario serves whole, but only
``SLOW_S`` seconds after each reader opens it (twice the default 4 s lease TTL), as a dataset on a
slow network volume or a large file would take to read. Two coordinators start, both
``standby = true`` (the second one second after the first). The first takes the run's lease and
then reads the dataset; it must keep its lease through that read (the read off its event loop, or
the lease taken after it), so the standby stays a standby, nobody stops with ``LeaseLostError``,
and the run completes.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
from harness import FaultRun, MakeRun
from scenario import conclude

pytestmark = pytest.mark.slow
TOTAL_STEPS = 8
SLOW_S = 8.0


class SlowFile:
    """A named pipe at ``path`` that gives ``text`` to each reader ``delay_s`` after it opens it."""

    def __init__(self, path: Path, text: str, delay_s: float) -> None:
        self.path, self.text, self.delay_s = path, text.encode(), delay_s
        self.reads = 0
        self._stop = threading.Event()
        os.mkfifo(path)
        self._thread = threading.Thread(target=self._serve, name="slow-file", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            with self.path.open("wb") as out:  # blocks until a reader opens the pipe
                if self._stop.is_set():
                    return
                time.sleep(self.delay_s)
                try:
                    out.write(self.text)
                except BrokenPipeError:
                    continue
            self.reads += 1

    def close(self) -> None:
        self._stop.set()
        try:  # unblock the writer's open()
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
            os.close(fd)
        except OSError:
            pass
        self._thread.join(5)


def test_slow_coordinator_start_with_a_standby(fault_run: MakeRun, tiny_task: Path, tmp_path: Path) -> None:
    slow = SlowFile(tmp_path / "slow_train.jsonl", (tiny_task / "train.jsonl").read_text(), SLOW_S)
    try:
        overrides = [f"--total_steps={TOTAL_STEPS}", "--standby=true", f"--coordinator.dataset.path={slow.path}"]
        run: FaultRun = fault_run("slow-start", overrides)
        run.start()
        time.sleep(1.0)
        run.start_service("coordinator", "coordinator-1")

        def checks() -> list[str]:
            run.details["dataset_reads"] = slow.reads
            return [] if slow.reads else ["no coordinator read the slow dataset"]

        conclude(
            run,
            f"coordinator start slower than its lease ({SLOW_S:g} s) + standby",
            total_steps=TOTAL_STEPS,
            fault_end=None,
            recovery_bound_s=None,
            checks=checks,
        )
    finally:
        slow.close()
