"""LoRA RL in a learner group of 2 ranks under ZeRO-3 (gloo on CPU, a real Redis bus): every rank gathers
the adapter's shards for each version (the group's ``adapter`` command), rank 0 publishes it alone, and
the group trains what one rank trains."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis
from safetensors.torch import load_file
from test_learner_group import STEPS, assert_same_weights, feed, finish, learner, model_dir, recipe, trained

from streamrl.common.streams import StreamNames

__all__ = ["model_dir"]
pytestmark = pytest.mark.slow
LORA = """
[learner.lora]
rank = 4
alpha = 8.0
target_modules = ["q_proj", "v_proj", "down_proj"]
"""


def _run(tmp_path: Path, model: Path, redis_url: str, run_id: str, ranks: int, zero_stage: int) -> tuple[list, dict]:  # type: ignore[type-arg]
    client = redis.Redis.from_url(redis_url)
    names = StreamNames(run_id)
    feed(client, names, range(STEPS))
    tmp_path.mkdir()
    path = recipe(tmp_path / f"{run_id}.toml", model, redis_url, run_id, ranks, zero_stage)
    path.write_text(path.read_text() + LORA)
    finish(learner(path, "--burst"))
    return trained(client, names), load_file(tmp_path / run_id / "final" / "model.safetensors")


def test_two_ranks_zero3_train_the_adapter_like_one(
    tmp_path: Path, model_dir: Path, redis_url: str, run_id: str
) -> None:
    ref_steps, ref_weights = _run(tmp_path / "one", model_dir, redis_url, f"{run_id}-1", ranks=1, zero_stage=0)
    steps, weights = _run(tmp_path / "two", model_dir, redis_url, f"{run_id}-2", ranks=2, zero_stage=3)
    assert [w.version for w in steps] == list(range(1, STEPS + 1))
    for ours, theirs in zip(steps, ref_steps, strict=True):
        assert ours.payload == theirs.payload == "lora" and ours.lora == theirs.lora
        assert ours.num_bytes == theirs.num_bytes  # the whole adapter, gathered from both ranks' shards
        for key in ("learner/loss/policy", "learner/grad_norm", "learner/tokens"):
            assert ours.metrics[key] == pytest.approx(theirs.metrics[key], rel=1e-4, abs=1e-6), key
    initial = load_file(model_dir / "model.safetensors")
    adapted = [n for n in initial if n.endswith(("q_proj.weight", "v_proj.weight", "down_proj.weight"))]
    # the exported (merged) policy: adapted weights moved alike on both; every other weight is the base's
    assert_same_weights({n: weights[n] for n in adapted}, {n: ref_weights[n] for n in adapted}, initial)
    for name in set(initial) - set(adapted):
        assert (weights[name] == initial[name]).all() and (ref_weights[name] == initial[name]).all(), name
