"""Prompts issued ahead (``coordinator.prefetch_steps``) wait for their weights without holding the
worker's in-flight slots: a prompt that can run now - the replacement of a filtered or failed group,
owed the current version - is read and generated while they wait, and once their version lands the
waiting prompts run with no more than ``consumer.max_in_flight`` at once.

The real rollout service and consumer loop against a real redis-server; the engine is a stand-in
that answers at once and records the version and the concurrency it saw.
"""

from __future__ import annotations

import asyncio

from committed import wait_on_stream

from streamrl.common.aio import cancel_and_wait
from streamrl.common.bus import Bus, connect
from streamrl.common.config import ConsumerConfig
from streamrl.common.lifecycle import ServiceContext
from streamrl.common.messages import PromptWorkItem, SamplingParams, Tensor, Trajectory, WeightsPublished
from streamrl.common.streams import StreamNames
from streamrl.rollout.config import RolloutConfig
from streamrl.rollout.engines.config import EngineConfig
from streamrl.rollout.engines.engine import GenerationRequest, Sample
from streamrl.rollout.service import RolloutService

SLOTS = 2


class _Engine:
    """Serves version 0 until told otherwise; every generation takes 50 ms."""

    def __init__(self) -> None:
        self.version = 0
        self.running = 0
        self.most_running = 0
        self.generated: list[tuple[int, int]] = []
        """(first prompt token, version) of each generation, in the order they started."""

    async def generate(self, requests: list[GenerationRequest]) -> list[list[Sample]]:
        self.running += 1
        self.most_running = max(self.most_running, self.running)
        self.generated.extend((r.prompt_ids[0], self.version) for r in requests)
        try:
            await asyncio.sleep(0.05)
        finally:
            self.running -= 1
        v = self.version
        return [
            [Sample(token_ids=[5], logprobs=[-0.1], text="x", finish_reason="stop", version_start=v, version_end=v)]
            for _ in requests
        ]

    async def update_weights(self, event: WeightsPublished, timeout_s: float) -> None:
        version = event.version
        self.version = version

    def close(self) -> None:
        pass


def _prompt(index: int, version: int) -> PromptWorkItem:
    return PromptWorkItem(
        id=f"p{index}",
        prompt_ids=Tensor.from_list([index], "int32"),
        sampling=SamplingParams(n=1),
        policy_version=version,
    )


def test_prompts_waiting_for_their_version_leave_the_slots_to_prompts_that_can_run(redis_url: str, run_id: str) -> None:
    async def scenario() -> tuple[_Engine, list[Trajectory], list[Trajectory]]:
        redis = connect(redis_url)
        bus, names = Bus(redis), StreamNames(run_id)
        config = RolloutConfig(
            run_id=run_id,
            engine=EngineConfig(model="unused"),
            consumer=ConsumerConfig(max_in_flight=SLOTS, count=SLOTS, block_ms=50),
        )
        ctx = ServiceContext("rollout", "rollout-0", config, bus, names, asyncio.Event())  # type: ignore[arg-type]
        engine = _Engine()
        service = RolloutService(config, ctx, engine)  # type: ignore[arg-type]
        # the next step's prompts, issued ahead, fill every slot; then a replacement owed version 0
        for i in range(2 * SLOTS):
            await bus.publish(names.prompts, _prompt(i, version=1))
        await bus.publish(names.prompts, _prompt(99, version=0))
        worker = asyncio.create_task(service.run())
        try:
            replacement = await wait_on_stream(redis, names, 1, timeout_s=5.0)
            await bus.publish(
                names.weights,
                WeightsPublished(
                    version=1, step=1, batch_id="b0", checksum="c", num_bytes=1, num_buckets=1, endpoint="tcp://x:1"
                ),
            )
            everything = await wait_on_stream(redis, names, 2 * SLOTS + 1, timeout_s=10.0)
        finally:
            ctx.stop.set()
            await asyncio.wait_for(worker, 10)
            await cancel_and_wait([worker])
            await redis.aclose()
        return engine, replacement, everything

    engine, replacement, everything = asyncio.run(scenario())
    assert [t.id for t in replacement] == ["p99/0"], "the replacement prompt was never read"
    assert replacement[0].policy_version_start == 0
    assert engine.generated[0] == (99, 0)
    assert sorted(engine.generated[1:]) == [(i, 1) for i in range(2 * SLOTS)], "prefetched prompts ran at version 1"
    assert engine.most_running <= SLOTS, "waiting prompts took slots back before they generated"
    assert sorted(t.id for t in everything) == sorted([f"p{i}/0" for i in range(2 * SLOTS)] + ["p99/0"])
