"""The key-range-parallel in-memory merge: decoded runs cut at sampled key quantiles,
each key range consolidated on its own thread.

When a merge's decoded parts fit its budget (but not necessarily the working set of
one sort of all their rows, which ``in_memory_merge`` needs), and the leading sort
column maps to integers (integers, floats by total order, temporal types, booleans:
``ranks.comparable``), the compactor merges this way:

1. Every part is fetched, verified and decoded on the decode pool, the largest first
   (a big part submitted last would decode alone on one core after the small ones).
   The decoded bytes are checked against the budget as they arrive (past it,
   everything is dropped and the caller streams).
2. Pivots are quantiles of a fixed random sample of the leading column (read as int64:
   nulls, which sort first, as the smallest int64) drawn from every table in
   proportion to its rows. Key range ``r`` holds the rows whose leading key is in
   ``(pivot[r-1], pivot[r]]``. Rows equal in ``(k, v, t)`` share their leading key,
   hence their range: consolidating each range is consolidating the whole, and every
   row of range ``r`` sorts before every row of range ``r + 1``, so the ranges'
   consolidated outputs, in range order, are the merge's output.
3. A table whose leading keys are non-decreasing (a sorted part: forwarding times to
   ``since`` never reorders them; checked, the part's flag is not trusted) is cut at
   the pivots by a binary search and sliced without a copy. Any other table (a bulk
   write's unsorted part) gets a permutation grouping its rows by range (a stable sort
   of small range numbers; int32, 4 bytes a row) and each range gathers its rows.
4. Each range, the concatenation of its pieces, is consolidated (``consolidate``: sort
   by ``(k, v, t)``, sum diffs) on a pool of two threads, at most two ranges in
   flight; numpy, Arrow and polars release the GIL, so ranges sort and gather on both
   cores while the output builder encodes earlier ones. No unsorted part is sorted
   whole, and no merge pass is written to blob and read back.

Memory (``admission_bytes``): the decoded tables and the permutations, plus either what
decoding holds (encoded bytes of the parts in flight) or what the ranges in flight
hold (their pieces, consolidated copy and sort working set) and the output parts
being encoded.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from persist_lib.location.base import Blob
from persist_lib.shard.batch_meta import PartMeta
from persist_lib.shard.codec import Schemas, internal_schema
from persist_lib.shard.consolidate import consolidate
from persist_lib.shard.in_memory_merge import decode_parts
from persist_lib.shard.kway_merge import few_linear_runs
from persist_lib.shard.memory_plan import (
    MemoryPlan,
    MergeStats,
    decoded_bytes_or_estimate,
    row_layout,
)
from persist_lib.shard.part_fetch import release_unused_memory
from persist_lib.shard.ranks import comparable, to_numpy
from persist_lib.shard.runs import RunSource
from persist_lib.shard.thread_pools import SharedPool

log = logging.getLogger(__name__)

MiB = 1 << 20
# Arrow bytes per key range (about one output part of an in-memory merge).
RANGE_BYTES = 8 * MiB
# Merges of fewer rows than this take the one-sort path (``in_memory_merge``).
MIN_RANGE_MERGE_ROWS = 1 << 16
# Key ranges consolidated at once.
RANGES_IN_FLIGHT = 2
# Bytes per row of one range's working set beside its concatenation and output:
# consolidate's sort (packed keys, permutation, ties, diffs) and polars' string views.
RANGE_SORT_BYTES_PER_ROW = 96
VIEW_BYTES_PER_ROW = 16
_SAMPLE = 1 << 14
_I64_MIN = np.iinfo(np.int64).min
# The permutation grouping an unsorted table's rows by key range (int32 row numbers).
PERM_BYTES_PER_ROW = 4

_RANGE_POOL = SharedPool(RANGES_IN_FLIGHT, "persist-merge-range")


def _leading_type_maps_to_ints(t: pa.DataType) -> bool:
    return (
        pa.types.is_integer(t)
        or pa.types.is_floating(t)
        or pa.types.is_boolean(t)
        or pa.types.is_temporal(t)
    )


def applies(schemas: Schemas) -> bool:
    """Whether this shard's merges may go by key ranges (the leading sort column maps
    to integers in persist's order)."""
    schema = internal_schema(schemas)
    return _leading_type_maps_to_ints(schema.field(0).type)


def leading_keys(col: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """The leading sort column as int64 in persist's row order (``ranks``): nulls as
    the smallest int64 (nulls sort first; a null may tie with that value, which only
    puts both in the first key range), unsigned 64-bit integers shifted into int64."""
    c = comparable(col)
    nulls = c.null_count > 0
    vals = to_numpy(c.fill_null(0) if nulls else c)
    if vals.dtype == np.uint64:
        vals = (vals ^ np.uint64(1 << 63)).view(np.int64)
    else:
        vals = vals.astype(np.int64, copy=False)
    if nulls:
        vals = vals.copy()
        vals[~to_numpy(c.is_valid()).astype(bool)] = _I64_MIN
    return vals


def range_bytes(rows: int, row_bytes: float, variable: int) -> int:
    """What one key range of ``rows`` rows holds while it is consolidated: its
    concatenation, the consolidated copy, the sort's working set and polars' views."""
    return int(rows * (2 * row_bytes + RANGE_SORT_BYTES_PER_ROW + variable * VIEW_BYTES_PER_ROW))


def _steps_bytes(decoded: int, rows: int, schemas: Schemas, plan: MemoryPlan) -> int:
    per_row = decoded / max(rows, 1)
    range_rows = max(1, int(RANGE_BYTES / max(per_row, 1.0)))
    return RANGES_IN_FLIGHT * range_bytes(range_rows, per_row, row_layout(schemas)[1]) + 4 * plan.output_part_bytes


def admission_bytes(parts: list[PartMeta], schemas: Schemas, plan: MemoryPlan) -> int:
    """The most a range merge of ``parts`` is expected to hold (estimated from the
    parts' metadata): every part decoded, the permutations of unsorted parts (and the
    int64 leading keys of the largest part, while it is cut), plus the larger of what
    decoding holds transiently (the encoded bytes of two parts) and what the merge
    steps hold (``_steps_bytes``)."""
    decoded = sum(decoded_bytes_or_estimate(p, schemas) for p in parts)
    rows = sum(p.count for p in parts)
    perms = PERM_BYTES_PER_ROW * sum(p.count for p in parts if not p.sorted)
    keys = 8 * max((p.count for p in parts), default=0)
    transient = sum(sorted((p.size for p in parts), reverse=True)[:2])
    return decoded + perms + keys + max(transient, _steps_bytes(decoded, rows, schemas, plan))


def may_merge_by_ranges(
    runs_parts: list[list[PartMeta]], sources: list[RunSource], schemas: Schemas, budget: int, plan: MemoryPlan
) -> bool:
    """Whether to try the range merge: the leading column maps to integers, there are
    enough rows to split, the estimate fits the budget, and the inputs are not a few
    sorted runs of flat key types (the linear merge steps combine those without
    sorting: ``kway_merge.few_linear_runs``)."""
    parts = [p for run in runs_parts for p in run]
    if sum(r.rows for r in sources) < MIN_RANGE_MERGE_ROWS or not applies(schemas):
        return False
    if all(p.sorted for p in parts) and few_linear_runs(len(runs_parts), schemas):
        return False
    return admission_bytes(parts, schemas, plan) <= budget


@dataclass
class _Cut:
    """A decoded table cut into the key ranges: range ``r`` is rows ``bounds[r]`` to
    ``bounds[r + 1]`` of the table (sorted by its leading key: ``perm`` None) or of
    ``perm`` (the table's row numbers grouped by range)."""

    table: pa.Table
    bounds: np.ndarray
    perm: np.ndarray | None

    def piece(self, r: int) -> pa.Table | None:
        lo, hi = int(self.bounds[r]), int(self.bounds[r + 1])
        if hi <= lo:
            return None
        if self.perm is None:
            return self.table.slice(lo, hi - lo)
        return self.table.take(pa.array(self.perm[lo:hi]))


def _is_sorted(keys: np.ndarray) -> bool:
    return len(keys) < 2 or bool(np.all(keys[1:] >= keys[:-1]))


def _cut(t: pa.Table, pivots: np.ndarray) -> _Cut:
    keys = leading_keys(t.column(0))
    if _is_sorted(keys):
        inner = np.searchsorted(keys, pivots, side="right")
        return _Cut(t, np.concatenate([[0], inner, [len(keys)]]).astype(np.int64), None)
    # The range of each row: the number of pivots below its key (``digitize`` is ~2x
    # faster than ``searchsorted`` for unsorted keys).
    rid = np.digitize(keys, pivots, right=True).astype(np.int16 if len(pivots) < (1 << 15) else np.int32)
    del keys
    perm = np.argsort(rid, kind="stable").astype(np.int32 if t.num_rows < (1 << 31) else np.int64)
    counts = np.bincount(rid, minlength=len(pivots) + 1)
    bounds = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=bounds[1:])
    return _Cut(t, bounds, perm)


def pivots(tables: list[pa.Table], n_ranges: int) -> np.ndarray:
    """Up to ``n_ranges - 1`` distinct leading keys cutting the rows into about equal
    ranges: quantiles of a fixed random sample drawn from every table in proportion to
    its rows."""
    total = sum(t.num_rows for t in tables)
    rng = np.random.default_rng(0)
    picks = []
    for t in tables:
        if t.num_rows:
            idx = np.sort(rng.integers(0, t.num_rows, max(1, _SAMPLE * t.num_rows // total)))
            picks.append(leading_keys(t.column(0).take(pa.array(idx))))
    sample = np.sort(np.concatenate(picks))
    q = sample[(np.arange(1, n_ranges) * len(sample)) // n_ranges]
    return np.unique(q)


class RangeMerge:
    """The decoded tables of one merge cut into key ranges; ``tables()`` yields the
    consolidated ranges in order (each consolidated on the range pool)."""

    def __init__(
        self, tables: list[pa.Table], stats: MergeStats, budget: int, plan: MemoryPlan, schemas: Schemas
    ) -> None:
        self.stats = stats
        self.schemas = schemas
        rows = sum(t.num_rows for t in tables)
        self.held = sum(t.get_total_buffer_size() for t in tables)
        per_row = self.held / max(rows, 1)
        n_ranges = max(2, -(-self.held // RANGE_BYTES))
        piv = pivots(tables, n_ranges) if rows else np.zeros(0, dtype=np.int64)
        self.n_ranges = len(piv) + 1
        self.cuts = [_cut(t, piv) for t in tables]
        perms = sum(c.perm.nbytes for c in self.cuts if c.perm is not None)
        largest = int(np.diff(sum(c.bounds for c in self.cuts)).max()) if self.cuts else 0
        biggest = range_bytes(largest, per_row, row_layout(schemas)[1])
        room = budget - self.held - perms - 4 * plan.output_part_bytes
        self.in_flight = RANGES_IN_FLIGHT if RANGES_IN_FLIGHT * biggest <= room else 1
        self.fits = biggest <= room
        self.rows = rows
        self.peak_bytes = self.held + perms + self.in_flight * biggest + 4 * plan.output_part_bytes

    def _range(self, r: int) -> pa.Table:
        pieces = [p for p in (c.piece(r) for c in self.cuts) if p is not None]
        if not pieces:
            return internal_schema(self.schemas).empty_table()
        return consolidate(pieces[0] if len(pieces) == 1 else pa.concat_tables(pieces))

    def tables(self) -> Iterator[pa.Table]:
        """The consolidated key ranges, in order (empty ones skipped)."""
        pool = _RANGE_POOL.get()
        pending: deque[Future[pa.Table]] = deque()
        try:
            for r in range(self.n_ranges + self.in_flight - 1):
                if r < self.n_ranges:
                    pending.append(pool.submit(self._range, r))
                if len(pending) < self.in_flight and r < self.n_ranges:
                    continue
                out = pending.popleft().result()
                if out.num_rows:
                    self.stats.output_rows += out.num_rows
                    yield out
        finally:
            for f in pending:
                f.cancel()
            for f in pending:
                if not f.cancelled():
                    f.exception()  # wait: the tables must outlive the threads reading them
            self.cuts = []


def plan_by_ranges(
    blob: Blob, schemas: Schemas, shard: str, runs_parts: list[list[PartMeta]], since_t: int | None,
    stats: MergeStats, plan: MemoryPlan, budget: int,
) -> RangeMerge | None:
    """Decodes every part and cuts the rows into key ranges. None when the decoded
    parts turn out larger than the budget allows or a key range would not fit (a
    leading key shared by too many rows): nothing is kept, the caller streams."""
    parts = [p for run in runs_parts for p in run]
    decoded = sum(decoded_bytes_or_estimate(p, schemas) for p in parts)
    limit = budget - (admission_bytes(parts, schemas, plan) - decoded)
    tables = decode_parts(blob, schemas, shard, runs_parts, since_t, limit=limit, count_views=False)
    if tables is None:
        log.info("shard %s: the merge's parts decode larger than its budget allows; streaming", shard)
        release_unused_memory()
        return None
    stats.bytes_read += sum(p.size for p in parts)
    stats.rows_read += sum(t.num_rows for t in tables)
    stats.unsorted_parts_sorted += sum(1 for p in parts if not p.sorted)  # (grouped by key range)
    merge = RangeMerge([t for t in tables if t.num_rows], stats, budget, plan, schemas)
    del tables
    if not merge.fits:
        log.info("shard %s: a key range of the merge does not fit its budget; streaming", shard)
        del merge
        release_unused_memory()
        return None
    stats.key_ranges = merge.n_ranges
    stats.peak_rows_held = max(stats.peak_rows_held, merge.rows)
    stats.peak_bytes_held = max(stats.peak_bytes_held, merge.peak_bytes)
    return merge
