"""Key-range consolidation of a bulk chunk from ONE sort of its leading key.

A writer that turns a large chunk into sorted parts of disjoint leading-key ranges
(``batch_builder``, ``key_range_min_bytes``) used to cut the chunk first, at sampled
quantiles of its leading key (``consolidate.split_key_ranges``: a search of every row
among the pivots, then a stable sort of the rows by range id), and then sort each
range's rows by the leading key again on its upload thread. For an integer leading key
(the common case) the two passes cost about three times one sort: numpy sorts the keys
packed with their row ids (``consolidate._int_order``) in ~45 ms per 4M rows on the
2-core box, where the cut alone took ~100 ms of CPU.

``SortedKeyRanges`` sorts the whole chunk's leading key once, packed with the row ids,
and cuts that order into ``k`` contiguous slices of about equal rows, each cut between
two different leading keys (never inside a run of one key, so equal rows always fall in
one slice). Each slice is then ordered by the later columns within its ties, summed and
gathered on its own thread (``table(i)``), exactly as a range of
``consolidate.RangeConsolidation`` is: the packed sort orders equal leading keys by row
id, as the per-range sort did, so the slices, concatenated, are ``consolidate(table)``
row for row. Only the places of the cuts differ (exact quantiles instead of sampled
ones). Leading columns that are not plain integers (strings, nulls, nested types) keep
``RangeConsolidation``.

Ties of the leading key are mostly pairs (random keys: two rows of one key, an update
and its retraction). ``break_pair_ties`` orders every such pair by all the later columns
at once — one comparison per column, only of the pairs still equal — before the
column-by-column tie-break (``consolidate._break_ties``) orders the larger groups: the
same order, without a pass over the whole slice per column.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from persist_lib.shard.codec import D_COL, T_COL
from persist_lib.shard.consolidate import (
    KeyRanges,
    TakeFn,
    _break_ties,
    _flat_int_values,
    _int_order,
    _key_columns,
    _pair_order,
    _sort_inputs,
    _summed,
    gather_updates,
    split_key_ranges,
)
from persist_lib.shard.kernels import MIN_POLARS_ROWS, RowSource
from persist_lib.shard.ranks import as_chunked, is_flat_comparable


def cuts_between_runs(same: np.ndarray, pieces: int) -> list[int]:
    """Positions cutting ``len(same) + 1`` sorted rows into up to ``pieces`` slices of
    about equal rows, each cut between two rows that differ (``same[i]``: rows ``i`` and
    ``i + 1`` are equal, so no cut at ``i + 1``): ascending, each in ``(0, n)``."""
    n = len(same) + 1
    if n < 2 or pieces < 2:
        return []
    candidates = np.flatnonzero(~same) + 1  # a cut before row p keeps equal rows whole
    if not len(candidates):
        return []
    targets = np.arange(1, pieces, dtype=np.int64) * n // pieces
    at = np.searchsorted(candidates, targets, side="left")
    return [int(p) for p in np.unique(candidates[at[at < len(candidates)]])]


def gather_at(
    source: pa.Table | RowSource, rows: np.ndarray, diffs: np.ndarray, time: int | None
) -> pa.Table:
    """``gather_updates(source, rows, diffs)``; with ``time`` (every row of ``source`` is
    at that time) the time column is built, not gathered."""
    if time is None or not isinstance(source, RowSource):
        return gather_updates(source, rows, diffs)
    schema = source.table.schema
    ti, di = schema.get_field_index(T_COL), schema.get_field_index(D_COL)
    cols = [
        pa.array(diffs, pa.int64()) if i == di
        else pa.array(np.full(len(rows), time, dtype=np.int64)) if i == ti
        else source.take_column(i, rows)
        for i in range(len(schema))
    ]
    return pa.Table.from_arrays(cols, schema=schema)


class SliceConsolidation:
    """Consolidates sets of a table's rows that come sorted by its leading key (a slice of
    its order, or one key range's rows), each e.g. on its own thread: the later columns
    order the ties (``break_pair_ties``), equal rows are summed, and the rows gathered.
    ``time``: every row of the table is at that time (a bulk commit's chunk), so the
    time column orders nothing and ties nothing apart: it is left out of the tie-break
    and built, not gathered."""

    def __init__(self, table: pa.Table, source: RowSource | None, time: int | None = None) -> None:
        """``source``: a ``RowSource`` of ``table`` to gather from (prepared here, before
        threads share it)."""
        cols, self._take, self._d = _sort_inputs(table, source)
        self._cols = cols[:-1] if time is not None else cols  # (t is the last sort column)
        self._time = time
        self._gather_from: pa.Table | RowSource = table
        if source is not None:
            self._gather_from = source
            for i in range(table.num_columns):
                source.prepare(i)

    def consolidated(self, perm: np.ndarray, same: np.ndarray) -> pa.Table:
        """The rows ``perm`` (row ids sorted by the leading key; ``same``: which
        neighbours tie on it; reordered in place) sorted by ``(k, v, t)``, equal rows
        summed, zero sums dropped, gathered."""
        order, dup = break_pair_ties(self._cols, perm, same, self._take)
        rows, diffs = _summed(order, dup, self._d)
        return gather_at(self._gather_from, rows, diffs, self._time)


class SampledKeyRanges(SliceConsolidation):
    """``consolidate.RangeConsolidation`` (the chunk cut at sampled quantiles of its
    leading key, ``split_key_ranges``; each range sorted by it on its own thread) with
    ``SliceConsolidation``'s tie-break and constant time: the same rows in the same
    order. For chunks of one or two ranges, where one sort of the whole leading key
    (``SortedKeyRanges``) saves nothing."""

    def __init__(self, table: pa.Table, ranges: KeyRanges, source: RowSource | None, time: int | None) -> None:
        super().__init__(table, source, time)
        self._ranges = ranges

    @classmethod
    def split(
        cls, table: pa.Table, k: int, *, shared_source: bool = True, time: int | None = None
    ) -> SampledKeyRanges | None:
        """``table`` cut into up to ``k`` key ranges; None when its leading column can't
        be (``split_key_ranges``). ``shared_source``: as ``RangeConsolidation.split``;
        ``time``: as ``SliceConsolidation``."""
        _key_columns(table)
        ranges = split_key_ranges(table.column(0), k) if table.num_rows else None
        if ranges is None:
            return None
        source = RowSource(table) if shared_source and table.num_rows >= MIN_POLARS_ROWS else None
        return cls(table, ranges, source, time)

    def __len__(self) -> int:
        return len(self._ranges.rows)

    def rows(self, i: int) -> int:
        """How many input rows range ``i`` holds."""
        return len(self._ranges.rows[i])

    def table(self, i: int) -> pa.Table:
        """Range ``i``'s rows sorted by ``(k, v, t)``, equal rows summed, zeros dropped."""
        return self.consolidated(*self._ranges.order(self._ranges.rows[i]))


class SortedKeyRanges(SliceConsolidation):
    """``consolidate`` of an update table in contiguous slices of its order by the
    leading key (module docstring): ``table(i)`` is slice ``i`` sorted by ``(k, v, t)``,
    equal rows summed and zero sums dropped; the slices, in order, concatenate into
    ``consolidate(table)`` and hold disjoint leading-key ranges."""

    def __init__(
        self, table: pa.Table, perm: np.ndarray, same: np.ndarray, bounds: list[int], source: RowSource | None,
        time: int | None = None,
    ) -> None:
        """``perm``/``same``: the table's order by its leading key (``_int_order``);
        ``bounds``: the slices' first rows in that order, then ``n``; ``source``,
        ``time``: as ``SliceConsolidation``."""
        super().__init__(table, source, time)
        self._order = (perm, same, bounds)

    @classmethod
    def split(
        cls, table: pa.Table, k: int, *, shared_source: bool = True, time: int | None = None
    ) -> SortedKeyRanges | None:
        """``table`` sorted by its leading key and cut into up to ``k`` slices; None when
        the leading column is not plain integers without nulls (``SampledKeyRanges``
        handles those) or the table has fewer than two rows. ``shared_source``: gather
        through a ``RowSource`` (as ``RangeConsolidation.split``); ``time``: as
        ``SliceConsolidation``."""
        _key_columns(table)
        n = table.num_rows
        if n < 2 or k < 1:
            return None
        vals = _flat_int_values(as_chunked(table.column(0)))
        if vals is None:
            return None
        perm, same = _int_order(vals)
        bounds = [0, *cuts_between_runs(same, k), n]
        source = RowSource(table) if shared_source and n >= MIN_POLARS_ROWS else None
        return cls(table, perm, same, bounds, source, time)

    def __len__(self) -> int:
        return len(self._order[2]) - 1

    def rows(self, i: int) -> int:
        """How many input rows slice ``i`` holds."""
        bounds = self._order[2]
        return bounds[i + 1] - bounds[i]

    def table(self, i: int) -> pa.Table:
        """Slice ``i``'s rows sorted by ``(k, v, t)``, equal rows summed, zeros dropped."""
        perm, same, bounds = self._order
        lo, hi = bounds[i], bounds[i + 1]
        # (a copy: the tie-break reorders it in place, and a second call starts afresh)
        return self.consolidated(perm[lo:hi].copy(), same[lo : hi - 1])


def break_pair_ties(
    columns: list[pa.ChunkedArray], perm: np.ndarray, same: np.ndarray, take: TakeFn | None
) -> tuple[np.ndarray, np.ndarray]:
    """``consolidate._break_ties`` (same arguments, same result: ``perm`` reordered in
    place within its ties, and ``dup``) with the groups of exactly two rows tied on the
    leading column ordered first, by all later columns at once (module docstring)."""
    n = len(perm)
    if n < 3 or len(columns) < 2 or not all(is_flat_comparable(c.type) for c in columns[1:]):
        return _break_ties(columns, perm, same, take)
    alone = np.ones(n - 1, dtype=bool)  # same[i] with neither neighbour tie also set
    alone[1:] &= ~same[:-1]
    alone[:-1] &= ~same[1:]
    i0 = np.flatnonzero(same & alone)  # the pairs (i0, i0 + 1) of sorted positions
    if not len(i0):
        return _break_ties(columns, perm, same, take)
    r0, r1 = perm[i0], perm[i0 + 1]
    swap = np.zeros(len(i0), dtype=bool)
    open_ = np.arange(len(i0))  # pairs equal on every column compared so far
    for ci in range(1, len(columns)):
        a0, a1 = r0[open_], r1[open_]
        if take is not None:
            first, second = take(ci, a0), take(ci, a1)
        else:
            first, second = columns[ci].take(pa.array(a0)), columns[ci].take(pa.array(a1))
        lt, eq = _pair_order(first, second)
        swap[open_[lt]] = True
        open_ = open_[eq]
        if not len(open_):
            break
    perm[i0] = np.where(swap, r1, r0)
    perm[i0 + 1] = np.where(swap, r0, r1)
    rest = same.copy()
    rest[i0] = False  # the pairs are ordered: the rest of the ties by column
    perm, dup = _break_ties(columns, perm, rest, take)
    dup[i0[open_] + 1] = True  # pairs equal on every column: consolidation sums them
    return perm, dup
