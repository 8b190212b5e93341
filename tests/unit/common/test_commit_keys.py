"""The commit script declares every key it touches (Redis Cluster routes a script by its keys and
refuses keys outside the node's slots), each once."""

from __future__ import annotations

import pytest

from streamrl.common.bus import Bus, Output, commit_keys
from streamrl.common.messages import Heartbeat
from streamrl.common.streams import StreamNames


class _NoRedis:
    def register_script(self, script: str) -> None:
        return None


def test_commit_keys_are_every_key_the_script_touches() -> None:
    bus = Bus(_NoRedis())  # type: ignore[arg-type]
    names = StreamNames("r")
    beat = Heartbeat(service="s", instance="i", pid=1, ts=0.0)
    first = bus.commit_args(
        [Output(stream=names.scored, message=beat), Output(key=names.group_buffer("g"), field="t", message=beat)],
        ack_stream=names.trajectories,
        ack_group="reward",
        ack_entry="1-0",
    )
    second = bus.commit_args([Output(stream=names.scored, message=beat)])  # no entry: guarded by a once key
    once = str(second[4])
    assert once.startswith("streamrl:{r}:once:")
    assert commit_keys([first, second]) == [names.trajectories, names.scored, names.group_buffer("g"), once]
    assert len({k.split("}")[0] for k in commit_keys([first, second])}) == 1  # one hash tag: one slot


def test_a_commit_of_an_entry_names_its_stream_and_group() -> None:
    bus = Bus(_NoRedis())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs its stream and group"):
        bus.commit_args([], ack_entry="1-0")
