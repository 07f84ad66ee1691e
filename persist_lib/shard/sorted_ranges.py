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

from persist_lib.shard.consolidate import (
    TakeFn,
    _break_ties,
    _flat_int_values,
    _int_order,
    _key_columns,
    _pair_order,
    _sort_inputs,
    _summed,
    gather_updates,
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


class SortedKeyRanges:
    """``consolidate`` of an update table in contiguous slices of its order by the
    leading key (module docstring): ``table(i)`` is slice ``i`` sorted by ``(k, v, t)``,
    equal rows summed and zero sums dropped; the slices, in order, concatenate into
    ``consolidate(table)`` and hold disjoint leading-key ranges."""

    def __init__(
        self, table: pa.Table, perm: np.ndarray, same: np.ndarray, bounds: list[int], source: RowSource | None
    ) -> None:
        """``perm``/``same``: the table's order by its leading key (``_int_order``);
        ``bounds``: the slices' first rows in that order, then ``n``; ``source``: a
        ``RowSource`` of ``table`` to gather from (prepared here, before threads share it)."""
        self._order = (perm, same, bounds)
        self._cols, self._take, self._d = _sort_inputs(table, source)
        self._gather_from: pa.Table | RowSource = table
        if source is not None:
            self._gather_from = source
            for i in range(table.num_columns):
                source.prepare(i)

    @classmethod
    def split(cls, table: pa.Table, k: int, *, shared_source: bool = True) -> SortedKeyRanges | None:
        """``table`` sorted by its leading key and cut into up to ``k`` slices; None when
        the leading column is not plain integers without nulls (``RangeConsolidation``
        handles those) or the table has fewer than two rows. ``shared_source``: gather
        through a ``RowSource`` (as ``RangeConsolidation.split``)."""
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
        return cls(table, perm, same, bounds, source)

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
        order, dup = break_pair_ties(self._cols, perm[lo:hi].copy(), same[lo : hi - 1], self._take)
        rows, diffs = _summed(order, dup, self._d)
        return gather_updates(self._gather_from, rows, diffs)


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
