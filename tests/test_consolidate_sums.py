"""Consolidation's diff sums against a model, for the insert-only case (every diff 1,
which ``consolidate._summed`` sums by run length) and for mixed diffs."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pyarrow as pa
import pytest

from persist_lib.shard.consolidate import RangeConsolidation, consolidate


def _updates(n: int, distinct: int, diffs: np.ndarray) -> pa.Table:
    rng = np.random.default_rng(distinct)
    keys = rng.integers(0, distinct, n)
    return pa.table({
        "k.k": pa.array(keys),
        "v.s": pa.array([f"s{x % 3}" for x in keys]),
        "t": pa.array(rng.integers(0, 2, n)),
        "d": pa.array(diffs),
    })


def _model(t: pa.Table) -> Counter[tuple[object, ...]]:
    c: Counter[tuple[object, ...]] = Counter()
    for k, s, ts, d in zip(*(t.column(i).to_pylist() for i in range(4)), strict=True):
        c[(k, s, ts)] += d
    return Counter({k: d for k, d in c.items() if d})


@pytest.mark.parametrize("diffs", ["ones", "mixed"])
@pytest.mark.parametrize("n", [1_000, 50_000])  # the second: the RowSource and key-range paths
def test_consolidation_sums_duplicates(diffs: str, n: int) -> None:
    d = np.ones(n, dtype=np.int64) if diffs == "ones" else np.random.default_rng(1).choice([1, -1, 2], n)
    t = _updates(n, max(10, n // 20), d)  # ~20 copies of each row
    want = _model(t)
    split = RangeConsolidation.split(t, 3)
    assert split is not None
    for got in (consolidate(t), pa.concat_tables([split.table(i) for i in range(len(split))])):
        rows = list(zip(*(got.column(i).to_pylist() for i in range(4)), strict=True))
        assert Counter({(k, s, ts): dd for k, s, ts, dd in rows}) == want
        assert len(rows) == len(want)  # one row per distinct (k, v, t)
