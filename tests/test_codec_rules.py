"""Which casts a write accepts (``codec._castable``: within a kind only) and the schema
JSON form shard state stores (``Schemas.to_json`` / ``from_json``)."""

from __future__ import annotations

import pyarrow as pa
import pytest

from persist_lib.codec import Schemas, _castable, check_update_table
from persist_lib.errors import InvalidUsage

TS, TSZ = pa.timestamp("ms"), pa.timestamp("ms", tz="UTC")
ST_AB = pa.struct([("a", pa.int32()), ("b", pa.string())])

ACCEPTED = [
    (pa.int32(), pa.int32()), (pa.null(), pa.string()), (pa.int8(), pa.float64()), (pa.float32(), pa.int64()),
    (pa.string(), pa.large_string()), (pa.string(), pa.binary()), (pa.large_string(), pa.large_binary()),
    (pa.binary(), pa.large_binary()), (TS, pa.timestamp("us")), (TSZ, pa.timestamp("s", tz="Europe/Paris")),
    (pa.date32(), pa.date64()), (pa.time32("s"), pa.time64("us")), (pa.duration("s"), pa.duration("ms")),
    (ST_AB, pa.struct([("a", pa.int64()), ("b", pa.large_string())])),
    (pa.list_(pa.int8()), pa.large_list(pa.int64())), (pa.list_(pa.int8(), 2), pa.list_(pa.int16())),
]
REFUSED = [
    (pa.string(), pa.int64()), (pa.int64(), pa.string()), (pa.binary(), pa.string()), (pa.bool_(), pa.int8()),
    (TS, TSZ), (TSZ, TS), (pa.date32(), TS), (pa.time32("s"), pa.duration("s")), (pa.duration("s"), pa.int64()),
    (ST_AB, pa.struct([("b", pa.string()), ("a", pa.int32())])), (ST_AB, pa.struct([("a", pa.int32())])),
    (ST_AB, pa.struct([("a", pa.string()), ("b", pa.string())])),
    (pa.list_(pa.string()), pa.list_(pa.int64())), (pa.list_(pa.int8()), pa.int8()), (pa.int8(), pa.list_(pa.int8())),
    (ST_AB, pa.list_(pa.int32())),
]


@pytest.mark.parametrize(("src", "dst"), ACCEPTED, ids=[f"{s}->{d}" for s, d in ACCEPTED])
def test_casts_within_a_kind_are_accepted(src: pa.DataType, dst: pa.DataType) -> None:
    assert _castable(src, dst)


@pytest.mark.parametrize(("src", "dst"), REFUSED, ids=[f"{s}->{d}" for s, d in REFUSED])
def test_casts_across_kinds_are_refused(src: pa.DataType, dst: pa.DataType) -> None:
    assert not _castable(src, dst)


def test_a_write_with_a_refused_cast_is_a_typed_error() -> None:
    schemas = Schemas.create(pa.schema([("k", pa.int64())]), pa.schema([("v", pa.string())]))
    bad = pa.table({"k": ["1"], "v": ["x"], "ts": [0], "diff": [1]})
    with pytest.raises(InvalidUsage, match="k"):
        check_update_table(bad, schemas, shard="s1")


def test_schema_json_round_trip_and_bad_input() -> None:
    key = pa.schema([pa.field("k", pa.int64(), nullable=False, metadata={b"m": b"1"})])
    val = pa.schema([("v", pa.large_list(ST_AB))])
    s = Schemas.create(key, val)
    d = s.to_json()
    assert set(d) == {"key", "val"} and all(isinstance(x, str) for x in d.values())
    back = Schemas.from_json(dict(d))
    assert back == s and back.key.equals(key, check_metadata=True) and back.val.equals(val)
    assert Schemas.from_json(dict(d)) is back, "equal inputs give the same object"
    other = Schemas.create(key, pa.schema([("v", pa.string())]))
    assert Schemas.from_json(other.to_json()) == other != s
    for bad in ({"key": d["key"]}, {"key": d["key"], "val": "not base64 ipc"}, {"key": 1, "val": 2}, "x"):
        with pytest.raises(InvalidUsage, match="cannot decode schemas from"):
            Schemas.from_json(bad)  # type: ignore[arg-type]
