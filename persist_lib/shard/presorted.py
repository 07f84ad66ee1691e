"""Bulk chunks that arrive already sorted: recognised in linear time, written without a sort.

A writer that cuts a large chunk into sorted key-range parts (``batch_builder``,
``key_range_min_bytes``) sorts it by ``(k, v, t)`` and gathers every column into that
order: for an unsorted chunk that is most of the writer's CPU beyond the Parquet
encode. Many bulk loads come sorted already (a table exported in key order, a Spark job
that sorted its output, an ingest replaying a sorted source). For those the sort and
the gather are pure cost: the chunk is its own sorted order.

``is_presorted`` finds out cheaply. A probe of a few thousand neighbouring pairs of
the leading key rejects an unsorted chunk at once (random data fails on the first
pairs); a chunk that passes is checked in full, linearly. ``cut_points`` then cuts it
into contiguous slices at leading-key changes, never inside a run of one leading key,
so the slices hold disjoint leading-key ranges, and equal rows (equal leading keys
first) always fall in one slice: each slice is consolidated on its own, on its upload
thread, where it lies (``consolidate_presorted``: equal neighbours summed, zeros
dropped, no row moved). The parts are exactly those the sorting path would write,
without its sort and gather.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from persist_lib.errors import InvalidUsage
from persist_lib.shard.codec import D_COL, T_COL
from persist_lib.shard.consolidate import consolidate, consolidate_sorted
from persist_lib.shard.ranks import as_chunked, comparable
from persist_lib.shard.sorted_checks import linear_kernels_apply, sorted_ties
from persist_lib.shard.sorted_ranges import cuts_between_runs

# Neighbouring pairs of the leading key the probe compares: the first ones, and as many
# at random places (a fixed seed: deterministic).
PROBE_PAIRS = 2048


def _descends(col: pa.ChunkedArray, at: np.ndarray) -> bool:
    """Whether some row ``i`` in ``at`` sorts after row ``i + 1`` (persist's order:
    ``comparable``, nulls first)."""
    c = comparable(col)
    a, b = c.take(pa.array(at)), c.take(pa.array(at + 1))
    gt = pc.fill_null(pc.greater(a, b), False)
    if c.null_count:  # a value before a null: nulls sort first
        gt = pc.or_(gt, pc.and_(pc.is_valid(a), pc.is_null(b)))
    return bool(pc.any(gt).as_py())


def probably_sorted(col: pa.Array | pa.ChunkedArray) -> bool:
    """False when a probe of the leading key finds two neighbours out of order (the
    chunk is certainly unsorted); True when the probe finds none (it may be sorted:
    only a full check says)."""
    col = as_chunked(col)
    n = len(col)
    if n < 2:
        return True
    head = np.arange(min(n - 1, PROBE_PAIRS), dtype=np.int64)
    spread = np.random.default_rng(0).integers(0, n - 1, min(n - 1, PROBE_PAIRS))
    return not _descends(col, np.concatenate([head, spread]))


def is_presorted(table: pa.Table) -> bool:
    """Whether ``table`` (an update table, internal layout) is already sorted by
    ``(k, v, t)`` (equal rows allowed), checked in linear time: False when it is not,
    or when its columns need the ranking path to be compared (nested types)."""
    names = [c for c in table.column_names if c not in (T_COL, D_COL)] + [T_COL]
    if table.num_rows < 2 or not names[:-1]:
        return False
    if not linear_kernels_apply(table.column(c).type for c in names):
        return False
    if not probably_sorted(table.column(0)):
        return False
    return sorted_ties([table.column(c) for c in names]) is not None


def consolidate_presorted(table: pa.Table) -> pa.Table:
    """``consolidate(table)`` for a slice of a chunk ``is_presorted`` accepted: equal
    neighbours summed and zero sums dropped where they lie, no row moved (the slice
    itself when there is nothing to sum)."""
    out = consolidate_sorted(table)
    return consolidate(table) if out is None else out  # (None: not sorted after all)


def cut_points(col: pa.Array | pa.ChunkedArray, pieces: int) -> list[int]:
    """Row positions cutting a column sorted in persist's order into up to ``pieces``
    slices of about equal rows, each cut between two different values (so no value
    spans two slices): ascending, each in ``(0, len(col))``."""
    col = as_chunked(col)
    n = len(col)
    if n < 2 or pieces < 2:
        return []
    ties = sorted_ties([col])
    if ties is None:  # (callers pass sorted columns)
        raise InvalidUsage("cut_points: the column is not sorted in persist's order")
    same = np.zeros(n - 1, dtype=bool)
    same[ties] = True
    return cuts_between_runs(same, pieces)
