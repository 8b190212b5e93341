"""Delta weight sync (streamrl.torchkit.delta): exact round trips, refusals, the checksum, the sync policy.

Every round trip goes through the wire form (``delta_to_bytes`` -> ``delta_from_bytes``) and compares
raw bit patterns, so NaN payloads and -0.0 count.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from streamrl.common.errors import WeightSyncError
from streamrl.torchkit.delta import (
    ENCODINGS,
    VALUE_CODINGS,
    DeltaChecksumError,
    DeltaInfo,
    apply_delta,
    delta_from_bytes,
    delta_to_bytes,
    encode_delta,
    plan_sync,
    weights_digest,
)

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
INT = {2: torch.int16, 4: torch.int32}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(INT[t.element_size()])


def _weights(dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": (torch.randn(64, 32, generator=g) * 0.02).to(dtype),
        "layer.0.q.weight": (torch.randn(32, 32, generator=g) * 0.02).to(dtype),
        "layer.0.q.bias": torch.zeros(32, dtype=dtype),
        "norm.weight": torch.ones(32, dtype=dtype),
    }


def _step(weights: dict[str, torch.Tensor], fraction: float, seed: int) -> dict[str, torch.Tensor]:
    """A copy with about ``fraction`` of each tensor's elements moved by one unit in the last place."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in weights.items():
        bits = _bits(t).clone().reshape(-1)
        bits[torch.rand(bits.numel(), generator=g) < fraction] += 1
        out[name] = bits.view(t.dtype).reshape(t.shape)
    return out


def _round_trip(
    old: dict[str, torch.Tensor], new: dict[str, torch.Tensor], zlib_level: int | None = 1, **kw: object
) -> dict[str, torch.Tensor]:
    held = {n: t.clone() for n, t in old.items()}
    delta = encode_delta(old, new, 3, 4, **kw)  # type: ignore[arg-type]
    apply_delta(held, delta_from_bytes(delta_to_bytes(delta, zlib_level)))
    return held


def _assert_bit_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(_bits(a[name]), _bits(b[name])), name


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fraction", [0.001, 0.05, 0.3, 0.99])
@pytest.mark.parametrize("zlib_level", [1, None])
def test_round_trip_is_bit_exact(dtype: torch.dtype, fraction: float, zlib_level: int | None) -> None:
    old = _weights(dtype)
    new = _step(old, fraction, seed=1)
    _assert_bit_equal(_round_trip(old, new, zlib_level), new)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("encoding", ENCODINGS)
@pytest.mark.parametrize("values", VALUE_CODINGS)
def test_each_encoding_round_trips_nan_payloads_and_signed_zeros(
    dtype: torch.dtype, encoding: str, values: str
) -> None:
    old = _weights(dtype)
    new = {n: t.clone() for n, t in old.items()}
    q = _bits(new["layer.0.q.weight"]).reshape(-1)
    nan_a, nan_b = (0x7FC1, 0x7FFF) if dtype != torch.float32 else (0x7FC00001, 0x7FFFFFFF)
    q[0], q[5], q[1000] = nan_a, nan_b, q[1000] + 1  # two NaNs of different payloads, one ulp
    new["layer.0.q.bias"][3] = -0.0  # +0.0 -> -0.0: equal as numbers, different bits
    old["embed.weight"][0, 0] = float("nan")
    new["embed.weight"][0, 0] = -float("nan")  # NaN -> NaN of the other sign
    assert {t.encoding for t in encode_delta(old, new, 0, 1, (encoding,), (values,)).tensors} <= {encoding, "none"}
    held = _round_trip(old, new, encodings=(encoding,), value_codings=(values,))
    _assert_bit_equal(held, new)
    assert weights_digest(held) == weights_digest(new)


def test_nothing_changed_is_an_empty_delta() -> None:
    old = _weights(torch.bfloat16)
    delta = encode_delta(old, {n: t.clone() for n, t in old.items()}, 3, 4)
    assert delta.num_bytes == 0
    assert {t.encoding for t in delta.tensors} == {"none"}
    _assert_bit_equal(_round_trip(old, old), old)


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_changed_costs_no_more_than_the_full_weights(dtype: torch.dtype) -> None:
    old = _weights(dtype)
    new = {n: (t.float() + 1).to(dtype) for n, t in old.items()}
    delta = encode_delta(old, new, 3, 4)
    assert {t.encoding for t in delta.tensors} == {"dense"}
    assert delta.num_bytes == sum(t.numel() * t.element_size() for t in new.values())
    _assert_bit_equal(_round_trip(old, new), new)


def test_sparse_changes_choose_gaps_and_dense_ones_bitmask() -> None:
    old = {"w": torch.zeros(100_000, dtype=torch.bfloat16)}
    sparse = _step(old, 0.01, seed=2)
    dense = _step(old, 0.4, seed=2)
    assert encode_delta(old, sparse, 0, 1).tensors[0].encoding == "gaps"
    assert encode_delta(old, dense, 0, 1).tensors[0].encoding == "bitmask"
    # gaps: ~1 byte per index + 2 per value, a third of idx32's 6
    assert (
        encode_delta(old, sparse, 0, 1).num_bytes
        < 0.55 * encode_delta(old, sparse, 0, 1, encodings=("idx32",)).num_bytes
    )


def test_large_gaps_take_multi_byte_varints() -> None:
    old = {"w": torch.zeros(2**22, dtype=torch.float16)}
    new = {"w": old["w"].clone()}
    new["w"][[0, 1, 200, 70_000, 2**22 - 1]] = 1.0
    delta = encode_delta(old, new, 0, 1, encodings=("gaps",))
    assert delta.tensors[0].encoding == "gaps"
    _assert_bit_equal(_round_trip(old, new, encodings=("gaps",)), new)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda w: w.pop("norm.weight"), "names differ"),
        (lambda w: w.__setitem__("extra.weight", torch.zeros(3, dtype=torch.bfloat16)), "names differ"),
        (lambda w: w.__setitem__("norm.weight", torch.ones(33, dtype=torch.bfloat16)), r"held .*\(33,\)"),
        (lambda w: w.__setitem__("norm.weight", torch.ones(32, dtype=torch.float16)), "held torch.float16"),
    ],
)
def test_mismatched_names_shapes_and_dtypes_are_refused_before_writing(change: object, match: str) -> None:
    old = _weights(torch.bfloat16)
    delta = encode_delta(old, _step(old, 0.5, seed=1), 3, 4)
    held = {n: t.clone() for n, t in old.items()}
    change(held)  # type: ignore[operator]
    before = {n: t.clone() for n, t in held.items()}
    with pytest.raises(ValueError, match=match):
        apply_delta(held, delta)
    _assert_bit_equal(held, before)


def test_encode_refuses_different_tensor_sets() -> None:
    old = _weights(torch.bfloat16)
    new = {n: t.clone() for n, t in old.items()}
    new["norm.weight"] = torch.ones(32, dtype=torch.float32)
    with pytest.raises(ValueError, match="not one tensor"):
        encode_delta(old, new, 0, 1)
    with pytest.raises(ValueError, match="names differ"):
        encode_delta(old, {"embed.weight": old["embed.weight"]}, 0, 1)
    with pytest.raises(ValueError, match="bfloat16, float16 or float32"):
        encode_delta({"i": torch.zeros(3, dtype=torch.int64)}, {"i": torch.ones(3, dtype=torch.int64)}, 0, 1)


@pytest.mark.parametrize("values", VALUE_CODINGS)
def test_a_corrupted_value_fails_the_checksum(values: str) -> None:
    old = _weights(torch.bfloat16)
    delta = encode_delta(old, _step(old, 0.05, seed=1), 3, 4, value_codings=(values,))
    buf = bytearray(delta_to_bytes(delta, zlib_level=None))
    buf[-1] ^= 0x01  # the last value byte of the last changed tensor (a diff varint stays one byte)
    held = {n: t.clone() for n, t in old.items()}
    with pytest.raises(DeltaChecksumError, match="fetch full weights"):
        apply_delta(held, delta_from_bytes(bytes(buf)))
    assert issubclass(DeltaChecksumError, WeightSyncError)


def test_a_corrupted_compressed_delta_is_refused_by_zlib() -> None:
    old = _weights(torch.bfloat16)
    buf = bytearray(delta_to_bytes(encode_delta(old, _step(old, 0.05, seed=1), 3, 4)))
    buf[-8] ^= 0x01
    with pytest.raises(ValueError, match="malformed delta"):
        delta_from_bytes(bytes(buf))


def test_a_delta_applied_to_the_wrong_base_fails_the_checksum() -> None:
    v0 = _weights(torch.bfloat16)
    v1 = _step(v0, 0.05, seed=1)
    v2 = _step(v1, 0.05, seed=2)
    held = {n: t.clone() for n, t in v0.items()}  # holds v0, gets the v1 -> v2 delta
    with pytest.raises(DeltaChecksumError):
        apply_delta(held, encode_delta(v1, v2, 1, 2))


def test_a_truncated_or_garbled_delta_is_refused() -> None:
    old = _weights(torch.bfloat16)
    delta = encode_delta(old, _step(old, 0.05, seed=1), 3, 4)
    with pytest.raises(ValueError, match="header says"):
        delta_from_bytes(delta_to_bytes(delta, zlib_level=None)[:-1])
    buf = delta_to_bytes(delta)
    with pytest.raises(ValueError, match="zlib stream truncated"):
        delta_from_bytes(buf[:-1])
    with pytest.raises(ValueError, match="malformed delta"):
        delta_from_bytes(b"\x01\x00")
    # a payload whose index part does not parse: refused while writing, so the tensors are spoiled
    delta = delta_from_bytes(buf)
    first = delta.tensors[0]
    garbled = replace(delta, tensors=(replace(first, data=b"\xff" * len(first.data)), *delta.tensors[1:]))
    with pytest.raises(DeltaChecksumError, match="corrupt delta"):
        apply_delta({n: t.clone() for n, t in old.items()}, garbled)
    # an idx32 index past the end
    delta = encode_delta(old, _step(old, 0.05, seed=1), 3, 4, encodings=("idx32",))
    first = delta.tensors[0]
    data = bytearray(first.data)
    data[0:4] = (10**6).to_bytes(4, "little")
    garbled = replace(delta, tensors=(replace(first, data=bytes(data)), *delta.tensors[1:]))
    with pytest.raises(DeltaChecksumError, match="out of range"):
        apply_delta({n: t.clone() for n, t in old.items()}, garbled)


def test_a_chain_of_deltas_reaches_the_current_version() -> None:
    versions = [_weights(torch.bfloat16)]
    for v in range(1, 5):
        versions.append(_step(versions[-1], 0.02, seed=v))
    held = {n: t.clone() for n, t in versions[0].items()}
    for v in range(1, 5):
        apply_delta(held, encode_delta(versions[v - 1], versions[v], v - 1, v), verify=v == 4)
    _assert_bit_equal(held, versions[4])


def test_digest_ignores_order_and_sees_names_and_bits() -> None:
    w = _weights(torch.bfloat16)
    assert weights_digest(w) == weights_digest(dict(reversed(w.items())))
    renamed = {("x." + n if n == "norm.weight" else n): t for n, t in w.items()}
    assert weights_digest(renamed) != weights_digest(w)
    zero = {n: t.clone() for n, t in w.items()}
    zero["layer.0.q.bias"][0] = -0.0
    assert weights_digest(zero) != weights_digest(w)


FULL = 1000


def _chain(*links: tuple[int, int, int]) -> list[DeltaInfo]:
    return [DeltaInfo(a, b, n) for a, b, n in links]


def test_policy_chains_deltas_while_cheap() -> None:
    plan = plan_sync(5, 8, _chain((5, 6, 100), (6, 7, 100), (7, 8, 100)), FULL)
    assert plan.kind == "delta"
    assert [(d.base_version, d.version) for d in plan.deltas] == [(5, 6), (6, 7), (7, 8)]
    assert plan.num_bytes == 300


def test_policy_takes_the_cheapest_chain_including_multi_version_links() -> None:
    links = _chain((5, 6, 100), (6, 7, 100), (7, 8, 100), (5, 8, 150), (4, 5, 1))
    plan = plan_sync(5, 8, links, FULL)
    assert [(d.base_version, d.version) for d in plan.deltas] == [(5, 8)]
    assert plan.num_bytes == 150


def test_policy_sends_full_weights_when_the_chain_is_too_expensive() -> None:
    links = _chain((5, 6, 200), (6, 7, 200), (7, 8, 200))
    assert plan_sync(5, 8, links, FULL).kind == "full"  # 600 >= 0.5 x 1000
    assert plan_sync(6, 8, links, FULL).kind == "delta"  # 400
    assert plan_sync(5, 8, links, FULL, max_delta_fraction=0.8).kind == "delta"


def test_policy_sends_full_weights_without_a_chain() -> None:
    links = _chain((6, 7, 10), (7, 8, 10))
    plan = plan_sync(5, 8, links, FULL)  # too far behind: the 5 -> 6 delta is gone
    assert (plan.kind, plan.num_bytes) == ("full", FULL)
    assert "no delta chain from version 5" in plan.reason
    assert plan_sync(None, 8, links, FULL).kind == "full"  # a new worker
    assert plan_sync(9, 8, links, FULL).kind == "full"  # held ahead: a restarted learner
    assert plan_sync(8, 8, links, FULL).kind == "none"
    with pytest.raises(ValueError, match="max_delta_fraction"):
        plan_sync(5, 8, links, FULL, max_delta_fraction=0)
