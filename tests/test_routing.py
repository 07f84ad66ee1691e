"""Key-hash routing (``persist_lib.storage.routing``) against an independent reference.

The route of a key must never change: existing data sits in the shard its key hashed
to. So the hash is checked against a plain-Python reimplementation of its documented
recipe (splitmix64 of integers and float bits, BLAKE2b-64 of string bytes, a fixed
null constant, columns combined in key order) and against literal values pinned here:
a change to either the recipe or the code fails.
"""

from __future__ import annotations

import datetime
import decimal
import hashlib
import struct
from collections import Counter
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from persist_lib.storage.routing import key_hashes, route, split_by_shard

M = (1 << 64) - 1
NULL = 0x9E3779B97F4A7C15


def splitmix(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & M
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M
    return z ^ (z >> 31)


def value_hash(v: Any) -> int:
    if v is None:
        return NULL
    if isinstance(v, bool) or isinstance(v, int):
        return splitmix(int(v) & M)
    if isinstance(v, float):
        return splitmix(struct.unpack("<Q", struct.pack("<d", 0.0 if v == 0.0 else v))[0])
    b = v.encode() if isinstance(v, str) else bytes(v)
    return int.from_bytes(hashlib.blake2b(b, digest_size=8).digest(), "little")


def ref_hash(row: tuple[Any, ...]) -> int:
    h = 0
    for v in row:
        h = splitmix(((h * 31) & M) ^ value_hash(v))
    return h


def test_known_routes_are_pinned() -> None:
    # Computed once from the recipe above; they must never change.
    t = pa.table({"k": pa.array([0, 1, 2, 3, -1, 1 << 40], pa.int64())})
    assert route(t, ["k"], 1000).tolist() == [
        ref_hash((v,)) % 1000 for v in [0, 1, 2, 3, -1, 1 << 40]
    ] == [55, 158, 636, 615, 767, 996]
    s = pa.table({"s": ["", "a", "persist", "ünïcode"]})
    assert route(s, ["s"], 1000).tolist() == [ref_hash((v,)) % 1000 for v in ["", "a", "persist", "ünïcode"]] == [
        792, 423, 881, 401,
    ]
    assert int(key_hashes(pa.table({"k": [1], "s": ["a"]}), ["k", "s"])[0]) == ref_hash((1, "a")) == 17359714405926953698


@pytest.mark.parametrize(
    "column",
    [
        pa.array(range(-500, 1500), pa.int64()),
        pa.array([i if i % 7 else None for i in range(2000)], pa.int32()),
        pa.array([f"k{i}" if i % 11 else None for i in range(2000)], pa.string()),
        pa.array([i / 4 - 100 if i % 13 else None for i in range(2000)], pa.float64()),
        pa.array([bool(i % 2) for i in range(2000)]),
    ],
    ids=["int64", "int32-nulls", "string-nulls", "float64-nulls", "bool"],
)
def test_hashes_equal_the_reference(column: pa.Array) -> None:
    t = pa.table({"a": column, "b": pa.array([f"x{i % 37}" for i in range(len(column))])})
    vals = column.to_pylist()
    for keys, rows in ((["a"], [(v,) for v in vals]), (["a", "b"], list(zip(vals, t["b"].to_pylist(), strict=True)))):
        expected = np.array([ref_hash(r) for r in rows], dtype=np.uint64)
        assert (key_hashes(t, keys) == expected).all()
        for n in (2, 7, 64):
            assert route(t, keys, n).tolist() == [int(h) % n for h in expected]


def test_equal_keys_route_together() -> None:
    # Same value, other physical types: one route (as the recipe says).
    assert route(pa.table({"k": pa.array([1, 2, 3], pa.int32())}), ["k"], 97).tolist() == route(
        pa.table({"k": pa.array([1, 2, 3], pa.int64())}), ["k"], 97
    ).tolist()
    zeros = pa.table({"f": pa.array([0.0, -0.0], pa.float64())})
    assert len(set(route(zeros, ["f"], 1 << 20).tolist())) == 1
    a, b = route(pa.table({"s": ["ab"], "t": ["c"]}), ["s", "t"], 1 << 30), route(
        pa.table({"s": ["a"], "t": ["bc"]}), ["s", "t"], 1 << 30
    )
    assert a.tolist() != b.tolist(), "columns are hashed separately, not concatenated"


def test_routing_is_balanced_and_one_shard_is_trivial() -> None:
    t = pa.table({"k": list(range(10_000)), "s": [f"x{i}" for i in range(10_000)]})
    counts = Counter(route(t, ["k"], 8).tolist())
    assert sorted(counts) == list(range(8)) and min(counts.values()) > 1000
    assert route(t, ["k"], 1).tolist() == [0] * 10_000


def test_nested_keys_hash_their_canonical_json() -> None:
    """Nested values hash as BLAKE2b-64 of their JSON with sorted keys and no spaces."""
    t = pa.table({"n": pa.array([{"b": 1, "a": [1, 2]}, None, {"b": None, "a": []}],
                                pa.struct([("b", pa.int64()), ("a", pa.list_(pa.int64()))]))})
    col = [
        int.from_bytes(hashlib.blake2b(b'{"a":[1,2],"b":1}', digest_size=8).digest(), "little"),
        NULL,
        int.from_bytes(hashlib.blake2b(b'{"a":[],"b":null}', digest_size=8).digest(), "little"),
    ]
    assert key_hashes(t, ["n"]).tolist() == [splitmix(h) for h in col]  # one column: splitmix(0 * 31 ^ h)


def test_binary_all_null_and_non_json_values_hash_by_the_recipe() -> None:
    t = pa.table({"b": pa.array([b"\x00", b"", None, b"\x00"], pa.binary())})
    assert key_hashes(t, ["b"]).tolist() == [ref_hash((v,)) for v in t["b"].to_pylist()]
    nulls = pa.table({"s": pa.array([None, None], pa.string())})
    assert key_hashes(nulls, ["s"]).tolist() == [ref_hash((None,))] * 2
    # Values JSON has no form for hash by their str().
    d = pa.table({"n": pa.array([[datetime.date(2024, 1, 2)]], pa.list_(pa.date32()))})
    want = int.from_bytes(hashlib.blake2b(b'["2024-01-02"]', digest_size=8).digest(), "little")
    assert key_hashes(d, ["n"]).tolist() == [splitmix(want)]


def test_decimal_fixed_binary_and_uint64_keys_hash_by_the_recipe() -> None:
    dec = pa.array([decimal.Decimal("1.50"), None, decimal.Decimal("-3.00")], pa.decimal128(6, 2))
    # Decimals hash as the bytes of their string form.
    assert key_hashes(pa.table({"d": dec}), ["d"]).tolist() == [ref_hash(("1.50",)), ref_hash((None,)), ref_hash(("-3.00",))]
    fsb = pa.array([b"ab", None, b"\x00\x01"], pa.binary(2))
    assert key_hashes(pa.table({"f": fsb}), ["f"]).tolist() == [ref_hash((v,)) for v in fsb.to_pylist()]
    # uint64 values past 2^63 hash by their 64 bits, like the int64 of the same bits.
    u = pa.array([1, (1 << 64) - 1, None], pa.uint64())
    assert key_hashes(pa.table({"u": u}), ["u"]).tolist() == [ref_hash((1,)), ref_hash((-1,)), ref_hash((None,))]


@pytest.mark.parametrize("num_shards", [2, 3, 64])
def test_split_by_shard_keeps_every_row_in_order(num_shards: int) -> None:
    t = pa.table({"k": [i % 7 for i in range(1000)], "v": list(range(1000))})
    parts = split_by_shard(t, ["k"], num_shards)
    routes = route(t, ["k"], num_shards).tolist()
    assert len(parts) == num_shards
    for shard, part in enumerate(parts):
        assert part.to_pylist() == [r for r, s in zip(t.to_pylist(), routes, strict=True) if s == shard]
    assert split_by_shard(t, ["k"], 1) == [t]


def test_temporal_keys_hash_their_integer_storage() -> None:
    # date32 has no Arrow cast to int64 (routing a date key used to raise); every
    # temporal key hashes its stored integer (days, seconds, micro/nanoseconds).
    days = [0, 1, 19_000, -3, None]
    cols = {
        "date32": pa.array(days, pa.date32()),
        "time32": pa.array([0, 5, 86_399, 7, None], pa.time32("s")),
        "date64": pa.array([d * 86_400_000 if d is not None else None for d in days], pa.date64()),
        "timestamp": pa.array([0, 10**15, -(10**12), 42, None], pa.timestamp("us")),
        "duration": pa.array([0, 1, -1, 10**9, None], pa.duration("ns")),
    }
    for name, col in cols.items():
        raw = col.view(pa.int32() if col.type.bit_width == 32 else pa.int64()).to_pylist()
        expected = [ref_hash((v,)) % 97 for v in raw]
        assert route(pa.table({"k": col}), ["k"], 97).tolist() == expected, name
    dates = pa.table({"d": pa.array([datetime.date(2026, 11, i) for i in range(1, 28)])})
    assert sum(len(p) for p in split_by_shard(dates, ["d"], 4)) == 27
