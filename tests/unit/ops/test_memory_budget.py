"""The Redis memory bound's pure parts: allocation sizes, message sizes, reading a recipe, the warnings."""

from __future__ import annotations

from pathlib import Path

import msgspec
import numpy as np
import pytest

from streamrl.common.batch_payloads import manifest_of
from streamrl.common.codec import encode
from streamrl.common.config import ConfigError, ConsumerConfig, RedisConfig, read_recipe, validate
from streamrl.common.messages import ScoredRecord, ScoredTrajectory, Tensor, TrainingBatch, Trajectory
from streamrl.common.payloads import record_of
from streamrl.common.streams import StreamNames
from streamrl.ops.memory_budget import (
    MIB,
    SERVICE_DEFAULTS,
    RunShape,
    jemalloc_size,
    maxmemory_for,
    memory_bound,
    message_sizes,
    policy_warnings,
    shape_from_recipe,
)
from streamrl.ops.up_config import LaunchRecipe

ROOT = Path(__file__).resolve().parents[3]
SHAPE = RunShape(
    prompts_per_step=4,
    group_size=4,
    max_staleness=1,
    prefetch_steps=1,
    total_steps=50,
    checkpoint_every=5,
    max_model_len=512,
    response_tokens=256,
)


def test_jemalloc_size_classes() -> None:
    """Redis counts what jemalloc hands out: 16-byte steps to 128, then four classes per power of two."""
    assert [jemalloc_size(n) for n in (1, 8, 9, 17, 128, 129, 160, 161, 257, 4097, 65_537, 300_000)] == [
        8,
        8,
        16,
        32,
        128,
        160,
        160,
        192,
        320,
        5120,
        81_920,
        327_680,
    ]
    for n in range(1, 200_000, 997):
        assert n <= jemalloc_size(n) <= max(16, 1.25 * n)


def test_service_defaults_are_the_services_defaults() -> None:
    """The bound reads the recipe with the services' defaults, mirrored in libs/common (which imports no
    service): a default changed in a service without the mirror would bound the wrong run."""
    from streamrl.coordinator.config import CoordinatorConfig, EvalConfig, SamplingConfig
    from streamrl.learner.rl.config import LearnerConfig
    from streamrl.rollout.config import EnvironmentConfig
    from streamrl.rollout.engines.config import EngineConfig

    models = {
        "coordinator": CoordinatorConfig,
        "coordinator.sampling": SamplingConfig,
        "coordinator.eval": EvalConfig,
        "learner": LearnerConfig,
        "rollout.engine": EngineConfig,
        "rollout.environment": EnvironmentConfig,
        "redis": RedisConfig,
        "consumer": ConsumerConfig,
    }
    for dotted, value in SERVICE_DEFAULTS.items():
        section, name = dotted.rsplit(".", 1)
        assert models[section].model_fields[name].default == value, dotted


def test_shape_from_the_demo_recipe() -> None:
    """Section values, top-level shared ones (total_steps) and the services' defaults elsewhere."""
    shape = shape_from_recipe(read_recipe(ROOT / "recipes" / "demo.toml"))
    assert (shape.prompts_per_step, shape.group_size, shape.max_staleness, shape.prefetch_steps) == (32, 8, 1, 1)
    assert (shape.total_steps, shape.checkpoint_every, shape.max_model_len, shape.response_tokens) == (600, 10, 32, 6)
    assert (shape.eval_prompts, shape.eval_response_tokens, shape.read_count, shape.instances) == (500, 6, 256, 4)
    assert (shape.maxlen, shape.outage_s, shape.retain_consumed_s, shape.turns) == (100_000, 60.0, 0.0, 0)


def test_shape_of_a_multi_turn_recipe_counts_the_episode() -> None:
    data = {
        "rollout": {"environment": {"path": "env.py", "max_tokens": 300, "max_turns": 3}},
        "coordinator": {"sampling": {"max_new_tokens": 20}},
        "redis": {"retain_consumed_s": 30},
    }
    shape = shape_from_recipe(data, {"min_step_s": 10.0})
    assert (shape.response_tokens, shape.turns, shape.retain_consumed_s, shape.lag_batches) == (300, 3, 30.0, 4)


def test_the_recipe_states_its_assumptions() -> None:
    """``[up.redis_memory]`` of the recipe sets the assumptions (what the launcher and the soak bench bound)."""
    data = {"up": {"redis_memory": {"min_step_s": 5.0, "image_bytes": 4096, "margin": 3.0}}}
    shape = shape_from_recipe(data)
    assert (shape.min_step_s, shape.image_bytes, shape.lag_batches) == (5.0, 4096, 1)
    assert memory_bound(shape).sizes.prompt > memory_bound(shape_from_recipe({})).sizes.prompt + 4096
    with pytest.raises(ValueError, match=r"up\.redis_memory\.row_bytes"):
        shape_from_recipe({"up": {"redis_memory": {"row_bytes": -1}}})


def test_bad_values_are_named() -> None:
    with pytest.raises(ValueError, match="prompts_per_step"):
        shape_from_recipe({"coordinator": {"prompts_per_step": 0}})
    with pytest.raises(ValueError, match=r"coordinator\.group_size = 'eight' is not a number"):
        shape_from_recipe({"coordinator": {"group_size": "eight"}})
    with pytest.raises(ValueError, match="min_step_s"):
        RunShape(**{**SHAPE.__dict__, "min_step_s": 0.0})
    with pytest.raises(ConfigError, match=r"up\.redis_memory\.margin"):
        validate(LaunchRecipe, {"up": {"redis_memory": {"margin": 0.5}}})


def test_message_sizes_cover_real_messages() -> None:
    """A trajectory as the rollout writes it (int32 ids, float32 log-probs, uint8 mask, texts, the row's
    metadata) is no larger than the size the bound uses, and not much smaller."""
    sizes = message_sizes(SHAPE)
    prompt, response = 256, 256
    traj = Trajectory(
        id="a" * 36,
        group_id="g" * 36,
        group_index=3,
        group_size=4,
        prompt_ids=Tensor.from_numpy(np.arange(prompt, dtype=np.int32)),
        response_ids=Tensor.from_numpy(np.arange(response, dtype=np.int32)),
        logprobs=Tensor.from_numpy(-np.ones(response, dtype=np.float32)),
        loss_mask=Tensor.from_numpy(np.ones(response, dtype=np.uint8)),
        prompt_text="p" * 6 * prompt,
        response_text="r" * 6 * response,
        metadata={"row": "m" * 1000},
        timings={"generate_s": 1.0, "queue_s": 0.5},
        traceparent="00-" + "1" * 32 + "-" + "2" * 16 + "-01",
    )
    scored = ScoredTrajectory(trajectory=traj, reward=1.0, score=1.0, extra={"format": 1.0}, scorer="fn")
    assert 0.9 * sizes.trajectory <= len(encode(traj)) <= sizes.trajectory
    assert 0.9 * sizes.scored <= len(encode(scored)) <= sizes.scored
    assert sizes.batch >= SHAPE.batch_samples * len(encode(scored))
    # the batch's entry is its manifest: long ids (48 characters) and a trace context per sample
    names, group = StreamNames("r" * 48), "g" * 48
    samples = [
        msgspec.structs.replace(
            scored,
            traceparent=traj.traceparent,
            trajectory=msgspec.structs.replace(traj, id=f"{group}/{i}", group_id=group),
        )
        for i in range(SHAPE.batch_samples)
    ]
    batch = TrainingBatch(
        id="batch-99999", index=99999, samples=samples, policy_version=99999, staleness=[99999] * len(samples)
    )
    # each ref carries the sample's scored record (the payload stays under its own key)
    records = [
        ScoredRecord(
            trajectory=record_of(t.trajectory, names.payload(t.trajectory.id, "a" * 12), len(encode(t.trajectory))),
            reward=t.reward,
            score=t.score,
            extra=t.extra,
            scorer=t.scorer,
            traceparent=t.traceparent,
        )
        for t in samples
    ]
    assert max(len(encode(r)) for r in records) <= sizes.record
    manifest = manifest_of(
        batch, [names.batched_payload(batch.id, r.trajectory.id) for r in records], [1] * len(samples)
    )
    manifest = msgspec.structs.replace(
        manifest,
        samples=[
            msgspec.structs.replace(ref, field="", scored=r) for ref, r in zip(manifest.samples, records, strict=True)
        ],
    )
    assert 0.7 * sizes.manifest <= len(encode(manifest)) <= sizes.manifest  # records keep at most 1 KiB of metadata
    assert sizes.manifest < sizes.batch / 3, "a manifest is a small part of the batch it names (1/50 at 8k tokens)"


def test_the_bound_grows_with_what_the_run_holds() -> None:
    """Each knob that holds more in Redis raises the bound by about what it holds."""
    base = memory_bound(SHAPE)
    per_batch = message_sizes(SHAPE).batch
    more_checkpoint = memory_bound(RunShape(**{**SHAPE.__dict__, "checkpoint_every": 10}))
    assert 5 * per_batch <= more_checkpoint.total - base.total <= 5 * 1.6 * per_batch  # payloads + manifests (records)
    staler = memory_bound(RunShape(**{**SHAPE.__dict__, "max_staleness": 3}))
    assert 2 * per_batch <= staler.total - base.total <= 2 * 1.7 * per_batch  # a payload and its record apart
    longer = memory_bound(RunShape(**{**SHAPE.__dict__, "max_model_len": 1024, "response_tokens": 512}))
    # 256 more prompt tokens (4 bytes of ids + 6 of text) and 256 more response tokens (9 + 6)
    assert longer.sizes.trajectory - base.sizes.trajectory >= 256 * (4 + 6) + 256 * (9 + 6)
    assert set(base.terms) >= {"in_flight_samples", "retained_batches", "consumed_untrimmed", "once_keys", "transient"}
    assert "MiB" in base.describe()


def test_weights_events_that_list_every_tensor_cost_more() -> None:
    """CUDA IPC and broadcast events carry a tensor table: one such entry per version stays all run."""
    ipc = memory_bound(RunShape(**{**SHAPE.__dict__, "weights_transport": "ipc"}))
    grown = ipc.terms["weights_and_versions"] - memory_bound(SHAPE).terms["weights_and_versions"]
    assert grown >= (SHAPE.total_steps + 1) * 120 * 1024
    assert shape_from_recipe({"learner": {"weights_transport": "broadcast"}}).weights_transport == "broadcast"
    with pytest.raises(ValueError, match="weights_transport"):
        RunShape(**{**SHAPE.__dict__, "weights_transport": "carrier-pigeon"})


def test_maxmemory_has_a_margin_and_a_floor() -> None:
    bound = memory_bound(SHAPE)
    assert maxmemory_for(bound, margin=1.0, floor=0) >= bound.total
    assert maxmemory_for(bound, margin=2.0, floor=0) >= 2 * bound.total
    assert maxmemory_for(bound, margin=2.0, floor=10**12) == 10**12
    assert maxmemory_for(bound) % MIB == 0
    with pytest.raises(ValueError, match="margin"):
        maxmemory_for(bound, margin=0.5)


@pytest.mark.parametrize(
    ("policy", "maxmemory", "expected"),
    [
        ("noeviction", 0, []),
        ("noeviction", 10**12, []),
        ("allkeys-lru", 0, ["evicts any key"]),
        ("allkeys-random", 0, ["evicts any key"]),
        ("volatile-ttl", 0, ["leases, heartbeats"]),
        ("volatile-lru", 0, ["leases, heartbeats"]),
        ("noeviction", 1 * MIB, ["below this run's bound"]),
        ("volatile-lfu", 1 * MIB, ["leases, heartbeats", "below this run's bound"]),
    ],
)
def test_policy_warnings(policy: str, maxmemory: int, expected: list[str]) -> None:
    """Every policy but noeviction may evict streamrl keys; a maxmemory below the bound fills up."""
    problems = policy_warnings(policy, maxmemory, memory_bound(SHAPE))
    assert len(problems) == len(expected)
    for problem, words in zip(problems, expected, strict=True):
        assert words in problem


def test_command_line_prints_the_bound(capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m streamrl.ops.memory_budget RECIPE``: terms, total, maxmemory; last line one JSON object."""
    import json

    from streamrl.ops.memory_budget import main

    assert main([str(ROOT / "recipes" / "demo.toml"), "--up.redis_memory.margin=3"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    result = json.loads(lines[-1])
    assert result["bound_bytes"] == sum(result["terms"].values())
    assert result["maxmemory_bytes"] >= 3 * result["bound_bytes"]
    assert any(line.startswith("retained_batches") for line in lines)
    assert main([str(ROOT / "recipes" / "demo.toml"), "--coordinator.group_size=0"]) == 2
    assert "group_size" in capsys.readouterr().err
