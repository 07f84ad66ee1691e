"""``sorted_as_of.consolidate_sorted_at``: one copy for a sorted part read at an as-of
(issue 28), equal to ``consolidate_sorted(snapshot_at(...))`` on every input, and
``sorted_ties(rows=...)`` equal to ``sorted_ties`` of the columns taken at ``rows``."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from persist_lib.shard.consolidate import consolidate_sorted
from persist_lib.shard.sorted_as_of import consolidate_sorted_at
from persist_lib.shard.sorted_checks import sorted_ties
from persist_lib.shard.time_filters import snapshot_at


def _table(rows: list[tuple[Any, Any, int, int]], key_type: pa.DataType = pa.int64()) -> pa.Table:
    """An internal-layout update table of ``(key, value, t, d)`` rows, sorted by
    ``(k, v, t)`` (nulls first) as a sorted run is."""
    rows = sorted(rows, key=lambda r: ((r[0] is not None, r[0]), (r[1] is not None, r[1] or ""), r[2]))
    k, v, t, d = zip(*rows, strict=True) if rows else ((), (), (), ())
    return pa.table({
        "k.key": pa.array(k, key_type), "v.value": pa.array(v, pa.string()),
        "t": pa.array(t, pa.int64()), "d": pa.array(d, pa.int64()),
    })


@st.composite
def _sorted_parts(draw: Any) -> tuple[pa.Table, int]:
    n = draw(st.integers(0, 60))
    keys = st.one_of(st.none(), st.integers(-3, 5)) if draw(st.booleans()) else st.integers(-3, 5)
    rows = [
        (draw(keys), draw(st.one_of(st.none(), st.sampled_from(["a", "b", "é"]))),
         draw(st.integers(0, 5)), draw(st.integers(-2, 2)))
        for _ in range(n)
    ]
    return _table(rows), draw(st.integers(-1, 6))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_sorted_parts())
def test_one_copy_equals_forward_then_consolidate(case: tuple[pa.Table, int]) -> None:
    table, as_of = case
    want = consolidate_sorted(snapshot_at(table, as_of))
    got = consolidate_sorted_at(table, as_of)
    assert want is not None and got is not None
    assert got.equals(want), (got.to_pylist(), want.to_pylist())
    if table.num_rows and max(table.column("t").to_pylist()) <= as_of:  # a latest read's hint
        hinted = consolidate_sorted_at(table, as_of, all_at_or_before=True)
        assert hinted is not None and hinted.equals(want)


def test_the_layer_case_drops_later_history_and_sums_the_rest() -> None:
    # A (k, v)-whole layer: each key with its later updates; as of 1 the updates at 2
    # and 3 go, key 1's two updates at or before 1 sum, key 4's cancel.
    rows = [(1, "a", 0, 1), (1, "a", 1, 1), (1, "a", 3, 5), (2, "b", 0, 1), (2, "b", 2, -1),
            (3, "c", 2, 1), (4, "d", 0, 1), (4, "d", 1, -1), (5, "e", 1, 2)]
    got = consolidate_sorted_at(_table(rows), 1)
    assert got is not None
    assert got.to_pylist() == [
        {"k.key": 1, "v.value": "a", "t": 1, "d": 2},
        {"k.key": 2, "v.value": "b", "t": 1, "d": 1},
        {"k.key": 5, "v.value": "e", "t": 1, "d": 2},
    ]


@pytest.mark.parametrize(("swap", "what"), [(0, "keys"), (4, "values under one key")])
def test_kept_rows_out_of_order_are_reported(swap: int, what: str) -> None:
    # Rows at or before the as-of out of (k, v) order (a faulty writer): None, so the
    # reader reads the run another way, never a wrongly consolidated table.
    t = _table([(1, "a", 0, 1), (2, "a", 0, 1), (3, "a", 5, 1), (4, "a", 0, 1), (4, "b", 0, 1), (5, "a", 0, 1)])
    rows = t.to_pylist()
    rows[swap], rows[swap + 1] = rows[swap + 1], rows[swap]
    assert consolidate_sorted_at(pa.Table.from_pylist(rows, schema=t.schema), 1) is None, what


def test_string_keys_take_the_two_step_path() -> None:
    t = _table([("x", "a", 0, 1), ("x", "a", 1, 1), ("y", "a", 3, 1)], key_type=pa.string())
    got = consolidate_sorted_at(t, 1)
    assert got is not None
    assert got.to_pylist() == [{"k.key": "x", "v.value": "a", "t": 1, "d": 2}]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.sampled_from(["a", "b", None])), max_size=40), st.data())
def test_sorted_ties_at_rows_equals_ties_of_the_taken_rows(pairs: list[tuple[int, Any]], data: Any) -> None:
    cols = [pa.array([p[0] for p in pairs], pa.int64()), pa.array([p[1] for p in pairs], pa.string())]
    rows = np.array(sorted(data.draw(st.sets(st.integers(0, max(len(pairs) - 1, 0)))) if pairs else []), dtype=np.int64)
    taken = [c.take(pa.array(rows, pa.int64())) for c in cols]
    want = sorted_ties(taken)
    got = sorted_ties(cols, rows)
    assert (want is None) == (got is None)
    if want is not None and got is not None:
        assert want.tolist() == got.tolist()
