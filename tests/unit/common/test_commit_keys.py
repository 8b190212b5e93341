"""The commit script declares every key it touches (Redis Cluster routes a script by its keys and
refuses keys outside the node's slots), each once."""

from __future__ import annotations

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
        ack_stream=names.trajectories, ack_group="reward", ack_entry="1-0", dedupe_key=names.done("reward", "t"),
        dedupe_ttl_s=60,
    )  # fmt: skip
    second = bus.commit_args(
        [Output(stream=names.scored, message=beat)], ack_stream="", ack_group="", ack_entry="", dedupe_key="",
        dedupe_ttl_s=60,
    )  # fmt: skip
    assert commit_keys([first, second]) == [
        names.trajectories, names.done("reward", "t"), names.scored, names.group_buffer("g"),
    ]  # fmt: skip
    assert len({k.split("}")[0] for k in commit_keys([first])}) == 1  # one hash tag: one slot
