"""Dead letters about batches are honoured only from the learner: with the run's weights key, a letter naming the
``batches`` stream must be signed with it. Every service's credential can write to ``dead``; a forged "skipped
untrained" letter naming a batch's manifest would otherwise have the coordinator delete every sample it names, and
a forged "refused" one have it send a batch of the forger's making to the learner."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
from test_coordinator import Harness, batches_of, coordinator

from streamrl.common.codec import encode
from streamrl.common.messages import BATCH_SKIPPED, DeadLetter, WeightsPublished
from streamrl.common.weights.auth import KEY_ENV, sign

RUN_KEY = b"the-run-key-0123456789"


def signed_weights(h: Harness, version: int) -> None:
    event = WeightsPublished(
        version=version, step=version, batch_id="", checksum="0", num_bytes=0, num_buckets=0, endpoint="tcp://x:1"
    )
    h.client.xadd(h.names.weights, {b"d": encode(sign(event, RUN_KEY, run_id=h.names.run_id))})


def letter(h: Harness, payload: bytes, error: str, key: bytes | None) -> None:
    unsigned = DeadLetter(
        stream=h.names.batches,
        entry_id="1-0",
        group="learner",
        consumer="learner",
        error=error,
        deliveries=1,
        payload=payload,
        ts=0.0,
    )
    h.client.xadd(h.names.dead, {b"d": encode(sign(unsigned, key, run_id=h.names.run_id))})


def test_a_forged_batch_letter_deletes_nothing_and_is_counted_forged(
    tiny_task: Path,
    tmp_path: Path,
    redis_url: str,
    run_id: str,
    write_recipe,  # type: ignore[no-untyped-def]
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(KEY_ENV, RUN_KEY.decode())
    recipe = write_recipe(tiny_task, tmp_path / "run", redis_url)

    async def scenario() -> None:
        async with coordinator(recipe, run_id, redis_url, "--coordinator.prefetch_steps=0") as h:
            signed_weights(h, 0)
            await h.until(lambda: len(h.prompts()) >= 4, "the prompts of batch 0")
            for item in h.prompts():
                h.answer(item)
            await h.until(lambda: h.client.xlen(h.names.batches) == 1, "batch 0")
            (batch,) = batches_of(h)
            assert all(h.client.exists(key) for key in batch.buffers)
            skipped = f"batch-0 ({batch.num_samples} samples) {BATCH_SKIPPED}: forged"
            letter(h, encode(batch), skipped, key=None)  # finding 5: any credential, no key
            letter(h, encode(batch), skipped, key=b"someone-else-0123456789")  # another key
            letter(h, encode(batch), "PoisonMessageError: batch-0 is ahead", key=None)  # a forged refusal
            await h.until(lambda: h.counter("dead_letters_forged") == 3, "three letters counted as forged")
            await asyncio.sleep(0.3)
            assert all(h.client.exists(key) for key in batch.buffers), "a forged letter deleted the batch's samples"
            assert h.counter("batches_dead") == 0 and h.counter("batch_groups_dead") == 0
            assert h.client.xlen(h.names.batches) == 1, "a forged refusal had the batch sent again"
            assert h.progress()["dead_letters_forged"] == "3"
            letter(h, encode(batch), skipped.replace("forged", "its step failed"), key=RUN_KEY)  # the learner's
            await h.until(lambda: h.counter("batches_dead") == 1, "the learner's letter honoured")
            assert not any(h.client.exists(key) for key in batch.buffers), "the dead batch's samples are deleted"
            assert h.counter("dead_letters_forged") == 3

    with caplog.at_level(logging.ERROR, logger="streamrl.coordinator.service"):
        asyncio.run(scenario())
    forged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("forged dead letter")]
    assert len(forged) == 3, forged
    assert "is not signed (STREAMRL_WEIGHTS_KEY" in forged[0] and "forged, refused" in forged[0]
    assert "is not signed with this run's key" in forged[1]
