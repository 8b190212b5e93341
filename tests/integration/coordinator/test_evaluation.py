"""Evaluation rounds against a real Redis: started all-or-nothing, closed once every prompt is
answered or dead-lettered, or when too old; answers that come after are dropped."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from coordinator_fakes import Prompts, config, sample, store
from redis.asyncio.client import Pipeline
from redis.exceptions import ConnectionError as RedisConnectionError

from streamrl.common.codec import decode
from streamrl.common.messages import PromptWorkItem
from streamrl.coordinator import state as st
from streamrl.coordinator.evaluation import EvalRounds, round_buffer_id
from streamrl.coordinator.metrics import MetricsWriter
from streamrl.coordinator.state import RunState


def rounds(state: RunState, run_dir: Path, num_prompts: int = 3) -> EvalRounds:
    cfg = config(
        eval={"dataset": {"path": "unused.jsonl", "tokenizer": "unused"}, "num_prompts": num_prompts, "every_steps": 1}
    )
    return EvalRounds(cfg, state, Prompts(), MetricsWriter(run_dir))  # type: ignore[arg-type]


async def eval_prompts(state: RunState, version: int) -> list[str]:
    items = [decode(f[b"d"], PromptWorkItem) for _, f in await state.redis.xrange(state.names.prompts)]
    return [p.id for p in items if p.metadata["eval_version"] == version]


async def status(state: RunState, version: int) -> str | None:
    raw = await state.redis.hget(state.key(st.EVAL_ROUNDS), str(version))
    return None if raw is None else raw.decode()


def metric_rows(run_dir: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@contextmanager
def crash_after(client: aioredis.Redis, round_trips: int) -> Iterator[None]:
    """Every round trip to Redis after the first ``round_trips`` fails, as if the process had died there."""
    count = 0
    real_command, real_execute = client.execute_command, Pipeline.execute

    def alive() -> None:
        nonlocal count
        count += 1
        if count > round_trips:
            raise RedisConnectionError("the coordinator died here")

    async def command(*args: object, **kwargs: object) -> object:
        alive()
        return await real_command(*args, **kwargs)  # type: ignore[arg-type]

    async def execute(self: Pipeline, raise_on_error: bool = True) -> list[object]:
        alive()
        return await real_execute(self, raise_on_error)

    client.execute_command = command  # type: ignore[method-assign]
    Pipeline.execute = execute  # type: ignore[method-assign]
    try:
        yield
    finally:
        client.execute_command = real_command  # type: ignore[method-assign]
        Pipeline.execute = real_execute  # type: ignore[method-assign]


def test_a_round_starts_with_all_its_prompts_or_not_at_all(in_redis, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Wherever the coordinator dies while starting a round, the round is either not started (a
    restart starts it) or started with every prompt issued - never started with none (a run that
    then waits for it forever)."""

    async def scenario(state: RunState) -> None:
        evals = rounds(state, tmp_path)
        for version in range(4):  # die after 0, 1, 2, 3 round trips
            with crash_after(state.redis, version):
                try:
                    await evals.maybe_start(version)
                except RedisConnectionError:
                    pass
            started = (await status(state, version)) is not None
            assert len(await eval_prompts(state, version)) == (3 if started else 0), f"died after {version}"
            await evals.maybe_start(version)  # the restarted coordinator
            await evals.maybe_start(version)
            assert len(await eval_prompts(state, version)) == 3

    in_redis(scenario)


def test_a_round_closes_when_each_prompt_is_answered_or_dead(in_redis, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    async def scenario(state: RunState) -> None:
        evals = rounds(state, tmp_path)
        await evals.maybe_start(0)
        first, second, third = await eval_prompts(state, 0)
        await store(
            state, round_buffer_id(0), sample(first, 0, 1.0, is_eval=True), sample(second, 0, 0.0, is_eval=True)
        )
        assert not await evals.finish(look=True, timeout_s=600.0)
        await evals.record_dead(0, third)
        await evals.record_dead(0, third)  # the dead tail may see a letter twice
        assert await evals.finish(look=True, timeout_s=600.0)
        assert await status(state, 0) == "0.500000" and evals.last_acc == 0.5
        assert await state.get_int(st.EVAL_DEAD) == 1
        assert not await state.redis.exists(state.key(st.eval_dead(0)), state.names.group_buffer(round_buffer_id(0)))
        await evals.record_dead(0, third)  # a letter seen again after the round closed: nothing kept
        assert not await state.redis.exists(state.key(st.eval_dead(0)))

    in_redis(scenario)
    (row,) = metric_rows(tmp_path)
    assert (row["eval/acc"], row["eval/num_answered"], row["eval/num_dead"], row["eval/num_missing"]) == (0.5, 2, 1, 0)


def test_a_round_with_every_prompt_dead_closes_without_accuracy(
    in_redis, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:  # type: ignore[no-untyped-def]
    async def scenario(state: RunState) -> None:
        evals = rounds(state, tmp_path, num_prompts=2)
        await evals.maybe_start(5)
        for prompt in await eval_prompts(state, 5):
            await evals.record_dead(5, prompt)
        assert await evals.finish(look=True, timeout_s=600.0)
        assert await status(state, 5) == "none" and evals.last_acc is None

    with caplog.at_level(logging.WARNING):
        in_redis(scenario)
    (row,) = metric_rows(tmp_path)
    assert "eval/acc" not in row and row["eval/num_dead"] == 2
    assert any("version 5 closed with no answer" in r.getMessage() for r in caplog.records)


def test_a_round_past_the_timeout_closes_with_what_it_has(in_redis, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    async def scenario(state: RunState) -> None:
        evals = rounds(state, tmp_path)
        await evals.maybe_start(2)
        first = (await eval_prompts(state, 2))[0]
        await store(state, round_buffer_id(2), sample(first, 0, 1.0, is_eval=True, eval_version=2, version=2))
        assert not await evals.finish(look=True, timeout_s=600.0)
        await asyncio.sleep(0.02)
        assert await evals.finish(look=True, timeout_s=0.01)
        assert await state.get_int(st.EVAL_MISSING) == 2

    in_redis(scenario)
    (row,) = metric_rows(tmp_path)
    assert (row["eval/acc"], row["eval/num_answered"], row["eval/num_missing"]) == (1.0, 1, 2)


def test_answers_to_a_closed_round_are_dropped(in_redis, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    async def scenario(state: RunState) -> None:
        evals = rounds(state, tmp_path, num_prompts=1)
        await evals.maybe_start(0)
        await evals.maybe_start(1)
        (prompt,) = await eval_prompts(state, 0)
        await evals.record_dead(0, prompt)
        await evals.finish(look=True, timeout_s=600.0)  # round 0 closes; round 1 stays open
        (open_prompt,) = await eval_prompts(state, 1)
        await store(state, round_buffer_id(0), sample(prompt, 0, is_eval=True))  # late
        await store(state, round_buffer_id(1), sample(open_prompt, 0, is_eval=True, eval_version=1))
        assert await evals.drop_late({0, 1}) == 1
        assert not await state.redis.exists(state.names.group_buffer(round_buffer_id(0)))
        assert await state.redis.hlen(state.names.group_buffer(round_buffer_id(1))) == 1

    in_redis(scenario)
