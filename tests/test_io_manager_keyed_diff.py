"""The overwrite's difference by a sort on the key (``keyed_diff``) equals persist's
consolidation of ``-old + new`` exactly: on random keyed tables with nulls, NaNs and
``-0.0`` (in values and in a float key), a two-column key, changed, dropped and added
rows; it declines (``None``) a key repeated on one side and a nested column."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from dagster_project.io_manager.keyed_diff import keyed_difference
from dagster_project.io_manager.write_modes import multiset_difference

FLOATS = [0.0, -0.0, float("nan"), 1.5, None, -2.25]


def _norm(v: Any) -> Any:
    return ("f", v.hex()) if isinstance(v, float) else ("v", repr(v))


def _multiset(t: pa.Table) -> list[tuple[Any, ...]]:
    cols = sorted(t.column_names)
    return sorted(tuple(_norm(r[c]) for c in cols) for r in t.to_pylist())


def _tables(seed: int, float_key: bool) -> tuple[pa.Table, pa.Table, list[str]]:
    rnd = random.Random(seed)
    if float_key:
        keys: list[Any] = [0.0, -0.0, float("nan"), None, 1.0, 2.0, 3.0]
        key = ["k"]
    else:
        keys = [(i, rnd.choice(["a", "b", None])) for i in range(200)]
        keys = list(dict.fromkeys(keys))
        key = ["k", "k2"]

    def side() -> pa.Table:
        chosen = [k for k in keys if rnd.random() < 0.8]
        rows = {
            "v": [rnd.choice(FLOATS) for _ in chosen],
            "s": [rnd.choice(["x", "y", None]) for _ in chosen],
        }
        if float_key:
            cols = {"k": pa.array(chosen, pa.float64())}
        else:
            cols = {"k": pa.array([k[0] for k in chosen], pa.int64()), "k2": pa.array([k[1] for k in chosen], pa.string())}
        return pa.table({**cols, "v": pa.array(rows["v"], pa.float64()), "s": pa.array(rows["s"], pa.string())})

    old = side()
    new = side()
    return old, new, key


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("float_key", [False, True])
def test_keyed_difference_equals_consolidation(seed: int, float_key: bool) -> None:
    old, new, key = _tables(seed, float_key)
    want = multiset_difference(old, new)  # persist's consolidation (no key: the general path)
    got = keyed_difference(old, new, key)
    assert got is not None
    assert got.column_names == [*old.column_names, "diff"]
    assert _multiset(got) == _multiset(want)
    assert multiset_difference(old, new, key).num_rows == want.num_rows  # the keyed path is taken


def test_unchanged_rows_are_not_updates() -> None:
    old = pa.table({"id": np.arange(1000, dtype=np.int64), "x": np.arange(1000, dtype=np.float64)})
    x = np.arange(1000, dtype=np.float64)
    x[7] = -1.0
    new = pa.table({"id": np.arange(1, 1001, dtype=np.int64), "x": np.append(x[1:], 5.0)})
    got = keyed_difference(old, new, ["id"])
    assert got is not None
    assert sorted(got.to_pylist(), key=lambda r: (r["id"], r["diff"])) == [
        {"id": 0, "x": 0.0, "diff": -1}, {"id": 7, "x": 7.0, "diff": -1}, {"id": 7, "x": -1.0, "diff": 1},
        {"id": 1000, "x": 5.0, "diff": 1},
    ]


def test_declines_repeated_keys_and_nested_columns() -> None:
    t = pa.table({"id": [1, 2], "x": ["a", "b"]})
    dup = pa.table({"id": [1, 1], "x": ["a", "c"]})
    assert keyed_difference(t, dup, ["id"]) is None
    assert keyed_difference(dup, t, ["id"]) is None
    want = multiset_difference(t, dup)
    assert _multiset(multiset_difference(t, dup, ["id"])) == _multiset(want)  # falls back, same result
    nested = pa.table({"id": [1], "l": pa.array([[1, 2]], pa.list_(pa.int64()))})
    assert keyed_difference(nested, nested, ["id"]) is None


def test_float_keys_zero_and_negative_zero_are_different_keys() -> None:
    """0.0 and -0.0 sort as equals but are different keys: each still cancels its own
    unchanged row."""
    old = pa.table({"k": pa.array([0.0, -0.0, float("nan")]), "v": ["a", "b", "c"]})
    new = pa.table({"k": pa.array([-0.0, 0.0, float("nan")]), "v": ["b", "a", "c"]})
    got = keyed_difference(old, new, ["k"])
    assert got is not None and got.num_rows == 0, got.to_pylist()
