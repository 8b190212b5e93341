"""The coordinator process against a real Redis: admission, dead-letter handling, restart."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis

from streamrl.common.codec import decode, encode
from streamrl.common.messages import DeadLetter, PromptWorkItem, Tensor, Trajectory, WeightsPublished
from streamrl.common.streams import StreamNames


def start(recipe: Path, run_id: str, *extra: str) -> subprocess.Popen[bytes]:
    """The coordinator as a process; its output goes to a file (``proc.log_path``)."""
    cmd = [
        sys.executable,
        "-m",
        "streamrl.coordinator",
        str(recipe),
        f"--run_id={run_id}",
        "--coordinator.eval.dataset=null",
        *extra,
    ]
    log = tempfile.NamedTemporaryFile(prefix="coordinator-", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=log, stderr=subprocess.STDOUT)
    proc.log_path = log.name  # type: ignore[attr-defined]
    return proc


def wait_for(predicate, timeout_s: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def prompts(client: redis.Redis, names: StreamNames) -> list[PromptWorkItem]:
    return [decode(f[b"d"], PromptWorkItem) for _, f in client.xrange(names.prompts)]


def stop(proc: subprocess.Popen[bytes]) -> str:
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    out = Path(proc.log_path).read_text()  # type: ignore[attr-defined]
    assert proc.returncode == 0, out[-3000:]
    return out


def test_sync_admission_dead_letters_and_restart(tiny_task: Path, tmp_path: Path, redis_url: str, run_id: str,
                                                 write_recipe) -> None:  # type: ignore[no-untyped-def]  # fmt: skip
    recipe = write_recipe(tiny_task, tmp_path / "run", redis_url)
    client = redis.Redis.from_url(redis_url)
    names = StreamNames(run_id)
    proc = start(recipe, run_id)
    try:
        # no prompt before a learner is ready (has published its weights)
        log = Path(proc.log_path)  # type: ignore[attr-defined]
        wait_for(lambda: "waiting for a learner" in log.read_text(), 30, "the coordinator to wait for a learner")
        time.sleep(1.0)
        assert client.xlen(names.prompts) == 0, "prompts were issued before any learner was ready"
        ready = WeightsPublished(version=0, step=0, batch_id="", checksum="0", num_bytes=0, num_buckets=0,
                                 endpoint="tcp://127.0.0.1:1")  # fmt: skip
        client.xadd(names.weights, {b"d": encode(ready)})
        # synchronous mode, one batch prefetched: the 4 prompts of batch 0 at version 0 and the 4 of
        # batch 1 asking for version 1 (the rollout holds them until those weights land); no more
        wait_for(lambda: client.xlen(names.prompts) >= 8, 30, "the first prompts")
        time.sleep(1.0)
        issued = prompts(client, names)
        assert [p.policy_version for p in issued] == [0, 0, 0, 0, 1, 1, 1, 1]
        assert all(p.sampling.n == 4 for p in issued)
        # a dead-lettered trajectory fails its group: counted with its reason, and replaced
        victim = issued[0]
        traj = Trajectory(id=f"{victim.id}/0", group_id=victim.id, group_index=0, group_size=4,
                          prompt_ids=victim.prompt_ids, response_ids=Tensor.from_list([5], "int32"),
                          logprobs=Tensor.from_list([-1.0], "float32"), loss_mask=Tensor.from_list([1], "uint8"))  # fmt: skip
        letter = DeadLetter(stream=names.trajectories, entry_id="1-0", group="reward", consumer="r",
                            error="ScorerError: reward server said HTTP 500", deliveries=3, payload=encode(traj), ts=0.0)  # fmt: skip
        client.xadd(names.dead, {b"d": encode(letter)})
        wait_for(lambda: client.xlen(names.prompts) >= 9, 10, "a replacement prompt")
        assert prompts(client, names)[8].policy_version == 1, "the replacement fills batch 1's place"
        progress = {k.decode(): v.decode() for k, v in client.hgetall(names.state("progress")).items()}
        assert progress["dead"] == "1" and "HTTP 500" in progress["dead_reason"]
        assert victim.id.encode() not in client.smembers(names.state("inflight"))
    finally:
        stop(proc)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("coordinator/dead_letters") == 1 and "HTTP 500" in r["coordinator/dead_reason"] for r in rows)

    # a restart continues: the cursor and the version survive, nothing is re-issued
    client.set(names.state("policy_version"), 1)
    proc = start(recipe, run_id)
    try:
        wait_for(lambda: client.xlen(names.prompts) >= 13, 30, "the prompts of batch 2")
        time.sleep(1.0)
        ids = [p.id for p in prompts(client, names)]
        assert len(ids) == len(set(ids)) == 13
        assert [p.policy_version for p in prompts(client, names)][9:] == [2, 2, 2, 2]
    finally:
        stop(proc)


def test_a_prompt_over_the_message_limit_is_skipped_with_a_reason(tiny_task: Path, tmp_path: Path, redis_url: str,
                                                                  run_id: str, write_recipe) -> None:  # type: ignore[no-untyped-def]  # fmt: skip
    data = tmp_path / "train.jsonl"
    rows = [{"prompt": "1+1=" * 100_000, "label": "2"}] + [
        {"prompt": f"{i}+1=", "label": str(i + 1)} for i in range(20)
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = write_recipe(tiny_task, tmp_path / "run", redis_url)
    client = redis.Redis.from_url(redis_url)
    names = StreamNames(run_id)
    ready = WeightsPublished(version=0, step=0, batch_id="", checksum="0", num_bytes=0, num_buckets=0,
                             endpoint="tcp://127.0.0.1:1")  # fmt: skip
    client.xadd(names.weights, {b"d": encode(ready)})
    proc = start(recipe, run_id, f"--coordinator.dataset.path={data}", "--coordinator.dataset.shuffle=false",
                 "--redis.max_message_mb=0.5")  # fmt: skip
    try:
        wait_for(lambda: client.xlen(names.prompts) >= 7, 30, "the first prompts")
        time.sleep(1.0)
        issued = prompts(client, names)
        assert [p.prompt_text for p in issued[:3]] == ["0+1=", "1+1=", "2+1="]  # dataset rows 1.. (row 0 skipped)
        assert client.scard(names.state("inflight")) == len(issued)
    finally:
        out = stop(proc)
    assert "skipping dataset prompt 0: a PromptWorkItem of" in out and "over the 0.5 MiB limit" in out


def test_the_last_evaluation_round_is_never_lost(tiny_task: Path, tmp_path: Path, redis_url: str, run_id: str,
                                                 write_recipe) -> None:  # type: ignore[no-untyped-def]  # fmt: skip
    """The final version's evaluation round counts before the version does: the run cannot be found
    complete in between (here that gap is widened: starting a round takes 0.5 s)."""
    import asyncio

    from streamrl.common.bus import Bus, connect
    from streamrl.common.config import load_config
    from streamrl.common.lifecycle import ServiceContext
    from streamrl.common.messages import ScoredTrajectory
    from streamrl.coordinator.config import CoordinatorConfig
    from streamrl.coordinator.service import CoordinatorService

    recipe = write_recipe(tiny_task, tmp_path / "run", redis_url)
    names = StreamNames(run_id)
    client = redis.Redis.from_url(redis_url)

    def weights(version: int) -> dict[bytes, bytes]:
        return {b"d": encode(WeightsPublished(version=version, step=version, batch_id="", checksum="0", num_bytes=0,
                                              num_buckets=0, endpoint="tcp://127.0.0.1:1"))}  # fmt: skip

    def answer_round(version: int) -> None:
        for item in prompts(client, names):
            if item.is_eval and item.metadata.get("eval_version") == version:
                traj = Trajectory(id=f"{item.id}/0", group_id=item.id, group_index=0, group_size=1,
                                  prompt_ids=item.prompt_ids, response_ids=Tensor.from_list([5], "int32"),
                                  logprobs=Tensor.from_list([-1.0], "float32"), loss_mask=Tensor.from_list([1], "uint8"),
                                  is_eval=True, metadata={"eval_version": version}, policy_version_end=version)  # fmt: skip
                client.hset(
                    names.group_buffer(f"eval-v{version}"),
                    traj.id,
                    encode(ScoredTrajectory(trajectory=traj, reward=1.0, score=1.0)),
                )

    async def scenario() -> tuple[bool, dict[bytes, bytes]]:
        overrides = [f"--run_id={run_id}", "--total_steps=1", "--coordinator.eval.every_steps=1",
                     "--coordinator.eval.num_prompts=2"]  # fmt: skip
        config = load_config(CoordinatorConfig, str(recipe), overrides, section="coordinator")
        bus = Bus(connect(redis_url))
        ctx = ServiceContext(service="coordinator", instance="t", config=config, bus=bus, names=names,
                             stop=asyncio.Event())  # fmt: skip
        real_hsetnx = bus.redis.hsetnx

        async def slow_hsetnx(*args: object, **kwargs: object) -> object:
            await asyncio.sleep(0.5)
            return await real_hsetnx(*args, **kwargs)  # type: ignore[arg-type]

        bus.redis.hsetnx = slow_hsetnx  # type: ignore[method-assign]
        client.xadd(names.weights, weights(0))
        run = asyncio.create_task(CoordinatorService(config, ctx).run())
        while not any(p.is_eval for p in prompts(client, names)):
            await asyncio.sleep(0.05)
        answer_round(0)
        while client.hget(names.state("eval_rounds"), "0").startswith(b"started"):
            await asyncio.sleep(0.05)
        client.xadd(names.weights, weights(1))
        await asyncio.sleep(2.0)
        ended_early = run.done()
        rounds = client.hgetall(names.state("eval_rounds"))
        answer_round(1)
        await asyncio.wait_for(run, 30)
        await bus.redis.aclose()
        return ended_early, rounds

    ended_early, rounds = asyncio.run(scenario())
    assert not ended_early, "the run ended before its last evaluation round was read"
    assert rounds[b"1"].startswith(b"started")
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["eval/acc"] for r in rows if "eval/acc" in r] == [1.0, 1.0]
