"""Key-range consolidation from one sort of the leading key (``shard.sorted_ranges``).

The property: whatever the data (random integer keys with many duplicates, multi-column
keys, string values with nulls, several times, retractions that cancel), the slices of
``SortedKeyRanges``, concatenated, are row for row what pyarrow's ``sort_indices`` over
``(k..., v..., t)`` followed by summing equal rows gives — and ``consolidate`` — and
each slice holds leading keys no other slice holds.
"""

from __future__ import annotations

import uuid

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from persist_lib.location.mem import MemBlob
from persist_lib.shard import sorted_ranges
from persist_lib.shard.batch_builder import build_batch
from persist_lib.shard.codec import Schemas, normalize_updates
from persist_lib.shard.consolidate import RangeConsolidation, _break_ties, _int_order, consolidate
from persist_lib.shard.parts import fetch_part
from persist_lib.shard.presorted import cut_points
from persist_lib.shard.sorted_ranges import (
    SampledKeyRanges,
    SortedKeyRanges,
    break_pair_ties,
    cuts_between_runs,
)


def reference(table: pa.Table) -> pa.Table:
    """Arrow's multi-column sort (nulls first), then equal (k, v, t) rows summed, zero
    sums dropped: the consolidation persist must write, computed independently."""
    keys = [c for c in table.column_names if c != "d"]
    idx = pc.sort_indices(table, sort_keys=[(c, "ascending", "at_start") for c in keys])
    s = table.take(idx)
    rows = list(zip(*(s.column(c).to_pylist() for c in keys), strict=True))
    diffs = s.column("d").to_pylist()
    keep: list[int] = []
    sums: list[int] = []
    for i, r in enumerate(rows):
        if i and r == rows[i - 1]:
            sums[-1] += diffs[i]
        else:
            keep.append(i)
            sums.append(diffs[i])
    nz = [j for j, x in enumerate(sums) if x != 0]
    out = s.take(pa.array([keep[j] for j in nz], pa.int64()))
    return out.set_column(out.num_columns - 1, "d", pa.array([sums[j] for j in nz], pa.int64()))


def updates(n: int, distinct: int, *, two_keys: bool, null_rate: float, cancel: bool, seed: int) -> pa.Table:
    rng = np.random.default_rng(seed)
    k = rng.integers(-distinct, distinct, n)
    cols: dict[str, pa.Array] = {"k.id": pa.array(k, pa.int64())}
    if two_keys:
        cols["k.name"] = pa.array([f"n{x}" for x in rng.integers(0, 3, n)], pa.string())
    vals = [None if rng.random() < null_rate else f"v{x}" for x in rng.integers(0, 4, n)]
    cols["v.s"] = pa.array(vals, pa.string())
    cols["t"] = pa.array(rng.integers(0, 3, n), pa.int64())
    cols["d"] = pa.array(rng.choice([1, 1, 2, -1], n), pa.int64())
    t = pa.table(cols)
    if cancel:  # retractions of the first half: rows whose sums are zero
        half = t.slice(0, n // 2)
        neg = half.set_column(half.num_columns - 1, "d", pc.negate(half.column("d")))
        t = pa.concat_tables([t, neg])
    return t


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(2, 3000),
    distinct=st.sampled_from([1, 2, 30, 500, 100_000]),
    two_keys=st.booleans(),
    null_rate=st.sampled_from([0.0, 0.1, 0.6]),
    cancel=st.booleans(),
    k=st.integers(1, 9),
    shared=st.booleans(),
    at=st.sampled_from([None, 0, 7, -(2**63), 2**63 - 1]),
    seed=st.integers(0, 2**32 - 1),
)
def test_slices_concatenate_into_the_reference_consolidation(
    n: int, distinct: int, two_keys: bool, null_rate: float, cancel: bool, k: int, shared: bool,
    at: int | None, seed: int,
) -> None:
    """(``at``: every row at that time, handed to the split as ``time``: the time column
    is then built, not gathered, and left out of the tie-break.) ``SampledKeyRanges``
    gives the same rows as ``RangeConsolidation``, whose ranges they are."""
    t = updates(n, distinct, two_keys=two_keys, null_rate=null_rate, cancel=cancel, seed=seed)
    if at is not None:
        t = t.set_column(t.schema.get_field_index("t"), "t", pa.array(np.full(t.num_rows, at), pa.int64()))
    sampled, old = SampledKeyRanges.split(t, k, shared_source=shared, time=at), RangeConsolidation.split(t, k)
    assert sampled is not None and old is not None and len(sampled) == len(old)
    for i in range(len(old)):
        assert sampled.table(i).equals(old.table(i))
    split = SortedKeyRanges.split(t, k, shared_source=shared, time=at)
    assert split is not None
    assert 1 <= len(split) <= k
    assert sum(split.rows(i) for i in range(len(split))) == t.num_rows
    slices = [split.table(i) for i in range(len(split))]
    got = pa.concat_tables(slices).combine_chunks()
    want = reference(t)
    assert got.equals(want)
    assert got.equals(consolidate(t).combine_chunks())
    assert pa.concat_tables([sampled.table(i) for i in range(len(sampled))]).combine_chunks().equals(want)
    # Disjoint leading-key ranges, in order (an empty slice: everything cancelled there).
    bounds = [(pc.min(s.column(0)).as_py(), pc.max(s.column(0)).as_py()) for s in slices if s.num_rows]
    for (_, hi), (lo, _) in zip(bounds, bounds[1:], strict=False):
        assert hi < lo
    assert split.table(0).equals(slices[0])  # a second call gives the same slice


def test_a_large_chunk_is_cut_evenly_and_gathered_through_the_row_source() -> None:
    t = updates(100_000, 10_000_000, two_keys=False, null_rate=0.1, cancel=False, seed=3)
    split = SortedKeyRanges.split(t, 4)
    assert split is not None and len(split) == 4
    assert all(abs(split.rows(i) - 25_000) <= 1 for i in range(4))
    assert pa.concat_tables([split.table(i) for i in range(4)]).combine_chunks().equals(reference(t))


def test_one_key_cannot_be_cut() -> None:
    t = updates(500, 1, two_keys=True, null_rate=0.2, cancel=False, seed=1).set_column(
        0, "k.id", pa.array(np.full(500, 7), pa.int64())
    )
    split = SortedKeyRanges.split(t, 5)
    assert split is not None and len(split) == 1
    assert split.table(0).equals(reference(t))


@pytest.mark.parametrize(
    "leading",
    [
        pa.array(["b", "a", "c"] * 10),  # strings: RangeConsolidation's
        pa.array([3, None, 1] * 10, pa.int64()),  # nulls
    ],
)
def test_other_leading_columns_are_left_to_range_consolidation(leading: pa.Array) -> None:
    n = len(leading)
    t = pa.table({"k.a": leading, "t": pa.array(np.zeros(n, np.int64)), "d": pa.array(np.ones(n, np.int64))})
    assert SortedKeyRanges.split(t, 3) is None


def test_float_keys_sort_in_persists_total_order() -> None:
    # -0.0 before 0.0, NaN last: ``ranks.comparable``'s order, as ``consolidate``'s.
    lead = pa.array([0.0, float("nan"), -0.0, 1.5, -2.0, float("-inf"), 0.0, float("nan")] * 40)
    n = len(lead)
    t = pa.table({
        "k.a": lead, "v.s": pa.array([f"s{i % 3}" for i in range(n)]),
        "t": pa.array(np.zeros(n, np.int64)), "d": pa.array(np.ones(n, np.int64)),
    })
    split = SortedKeyRanges.split(t, 3)
    assert split is not None and len(split) == 3
    got = pa.concat_tables([split.table(i) for i in range(3)]).combine_chunks()
    want = consolidate(t).combine_chunks()
    # (bit for bit: Arrow's equals never finds NaN equal to NaN)
    assert np.array_equal(got.column(0).to_numpy().view(np.int64), want.column(0).to_numpy().view(np.int64))
    assert got.drop_columns(["k.a"]).equals(want.drop_columns(["k.a"]))


@settings(max_examples=60, deadline=None)
@given(runs=st.lists(st.integers(1, 6), min_size=1, max_size=40), pieces=st.integers(1, 12))
def test_cuts_never_split_a_run_and_match_cut_points(runs: list[int], pieces: int) -> None:
    col = pa.array(np.repeat(np.arange(len(runs)), runs), pa.int64())
    same = np.repeat(np.arange(len(runs)), runs)
    same = same[1:] == same[:-1]
    cuts = cuts_between_runs(same, pieces)
    assert cuts == cut_points(col, pieces)
    assert cuts == sorted(set(cuts))
    assert len(cuts) <= pieces - 1
    for p in cuts:
        assert 0 < p < len(col) and col[p - 1] != col[p]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(3, 2000),
    distinct=st.sampled_from([2, 50, 700, 5000]),
    two_keys=st.booleans(),
    null_rate=st.sampled_from([0.0, 0.3]),
    seed=st.integers(0, 2**32 - 1),
)
def test_pairs_first_orders_ties_as_the_column_by_column_break(
    n: int, distinct: int, two_keys: bool, null_rate: float, seed: int
) -> None:
    """Groups of two, three and more rows tied on the leading key, equal or not on the
    later columns (strings with nulls, a second key column, times): the same
    permutation and the same duplicates as ``consolidate._break_ties``."""
    t = updates(n, distinct, two_keys=two_keys, null_rate=null_rate, cancel=False, seed=seed)
    cols = [t.column(c) for c in t.column_names if c != "d"]
    perm, same = _int_order(t.column(0).to_numpy())
    want = _break_ties(cols, perm.copy(), same.copy(), None)
    got = break_pair_ties(cols, perm.copy(), same.copy(), None)
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])


@pytest.mark.parametrize("chunk_mib", [1, 3])
def test_a_bulk_chunk_is_written_as_the_slices_in_order(chunk_mib: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the batch builder: an integer-keyed chunk cut into 3+ key ranges takes the
    one-sort path, and its parts (fetched and checksum-verified), in order, are
    ``consolidate`` of the chunk row for row; a chunk of two ranges keeps the old path."""
    schemas = Schemas.create(
        pa.schema([("id", pa.int64()), ("name", pa.string())]), pa.schema([("s", pa.string())])
    )
    rng = np.random.default_rng(chunk_mib)
    n = chunk_mib * 24_000
    ids = rng.integers(0, n, n)
    data = normalize_updates(pa.table({
        "id": ids, "name": pa.array(np.char.add("n", (ids % 3).astype(str))),
        "s": pa.array([None if x % 5 == 0 else f"s{x % 4}" for x in rng.integers(0, 100, n)], pa.string()),
        "ts": rng.integers(0, 4, n), "diff": rng.choice(np.array([-1, 1, 2]), n),
    }), schemas, shard="s1")
    calls: list[int] = []
    real = sorted_ranges.SortedKeyRanges.split

    def spy(table: pa.Table, k: int, **kw: bool) -> sorted_ranges.SortedKeyRanges | None:
        calls.append(k)
        return real(table, k, **kw)

    monkeypatch.setattr(sorted_ranges.SortedKeyRanges, "split", staticmethod(spy))
    blob = MemBlob(f"sr-{uuid.uuid4().hex}")
    target = int(data.nbytes / (4 if chunk_mib == 3 else 1.5)) + 1  # 4 ranges, or 2
    batch = build_batch(
        blob, schemas, data, shard="s1", writer="w1", lower=0, upper=10,
        key_range_min_bytes=0, target_part_bytes=target,
    )
    assert calls == ([4] if chunk_mib == 3 else [])
    parts = [fetch_part(blob, p, schemas, "s1") for p in batch.parts]
    assert len(parts) == (4 if chunk_mib == 3 else 2)
    assert all(p.sorted for p in batch.parts)
    assert pa.concat_tables(parts).combine_chunks().equals(consolidate(data).combine_chunks())


def test_a_bulk_commit_builds_its_time_column_and_a_mixed_chunk_gathers_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the batch builder: a chunk whose rows are all at one time hands that time
    to the key ranges (which build the column); a chunk of several times hands none.
    Either way the parts, fetched and checksum-verified, are ``consolidate`` of it."""
    schemas = Schemas.create(pa.schema([("id", pa.int64())]), pa.schema([("s", pa.string())]))
    rng = np.random.default_rng(9)
    n = 30_000
    seen: list[int | None] = []
    real = sorted_ranges.SliceConsolidation.__init__

    def spy(self: sorted_ranges.SliceConsolidation, table: pa.Table, source: object, time: int | None = None) -> None:
        seen.append(time)
        real(self, table, source, time)  # type: ignore[arg-type]

    monkeypatch.setattr(sorted_ranges.SliceConsolidation, "__init__", spy)
    for times, want_time in ((np.full(n, 3), 3), (rng.integers(0, 4, n), None)):
        ids = rng.integers(0, n // 2, n)
        data = normalize_updates(pa.table({
            "id": ids, "s": pa.array([None if x % 5 == 0 else f"s{x % 4}" for x in ids], pa.string()),
            "ts": times, "diff": rng.choice(np.array([-1, 1, 2]), n),
        }), schemas, shard="s1")
        seen.clear()
        blob = MemBlob(f"sr-{uuid.uuid4().hex}")
        batch = build_batch(
            blob, schemas, data, shard="s1", writer="w1", lower=0, upper=10,
            key_range_min_bytes=0, target_part_bytes=int(data.nbytes / 1.5) + 1,
        )
        assert seen == [want_time]
        parts = [fetch_part(blob, p, schemas, "s1") for p in batch.parts]
        assert len(parts) == 2
        assert pa.concat_tables(parts).combine_chunks().equals(consolidate(data).combine_chunks())
