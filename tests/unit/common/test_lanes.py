"""Lanes: which keys, Redis and lane a service of a run with several lanes uses."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from streamrl.common.lanes import (
    LaneClients,
    LanesConfig,
    check_lane,
    home_run_id,
    key_slot,
    lane_names,
    lane_of_key,
    node_url,
)
from streamrl.common.streams import StreamNames


def test_a_lanes_keys_share_one_hash_tag_of_their_own() -> None:
    lane = lane_names("run7", 1)
    assert lane.prompts == "streamrl:{run7/lane1}:prompts"
    assert lane.batched_payload("batch-3", "t1") == "streamrl:{run7/lane1}:batched:batch-3:t1"
    assert lane_of_key(lane.payload("t1", "a")) == 1
    assert lane_of_key(lane.batches.encode()) == 1
    assert lane_of_key(StreamNames("run7").batches) is None
    assert len({key_slot(lane.prompts), key_slot(lane.dead), key_slot(lane.payload("x", "y"))}) == 1


def test_key_slot_is_redis_clusters() -> None:
    # values CLUSTER KEYSLOT answers
    assert key_slot("foo") == 12182
    assert key_slot("123456789") == 12739
    assert key_slot("{foo}:bar") == key_slot("foo")


def test_each_lane_gets_its_url_or_the_home_one() -> None:
    assert LanesConfig(count=2).url(1, "redis://home:1") == "redis://home:1"
    assert LanesConfig(count=2, urls=["redis://a:1", "redis://b:2"]).url(1, "redis://home:1") == "redis://b:2"
    with pytest.raises(ValidationError, match=r"names 1 Redis URLs for lanes\.count = 2"):
        LanesConfig(count=2, urls=["redis://a:1"])
    with pytest.raises(ValueError, match=r"lane 2 is not one of the run's 2 lanes"):
        LanesConfig(count=2).url(2, "redis://home:1")


def test_lane_services_must_name_their_lane() -> None:
    two = LanesConfig(count=2)
    assert check_lane("rollout", None, two) is not None and "STREAMRL_LANE" in str(check_lane("rollout", None, two))
    assert check_lane("coordinator", 1, two) is None
    assert "0..1" in str(check_lane("reward", 2, two))
    assert check_lane("learner", 0, two) is not None
    assert check_lane("learner", None, two) is None
    assert check_lane("rollout", None, LanesConfig()) is None
    assert check_lane("rollout", 1, LanesConfig()) is not None


def test_a_cluster_node_url_is_resolved_to_the_node_serving_the_lane() -> None:
    slots = [[0, 5460, [b"127.0.0.1", 7001, b"id1"]], [5461, 16383, [b"127.0.0.1", 7002, b"id2"]]]
    key = lane_names("r", 0).prompts
    want = 7001 if key_slot(key) <= 5460 else 7002
    assert node_url("redis://:pw@127.0.0.1:7000/0", key, lambda: slots) == f"redis://:pw@127.0.0.1:{want}/0"
    assert node_url("redis://127.0.0.1:7000", key, None) == "redis://127.0.0.1:7000"


def test_lane_clients_route_a_key_by_its_tag() -> None:
    home, a, b = object(), object(), object()
    clients = LaneClients(home, [a, b])
    keys = [lane_names("r", 1).payload("t", "x"), StreamNames("r").batches, lane_names("r", 0).payload("u", "y")]
    assert [clients.for_key(k) for k in keys] == [b, home, a]
    assert clients.by_client(keys) == [(b, [keys[0]]), (home, [keys[1]]), (a, [keys[2]])]
    with pytest.raises(ValueError, match="names lane 5"):
        clients.for_key(lane_names("r", 5).prompts)


def test_a_lanes_readers_check_weights_against_the_home_run() -> None:
    assert home_run_id(lane_names("run7", 3).run_id) == "run7"
    assert home_run_id("run7") == "run7"
