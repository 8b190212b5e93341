"""LoRA runs refused at start, naming the setting: ``streamrl up`` checks that the rollout engine takes the
learner's adapters, the engine's config what vLLM accepts; and a LoRA weights event is signed like any other
(an altered adapter shape is refused)."""

from __future__ import annotations

from typing import Any

import msgspec
import pydantic
import pytest

from streamrl.common.codec import decode, encode
from streamrl.common.config import validate
from streamrl.common.errors import ConfigError, PoisonMessageError
from streamrl.common.messages import LoraAdapter, WeightsPublished
from streamrl.common.weights.auth import WeightsAuthError, check, sign
from streamrl.ops.up_config import LaunchRecipe, lora_engine_problem
from streamrl.rollout.engines.config import EngineConfig


def _recipe(lora: dict[str, Any] | None, max_lora_rank: int | None) -> dict[str, Any]:
    engine: dict[str, Any] = {"model": "m"}
    if max_lora_rank is not None:
        engine["max_lora_rank"] = max_lora_rank
    learner: dict[str, Any] = {"model": "m"}
    if lora is not None:
        learner["lora"] = lora
    return {"rollout": {"engine": engine}, "learner": learner}


def test_an_engine_that_takes_the_adapters_passes() -> None:
    assert lora_engine_problem(_recipe({"rank": 8}, 8)) is None
    assert lora_engine_problem(_recipe({}, 16)) is None  # rank 16 by default
    assert lora_engine_problem(_recipe({"sync": "merged"}, None)) is None  # merged: full weights
    assert lora_engine_problem(_recipe(None, None)) is None
    validate(LaunchRecipe, _recipe({"rank": 8}, 16), source="recipe")


@pytest.mark.parametrize(
    ("recipe", "problem"),
    [
        (_recipe({"rank": 8}, None), r"set rollout\.engine\.max_lora_rank"),
        (_recipe({}, None), r"adapters of rank 16"),
        (_recipe({"rank": 32}, 16), r"learner\.lora\.rank = 32 is above rollout\.engine\.max_lora_rank = 16"),
    ],
)
def test_an_engine_that_cannot_take_them_is_refused(recipe: dict[str, Any], problem: str) -> None:
    with pytest.raises(ConfigError, match=problem):
        validate(LaunchRecipe, recipe, source="recipe")


def test_engine_lora_settings_vllm_cannot_take_are_refused() -> None:
    with pytest.raises(pydantic.ValidationError, match=r"max_lora_rank = 4: vLLM takes one of"):
        EngineConfig(model="m", max_lora_rank=4)
    with pytest.raises(pydantic.ValidationError, match=r"set partial_rollout = false"):
        EngineConfig(model="m", max_lora_rank=8, partial_rollout=True)
    assert EngineConfig(model="m", type="hf", max_lora_rank=4, partial_rollout=True).max_lora_rank == 4


def _event() -> WeightsPublished:
    return WeightsPublished(
        version=3,
        step=3,
        batch_id="batch-2",
        checksum="c" * 64,
        num_bytes=7168,
        num_buckets=1,
        endpoint="tcp://learner:5555",
        payload="lora",
        lora=LoraAdapter(rank=8, alpha=16.0, target_modules=["q_proj", "v_proj"]),
    )


def test_a_lora_event_is_signed_and_an_altered_one_refused() -> None:
    key = b"k" * 32
    signed = sign(_event(), key, run_id="run")
    check(decode(encode(signed), WeightsPublished), key, run_id="run")
    for altered in (
        msgspec.structs.replace(signed, lora=LoraAdapter(rank=8, alpha=64.0, target_modules=["q_proj", "v_proj"])),
        msgspec.structs.replace(signed, payload="full", lora=None),
        msgspec.structs.replace(signed, checksum="d" * 64),
    ):
        with pytest.raises(WeightsAuthError, match="not signed with this run's key"):
            check(altered, key, run_id="run")


def test_weights_events_are_v4_and_older_ones_are_refused() -> None:
    event = _event()
    assert event.v == 4 and decode(encode(event), WeightsPublished) == event
    for old in (1, 2, 3, 5):  # v1/v2: no transport tag, v3: no IPC buffer sets; v5: a future schema
        with pytest.raises(PoisonMessageError, match=rf"unsupported version v={old} of 'weights' \(supported: \[4\]\)"):
            decode(encode(msgspec.structs.replace(event, v=old)), WeightsPublished)
