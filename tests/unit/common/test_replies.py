"""The typed views of redis-py replies: both reply forms a client can hand back give the same answer."""

from __future__ import annotations

import pytest

from streamrl.common.replies import Pending, entries, entry_ids, pending, read_entries, text


def test_a_read_reply_gives_its_entries_in_either_protocol() -> None:
    resp2 = [[b"s", [(b"1-0", {b"d": b"x"}), (b"2-0", {b"d": b"y"})]]]
    resp3 = {b"s": [(b"1-0", {b"d": b"x"}), (b"2-0", {b"d": b"y"})]}
    want = [(b"1-0", {b"d": b"x"}), (b"2-0", {b"d": b"y"})]
    assert read_entries(resp2) == want
    assert read_entries(resp3) == want
    assert read_entries(None) == [] and read_entries([]) == []


def test_a_decoded_reply_gives_the_same_bytes_and_a_trimmed_entry_no_fields() -> None:
    assert entries([("1-0", {"d": "x"}), ("2-0", None)]) == [(b"1-0", {b"d": b"x"}), (b"2-0", {})]


def test_pending_rows_and_claimed_ids_are_text() -> None:
    rows = [{"message_id": b"1-0", "consumer": b"c", "time_since_delivered": 5, "times_delivered": 3}]
    assert pending(rows) == [Pending("1-0", 3)]
    assert entry_ids([b"1-0", "2-0"]) == ["1-0", "2-0"]


def test_a_reply_of_the_wrong_kind_is_named() -> None:
    with pytest.raises(TypeError, match="expected a bytes or str reply, got None"):
        text(None)
    with pytest.raises(TypeError, match="unexpected stream read reply 7"):
        read_entries(7)
