"""Bulk chunks that arrive sorted (issue 28): the writer recognises them in linear time and
cuts them into key-range parts where they lie, without sorting or gathering them.

The property: a sorted chunk (duplicates, null keys, retractions that cancel, several
key types) reads back at every as-of what the same updates written the old way
(unsorted bulk parts) read back, its parts are sorted and hold disjoint leading-key
ranges; a chunk that only looks sorted (a probe misses its one inversion) or is sorted
on its key alone still goes through the sort.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_key_range_parts import (
    KEY_TYPES,
    VAL,
    as_counter,
    assert_disjoint_parts_read_as_one_run,
    client,
    model,
    table_of,
    write_batches,
)

from persist_lib.shard import consolidate as consolidate_mod
from persist_lib.shard import sorted_ranges as sorted_ranges_mod
from persist_lib.shard.codec import Schemas, normalize_checked
from persist_lib.shard.consolidate import consolidate
from persist_lib.shard.disjoint_runs import chain_disjoint_runs
from persist_lib.shard.presorted import (
    PROBE_PAIRS,
    consolidate_presorted,
    cut_points,
    is_presorted,
    probably_sorted,
)
from persist_lib.shard.runs import batch_runs

SORTABLE = ["int", "str", "bin", "ts"]


def _order_key(kind: str, row: tuple[int | None, int, int, int]) -> tuple[Any, ...]:
    """persist's order of ``table_of``'s rows: (k, v, n, t), nulls first."""
    x, v, t, _ = row
    k = None if x is None else table_of(kind, [row]).column("k")[0].as_py()
    return (k is not None, k if k is not None else 0, f"v{v % 5}", v % 3, t)


def _sorted_rows(kind: str, rows: list[tuple[int | None, int, int, int]]) -> list[tuple[int | None, int, int, int]]:
    return sorted(rows, key=lambda r: _order_key(kind, r))


@pytest.fixture
def no_sort(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the chunks the writer sorted into key ranges (``SortedKeyRanges.split``
    for integer leading keys in 3+ ranges, else ``SampledKeyRanges.split``)."""
    calls: list[int] = []
    for cls in (
        consolidate_mod.RangeConsolidation, sorted_ranges_mod.SampledKeyRanges, sorted_ranges_mod.SortedKeyRanges
    ):
        real = cls.split

        def counting(table: pa.Table, k: int, real: Any = real, **kw: Any) -> Any:
            out = real(table, k, **kw)
            if out is not None:
                calls.append(table.num_rows)
            return out

        monkeypatch.setattr(cls, "split", staticmethod(counting))
    return calls


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(
    kind=st.sampled_from(SORTABLE),
    n=st.integers(2, 700),
    distinct=st.sampled_from([1, 3, 40, 250]),
    null_rate=st.sampled_from([0.0, 0.05, 0.5]),
    cancel=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_sorted_chunks_read_back_as_the_old_path(
    no_sort: list[int], kind: str, n: int, distinct: int, null_rate: float, cancel: bool, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    rows: list[tuple[int | None, int, int, int]] = [
        (None if rng.random() < null_rate else int(x), int(rng.integers(0, 10)), int(rng.integers(0, 2)),
         int(rng.choice([1, 1, 2, -1])))
        for x in rng.integers(0, distinct, n)
    ]
    if cancel:  # each retraction next to its insert once sorted: sums of zero
        rows += [(x, v, t, -d) for x, v, t, d in rows[: n // 2]]
    table = table_of(kind, _sorted_rows(kind, rows))
    new, old = client(key_ranges=True, target=2 << 10), client(key_ranges=False, target=2 << 10)
    no_sort.clear()
    _, r_new, (b,) = write_batches(new, kind, [table])
    assert no_sort == []  # sorted: cut where it lay, never sorted
    _, r_old, _ = write_batches(old, kind, [table])
    assert all(p.sorted for p in b.parts)
    sums: Counter[tuple[int | None, int, int]] = Counter()
    for x, v, t, d in rows:
        sums[(x, v, t)] += d
    # Consolidated parts: one row per (k, v, t) with a nonzero sum, none repeated.
    assert sum(p.count for p in b.parts) == sum(1 for d in sums.values() if d)
    if len(b.parts) > 1:
        assert len(chain_disjoint_runs(batch_runs(b), Schemas(KEY_TYPES[kind], VAL))) == 1
    for as_of in range(2):
        want = model([table], as_of)
        assert as_counter(r_old.snapshot(as_of)) == want
        assert as_counter(r_new.snapshot(as_of)) == want


def test_a_large_sorted_chunk_is_cut_into_disjoint_parts_without_a_sort(no_sort: list[int]) -> None:
    c = client(key_ranges=True)
    n = 30_000
    keys = np.sort(np.random.default_rng(1).integers(0, 3_000, n))  # runs of equal keys
    t = pa.table({
        "k": pa.array(keys), "v": pa.array([f"v{i % 7}" for i in range(n)]),
        "n": pa.array(np.zeros(n, dtype=np.int64)), "ts": pa.array(np.zeros(n, dtype=np.int64)),
        "diff": pa.array(np.ones(n, dtype=np.int64)),
    })
    t = t.sort_by([("k", "ascending"), ("v", "ascending")])
    w, r, (b,) = write_batches(c, "int", [t])
    assert no_sort == []
    assert_disjoint_parts_read_as_one_run(b, r, t, min_parts=8)


def test_an_unsorted_chunk_is_still_sorted(no_sort: list[int]) -> None:
    c = client(key_ranges=True)
    t = table_of("int", [(int(x), 1, 0, 1) for x in np.random.default_rng(2).integers(0, 500, 3_000)])
    _, r, (b,) = write_batches(c, "int", [t])
    assert no_sort == [3_000]
    assert as_counter(r.snapshot(0)) == model([t], 0)


def test_one_inversion_the_probe_misses_goes_through_the_sort(no_sort: list[int]) -> None:
    """Sorted but for two neighbouring rows where the probe doesn't look: the full
    check catches it and the chunk is sorted, not written out of order."""
    n = 40 * PROBE_PAIRS
    keys = np.arange(n, dtype=np.int64)
    probed = set(range(PROBE_PAIRS)) | set(np.random.default_rng(0).integers(0, n - 1, PROBE_PAIRS).tolist())
    i = next(i for i in range(n // 2, n - 1) if i not in probed)
    keys[i], keys[i + 1] = keys[i + 1], keys[i]
    rows = [(int(x), 1, 0, 1) for x in keys]
    t = table_of("int", rows)
    schemas = Schemas(KEY_TYPES["int"], VAL)
    internal = normalize_checked(t, schemas, shard="s").table
    assert probably_sorted(internal.column(0))  # the probe misses it...
    assert not is_presorted(internal)  # ...the full check does not
    c = client(key_ranges=True)
    _, r, (b,) = write_batches(c, "int", [t])
    assert no_sort == [n]
    assert as_counter(r.snapshot(0)) == model([t], 0)


def test_sorted_on_the_key_alone_goes_through_the_sort(no_sort: list[int]) -> None:
    """Leading keys ascending, values within a key descending: not sorted by (k, v, t)."""
    rows = [(k, v, 0, 1) for k in range(300) for v in (4, 3, 2, 1)]
    t = table_of("int", rows)
    c = client(key_ranges=True)
    _, r, (b,) = write_batches(c, "int", [t])
    assert no_sort == [len(rows)]
    assert as_counter(r.snapshot(0)) == model([t], 0)


@pytest.mark.parametrize("pieces", [2, 3, 4, 7, 50])
def test_cut_points_never_split_a_run_of_one_value(pieces: int) -> None:
    col = pa.chunked_array([pa.array([None] * 5 + [0] * 600 + [1] * 10 + [2] * 400 + [3], pa.int64())])
    cuts = cut_points(col, pieces)
    values = col.to_pylist()
    assert cuts == sorted(set(cuts)) and all(0 < p < len(values) for p in cuts)
    assert all(values[p - 1] != values[p] for p in cuts)
    assert len(cuts) <= pieces - 1
    assert cut_points(pa.chunked_array([pa.array([7] * 100)]), pieces) == []


def test_presorted_consolidation_sums_equal_neighbours() -> None:
    schemas = Schemas(KEY_TYPES["str"], VAL)
    rows = _sorted_rows("str", [(1, 1, 0, 1), (1, 1, 0, 2), (2, 1, 0, 1), (2, 1, 0, -1), (None, 3, 0, 5), (3, 2, 1, 1)])
    internal = normalize_checked(table_of("str", rows), schemas, shard="s").table
    assert is_presorted(internal)
    assert consolidate_presorted(internal).equals(consolidate(internal))
