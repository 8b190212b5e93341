"""The sleep policy of colocated synchronous runs (``rollout.engine.sleep_between_versions``) with the
real rollout service, the real transformers engine (tiny Qwen2 on the CPU), a real redis-server and
the learner's real ZMQ weight server: once the current version's prompts are answered the engine
sleeps (its KV cache freed) and stays asleep while the next version's prompts wait for their
weights; when those arrive it is woken, then updated, then generates them - and sleeps again."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
from committed import wait_on_stream
from transformers import AutoModelForCausalLM

from streamrl.common.aio import cancel_and_wait
from streamrl.common.bus import Bus, connect
from streamrl.common.config import ConsumerConfig
from streamrl.common.lifecycle import ServiceContext
from streamrl.common.messages import PromptWorkItem, SamplingParams, Tensor, WeightsPublished
from streamrl.common.streams import StreamNames
from streamrl.rollout.config import RolloutConfig
from streamrl.rollout.engines.config import EngineConfig
from streamrl.rollout.engines.hf_engine import HFEngine
from streamrl.rollout.service import RolloutService
from streamrl.torchkit.testing import build_tiny_qwen2
from streamrl.torchkit.weights.zmq import ZmqPublisher


def _prompt(index: int, version: int) -> PromptWorkItem:
    return PromptWorkItem(
        id=f"p{index}",
        prompt_ids=Tensor.from_list([5, 6, 7, index], "int32"),
        sampling=SamplingParams(n=2, max_new_tokens=4, seed=index),
        policy_version=version,
    )


async def _until(condition: object, timeout_s: float) -> bool:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():  # type: ignore[operator]
        if loop.time() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


def test_the_engine_sleeps_between_versions_and_wakes_updates_then_generates(
    redis_url: str, run_id: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = build_tiny_qwen2(tmp_path / "a", seed=0)
    state = AutoModelForCausalLM.from_pretrained(build_tiny_qwen2(tmp_path / "b", seed=1)).state_dict()
    engine_config = EngineConfig(
        type="hf",
        model=str(model),
        dtype="float32",
        device="cpu",
        max_model_len=128,
        max_num_seqs=8,
        sleep_between_versions=True,
    )  # type: ignore[arg-type]
    engine = HFEngine(engine_config)
    assert engine._decoder is not None, "the tiny Qwen2 decodes through the KV decoder"
    caplog.set_level(logging.INFO, logger="streamrl.rollout.service")

    async def scenario() -> dict[str, object]:
        redis = connect(redis_url)
        bus, names = Bus(redis), StreamNames(run_id)
        config = RolloutConfig(
            run_id=run_id, engine=engine_config, consumer=ConsumerConfig(max_in_flight=4, count=4, block_ms=50)
        )
        ctx = ServiceContext("rollout", "rollout-0", config, bus, names, asyncio.Event())  # type: ignore[arg-type]
        service = RolloutService(config, ctx, engine)
        server = ZmqPublisher()
        seen: dict[str, object] = {}
        for i in range(2):
            await bus.publish(names.prompts, _prompt(i, version=0))
        worker = asyncio.create_task(service.run())
        try:
            seen["v0"] = await wait_on_stream(redis, names, 4, timeout_s=60.0)
            seen["slept"] = await _until(lambda: engine.asleep, timeout_s=5.0)
            seen["cache_after_sleep"] = engine._decoder.cache_bytes  # type: ignore[union-attr]
            for i in range(2, 4):  # the next version's prompts: they wait for its weights
                await bus.publish(names.prompts, _prompt(i, version=1))
            await asyncio.sleep(1.0)
            seen["asleep_while_waiting"] = engine.asleep
            seen["before_weights"] = len(await redis.xrange(names.trajectories))
            published = server.publish(list(state.items()), 1)
            checksum, num_bytes, num_buckets = published["checksum"], published["num_bytes"], published["num_buckets"]
            event = WeightsPublished(
                version=1,
                step=1,
                batch_id="b0",
                checksum=checksum,
                num_bytes=num_bytes,
                num_buckets=num_buckets,
                endpoint=server.endpoint,
            )
            await bus.publish(names.weights, event)
            seen["all"] = await wait_on_stream(redis, names, 8, timeout_s=60.0)
            seen["slept_again"] = await _until(lambda: engine.asleep, timeout_s=5.0)
        finally:
            ctx.stop.set()
            await asyncio.wait_for(worker, 30)
            await cancel_and_wait([worker])
            await redis.aclose()
            server.close()
        return seen

    seen = asyncio.run(scenario())
    assert all(t.policy_version_start == 0 for t in seen["v0"])  # type: ignore[attr-defined]
    assert seen["slept"], "the engine did not sleep once the version's prompts were answered"
    assert seen["cache_after_sleep"] == 0, "sleeping did not free the KV cache"
    assert seen["asleep_while_waiting"], "prompts waiting for the next version woke the engine"
    assert seen["before_weights"] == 4, "a prompt of the next version generated before its weights"
    later = [t for t in seen["all"] if t.id.split("/")[0] in ("p2", "p3")]  # type: ignore[attr-defined]
    assert len(later) == 4 and all(t.policy_version_start == t.policy_version_end == 1 for t in later)
    assert seen["slept_again"], "the engine did not sleep after the next version's prompts"
    events = [
        m
        for r in caplog.records
        if (m := r.getMessage()).startswith(("engine asleep", "engine awake", "now serving policy version"))
    ]
    order = [e.split(" (")[0] for e in events]
    assert order == [
        "engine asleep at policy version 0",
        "engine awake for policy version 1",
        "now serving policy version 1",
        "engine asleep at policy version 1",
    ], events
