"""Where a rollout worker fetches a relay version from (streamrl.rollout.weights.relay_sources, pure), and the
relay settings checked at start."""

from __future__ import annotations

import pytest

from streamrl.rollout.config import RolloutConfig
from streamrl.rollout.weights.relay_sources import Peer, relay_upstreams


def peer(name: str, version: int = 3, port: int | None = None) -> Peer:
    return Peer(name, f"h:{port if port is not None else ord(name[-1])}", version)


def test_a_chain_by_instance_name_each_worker_falling_back_to_every_earlier_one() -> None:
    workers = [peer("rollout-c"), peer("rollout-a"), peer("rollout-b")]
    assert relay_upstreams(peer("rollout-a"), workers, 4) == []  # the learner's child: the learner alone
    assert relay_upstreams(peer("rollout-b"), workers, 4) == [("h", ord("a"))]
    assert relay_upstreams(peer("rollout-c"), workers, 4) == [("h", ord("b")), ("h", ord("a"))]


def test_a_tree_by_fanout() -> None:
    workers = [peer(f"rollout-{c}") for c in "abcdef"]
    # learner -> a, b; a -> c, d; b -> e, f
    assert relay_upstreams(peer("rollout-f"), workers, 4, fanout=2) == [("h", ord("b"))]
    assert relay_upstreams(peer("rollout-d"), workers, 4, fanout=2) == [("h", ord("a"))]


def test_holders_of_the_version_come_first_and_newer_or_unadvertised_peers_not_at_all() -> None:
    workers = [
        peer("rollout-a", version=4),  # holds it already
        peer("rollout-b", version=5),  # moved on: serves version 5 only
        Peer("rollout-c", "", 3),  # no relay node yet
        peer("rollout-d"),
    ]
    assert relay_upstreams(peer("rollout-e"), workers, 4) == [("h", ord("a")), ("h", ord("d"))]


def test_a_worker_missing_from_the_registry_still_takes_its_place_by_name() -> None:
    workers = [peer("rollout-a"), peer("rollout-c")]
    assert relay_upstreams(peer("rollout-b"), workers, 4) == [("h", ord("a"))]


def test_a_relay_stall_that_leaves_no_room_within_the_sync_deadline_is_refused_at_start() -> None:
    base = {"run_id": "r", "engine": {"model": "m"}, "weight_sync_timeout_s": 6.0}
    assert RolloutConfig.model_validate(base).relay_stall_s == 2.0  # default: a third of the deadline
    assert RolloutConfig.model_validate({**base, "weights_relay": {"stall_s": 4}}).relay_stall_s == 4
    with pytest.raises(ValueError, match=r"rollout\.weights_relay\.stall_s \(6\.0 s\) must be below"):
        RolloutConfig.model_validate({**base, "weights_relay": {"stall_s": 6}})
