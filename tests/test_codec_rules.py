"""Which casts a write accepts (``codec._castable``: within a kind only) and the schema
JSON form shard state stores (``Schemas.to_json`` / ``from_json``)."""

from __future__ import annotations

import pyarrow as pa
import pytest

from persist_lib.errors import InvalidUsage
from persist_lib.shard.codec import Schemas, _castable, check_update_table

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


NN_STRUCT = pa.struct([pa.field("a", pa.int64(), nullable=False), ("l", pa.list_(pa.field("e", pa.int64(), nullable=False)))])
NN_LIST = pa.list_(pa.struct([pa.field("x", pa.int64(), nullable=False)]))
NESTED = Schemas.create(pa.schema([("k", pa.int64())]), pa.schema([("s", NN_STRUCT), ("ls", NN_LIST)]))


def _nested(s: list[object], ls: list[object], chunk: int) -> pa.Table:
    """The rows in chunks of ``chunk`` rows."""
    n = len(s)

    def col(vals: list[object], t: pa.DataType) -> pa.ChunkedArray:
        return pa.chunked_array([pa.array(vals[i : i + chunk], t) for i in range(0, n, chunk)], t)

    return pa.table({"k": list(range(n)), "s": col(s, NN_STRUCT), "ls": col(ls, NN_LIST),
                     "ts": [0] * n, "diff": [1] * n})


OK_S = {"a": 1, "l": [1, 2]}


@pytest.mark.parametrize(
    ("s", "ls", "chunk", "error"),
    [
        ([OK_S, None, OK_S], [[{"x": 1}], None, []], 9, None),  # a null parent may hide its children
        ([{"a": None, "l": []}, OK_S], [[], []], 9, r"column s\.a is null in row 0 but"),
        ([OK_S, {"a": None, "l": []}], [[], []], 9, r"column s\.a is null in row 1 but the field is not nullable \(rows counted from 0\)"),
        ([OK_S, {"a": 2, "l": [1, None]}], [[], []], 9, r"column s\.l contains a null list element"),
        ([OK_S, OK_S], [[{"x": 1}], [{"x": None}]], 9, r"column ls\[\]\.x is null in row 1 but"),
        ([OK_S] * 5 + [{"a": None, "l": []}], [[]] * 6, 2, r"column s\.a is null in row 1 .*\(rows counted from 4\)"),
    ],
)
def test_non_nullable_nested_fields_are_enforced(s: list[object], ls: list[object], chunk: int, error: str | None) -> None:
    t = _nested(s, ls, chunk)
    if error is None:
        assert check_update_table(t, NESTED, shard="s1").num_rows == len(s)
    else:
        with pytest.raises(InvalidUsage, match=rf"^shard s1: {error}"):
            check_update_table(t, NESTED, shard="s1")


def test_a_narrowing_cast_that_loses_values_is_a_typed_error() -> None:
    schemas = Schemas.create(pa.schema([("k", pa.int8())]), pa.schema([("v", pa.string())]))
    ok = check_update_table(pa.table({"k": [1, -128], "v": ["a", "b"], "ts": [0, 0], "diff": [1, 1]}), schemas, shard="s1")
    assert ok.column(0).type == pa.int8() and ok.column(0).to_pylist() == [1, -128]
    with pytest.raises(InvalidUsage, match=r"^shard s1: column 'k' of type int64 cannot be cast safely to the schema type int8"):
        check_update_table(pa.table({"k": [1, 300], "v": ["a", "b"], "ts": [0, 0], "diff": [1, 1]}), schemas, shard="s1")
