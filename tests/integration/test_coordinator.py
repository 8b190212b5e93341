"""The coordinator process against a real Redis: admission, dead-letter handling, restart."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from streamrl.common.codec import decode, encode
from streamrl.common.messages import (
    BATCH_SKIPPED,
    BatchManifest,
    DeadLetter,
    PromptWorkItem,
    ScoredRecord,
    ScoredTrajectory,
    Tensor,
    TrainingBatch,
    Trajectory,
    WeightsPublished,
)
from streamrl.common.payloads import record_of
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


def test_sync_admission_dead_letters_and_restart(
    tiny_task: Path, tmp_path: Path, redis_url: str, run_id: str, write_recipe
) -> None:  # type: ignore[no-untyped-def]
    recipe = write_recipe(tiny_task, tmp_path / "run", redis_url)
    client = redis.Redis.from_url(redis_url)
    names = StreamNames(run_id)
    proc = start(recipe, run_id)
    try:
        # no prompt before a learner is ready (has published its weights)
        log = Path(proc.log_path)  # type: ignore[attr-defined]
        wait_for(lambda: "waiting for a learner" in log.read_text(), 120, "the coordinator to wait for a learner")
        time.sleep(1.0)
        assert client.xlen(names.prompts) == 0, "prompts were issued before any learner was ready"
        ready = WeightsPublished(
            version=0, step=0, batch_id="", checksum="0", num_bytes=0, num_buckets=0, endpoint="tcp://127.0.0.1:1"
        )
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
        traj = Trajectory(
            id=f"{victim.id}/0",
            group_id=victim.id,
            group_index=0,
            group_size=4,
            prompt_ids=victim.prompt_ids,
            response_ids=Tensor.from_list([5], "int32"),
            logprobs=Tensor.from_list([-1.0], "float32"),
            loss_mask=Tensor.from_list([1], "uint8"),
        )
        letter = DeadLetter(
            stream=names.trajectories,
            entry_id="1-0",
            group="reward",
            consumer="r",
            error="ScorerError: reward server said HTTP 500",
            deliveries=3,
            payload=encode(traj),
            ts=0.0,
        )
        client.xadd(names.dead, {b"d": encode(letter)})
        wait_for(lambda: client.xlen(names.prompts) >= 9, 10, "a replacement prompt")
        # the replacement asks for the version its group needed (batch 0's), not its position's (batch 1's:
        # that version needs batch 0 trained first, which needs the replacement - the run would wait forever)
        assert prompts(client, names)[8].policy_version == 0
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
        wait_for(lambda: client.xlen(names.prompts) >= 13, 120, "the prompts of batch 2")
        time.sleep(1.0)
        ids = [p.id for p in prompts(client, names)]
        assert len(ids) == len(set(ids)) == 13
        assert [p.policy_version for p in prompts(client, names)][9:] == [2, 2, 2, 2]
    finally:
        stop(proc)


def test_a_prompt_over_the_message_limit_is_skipped_with_a_reason(
    tiny_task: Path, tmp_path: Path, redis_url: str, run_id: str, write_recipe
) -> None:  # type: ignore[no-untyped-def]
    data = tmp_path / "train.jsonl"
    rows = [{"prompt": "1+1=" * 100_000, "label": "2"}] + [
        {"prompt": f"{i}+1=", "label": str(i + 1)} for i in range(20)
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = write_recipe(tiny_task, tmp_path / "run", redis_url)
    client = redis.Redis.from_url(redis_url)
    names = StreamNames(run_id)
    ready = WeightsPublished(
        version=0, step=0, batch_id="", checksum="0", num_bytes=0, num_buckets=0, endpoint="tcp://127.0.0.1:1"
    )
    client.xadd(names.weights, {b"d": encode(ready)})
    proc = start(
        recipe,
        run_id,
        f"--coordinator.dataset.path={data}",
        "--coordinator.dataset.shuffle=false",
        "--redis.max_message_mb=0.5",
    )
    try:
        wait_for(lambda: client.xlen(names.prompts) >= 7, 120, "the first prompts")
        time.sleep(1.0)
        issued = prompts(client, names)
        assert [p.prompt_text for p in issued[:3]] == ["0+1=", "1+1=", "2+1="]  # dataset rows 1.. (row 0 skipped)
        assert client.scard(names.state("inflight")) == len(issued)
    finally:
        out = stop(proc)
    assert "skipping dataset prompt 0: a PromptWorkItem of" in out and "over the 0.5 MiB limit" in out


def test_the_last_evaluation_round_is_never_lost(
    tiny_task: Path, tmp_path: Path, redis_url: str, run_id: str, write_recipe, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    """The final version's evaluation round counts before the version does: the run cannot be found
    complete in between (here that gap is widened: starting a round takes 0.5 s)."""
    from streamrl.common.bus import Bus, connect
    from streamrl.common.config import load_config
    from streamrl.common.lifecycle import ServiceContext
    from streamrl.coordinator.config import CoordinatorConfig
    from streamrl.coordinator.evaluation import EvalRounds
    from streamrl.coordinator.service import CoordinatorService

    recipe = write_recipe(tiny_task, tmp_path / "run", redis_url)
    names = StreamNames(run_id)
    client = redis.Redis.from_url(redis_url)

    def weights(version: int) -> dict[bytes, bytes]:
        return {
            b"d": encode(
                WeightsPublished(
                    version=version,
                    step=version,
                    batch_id="",
                    checksum="0",
                    num_bytes=0,
                    num_buckets=0,
                    endpoint="tcp://127.0.0.1:1",
                )
            )
        }

    def answer_round(version: int) -> None:
        for item in prompts(client, names):
            if item.is_eval and item.metadata.get("eval_version") == version:
                traj = Trajectory(
                    id=f"{item.id}/0",
                    group_id=item.id,
                    group_index=0,
                    group_size=1,
                    prompt_ids=item.prompt_ids,
                    response_ids=Tensor.from_list([5], "int32"),
                    logprobs=Tensor.from_list([-1.0], "float32"),
                    loss_mask=Tensor.from_list([1], "uint8"),
                    is_eval=True,
                    metadata={"eval_version": version},
                    policy_version_end=version,
                )
                record = record_of(traj, names.payload(traj.id, "t"), 0)
                client.hset(
                    names.group_buffer(f"eval-v{version}"),
                    traj.id,
                    encode(ScoredRecord(trajectory=record, reward=1.0, score=1.0)),
                )

    async def scenario() -> tuple[bool, dict[bytes, bytes]]:
        overrides = [
            f"--run_id={run_id}",
            "--total_steps=1",
            "--coordinator.eval.every_steps=1",
            "--coordinator.eval.num_prompts=2",
        ]
        config = load_config(CoordinatorConfig, str(recipe), overrides, section="coordinator")
        bus = Bus(connect(redis_url))
        ctx = ServiceContext(
            service="coordinator", instance="t", config=config, bus=bus, names=names, stop=asyncio.Event()
        )
        real_start = EvalRounds.maybe_start

        async def slow_start(self: EvalRounds, version: int) -> None:
            await asyncio.sleep(0.5)
            await real_start(self, version)

        monkeypatch.setattr(EvalRounds, "maybe_start", slow_start)
        client.xadd(names.weights, weights(0))
        run = asyncio.create_task(CoordinatorService(config, ctx).run())
        while not any(p.is_eval for p in prompts(client, names)):
            await asyncio.sleep(0.05)
        answer_round(0)
        while client.hget(names.state("eval_rounds"), "0").startswith(b"started"):
            await asyncio.sleep(0.05)
        client.xadd(names.weights, weights(1))
        deadline = time.monotonic() + 30  # (a loaded machine takes seconds to get there)
        while not client.hexists(names.state("eval_rounds"), "1") and not run.done():
            assert time.monotonic() < deadline, "round 1 never started"
            await asyncio.sleep(0.05)
        await asyncio.sleep(1.0)
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


# -- the coordinator in this process, driven through its streams (real Redis) -----------------------


class Harness:
    """A running coordinator service and the streams around it, seen from the other tiers' side."""

    def __init__(self, client: redis.Redis, names: StreamNames, run_dir: Path) -> None:
        self.client = client
        self.names = names
        self.run_dir = run_dir
        self.service_task: asyncio.Task[None] | None = None

    def prompts(self) -> list[PromptWorkItem]:
        return prompts(self.client, self.names)

    def weights(self, version: int) -> None:
        event = WeightsPublished(
            version=version,
            step=version,
            batch_id="",
            checksum="0",
            num_bytes=0,
            num_buckets=0,
            endpoint="tcp://127.0.0.1:1",
        )
        self.client.xadd(self.names.weights, {b"d": encode(event)})

    def answer(self, item: PromptWorkItem, scores: list[float] | None = None, **scored: Any) -> None:
        """Every sample of ``item``'s group scored and on the scored stream, as the reward tier writes it."""
        n = item.sampling.n
        for i, score in enumerate(scores if scores is not None else [float(i % 2) for i in range(n)]):
            self.score_one(item, i, score, **scored)

    def score_one(self, item: PromptWorkItem, index: int, score: float, **scored: Any) -> str:
        """Sample ``index`` of ``item``: its payload stored as the rollout worker stores it, its scored record on
        the scored stream as the reward tier writes it; the payload's key."""
        record = score_sample(self.names, item, index, score, **scored)
        traj = record.trajectory
        self.client.set(traj.payload_key, encode(trajectory_of(item, index, traj.policy_version_start)))
        self.client.xadd(self.names.scored, {b"d": encode(record)})
        return traj.payload_key

    def dead_letter(self, stream: str, message: Any, error: str = "ScorerError: HTTP 500") -> None:
        letter = DeadLetter(
            stream=stream,
            entry_id="1-0",
            group="g",
            consumer="c",
            error=error,
            deliveries=3,
            payload=encode(message),
            ts=0.0,
        )
        self.client.xadd(self.names.dead, {b"d": encode(letter)})

    def counter(self, name: str) -> int:
        return int(self.client.get(self.names.state(name)) or 0)

    def progress(self) -> dict[str, str]:
        return {k.decode(): v.decode() for k, v in self.client.hgetall(self.names.state("progress")).items()}

    def metrics(self) -> list[dict[str, Any]]:
        return metric_rows(self.run_dir)

    async def until(self, predicate: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            assert self.service_task is None or not self.service_task.done(), f"the coordinator ended: {what}"
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            await asyncio.sleep(0.02)


def score_sample(
    names: StreamNames, item: PromptWorkItem, index: int, score: float, version: int | None = None, **scored: Any
) -> ScoredRecord:
    """The scored record of sample ``index`` of ``item`` (its payload, :func:`trajectory_of`, under run ``names``'s
    payload key of attempt ``t``)."""
    v = item.policy_version if version is None else version
    traj = trajectory_of(item, index, v)
    key = names.payload(traj.id, "t")
    return ScoredRecord(trajectory=record_of(traj, key, len(encode(traj))), reward=score, score=score, **scored)


def trajectory_of(item: PromptWorkItem, index: int, version: int) -> Trajectory:
    return Trajectory(
        id=f"{item.id}/{index}",
        group_id=item.id,
        group_index=index,
        group_size=item.sampling.n,
        prompt_ids=item.prompt_ids,
        response_ids=Tensor.from_list([5], "int32"),
        logprobs=Tensor.from_list([-1.0], "float32"),
        loss_mask=Tensor.from_list([1], "uint8"),
        is_eval=item.is_eval,
        metadata=item.metadata,
        policy_version_start=version,
        policy_version_end=version,
    )


def metric_rows(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def a_trajectory(item: PromptWorkItem) -> Trajectory:
    return trajectory_of(item, 0, item.policy_version)


@contextlib.asynccontextmanager
async def coordinator(
    recipe: Path, run_id: str, redis_url: str, *overrides: str, evaluation: bool = False
) -> AsyncIterator[Harness]:
    """The coordinator service running in this event loop (the recipe's evaluation only with ``evaluation``)."""
    from streamrl.common.bus import Bus, connect
    from streamrl.common.config import load_config
    from streamrl.common.lifecycle import ServiceContext
    from streamrl.coordinator.config import CoordinatorConfig
    from streamrl.coordinator.service import CoordinatorService

    args = [f"--run_id={run_id}", *([] if evaluation else ["--coordinator.eval.dataset=null"]), *overrides]
    config = load_config(CoordinatorConfig, str(recipe), args, section="coordinator")
    names = StreamNames(run_id)
    bus = Bus(connect(redis_url), maxlen=config.redis.maxlen, max_message_bytes=config.redis.max_message_bytes)
    ctx = ServiceContext(service="coordinator", instance="t", config=config, bus=bus, names=names, stop=asyncio.Event())
    harness = Harness(redis.Redis.from_url(redis_url), names, Path(config.run_dir))
    harness.service_task = asyncio.create_task(CoordinatorService(config, ctx).run())
    try:
        yield harness
    finally:
        ctx.stop.set()
        await asyncio.wait_for(harness.service_task, 30)
        await bus.redis.aclose()


@pytest.mark.parametrize("loss", ["dead-lettered", "filtered", "timed out"])
def test_a_lost_group_is_replaced_for_its_own_batch(
    tiny_task: Path, tmp_path: Path, redis_url: str, run_id: str, write_recipe, loss: str
) -> None:  # type: ignore[no-untyped-def]
    """Synchronous, one batch prefetched: batch 1's groups wait for version 1 while a group of batch 0
    is lost. Its replacement must ask for version 0 - one asking for version 1 (its position in issue
    order) could only be generated after batch 0 trained, which needs it: the run would stop for good."""
    recipe = write_recipe(tiny_task, tmp_path / "run", redis_url)
    extra = ["--coordinator.dynamic_filtering=true"] if loss == "filtered" else []
    extra += ["--coordinator.group_timeout_s=1.0"] if loss == "timed out" else []

    async def scenario() -> None:
        async with coordinator(recipe, run_id, redis_url, *extra) as h:
            h.weights(0)
            await h.until(lambda: len(h.prompts()) >= 8, "the prompts of batches 0 and 1")
            issued = h.prompts()
            assert [p.policy_version for p in issued] == [0, 0, 0, 0, 1, 1, 1, 1]
            for item in issued[:3]:
                h.answer(item)
            lost = issued[3]
            if loss == "dead-lettered":
                h.dead_letter(h.names.trajectories, a_trajectory(lost))
            elif loss == "filtered":
                h.answer(lost, scores=[1.0, 1.0, 1.0, 1.0])  # no spread: dropped by dynamic filtering
            await h.until(lambda: len(h.prompts()) >= 9, "a replacement prompt")
            replacement = h.prompts()[8]
            assert replacement.policy_version == 0, "the replacement asks for the version its batch needs"
            h.answer(replacement)
            await h.until(lambda: h.client.xlen(h.names.batches) == 1, "batch 0")
            assert len(h.prompts()) == 9  # batch 1's groups (waiting for version 1) were not timed out
            counter = {"dead-lettered": "groups_dead", "filtered": "groups_filtered", "timed out": "groups_timed_out"}
            assert h.counter(counter[loss]) == 1

    asyncio.run(scenario())


def test_a_timed_out_group_is_logged_counted_and_its_late_samples_dropped(
    tiny_task: Path, tmp_path: Path, redis_url: str, run_id: str, write_recipe, caplog: pytest.LogCaptureFixture
) -> None:  # type: ignore[no-untyped-def]
    recipe = write_recipe(tiny_task, tmp_path / "run", redis_url)

    async def scenario() -> None:
        # every group of the run times out here: with the error budget on, 4 of 4 failed would pause issuing
        budget_off = "--coordinator.max_dead_fraction=1.0"
        async with coordinator(recipe, run_id, redis_url, "--coordinator.group_timeout_s=1.0", budget_off) as h:
            h.weights(0)
            await h.until(lambda: len(h.prompts()) >= 8, "the first prompts")
            late = h.prompts()[0]
            h.score_one(late, 0, 1.0)  # 1 of 4 samples, then silence
            await h.until(lambda: h.counter("groups_timed_out") == 4, "batch 0's groups to time out", 5.0)
            await h.until(lambda: len(h.prompts()) == 12, "their replacements")
            assert [p.policy_version for p in h.prompts()[8:]] == [0, 0, 0, 0]
            for item in h.prompts()[8:]:
                h.answer(item)
            assert not h.client.exists(h.names.group_buffer(late.id))
            h.score_one(late, 1, 1.0)  # a straggler
            await h.until(lambda: h.counter("late_samples_dropped") == 1, "the late sample to be dropped")
            assert not h.client.exists(h.names.group_buffer(late.id))
            await h.until(lambda: h.progress().get("groups_timed_out") == "4", "the count in the progress hash")

    asyncio.run(scenario())
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "timed out" in r.getMessage()]
    assert len(warned) == 4 and any("group p0 " in w for w in warned), warned


def test_a_dead_lettered_batch_is_counted_never_taken_for_a_group(
    tiny_task: Path, tmp_path: Path, redis_url: str, run_id: str, write_recipe, caplog: pytest.LogCaptureFixture
) -> None:  # type: ignore[no-untyped-def]
    recipe = write_recipe(tiny_task, tmp_path / "run", redis_url)

    async def scenario() -> None:
        async with coordinator(recipe, run_id, redis_url) as h:
            h.weights(0)
            await h.until(lambda: len(h.prompts()) >= 8, "the first prompts")
            item = h.prompts()[0]
            batch = TrainingBatch(
                id="batch-0",
                index=0,
                samples=[
                    ScoredTrajectory(trajectory=trajectory_of(item, i, 0), reward=1.0, score=1.0) for i in range(4)
                ],
                policy_version=0,
                staleness=[0, 0, 0, 0],
            )
            for _ in range(2):  # the same batch twice (a learner restarted mid-way): counted once
                h.dead_letter(
                    h.names.batches,
                    batch,
                    f"batch-0 ({len(batch.samples)} samples) {BATCH_SKIPPED}: its step failed 3 times, last: FloatingPointError: nan",
                )
            await h.until(lambda: h.progress().get("batches_dead") == "1", "the dead batch in the progress hash")
            assert (h.counter("batches_dead"), h.counter("samples_dead")) == (1, 4)
            assert h.counter("groups_dead") == 0 and item.id.encode() in h.client.smembers(h.names.state("inflight"))
            assert h.progress()["samples_dead"] == "4"
            await asyncio.sleep(0.3)
            assert len(h.prompts()) == 8, "no replacement: the batch's groups were not in flight"

    asyncio.run(scenario())
    rows = metric_rows(tmp_path / "run")
    assert any(r.get("coordinator/batches_dead") == 1 and r.get("coordinator/samples_dead") == 4 for r in rows)
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR and "batch-0" in r.getMessage()]
    assert errors and "FloatingPointError: nan" in errors[0] and "4 samples" in errors[0], errors


def test_batch_metrics_carry_the_reward_tiers_figures(
    tiny_task: Path, tmp_path: Path, redis_url: str, run_id: str, write_recipe
) -> None:  # type: ignore[no-untyped-def]
    recipe = write_recipe(tiny_task, tmp_path / "run", redis_url)

    async def scenario() -> None:
        async with coordinator(recipe, run_id, redis_url) as h:
            h.weights(0)
            await h.until(lambda: len(h.prompts()) >= 8, "the first prompts")
            issued = h.prompts()
            h.dead_letter(h.names.trajectories, a_trajectory(issued[4]))
            await h.until(lambda: h.counter("groups_dead") == 1, "the dead letter")
            for k, item in enumerate(issued[:4]):
                h.answer(item, reward_latency_ms=10.0 * (k + 1), extra={"reward/attempts": float(k % 2 + 1)})
            await h.until(lambda: h.client.xlen(h.names.batches) == 1, "batch 0")
            await h.until(lambda: any("rollout/acc" in r for r in h.metrics()), "batch 0's metrics")

    asyncio.run(scenario())
    rows = metric_rows(tmp_path / "run")
    (batch,) = [r for r in rows if "rollout/acc" in r]
    assert batch["reward/latency_ms_mean"] == pytest.approx(25.0) and batch["reward/latency_ms_max"] == 40.0
    assert batch["reward/attempts"] == pytest.approx(1.5)
    assert batch["reward/dead_lettered"] == 1 and batch["coordinator/groups_dead"] == 1
    assert any(r.get("reward/dead_lettered") == 1 for r in rows if "coordinator/dead_reason" in r)


def test_evaluation_rounds_close_with_dead_and_missing_prompts(
    tiny_task: Path, tmp_path: Path, redis_url: str, run_id: str, write_recipe, caplog: pytest.LogCaptureFixture
) -> None:  # type: ignore[no-untyped-def]
    """Round 0: one prompt answered, one dead-lettered - it closes on what it has. Round 1 (the last):
    no answer at all - it closes after group_timeout_s with both missing, and the run ends."""
    recipe = write_recipe(tiny_task, tmp_path / "run", redis_url)

    async def scenario() -> None:
        async with coordinator(
            recipe,
            run_id,
            redis_url,
            "--total_steps=1",
            "--coordinator.eval.num_prompts=2",
            "--coordinator.group_timeout_s=3",
            evaluation=True,
        ) as h:
            h.weights(0)
            await h.until(lambda: sum(p.is_eval for p in h.prompts()) == 2, "round 0's prompts")
            first, second = [p for p in h.prompts() if p.is_eval]
            h.answer(first, scores=[1.0])
            h.dead_letter(h.names.prompts, second, "WeightSyncError: deadline passed")
            await h.until(
                lambda: not h.client.hget(h.names.state("eval_rounds"), "0").startswith(b"started"),
                "round 0 to close",
                2.0,
            )  # before its timeout
            h.weights(1)
            assert h.service_task is not None
            await asyncio.wait_for(asyncio.shield(h.service_task), 10)  # the run ends: round 1 timed out
            assert h.progress().get("eval_dead") == "1"

    asyncio.run(scenario())
    rows = [r for r in metric_rows(tmp_path / "run") if "eval/num_prompts" in r]
    assert [(r["step"], r.get("eval/acc"), r["eval/num_dead"], r["eval/num_missing"]) for r in rows] == [
        (0, 1.0, 1, 0),
        (1, None, 0, 2),
    ]
    assert any(
        "version 1" in r.getMessage() and "no accuracy" in r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING
    )


def test_a_trimmed_entry_is_acknowledged_with_a_warning(
    redis_url: str, run_id: str, caplog: pytest.LogCaptureFixture
) -> None:
    """An entry trimmed from its stream before it was handled (its group then times out at the
    coordinator) is acknowledged by the consumer that claims it, with one warning line."""
    from streamrl.common.bus import Bus, connect
    from streamrl.common.config import ConsumerConfig
    from streamrl.common.consumer import ConsumerLoop

    names = StreamNames(run_id)
    client = redis.Redis.from_url(redis_url)
    client.xgroup_create(names.prompts, "rollout", id="0", mkstream=True)
    entry = client.xadd(names.prompts, {b"d": b"x"})
    client.xreadgroup("rollout", "gone", {names.prompts: ">"})  # delivered to a consumer that died
    client.xtrim(names.prompts, maxlen=0)

    async def handler(message: Any) -> list[Any]:
        raise AssertionError("a trimmed entry has nothing to handle")

    async def scenario() -> None:
        bus = Bus(connect(redis_url))
        config = ConsumerConfig(claim_idle_ms=100, claim_interval_s=0.1, block_ms=50)
        loop = ConsumerLoop(
            bus,
            names,
            stream=names.prompts,
            group="rollout",
            consumer="live",
            handler=handler,
            message_type=PromptWorkItem,
            config=config,
        )
        stop = asyncio.Event()
        running = asyncio.create_task(loop.run(stop))
        deadline = time.monotonic() + 5.0
        while client.xpending(names.prompts, "rollout")["pending"] and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        stop.set()
        await running
        await bus.redis.aclose()

    asyncio.run(scenario())
    assert client.xpending(names.prompts, "rollout")["pending"] == 0
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(entry.decode() in w and "trimmed" in w for w in warned), warned


def test_a_bad_dataset_row_is_skipped_named_and_counted(
    tiny_task: Path, tmp_path: Path, redis_url: str, run_id: str, write_recipe
) -> None:  # type: ignore[no-untyped-def]
    """A row with no prompt key and one whose chat template fails (the tiny tokenizer has none) are
    skipped with one error line each; the coordinator issues the good rows and keeps running."""
    data = tmp_path / "train.jsonl"
    rows: list[dict[str, Any]] = [{"prompt": f"{i}+1=", "label": str(i + 1)} for i in range(20)]
    rows[1] = {"question": "1+1=", "label": "2"}
    rows[3] = {"prompt": [{"role": "user", "content": "3+1="}], "label": "4"}
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = write_recipe(tiny_task, tmp_path / "run", redis_url)
    client = redis.Redis.from_url(redis_url)
    names = StreamNames(run_id)
    ready = WeightsPublished(
        version=0, step=0, batch_id="", checksum="0", num_bytes=0, num_buckets=0, endpoint="tcp://127.0.0.1:1"
    )
    client.xadd(names.weights, {b"d": encode(ready)})
    proc = start(recipe, run_id, f"--coordinator.dataset.path={data}", "--coordinator.dataset.shuffle=false")
    try:
        wait_for(lambda: client.xlen(names.prompts) >= 8 or proc.poll() is not None, 120, "the first prompts")
        time.sleep(1.0)
        assert proc.poll() is None, Path(proc.log_path).read_text()[-3000:]  # type: ignore[attr-defined]
        issued = prompts(client, names)
        assert [p.prompt_text for p in issued[:4]] == ["0+1=", "2+1=", "4+1=", "5+1="]
        assert client.get(names.state("cursor")) == b"10" and len(issued) == 8
        progress = {k.decode(): v.decode() for k, v in client.hgetall(names.state("progress")).items()}
        assert progress.get("prompts_bad") == "2", progress
    finally:
        out = stop(proc)
    errors = [line for line in out.splitlines() if " ERROR " in line and f"dataset {data}" in line]
    assert len(errors) == 2, out[-3000:]
    assert "row 1: " in errors[0] and "'prompt'" in errors[0]
    assert "row 3: " in errors[1] and "chat template" in errors[1]


def test_a_dataset_of_bad_rows_fails_at_start_with_one_clear_line(
    tiny_task: Path, tmp_path: Path, redis_url: str, run_id: str, write_recipe
) -> None:  # type: ignore[no-untyped-def]
    data = tmp_path / "train.jsonl"
    rows = [{"prompt": [{"role": "user", "content": f"{i}+1="}], "label": str(i + 1)} for i in range(50)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = write_recipe(tiny_task, tmp_path / "run", redis_url)
    client = redis.Redis.from_url(redis_url)
    names = StreamNames(run_id)
    ready = WeightsPublished(
        version=0, step=0, batch_id="", checksum="0", num_bytes=0, num_buckets=0, endpoint="tcp://127.0.0.1:1"
    )
    client.xadd(names.weights, {b"d": encode(ready)})
    proc = start(recipe, run_id, f"--coordinator.dataset.path={data}")
    try:
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = Path(proc.log_path).read_text()  # type: ignore[attr-defined]
    assert proc.returncode not in (0, None), out[-3000:]
    assert f"dataset {data}: the first 32 rows are all bad" in out and "chat template" in out, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert client.xlen(names.prompts) == 0


def batches_of(h: Harness) -> list[BatchManifest]:
    return [decode(f[b"d"], BatchManifest) for _, f in h.client.xrange(h.names.batches)]


def test_a_batch_the_learner_refused_is_sent_again_then_counted_as_dropped(
    tiny_task: Path, tmp_path: Path, redis_url: str, run_id: str, write_recipe, caplog: pytest.LogCaptureFixture
) -> None:  # type: ignore[no-untyped-def]
    """Synchronous, nothing prefetched: once batch 0 is out, admission is closed until the learner
    publishes version 1. A learner that dead-letters batch 0 without consuming it (it arrived out of
    order) publishes no version for it: the coordinator sends it again (same index and content) so the
    learner can take it in order, and after consumer.max_deliveries refusals counts its groups as
    dropped with the reason - never "nothing lost" while the run waits for ever."""
    recipe = write_recipe(tiny_task, tmp_path / "run", redis_url)
    reason = "batch-0 is ahead of the learner, whose next batch is 0: batches are never trained out of order"

    async def scenario() -> None:
        async with coordinator(recipe, run_id, redis_url, "--coordinator.prefetch_steps=0") as h:
            h.weights(0)
            await h.until(lambda: len(h.prompts()) >= 4, "the prompts of batch 0")
            for item in h.prompts():
                h.answer(item)
            await h.until(lambda: h.client.xlen(h.names.batches) == 1, "batch 0")
            (batch,) = batches_of(h)
            h.dead_letter(h.names.batches, batch, reason)
            await h.until(lambda: h.client.xlen(h.names.batches) == 2, "batch 0 sent again", timeout_s=10)
            again = batches_of(h)[1]
            assert again == batch  # the same manifest: its samples are still kept
            assert all(h.client.exists(r.key) for r in again.samples)  # its payloads are kept
            for _ in range(2):  # refused every time: after max_deliveries (3) letters it is given up
                h.dead_letter(h.names.batches, batch, reason)
            await h.until(lambda: h.counter("batches_dead") == 1, "the batch counted as dropped")
            assert h.client.xlen(h.names.batches) == 3
            assert (h.counter("samples_dead"), h.counter("batch_groups_dead")) == (16, 4)
            assert not any(h.client.exists(key) for key in batch.buffers), "a dead batch's samples are deleted"
            assert h.progress()["batch_groups_dead"] == "4"
            h.dead_letter(h.names.batches, batch, reason)  # a later letter for it changes nothing
            await asyncio.sleep(0.5)
            assert h.client.xlen(h.names.batches) == 3 and h.counter("batches_dead") == 1

    asyncio.run(scenario())
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR and "batch-0" in r.getMessage()]
    assert any("4 groups" in e and "out of order" in e and "dropped" in e for e in errors), errors


def test_the_coordinators_start_up_never_stalls_its_event_loop(
    tiny_task: Path, tmp_path: Path, redis_url: str, run_id: str, write_recipe, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    """Loading a dataset and its tokenizer (here made to take 2 s) runs off the event loop: the loop keeps
    the heartbeat and the leases renewed meanwhile (a start longer than the lease TTL would hand the run
    to a standby while the first coordinator is still starting)."""
    from streamrl.common.bus import Bus, connect
    from streamrl.common.config import load_config
    from streamrl.common.lifecycle import ServiceContext
    from streamrl.coordinator import service as service_module
    from streamrl.coordinator.__main__ import _run
    from streamrl.coordinator.config import CoordinatorConfig

    real_source = service_module.PromptSource

    def slow_source(*args: Any, **kwargs: Any) -> Any:
        time.sleep(2.0)
        return real_source(*args, **kwargs)

    monkeypatch.setattr(service_module, "PromptSource", slow_source)
    recipe = write_recipe(tiny_task, tmp_path / "run", redis_url)
    config = load_config(
        CoordinatorConfig, str(recipe), [f"--run_id={run_id}", "--coordinator.eval.dataset=null"], section="coordinator"
    )
    names = StreamNames(run_id)

    async def scenario() -> float:
        bus = Bus(connect(redis_url))
        ctx = ServiceContext(
            service="coordinator", instance="t", config=config, bus=bus, names=names, stop=asyncio.Event()
        )
        running = asyncio.create_task(_run(config, ctx))
        worst, last = 0.0, time.monotonic()
        while ctx.status != "running":
            assert not running.done(), running.exception()
            await asyncio.sleep(0.02)
            now = time.monotonic()
            worst, last = max(worst, now - last), now
        ctx.stop.set()
        await asyncio.wait_for(running, 30)
        await bus.redis.aclose()
        return worst

    worst_pause_s = asyncio.run(scenario())
    assert worst_pause_s < 1.0, f"the event loop stalled {worst_pause_s:.1f} s during start-up"


def test_a_dead_letter_read_again_after_a_restart_is_counted_once(
    tiny_task: Path, tmp_path: Path, redis_url: str, run_id: str, write_recipe
) -> None:  # type: ignore[no-untyped-def]
    """The dead-letter tail saves its cursor after handling what it read: a coordinator killed in between
    reads those letters again. Their effects are guarded (a group fails once); the counters too."""
    recipe = write_recipe(tiny_task, tmp_path / "run", redis_url)

    async def scenario() -> None:
        async with coordinator(recipe, run_id, redis_url) as h:
            h.weights(0)
            await h.until(lambda: len(h.prompts()) >= 8, "the first prompts")
            h.dead_letter(h.names.trajectories, a_trajectory(h.prompts()[0]))
            await h.until(lambda: h.counter("dead_letters") == 1 and len(h.prompts()) == 9, "the letter handled")
        h.client.delete(h.names.state("dead_cursor"))  # as if killed before the cursor was saved
        async with coordinator(recipe, run_id, redis_url) as h:
            await h.until(lambda: h.client.get(h.names.state("dead_cursor")) is not None, "the letter read again")
            await asyncio.sleep(0.3)
            assert (h.counter("dead_letters"), h.counter("reward_dead_lettered"), h.counter("groups_dead")) == (1, 1, 1)
            assert len(h.prompts()) == 9, "the group was replaced twice"

    asyncio.run(scenario())
