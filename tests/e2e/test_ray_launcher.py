"""``streamrl up`` on Ray, scaled and damaged while it runs: a local Ray (CPU) runs the smoke recipe with every
real tier (transformers rollout engine, function reward, DeepSpeed learner), 2 rollout and 2 reward replicas.

Once steps are trained: ``streamrl scale`` to 3 rollouts; once 3 heartbeat, the actor of one rollout replica is
killed (SIGKILL of the actor process; its service process gets SIGTERM through PR_SET_PDEATHSIG and drains) and
Ray restarts it under a new instance name; then ``streamrl scale`` back to 2 drains the highest replica. The run
must finish by itself with exit 0, and the streams must show every trajectory trained exactly once.

"Generated twice while its first holder was alive" is checked on the traces (sampling all): every generation is
a ``rollout.generate`` span in the file of the process that ran it; a trajectory with two such spans is allowed
only if the first came from the killed replica and the second started once that replica's process was gone.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import psutil
import pytest
import redis
from recipe_run import entries, trained_batches

from streamrl.common.health import live_heartbeats
from streamrl.common.messages import ScoredRecord
from streamrl.common.streams import StreamNames
from streamrl.common.telemetry.trace_file import decode_request, trace_files
from streamrl.common.telemetry.trace_schema import GENERATE, TRAJECTORY_ID

pytest.importorskip("ray", reason="the Ray backend needs pip install 'streamrl-ops[ray]' (scripts/setup.sh does)")
pytestmark = pytest.mark.slow
TOTAL_STEPS, SAMPLES_PER_STEP = 200, 16
ENV = {
    "STREAMRL_REDIS__RETAIN_CONSUMED_S": "86400",
    "STREAMRL_REDIS__PAYLOAD_RETENTION_S": "86400",  # trained and evaluation payloads stay readable
    "OMP_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_DEDUP_LOGS": "0",
}
UP = [
    f"--total_steps={TOTAL_STEPS}",
    "--rollout.engine.type=hf",  # starts in seconds; vLLM's CPU engine is what test_demo_pipeline covers
    "--tracing.sampling=all",
    "--up.backend=ray",
    "--up.ray_num_cpus=4",
    "--up.ray_object_store_mb=80",
    '--up.replicas={"rollout": 2, "reward": 2}',
    '--up.max_restarts={"rollout": 1, "reward": 1}',
    '--up.resources={"coordinator": {"num_cpus": 0.5}, "rollout": {"num_cpus": 0.5}, "reward": {"num_cpus": 0.5},'
    ' "learner": {"num_cpus": 0.5}}',
]


class Run:
    def __init__(
        self,
        client: redis.Redis,
        names: StreamNames,
        proc: subprocess.Popen[bytes],
        log: Path,  # type: ignore[type-arg]
        env: dict[str, str],
    ) -> None:
        self.client, self.names, self.proc, self.log, self.env = client, names, proc, log, env

    def wait_for(self, condition, what: str, timeout_s: float = 240):  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, (
                f"streamrl up ended (code {self.proc.returncode}) before {what}:\n"
                + (self.log.read_text(errors="replace")[-5000:])
            )
            found = condition()
            if found:
                return found
            time.sleep(0.1)
        raise AssertionError(f"timed out waiting for {what}:\n" + self.log.read_text(errors="replace")[-5000:])

    def step(self) -> int:
        return int(self.client.hget(self.names.state("progress"), "step") or 0)

    def rollouts(self) -> dict[str, int]:
        """Running rollout instances -> their service process's pid."""
        return {b.instance: b.pid for b in live_heartbeats(self.client, self.names, "rollout") if b.status == "running"}

    def scale(self, run_dir: Path, count: int) -> str:
        out = subprocess.run(
            [sys.executable, "-m", "streamrl.ops.cli", "scale", str(run_dir), f"rollout={count}"],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        assert f"requested: rollout={count}" in out.stdout
        return out.stdout


def generations(run_dir: Path) -> dict[str, list[tuple[float, str]]]:
    """Trajectory id -> (start time, instance) of every generation of it, from each rollout process's trace file
    (named ``rollout-{instance}-{pid}.jsonl``)."""
    found: dict[str, list[tuple[float, str]]] = defaultdict(list)
    for file in trace_files(run_dir):
        if not file.name.startswith("rollout-rollout-"):
            continue
        instance = file.stem.removeprefix("rollout-").rsplit("-", 1)[0]
        for line in file.read_bytes().splitlines():
            for span in decode_request(line) if line.strip() else []:
                if span.name == GENERATE:
                    found[span.attributes[TRAJECTORY_ID]].append((span.start_ns / 1e9, instance))
    return found


def test_ray_run_scaled_and_a_rollout_actor_killed_trains_every_trajectory_once(
    tiny_task: Path, tmp_path: Path, redis_url: str, run_id: str, write_recipe, worker_env: dict[str, str]
) -> None:  # type: ignore[no-untyped-def]
    run_dir = tmp_path / "run"
    recipe = write_recipe(tiny_task, run_dir, redis_url)
    log = tmp_path / "up.log"
    started = time.monotonic()
    cmd = [sys.executable, "-m", "streamrl.ops.cli", "up", str(recipe), f"--run_id={run_id}", *UP]
    env = {**worker_env, **ENV}
    with log.open("wb") as out:  # the child keeps its own descriptor; ours is closed at once
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    client = redis.Redis.from_url(redis_url)
    names = StreamNames(run_id)
    run = Run(client, names, proc, log, env)
    try:
        run.wait_for(lambda: run.step() >= 2, "the first trained steps")
        assert "live now:" in run.scale(run_dir, 3)
        before = run.wait_for(lambda: (r := run.rollouts()) and len(r) == 3 and r, "3 live rollout replicas")
        assert set(before) == {"rollout-0", "rollout-1", "rollout-2"}

        victim = psutil.Process(before["rollout-0"])
        actor = victim.parent()
        assert actor is not None and "ray::ServiceActor" in actor.name() + " ".join(actor.cmdline())
        killed_at_step = run.step()
        actor.kill()  # the actor, not its child: Ray must restart it
        run.wait_for(lambda: not victim.is_running() or victim.status() == psutil.STATUS_ZOMBIE, "the old process")
        victim_gone = time.time()
        run.wait_for(lambda: set(run.rollouts()) == {"rollout-0.1", "rollout-1", "rollout-2"}, "the restarted actor")

        run.scale(run_dir, 2)
        run.wait_for(lambda: set(run.rollouts()) == {"rollout-0.1", "rollout-1"}, "the drained replica")
        scaled_at_step = run.step()
        assert scaled_at_step < TOTAL_STEPS, "the run ended before the test was done: raise TOTAL_STEPS"
        assert proc.wait(300) == 0, log.read_text(errors="replace")[-5000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    wall_s = time.monotonic() - started
    text = log.read_text(errors="replace")
    assert "running on a local Ray" in text and "rollout-2 removed (exit code 0)" in text
    print(
        f"ray run: {wall_s:.0f} s; rollout-0's actor killed at step {killed_at_step}, scaled to 2 at {scaled_at_step}"
    )

    # every trajectory trained exactly once: each batch in order, no id in two batches, every scored one trained
    batches = trained_batches(client, names)
    assert [b.index for b in batches] == list(range(TOTAL_STEPS))
    trained = [s.trajectory.id for b in batches for s in b.samples]
    assert len(trained) == len(set(trained)) == TOTAL_STEPS * SAMPLES_PER_STEP
    scored = [
        m.trajectory.id
        for m in entries(client, names.scored)
        if isinstance(m, ScoredRecord) and not m.trajectory.is_eval
    ]
    assert len(scored) == len(set(scored)) and set(scored) == set(trained)
    assert client.xlen(names.dead) == 0, entries(client, names.dead)

    # no trajectory generated twice while its first holder was alive
    generated = generations(run_dir)
    assert set(trained) <= set(generated), "a trained trajectory has no generation span: the check would be blind"
    for trajectory, times in generated.items():
        (first_s, first), *again = sorted(times)
        for later_s, _ in again:
            assert first == "rollout-0" and later_s >= victim_gone - 0.5, (
                f"{trajectory} generated by {first} at {first_s:.2f} and again at {later_s:.2f} "
                f"(rollout-0 gone at {victim_gone:.2f})"
            )
