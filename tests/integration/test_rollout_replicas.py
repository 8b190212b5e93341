"""Two rollout replicas on one prompts stream (real Redis, the real rollout service and consumer loop,
engines that record what they generate): prompts that wait for future weights longer than
``claim_idle_ms`` with every slot of their worker taken are never generated twice, and a worker
whose first weight load fails still joins."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
from redis.exceptions import ResponseError

from streamrl.common.aio import cancel_and_wait
from streamrl.common.bus import Bus, connect
from streamrl.common.config import ConsumerConfig
from streamrl.common.consumer import encode_payload
from streamrl.common.errors import WeightSyncError
from streamrl.common.lifecycle import ServiceContext
from streamrl.common.messages import PromptWorkItem, SamplingParams, Tensor, WeightsPublished
from streamrl.common.streams import StreamNames
from streamrl.rollout.config import RolloutConfig
from streamrl.rollout.engines.config import EngineConfig
from streamrl.rollout.engines.engine import GenerationRequest, Sample
from streamrl.rollout.service import RolloutService


class _Engine:
    """Answers each prompt with one token (its first prompt token); loads any version it is given,
    except that the first ``fail_loads`` loads fail."""

    def __init__(self, generated: Counter[int], fail_loads: int = 0) -> None:
        self.version = 0
        self.generated = generated
        self.fail_loads = fail_loads

    async def generate(self, requests: list[GenerationRequest]) -> list[list[Sample]]:
        out = []
        for request in requests:
            self.generated[request.prompt_ids[0]] += 1
            sample = Sample([request.prompt_ids[0]], [-0.5], "x", "stop", self.version, self.version)
            out.append([sample] * request.sampling.n)
        return out

    async def update_weights(self, event: WeightsPublished, timeout_s: float) -> None:
        version = event.version
        if self.fail_loads:
            self.fail_loads -= 1
            raise WeightSyncError(f"version {version}: the learner's endpoint did not answer")
        self.version = version

    def close(self) -> None:
        pass


def _weights(version: int) -> WeightsPublished:
    return WeightsPublished(
        version=version,
        step=version,
        batch_id="",
        checksum=f"c{version}",
        num_bytes=1,
        num_buckets=1,
        endpoint="tcp://learner:1",
    )


def _prompt(i: int, version: int) -> PromptWorkItem:
    return PromptWorkItem(
        id=f"g{i}", prompt_ids=Tensor.from_list([i], "int32"), sampling=SamplingParams(n=2), policy_version=version
    )


def _replica(
    redis_url: str, names: StreamNames, instance: str, consumer: ConsumerConfig, engine: _Engine
) -> tuple[RolloutService, ServiceContext]:
    config = RolloutConfig(run_id=names.run_id, engine=EngineConfig(model="unused"), consumer=consumer)
    ctx = ServiceContext("rollout", instance, config, Bus(connect(redis_url)), names, asyncio.Event())
    return RolloutService(config, ctx, engine), ctx  # type: ignore[arg-type]


def test_prompts_waiting_for_future_weights_past_claim_idle_are_never_generated_twice(
    redis_url: str, run_id: str
) -> None:
    """A worker holding prompts for version 1 while version 0 is served (2 slots; the waiting prompts
    are parked and hold none, so it reads all four) and one with room (8 slots): the second would
    take the first one's prompts as idle after 500 ms if the first did not keep what it holds alive
    (its claim_interval_s is 2 s)."""
    names = StreamNames(run_id)
    generated: Counter[int] = Counter()
    base = dict(count=2, claim_idle_ms=500, claim_interval_s=2.0, retry_delay_s=0.05, max_deliveries=1)

    async def scenario() -> tuple[list[dict[str, object]], list[str], int]:
        busy, busy_ctx = _replica(
            redis_url, names, "rollout-0", ConsumerConfig(**base, max_in_flight=2), _Engine(generated)
        )
        roomy, roomy_ctx = _replica(
            redis_url, names, "rollout-1", ConsumerConfig(**base, max_in_flight=8), _Engine(generated)
        )
        redis = busy_ctx.bus.redis
        for i in range(4):
            await redis.xadd(names.prompts, encode_payload(_prompt(i, version=1)))
        tasks = [asyncio.create_task(busy.run())]
        while len(await _held(redis, names)) < 4:
            await asyncio.sleep(0.01)  # the busy one takes all four: waiting, they leave its slots free
        await asyncio.sleep(1.0)  # out of step with the busy one's claim_interval_s
        tasks.append(asyncio.create_task(roomy.run()))
        await asyncio.sleep(3.0)  # six times claim_idle_ms, and past one claim_interval_s of both
        held = await _held(redis, names)
        await busy_ctx.bus.publish(names.weights, _weights(1))
        while await redis.xlen(names.trajectories) < 8:
            await asyncio.sleep(0.02)
        left = (await redis.xpending(names.prompts, "rollout"))["pending"]
        ids = [f[b"d"] for _, f in await redis.xrange(names.trajectories)]
        for ctx in (busy_ctx, roomy_ctx):
            ctx.stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 20)
        await cancel_and_wait(tasks)
        for ctx in (busy_ctx, roomy_ctx):
            await ctx.bus.redis.aclose()
        return held, ids, left

    held, trajectories, left = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert sorted((h["consumer"], h["times_delivered"]) for h in held) == [(b"rollout-0", 1)] * 4
    assert generated == Counter({0: 1, 1: 1, 2: 1, 3: 1}), "a prompt was generated twice"
    assert len(trajectories) == 8 and left == 0


async def _held(redis, names: StreamNames) -> list[dict[str, object]]:  # type: ignore[no-untyped-def]
    try:
        return await redis.xpending_range(names.prompts, "rollout", min="-", max="+", count=10)  # type: ignore[no-any-return]
    except ResponseError:  # the group is not created yet
        return []


def test_a_late_joiner_whose_first_weight_load_fails_joins_and_catches_up(redis_url: str, run_id: str) -> None:
    names = StreamNames(run_id)
    generated: Counter[int] = Counter()

    async def scenario() -> int:
        engine = _Engine(generated, fail_loads=1)
        worker, ctx = _replica(redis_url, names, "rollout-late", ConsumerConfig(claim_interval_s=0.2), engine)
        await ctx.bus.publish(names.weights, _weights(3))  # published before the worker joins
        await ctx.bus.redis.xadd(names.prompts, encode_payload(_prompt(7, version=3)))
        task = asyncio.create_task(worker.run())
        while await ctx.bus.redis.xlen(names.trajectories) < 2:
            assert not task.done(), task.exception() if task.done() else ""
            await asyncio.sleep(0.02)
        ctx.stop.set()
        await asyncio.wait_for(task, 20)
        await ctx.bus.redis.aclose()
        return engine.version

    assert asyncio.run(asyncio.wait_for(scenario(), 30)) == 3
    assert generated == Counter({7: 1})


@pytest.fixture(autouse=True)
def _restore_gc():  # type: ignore[no-untyped-def]
    """The service freezes the objects built so far when it starts running (ServiceContext.mark_running)."""
    import gc

    thresholds = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*thresholds)
