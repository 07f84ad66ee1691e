"""Schemas, normalization of user updates, and consolidation (against a Counter model)."""

from __future__ import annotations

import datetime
import decimal
import math
import struct
from collections import Counter
from typing import Any
from unittest import mock

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from persist_lib.errors import InvalidUsage
from persist_lib.shard import consolidate as consolidate_mod
from persist_lib.shard import ranks as ranks_mod
from persist_lib.shard.codec import (
    Schemas,
    check_update_table,
    empty_updates,
    internal_schema,
    normalize_updates,
    to_user_table,
    user_schema,
)
from persist_lib.shard.consolidate import consolidate, is_consolidated, merge_sorted
from persist_lib.shard.time_filters import (
    advance_to_since,
    forward_and_filter,
    snapshot_at,
    time_range,
)

KEY = pa.schema([("id", pa.int64()), ("name", pa.string())])
VAL = pa.schema([("amount", pa.float64())])
S = Schemas.create(KEY, VAL)


def norm(updates: Any, schemas: Schemas = S) -> pa.Table:
    return normalize_updates(updates, schemas, shard="s1")


def raises(match: str) -> Any:
    return pytest.raises(InvalidUsage, match=match)


# ---------------------------------------------------------------------------------------
# Schemas


def test_schemas_describe_eq_hash_json() -> None:
    assert S.describe() == "key(id: int64, name: string) val(amount: double)"
    other = Schemas.create(
        pa.schema([("id", pa.int64()), ("name", pa.string())], metadata={"x": "y"}), VAL
    )
    assert S == other and hash(S) == hash(other)
    assert S != Schemas.create(KEY, pa.schema([("amount", pa.float32())]))
    assert S != Schemas.create(
        pa.schema([pa.field("id", pa.int64(), False), ("name", pa.string())]), VAL
    )
    back = Schemas.from_json(S.to_json())
    assert back == S and back.fingerprint() == S.fingerprint()


def test_schemas_json_round_trips_nested_types_and_metadata() -> None:
    key = pa.schema(
        [
            pa.field("id", pa.int64(), nullable=False, metadata={"doc": "the id"}),
            pa.field(
                "s",
                pa.struct(
                    [
                        pa.field("a", pa.list_(pa.timestamp("us", tz="UTC")), False),
                        ("b", pa.decimal256(40, 3)),
                    ]
                ),
            ),
        ],
        metadata={"owner": "me"},
    )
    s = Schemas.create(key, pa.schema([]))
    back = Schemas.from_json(s.to_json())
    assert back.key.equals(key, check_metadata=True)
    assert back.key.field("id").metadata == {b"doc": b"the id"}
    assert len(back.val) == 0 and back == s
    assert s.describe() == (
        "key(id: int64 not null, s: struct<a: list<item: timestamp[us, tz=UTC]> not null, "
        "b: decimal256(40, 3)>) val()"
    )


def test_schemas_nested_nullability_matters() -> None:
    a = Schemas.create(pa.schema([("s", pa.struct([pa.field("a", pa.int64(), False)]))]))
    b = Schemas.create(pa.schema([("s", pa.struct([pa.field("a", pa.int64(), True)]))]))
    assert a != b and a.fingerprint() != b.fingerprint()


@pytest.mark.parametrize(
    "key, val, match",
    [
        ("id", pa.schema([]), "key schema must be a pyarrow.Schema, got str"),
        (KEY, {"a": 1}, "value schema must be a pyarrow.Schema.*got dict"),
        (pa.schema([]), VAL, "key schema must have at least one field"),
        (pa.schema([("ts", pa.int64())]), VAL, "'ts'.*reserved"),
        (KEY, pa.schema([("diff", pa.int64())]), "'diff'.*reserved"),
        (pa.schema([("a", pa.int64()), ("a", pa.string())]), VAL, "'a' appears twice in the key"),
        (KEY, pa.schema([("id", pa.int64())]), "'id' appears in both the key and the value"),
        (
            pa.schema([("d", pa.dictionary(pa.int32(), pa.string()))]),
            VAL,
            "key field 'd' has unsupported type dictionary<values=string.*supported: int8",
        ),
        (
            KEY,
            pa.schema([("m", pa.map_(pa.string(), pa.int64()))]),
            "value field 'm'.*map<string, int64>",
        ),
        (pa.schema([("n", pa.null())]), VAL, "key field 'n' has unsupported type null"),
        (
            pa.schema([("u", pa.dense_union([pa.field("a", pa.int64())]))]),
            VAL,
            "key field 'u' has unsupported type dense_union",
        ),
        (
            pa.schema([("l", pa.list_(pa.dictionary(pa.int8(), pa.string())))]),
            VAL,
            "key field 'l'.*inside list",
        ),
        (pa.schema([("e", pa.struct([]))]), VAL, "empty struct"),
        (
            pa.schema([("sv", pa.string_view())]),
            VAL,
            "key field 'sv' has unsupported type string_view",
        ),
    ],
)
def test_schema_validation_errors(key: Any, val: Any, match: str) -> None:
    with raises(match):
        Schemas.create(key, val)


def test_extension_types_are_rejected() -> None:
    with raises("key field 'u'.*extension"):
        Schemas.create(pa.schema([("u", pa.uuid())]), VAL)


def test_layouts() -> None:
    assert internal_schema(S).names == ["k.id", "k.name", "v.amount", "t", "d"]
    assert not internal_schema(S).field("t").nullable
    assert user_schema(S).names == ["id", "name", "amount", "ts", "diff"]
    assert empty_updates(S).schema == internal_schema(S) and empty_updates(S).num_rows == 0
    unit = Schemas.create(KEY)
    assert internal_schema(unit).names == ["k.id", "k.name", "t", "d"]


# ---------------------------------------------------------------------------------------
# Normalization


def test_normalize_tuples_and_back() -> None:
    t = norm([(((1, "a"), (1.5,)), 3, 1), (((2, None), (None,)), 0, -1)])
    assert t.schema == internal_schema(S)
    assert t.to_pylist() == [
        {"k.id": 1, "k.name": "a", "v.amount": 1.5, "t": 3, "d": 1},
        {"k.id": 2, "k.name": None, "v.amount": None, "t": 0, "d": -1},
    ]
    user = to_user_table(t, S)
    assert user.schema == user_schema(S)
    assert user.column("ts").to_pylist() == [3, 0]
    assert norm(user).equals(t)


def test_normalize_unit_value_and_empty() -> None:
    unit = Schemas.create(pa.schema([("id", pa.int64())]))
    t = normalize_updates([(((1,), ()), 0, 1)], unit, shard="s1")
    assert t.column_names == ["k.id", "t", "d"]
    assert normalize_updates([], unit, shard="s1").num_rows == 0
    assert norm([]).schema == internal_schema(S)
    with pytest.raises(
        InvalidUsage, match=r"shard s1: update element 0: value must be a tuple of 0"
    ):
        normalize_updates([(((1,), (2,)), 0, 1)], unit, shard="s1")


def test_normalize_table_any_order_and_safe_casts() -> None:
    u = pa.table(
        {
            "diff": pa.array([1, -2], pa.int8()),
            "ts": pa.array([5, 6], pa.uint32()),
            "amount": pa.array([2, 3], pa.int32()),
            "name": pa.array(["x", "y"], pa.large_string()),
            "id": pa.array([3, 4], pa.int32()),
        }
    )
    t = norm(u)
    assert t.schema == internal_schema(S)
    assert t.to_pylist()[1] == {"k.id": 4, "k.name": "y", "v.amount": 3.0, "t": 6, "d": -2}
    # RecordBatch and pandas are accepted too.
    assert norm(u.to_batches()[0]).equals(t)
    pd = pytest.importorskip("pandas")
    df = pd.DataFrame(
        {"id": [3, 4], "name": ["x", "y"], "amount": [2.0, 3.0], "ts": [5, 6], "diff": [1, -2]}
    )
    assert norm(df).equals(t)


def _user(**overrides: Any) -> pa.Table:
    cols: dict[str, Any] = {
        "id": pa.array([1, 2], pa.int64()),
        "name": pa.array(["a", "b"]),
        "amount": pa.array([1.0, 2.0]),
        "ts": pa.array([0, 1], pa.int64()),
        "diff": pa.array([1, 1], pa.int64()),
    }
    for k, v in overrides.items():
        if v is None:
            del cols[k]
        else:
            cols[k] = v
    return pa.table(cols)


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"extra": pa.array([1, 2])}, r"unexpected column\(s\) \['extra'\]"),
        (
            {"name": None},
            r"missing column\(s\) \['name'\].*expected the columns \(id: int64, name: string",
        ),
        ({"ts": None, "diff": None}, r"missing column\(s\) \['ts', 'diff'\]"),
        ({"ts": pa.array([0, -7])}, r"update time must be >= 0 but row 1 has time -7"),
        (
            {"ts": pa.array([0, None], pa.int64())},
            r"column 'ts' has 1 null\(s\) \(first in row 1\)",
        ),
        (
            {"diff": pa.array([None, 1], pa.int64())},
            r"column 'diff' has 1 null\(s\) \(first in row 0\)",
        ),
        (
            {"ts": pa.array([0.0, 1.0])},
            r"column 'ts' must be an integer column \(int64\), got double",
        ),
        ({"diff": pa.array(["1", "2"])}, r"column 'diff' must be an integer column"),
        (
            {"diff": pa.array([1, 2**63], pa.uint64())},
            r"column 'diff' of type uint64 does not fit int64",
        ),
        (
            {"id": pa.array(["1", "2"])},
            r"column 'id' has type string but the schema says int64.*not safely castable",
        ),
        ({"name": pa.array([1, 2])}, r"column 'name' has type int64 but the schema says string"),
        (
            {"amount": pa.array([2**60 + 1, 0])},
            r"column 'amount' of type int64 cannot be cast safely",
        ),
    ],
)
def test_normalize_table_errors(overrides: dict[str, Any], match: str) -> None:
    with pytest.raises(InvalidUsage, match="^shard s1: .*" + match):
        norm(_user(**overrides))


def test_normalize_overflowing_cast_and_duplicates() -> None:
    s = Schemas.create(pa.schema([("id", pa.int32())]))
    with raises(
        r"shard s2: column 'id' of type int64 cannot be cast safely to the schema type int32"
    ):
        normalize_updates(pa.table({"id": [2**40], "ts": [0], "diff": [1]}), s, shard="s2")
    dup = pa.Table.from_arrays(
        [pa.array([1]), pa.array([1]), pa.array([0]), pa.array([1])],
        names=["id", "id", "ts", "diff"],
    )
    with raises(r"duplicate column names \['id'\]"):
        normalize_updates(dup, s, shard="s2")


def test_normalize_non_nullable_fields() -> None:
    s = Schemas.create(
        pa.schema(
            [
                pa.field("id", pa.int64(), nullable=False),
                ("s", pa.struct([pa.field("a", pa.int64(), nullable=False)])),
            ]
        )
    )
    with raises(r"field 'id' is not nullable but has 1 null\(s\) \(first in row 0\)"):
        normalize_updates([(((None, None), ()), 0, 1)], s, shard="s1")
    # A null struct is fine; a null non-nullable child of a valid struct is not.
    ok = normalize_updates([(((1, None), ()), 0, 1)], s, shard="s1")
    assert ok.num_rows == 1
    with raises(r"s\.a is null in row 1 but the field is not nullable"):
        normalize_updates(
            [(((1, {"a": 1}), ()), 0, 1), (((1, {"a": None}), ()), 0, 1)], s, shard="s1"
        )


@pytest.mark.parametrize(
    "updates, match",
    [
        (
            [(((1, "a"), (1.0,)), 0, 1), (((1,), (1.0,)), 0, 1)],
            r"update element 1: key must be a tuple of 2 value\(s\) \(id, name\)",
        ),
        ([(((1, "a", 3), (1.0,)), 0, 1)], r"update element 0: key must be a tuple of 2"),
        (
            [(((1, "a"), ()), 0, 1)],
            r"update element 0: value must be a tuple of 1 value\(s\) \(amount\)",
        ),
        (
            [(((1, "a"), (1.0,)), 0)],
            r"update element 0 must be \(\(key_tuple, val_tuple\), time, diff\)",
        ),
        ([42], r"update element 0 must be"),
        ([(("ab", (1.0,)), 0, 1)], r"update element 0: key must be a tuple"),
        (
            [(((1, "a"), (1.0,)), -1, 1)],
            r"update time must be >= 0 but update element 0 has time -1",
        ),
        (
            [(((1, "a"), (1.0,)), 0, 1), (((1, "a"), (1.0,)), 1.5, 1)],
            r"update element 1: time must be an int, got 1.5",
        ),
        ([(((1, "a"), (1.0,)), 0, None)], r"update element 0: diff must be an int, got None"),
        ([(((1, "a"), (1.0,)), 2**64, 1)], r"update element 0: ts value .* is not a valid int64"),
        (
            [(((1, "a"), (1.0,)), 0, 1), ((("x", "a"), (1.0,)), 0, 1)],
            r"update element 1: field 'id' value 'x' is not a valid int64",
        ),
    ],
)
def test_normalize_tuple_errors(updates: list[Any], match: str) -> None:
    with pytest.raises(InvalidUsage, match="^shard s1: " + match):
        norm(updates)


def test_check_update_table() -> None:
    t = norm([(((1, "a"), (1.0,)), 0, 1)])
    assert check_update_table(t, S, shard="s1") is t
    # Internal layout built by hand (nullable t/d, narrower ints) is conformed.
    loose = pa.table(
        {"k.id": pa.array([1], pa.int32()), "k.name": ["a"], "v.amount": [1.0], "t": [0], "d": [1]}
    )
    assert check_update_table(loose, S, shard="s1").equals(t)
    assert check_update_table(loose.to_batches()[0], S, shard="s1").equals(t)
    with raises(r"^shard s1: column 't' has 1 null\(s\).*every update needs a time"):
        check_update_table(loose.set_column(3, "t", pa.array([None], pa.int64())), S, shard="s1")
    with raises(r"^shard s1: update time must be >= 0 but row 0 has time -1"):
        check_update_table(loose.set_column(3, "t", pa.array([-1])), S, shard="s1")
    # User layout and tuples go through normalize_updates.
    assert check_update_table(to_user_table(t, S), S, shard="s1").equals(t)
    assert check_update_table([(((1, "a"), (1.0,)), 0, 1)], S, shard="s1").equals(t)


def test_normalize_rejects_other_objects() -> None:
    with raises("updates must be a pyarrow Table/RecordBatch or a list"):
        norm("not updates")
    with raises("updates must be"):
        norm(42)


# ---------------------------------------------------------------------------------------
# Consolidation against a Counter model


def _float_key(v: float) -> int:
    b: int = struct.unpack("<q", struct.pack("<d", v))[0]
    return b ^ ((1 << 63) - 1) if b < 0 else b


def _canon(v: Any) -> Any:
    """The documented order as a Python key: nulls first, floats by total order, lists
    lexicographically, dicts (structs) field by field."""
    if v is None:
        return (0,)
    if isinstance(v, float):
        return (1, _float_key(v))
    if isinstance(v, list):
        return (1, tuple(_canon(x) for x in v))
    if isinstance(v, dict):
        return (1, tuple(_canon(x) for x in v.values()))
    return (1, v)


def _model(rows: list[dict[str, Any]], cols: list[str]) -> list[tuple[Any, int]]:
    c: Counter[Any] = Counter()
    for r in rows:
        c[tuple(_canon(r[n]) for n in cols) + (r["t"],)] += r["d"]
    return sorted((k, d) for k, d in c.items() if d != 0)


def _observed(table: pa.Table, cols: list[str]) -> list[tuple[Any, int]]:
    return [(tuple(_canon(r[n]) for n in cols) + (r["t"],), r["d"]) for r in table.to_pylist()]


floats = st.sampled_from([0.0, -0.0, 1.5, -2.25, math.inf, -math.inf, math.nan, 1e300])
small_ints = st.integers(-3, 3)
names = st.sampled_from(["", "a", "b", "ab", "é", "\x00"])


def _check(table: pa.Table, cols: list[str]) -> None:
    _check_once(table, cols)
    # Force the other ranking strategies (hash vs sort) that big tables choose between.
    for estimate in (lambda col: float(len(col)), lambda col: 1.0):
        with (
            mock.patch.object(ranks_mod, "_SAMPLE", 1),
            mock.patch.object(ranks_mod, "_estimated_distinct", estimate),
        ):
            _check_once(table, cols)
    if any(pa.types.is_list(f.type) or pa.types.is_large_list(f.type) for f in table.schema):
        with mock.patch.object(ranks_mod, "_MAX_VECTOR_LIST_LEN", 0):  # the Python path
            _check_once(table, cols)


def _check_once(table: pa.Table, cols: list[str]) -> None:
    rows = table.to_pylist()
    out = consolidate(table)
    assert out.schema == table.schema
    assert _observed(out, cols) == _model(rows, cols)
    assert is_consolidated(out)
    # Idempotent, and independent of the input order.
    # (Compared via the canonical form: Table.equals says NaN != NaN.)
    assert _observed(consolidate(out), cols) == _observed(out, cols)
    if table.num_rows > 1:
        rev = consolidate(table.take(np.arange(table.num_rows)[::-1].copy()))
        assert _observed(rev, cols) == _observed(out, cols)


row_prim = st.fixed_dictionaries(
    {
        "k.id": st.none() | small_ints,
        "k.name": st.none() | names,
        "v.amount": st.none() | floats,
        "v.flag": st.none() | st.booleans(),
        "t": st.integers(0, 3),
        "d": st.integers(-2, 2),
    }
)
PRIM_SCHEMA = pa.schema(
    [
        ("k.id", pa.int64()),
        ("k.name", pa.string()),
        ("v.amount", pa.float64()),
        ("v.flag", pa.bool_()),
        pa.field("t", pa.int64(), False),
        pa.field("d", pa.int64(), False),
    ]
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(row_prim, max_size=60))
def test_consolidate_primitive_matches_counter(rows: list[dict[str, Any]]) -> None:
    _check(pa.Table.from_pylist(rows, schema=PRIM_SCHEMA), ["k.id", "k.name", "v.amount", "v.flag"])


NESTED_SCHEMA = pa.schema(
    [
        ("k.s", pa.struct([("a", pa.int32()), ("f", pa.float32())])),
        ("k.l", pa.list_(pa.int16())),
        ("v.ll", pa.large_list(pa.struct([("x", pa.string()), ("y", pa.float64())]))),
        pa.field("t", pa.int64(), False),
        pa.field("d", pa.int64(), False),
    ]
)
row_nested = st.fixed_dictionaries(
    {
        "k.s": st.none()
        | st.fixed_dictionaries(
            {"a": st.none() | small_ints, "f": st.none() | st.sampled_from([0.0, -0.0, 1.5])}
        ),
        "k.l": st.none() | st.lists(st.none() | small_ints, max_size=3),
        "v.ll": st.none()
        | st.lists(
            st.none() | st.fixed_dictionaries({"x": st.none() | names, "y": st.none() | floats}),
            max_size=2,
        ),
        "t": st.integers(0, 2),
        "d": st.integers(-2, 2),
    }
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(row_nested, max_size=40))
def test_consolidate_nested_matches_counter(rows: list[dict[str, Any]]) -> None:
    _check(pa.Table.from_pylist(rows, schema=NESTED_SCHEMA), ["k.s", "k.l", "v.ll"])


def test_consolidate_many_wide_columns_redensifies() -> None:
    # Five columns of ~5000 distinct values: the combined key would overflow int64.
    rng = np.random.default_rng(7)
    n = 20_000
    cols = {f"k.c{i}": rng.integers(0, 5000, n) for i in range(5)}
    cols["k.c0"][: n // 2] = cols["k.c0"][n // 2 :]  # some exact duplicates
    for i in range(1, 5):
        cols[f"k.c{i}"][: n // 2] = cols[f"k.c{i}"][n // 2 :]
    table = pa.table({**cols, "t": rng.integers(0, 2, n), "d": rng.integers(-1, 2, n)})
    _check(table, [f"k.c{i}" for i in range(5)])


def test_consolidate_big_tables_with_nulls_and_ties() -> None:
    # Big enough for the sampling estimate; a unique-ish leading column with some
    # nulls and ties, then columns that only matter for the tied rows.
    rng = np.random.default_rng(3)
    n = 30_000
    lead = rng.integers(0, 40_000, n).astype(object)
    lead[rng.random(n) < 0.01] = None
    names_ = np.array(["a", "b", None, "c"], dtype=object)[rng.integers(0, 4, n)]
    fl = np.array([0.0, -0.0, math.nan, 1.5], dtype=object)[rng.integers(0, 4, n)]
    table = pa.table(
        {
            "k.id": pa.array(list(lead), pa.int64()),
            "k.name": pa.array(list(names_), pa.string()),
            "v.f": pa.array(list(fl), pa.float64()),
            "t": rng.integers(0, 3, n),
            "d": rng.integers(-1, 2, n),
        }
    )
    _check(table, ["k.id", "k.name", "v.f"])


@pytest.mark.parametrize("lead", ["int", "str"])
def test_consolidate_above_the_split_threshold_matches_counter(lead: str) -> None:
    """At ``PARALLEL_PLAN_ROWS`` rows an integer (null-free: with nulls it is not split)
    or string leading key is split at a sampled median into two key ranges summed on two
    threads: the result is still the Counter model's, with nulls (strings; sorted first),
    many ties on the pivot and cancelling diffs."""
    rng = np.random.default_rng(17)
    n = consolidate_mod.PARALLEL_PLAN_ROWS
    ids = rng.integers(0, 60_000, n).astype(object)
    if lead == "str":
        ids[rng.random(n) < 0.02] = None
    ids[rng.random(n) < 0.05] = 30_000  # a heavy key at about the median
    lead_col = (
        pa.array(list(ids), pa.int64())
        if lead == "int"
        else pa.array([None if i is None else f"u{i:06d}" for i in ids], pa.string())
    )
    table = pa.table(
        {
            "k.id": lead_col,
            "k.tag": pa.array(np.array(["a", "b", None], dtype=object)[rng.integers(0, 3, n)], pa.string()),
            "t": rng.integers(0, 2, n),
            "d": rng.choice([-1, 1, 2], n),
        }
    )
    assert table.num_rows == consolidate_mod.PARALLEL_PLAN_ROWS
    cols = ["k.id", "k.tag", "t"]
    model: Counter[tuple[Any, ...]] = Counter()
    for *key, d in zip(*(table.column(c).to_pylist() for c in [*cols, "d"]), strict=True):
        model[tuple(key)] += d
    out = consolidate(table)
    assert out.schema == table.schema and is_consolidated(out)
    got = list(zip(*(out.column(c).to_pylist() for c in [*cols, "d"]), strict=True))
    assert len({g[:-1] for g in got}) == len(got)
    assert {g[:-1]: g[-1] for g in got} == {k: d for k, d in model.items() if d != 0}


def test_consolidate_all_supported_scalar_types() -> None:
    t = pa.table(
        {
            "k.dec": pa.array(
                [decimal.Decimal("1.10"), None, decimal.Decimal("1.10"), decimal.Decimal("-3")],
                pa.decimal128(6, 2),
            ),
            "k.ts": pa.array([1, None, 1, 2], pa.timestamp("ns", tz="UTC")),
            "k.dt": pa.array(
                [datetime.date(2020, 1, 1), None, datetime.date(2020, 1, 1), None], pa.date32()
            ),
            "k.b": pa.array([b"\x00", None, b"\x00", b""], pa.large_binary()),
            "k.h": pa.array([1.0, None, 1.0, -0.0], pa.float16()),
            "k.fl": pa.array([[1, 2], None, [1, 2], [1, 0]], pa.list_(pa.int8(), 2)),
            "t": pa.array([0, 0, 0, 0]),
            "d": pa.array([1, 1, 2, 1]),
        }
    )
    out = consolidate(t)
    assert out.num_rows == 3
    assert out.column("d").to_pylist() == [1, 1, 3]  # null row, -3 row, merged 1.10 rows


def test_consolidate_empty_and_all_cancelled() -> None:
    e = empty_updates(S)
    assert consolidate(e).num_rows == 0
    t = norm([(((1, "a"), (1.0,)), 0, 1), (((1, "a"), (1.0,)), 0, -1)])
    out = consolidate(t)
    assert out.num_rows == 0 and out.schema == internal_schema(S)


def test_merge_sorted() -> None:
    a = consolidate(norm([(((1, "a"), (1.0,)), 0, 1), (((2, "b"), (1.0,)), 0, 1)]))
    b = consolidate(norm([(((1, "a"), (1.0,)), 0, 2), (((0, "z"), (1.0,)), 1, 1)]))
    m = merge_sorted([a, b])
    assert [(r["k.id"], r["d"]) for r in m.to_pylist()] == [(0, 1), (1, 3), (2, 1)]
    with raises("at least one table"):
        merge_sorted([])


def test_time_helpers() -> None:
    t = norm([(((i, "a"), (1.0,)), i, 1) for i in range(6)])
    snap = snapshot_at(t, 3)
    assert snap.column("t").to_pylist() == [3, 3, 3, 3]
    assert snap.schema == t.schema
    adv = advance_to_since(t, 2)
    assert adv.column("t").to_pylist() == [2, 2, 2, 3, 4, 5] and adv.schema == t.schema
    assert advance_to_since(t, 0) is t
    assert time_range(t, 2, 4).column("t").to_pylist() == [2, 3]
    assert time_range(t, None, 1).column("t").to_pylist() == [0]
    assert time_range(t, 5).column("t").to_pylist() == [5]
    assert forward_and_filter(t, as_of=4, since=1, lower=1).column("t").to_pylist() == [4] * 4
    # Snapshot + consolidate = the accumulated collection at as_of.
    x = norm([(((1, "a"), (1.0,)), 0, 1), (((1, "a"), (1.0,)), 2, -1), (((2, "b"), (1.0,)), 1, 1)])
    assert [(r["k.id"], r["d"]) for r in consolidate(snapshot_at(x, 1)).to_pylist()] == [
        (1, 1),
        (2, 1),
    ]
    assert [(r["k.id"], r["d"]) for r in consolidate(snapshot_at(x, 2)).to_pylist()] == [(2, 1)]
