"""Pure rules of the consumer loop's reclaim round: when a peer counts as dead, and where a stream is
trimmed (the Redis side is tested in tests/integration/test_dead_peers.py and test_trim.py)."""

from __future__ import annotations

from streamrl.common.peers import PeerWatch, may_judge
from streamrl.common.trim import oldest_needed, parse_id, trim_point


def test_a_peer_is_dead_only_when_missing_on_two_looks_an_interval_apart() -> None:
    watch = PeerWatch(interval_s=2.0)
    assert watch.look({"a"}, set(), now=10.0) == set()  # first look: only noted
    assert watch.look({"a"}, set(), now=11.0) == set()  # too soon
    assert watch.look({"a"}, set(), now=12.0) == {"a"}
    assert watch.look(set(), {"a"}, now=13.0) == set()  # it beats again: forgotten
    assert watch.look({"a"}, set(), now=14.0) == set()  # a new run of misses starts over


def test_peers_are_judged_only_after_redis_was_healthy_for_a_heartbeat_ttl() -> None:
    assert not may_judge(healthy_for_s=0.0, heartbeat_ttl_s=4.0)  # down now
    assert not may_judge(healthy_for_s=3.9, heartbeat_ttl_s=4.0)  # just back: heartbeats not rewritten yet
    assert may_judge(healthy_for_s=4.0, heartbeat_ttl_s=4.0)
    assert may_judge(healthy_for_s=float("inf"), heartbeat_ttl_s=4.0)  # no outage seen


def test_the_trim_point_is_what_the_slowest_group_still_needs() -> None:
    assert parse_id(b"1700000000000-3") == (1700000000000, 3)
    assert oldest_needed([]) is None  # no group yet: keep everything
    # group A has read up to 5-0 with 3-0 pending; group B has read up to 4-1, nothing pending
    assert oldest_needed([((5, 0), (3, 0)), ((4, 1), None)]) == (3, 0)
    assert oldest_needed([((5, 0), None), ((4, 1), None)]) == (4, 2)  # the entry after B's last delivered
    assert trim_point((4, 2), now_ms=10_000, retain_s=0) == (4, 2)
    assert trim_point((9_000, 0), now_ms=10_000, retain_s=2.0) == (8_000, 0)  # consumed, but younger than 2 s
    assert trim_point(None, now_ms=10_000, retain_s=0) is None
