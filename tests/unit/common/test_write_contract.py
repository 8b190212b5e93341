"""Pure parts of the write path: the once key's hash tag, stored replies decoded as redis-py would, and
the lease TTL's validation."""

from __future__ import annotations

import msgpack
import pytest
from redis.exceptions import ResponseError

from streamrl.common.config import ConsumerConfig, validate
from streamrl.common.errors import ConfigError
from streamrl.common.tx import decode_replies, once_key


def test_the_once_key_shares_the_run_hash_tag() -> None:
    assert once_key(["plain", "streamrl:{r1}:batches"], "ab") == "streamrl:{r1}:once:ab"
    assert once_key(["plain"], "ab") == "streamrl:once:ab"
    assert once_key(["streamrl:{r1}:batches"], "ab", "learner") == "streamrl:{r1}:once:learner:ab"  # its own namespace


def test_stored_replies_decode_as_redis_py_replies() -> None:
    packed = msgpack.packb([b"1-0", 3, {"ok": "OK"}, False, [b"a", b"b"], {"err": "WRONGTYPE no"}, {}])
    entry, n, ok, missing, items, error, empty = decode_replies(packed)
    assert (entry, n, ok, missing, items, empty) == (b"1-0", 3, True, None, [b"a", b"b"], [])
    assert isinstance(error, ResponseError) and str(error) == "WRONGTYPE no"


def test_the_lease_ttl_must_cover_two_heartbeats() -> None:
    assert ConsumerConfig().lease_ttl == 10.0  # 5 heartbeat intervals by default
    assert ConsumerConfig(heartbeat_interval_s=0.2).lease_ttl == pytest.approx(1.0)
    assert ConsumerConfig(heartbeat_interval_s=2.0, lease_ttl_s=4.0).lease_ttl == 4.0
    with pytest.raises(ConfigError, match=r"consumer.lease_ttl_s \(3 s\) must be at least twice"):
        validate(ConsumerConfig, {"heartbeat_interval_s": 2.0, "lease_ttl_s": 3.0})
