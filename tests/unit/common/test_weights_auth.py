"""Signed weights events (streamrl.common.weights.auth): bound to the key and to the run."""

from __future__ import annotations

import msgspec
import pytest

from streamrl.common.codec import decode, encode
from streamrl.common.messages import WeightsPublished
from streamrl.common.weights.auth import KEY_ENV, WeightsAuthError, check, sign, weights_key

KEY = b"a-run-key-of-some-length"
RUN = "run-a"
EVENT = WeightsPublished(
    version=3,
    step=3,
    batch_id="batch-2",
    checksum="ab" * 32,
    num_bytes=10,
    num_buckets=1,
    endpoint="tcp://learner:5555",
    metrics={"learner/loss/policy": 0.125},
)


def test_a_signed_event_passes_after_the_wire() -> None:
    check(decode(encode(sign(EVENT, KEY, run_id=RUN)), WeightsPublished), KEY, run_id=RUN)


@pytest.mark.parametrize("field,value", [("endpoint", "tcp://elsewhere:1"), ("checksum", "00" * 32), ("version", 4)])
def test_any_change_to_a_signed_event_is_refused(field: str, value: object) -> None:
    tampered = msgspec.structs.replace(sign(EVENT, KEY, run_id=RUN), **{field: value})
    with pytest.raises(WeightsAuthError, match="not signed with this run's key"):
        check(tampered, KEY, run_id=RUN)


def test_an_event_of_another_run_sharing_the_key_is_refused() -> None:
    replayed = sign(EVENT, KEY, run_id="run-b")
    with pytest.raises(WeightsAuthError, match=r"version 3 is not signed with this run's key .* for run 'run-a'"):
        check(replayed, KEY, run_id=RUN)
    check(replayed, KEY, run_id="run-b")


def test_unsigned_or_foreign_events_are_refused_only_with_a_key() -> None:
    with pytest.raises(WeightsAuthError, match="is not signed; this worker requires"):
        check(EVENT, KEY, run_id=RUN)
    with pytest.raises(WeightsAuthError, match="another key"):
        check(sign(EVENT, b"another-key-of-some-length", run_id=RUN), KEY, run_id=RUN)
    check(EVENT, None, run_id=RUN)  # no key configured: nothing to check against
    assert sign(EVENT, None, run_id=RUN) == EVENT


def test_the_key_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KEY_ENV, raising=False)
    assert weights_key() is None
    monkeypatch.setenv(KEY_ENV, "short")
    with pytest.raises(ValueError, match="at least 16 characters"):
        weights_key()
    monkeypatch.setenv(KEY_ENV, "x" * 16)
    assert weights_key() == b"x" * 16
