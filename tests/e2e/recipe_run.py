"""What the end-to-end tests of a shipped recipe share: reading a stream, preparing the recipe's task
with its example's ``prepare.py``, running ``streamrl up`` on the recipe pointed at the task, and the
checks every finished run must pass (nothing dead-lettered or pending, one trained version a step)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import redis

from streamrl.common.batch_payloads import resolve
from streamrl.common.codec import decode
from streamrl.common.messages import BatchManifest, TrainingBatch, WeightsPublished
from streamrl.common.payload_format import unpack_payload
from streamrl.common.payloads import assemble
from streamrl.common.streams import StreamNames

ROOT = Path(__file__).resolve().parents[2]
VLLM_ENV = {
    **os.environ,
    "STREAMRL_REDIS__RETAIN_CONSUMED_S": "86400",
    "STREAMRL_REDIS__PAYLOAD_RETENTION_S": "86400",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "OMP_NUM_THREADS": "2",
    "TOKENIZERS_PARALLELISM": "false",
}
"""Environment of a run with the vLLM-cpu engine in-process (environment.md)."""


def entries(client: redis.Redis, stream: str) -> list[Any]:  # type: ignore[type-arg]
    """Every message of ``stream``, decoded."""
    return [decode(fields[b"d"]) for _, fields in client.xrange(stream)]


def trained_batches(client: redis.Redis, names: StreamNames) -> list[TrainingBatch]:  # type: ignore[type-arg]
    """Every batch on ``batches`` as the learner trained it. A manifest's payloads outlive their training only
    for ``redis.payload_retention_s`` (these runs keep them a day): each sample is its scored record (in the
    manifest) with its payload, and the manifest's trace context, as the learner's read gives them."""
    out = []
    for m in entries(client, names.batches):
        if isinstance(m, BatchManifest):
            samples = []
            for ref in m.samples:
                assert ref.scored is not None, f"{m.id}: {ref.trajectory_id} has no scored record"
                payload = client.get(ref.key)
                assert payload is not None, f"{m.id}: the payload of {ref.trajectory_id} ({ref.key}) is gone"
                samples.append(assemble(ref.scored, unpack_payload(payload)))
            out.append(resolve(m, samples))
        elif isinstance(m, TrainingBatch):
            out.append(m)
    return out


def prepare(example: str, recipe: str, out_dir: Path, *overrides: str) -> None:
    """``python examples/{example}/prepare.py recipes/{recipe}.toml --prepare.out_dir=... overrides``."""
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / example / "prepare.py"),
            str(ROOT / "recipes" / f"{recipe}.toml"),
            f"--prepare.out_dir={out_dir}",
            *overrides,
        ],
        env={**VLLM_ENV, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def up(recipe: str, task_dir: Path, workdir: Path, overrides: list[str]) -> None:
    """``streamrl up`` on ``recipes/{recipe}.toml`` with its ``runs/{recipe}_task`` paths pointed at
    ``task_dir``; fails the test when the run does not exit 0."""
    path = workdir / f"{recipe}.toml"
    path.write_text((ROOT / "recipes" / f"{recipe}.toml").read_text().replace(f"runs/{recipe}_task", str(task_dir)))
    proc = subprocess.run(
        [sys.executable, "-m", "streamrl.ops.cli", "up", str(path), *overrides],
        env=VLLM_ENV,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]


def check_finished(client: redis.Redis, names: StreamNames, steps: int) -> list[WeightsPublished]:  # type: ignore[type-arg]
    """A finished run's invariants; returns the versions it trained (1..steps, finite loss and gradient)."""
    assert client.xlen(names.dead) == 0, entries(client, names.dead)
    for stream, group in (
        (names.prompts, "rollout"),
        (names.trajectories, "reward"),
        (names.scored, "coordinator"),
        (names.batches, "learner"),
    ):
        assert client.xpending(stream, group)["pending"] == 0, f"{stream}/{group} has pending entries"
    trained = [w for w in entries(client, names.weights) if isinstance(w, WeightsPublished) and w.metrics]
    assert [w.version for w in trained] == list(range(1, steps + 1))
    for w in trained:
        assert math.isfinite(w.metrics["learner/loss/policy"]) and math.isfinite(w.metrics["learner/grad_norm"])
    return trained
