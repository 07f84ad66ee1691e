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
4. Each range, the concatenation of its pieces, is consolidated (``consolidate_pieces``:
   chunks combined, sort by ``(k, v, t)``, sum diffs, one Arrow gather) on a pool of two
   threads, at most two ranges in
   flight; numpy, Arrow and polars release the GIL, so ranges sort and gather on both
   cores while the output builder encodes earlier ones. No unsorted part is sorted
   whole, and no merge pass is written to blob and read back.
5. When the output is written in time layers (``time_layers``), the cut groups rows by
   ``(key range, layer)``: a table whose times all fall in one layer (every small
   commit, every part of a bulk write at one time) goes whole to that layer, a table
   spanning layers gets one permutation grouping its rows by both. Each range then
   yields one consolidated table per layer, which the caller adds to that layer's
   run: no routing pass over the output. Rows equal in ``(k, v, t)`` share their time,
   hence their layer, so consolidating per layer is consolidating the range.
6. A group whose pieces all come from sorted tables and are key-disjoint (each piece's
   last leading key <= the next one's first: one piece of a sorted bulk part, or the
   key-range parts of one write) is concatenated in key order and consolidated in
   linear time (``consolidate_sorted``: it checks the full ``(k, v, t)`` order and
   sums equal neighbours, so a part's ``sorted`` flag is never trusted); only if that
   check finds the rows out of order does the group take the sorting consolidation.

Memory (``admission_bytes``): the decoded tables and the permutations, plus either what
decoding holds (encoded bytes of the parts in flight) or what the ranges in flight
hold (their pieces, consolidated copy and sort working set) and the output parts
being encoded.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from persist_lib.location.base import Blob
from persist_lib.shard.batch_meta import PartMeta
from persist_lib.shard.codec import D_COL, T_COL, Schemas, internal_schema
from persist_lib.shard.consolidate import consolidate_pieces, consolidate_sorted
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
from persist_lib.shard.sorted_checks import linear_kernels_apply
from persist_lib.shard.thread_pools import SharedPool, cancel_and_wait

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
    parts' metadata): every part decoded, the permutations of unsorted parts and of
    parts holding more than one time (and the
    int64 leading keys of the largest part, while it is cut), plus the larger of what
    decoding holds transiently (the encoded bytes of two parts) and what the merge
    steps hold (``_steps_bytes``)."""
    decoded = sum(decoded_bytes_or_estimate(p, schemas) for p in parts)
    rows = sum(p.count for p in parts)
    # (a sorted part whose times span several time layers is grouped by a permutation too)
    perms = PERM_BYTES_PER_ROW * sum(p.count for p in parts if not p.sorted or p.tmin != p.tmax)
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


LayerOf = Callable[[np.ndarray], np.ndarray]


@dataclass
class _Piece:
    """The rows of one decoded table in one ``(key range, layer)`` group; ``first`` and
    ``last``: their smallest and largest leading key (``leading_keys``) when the table
    is sorted by its leading key (its rows kept in order), else None."""

    table: pa.Table
    first: int | None
    last: int | None


@dataclass
class _Cut:
    """A decoded table cut into groups: group ``g`` is rows ``bounds[g]`` to
    ``bounds[g + 1]`` of the table (sorted by its leading key, one layer: ``perm``
    None) or of ``perm`` (the table's row numbers grouped by group, in table order
    within a group). Groups are the key ranges when every row is in ``layer``, else
    ``(range r, layer l)`` pairs as ``r * n_layers + l`` (``layer`` None).
    ``first``/``last``: each group's smallest and largest leading key, for tables
    sorted by it (None otherwise)."""

    table: pa.Table
    bounds: np.ndarray
    perm: np.ndarray | None
    layer: int | None
    n_layers: int
    first: np.ndarray | None
    last: np.ndarray | None

    def range_rows(self) -> np.ndarray:
        """The rows of each key range (all layers)."""
        counts = np.diff(self.bounds)
        return counts if self.layer is not None else counts.reshape(-1, self.n_layers).sum(axis=1)

    def piece(self, r: int, layer: int) -> _Piece | None:
        """The rows of key range ``r`` in time layer ``layer`` (None: there are none)."""
        if self.layer is None:
            g = r * self.n_layers + layer
        elif layer == self.layer:
            g = r
        else:
            return None
        lo, hi = int(self.bounds[g]), int(self.bounds[g + 1])
        if hi <= lo:
            return None
        t = self.table.slice(lo, hi - lo) if self.perm is None else self.table.take(pa.array(self.perm[lo:hi]))
        if self.first is None or self.last is None:
            return _Piece(t, None, None)
        return _Piece(t, int(self.first[g]), int(self.last[g]))


def _is_sorted(keys: np.ndarray) -> bool:
    return len(keys) < 2 or bool(np.all(keys[1:] >= keys[:-1]))


def _cut(t: pa.Table, pivots: np.ndarray, layer_of: LayerOf | None = None, n_layers: int = 1) -> _Cut:
    keys = leading_keys(t.column(0))
    n = len(keys)
    srt = _is_sorted(keys)
    layers: np.ndarray | None = None
    layer: int | None = 0
    if layer_of is not None and n_layers > 1 and n:
        layers = layer_of(to_numpy(t.column(T_COL)))
        lo, hi = int(layers.min()), int(layers.max())
        if lo == hi:
            layer, layers = lo, None
        else:
            layer = None
    if srt and layers is None:
        inner = np.searchsorted(keys, pivots, side="right")
        bounds = np.concatenate([[0], inner, [n]]).astype(np.int64)
        return _Cut(t, bounds, None, layer, n_layers, keys[np.minimum(bounds[:-1], n - 1)],
                    keys[np.maximum(bounds[1:] - 1, 0)])
    # The range of each row: the number of pivots below its key (``digitize`` is ~2x
    # faster than ``searchsorted`` for unsorted keys); with layers, its (range, layer).
    groups = len(pivots) + 1
    rid = np.digitize(keys, pivots, right=True).astype(np.int16 if len(pivots) < (1 << 15) else np.int32)
    if layers is not None:
        groups *= n_layers
        rid = rid.astype(np.int32 if groups < (1 << 31) else np.int64) * n_layers + layers.astype(np.int32)
        del layers
    perm = np.argsort(rid, kind="stable").astype(np.int32 if t.num_rows < (1 << 31) else np.int64)
    counts = np.bincount(rid, minlength=groups)
    del rid
    bounds = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=bounds[1:])
    first = last = None
    if srt and n:  # (the stable grouping keeps each group's rows in key order)
        first = keys[perm[np.minimum(bounds[:-1], n - 1)]]
        last = keys[perm[np.maximum(bounds[1:] - 1, 0)]]
    return _Cut(t, bounds, perm, layer, n_layers, first, last)


def _key_chain(pieces: list[_Piece]) -> list[pa.Table] | None:
    """The pieces' tables in leading-key order when they come from sorted tables and
    are key-disjoint (each one's last key <= the next one's first): their concatenation
    is then sorted by the leading key. None otherwise."""
    if any(p.first is None for p in pieces):
        return None
    chain = sorted(pieces, key=lambda p: (p.first, p.last))
    for a, b in zip(chain, chain[1:], strict=False):
        assert a.last is not None and b.first is not None
        if a.last > b.first:
            return None
    return [p.table for p in chain]


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
    """The decoded tables of one merge cut into key ranges (and time layers:
    ``layer_of`` maps times to layers ``0 .. n_layers - 1``); ``tables()`` yields each
    range's consolidated rows per layer, ranges in order (each range consolidated on
    the range pool)."""

    def __init__(
        self, tables: list[pa.Table], stats: MergeStats, budget: int, plan: MemoryPlan, schemas: Schemas,
        layer_of: LayerOf | None = None, n_layers: int = 1,
    ) -> None:
        self.stats = stats
        self.schemas = schemas
        rows = sum(t.num_rows for t in tables)
        self.held = sum(t.get_total_buffer_size() for t in tables)
        per_row = self.held / max(rows, 1)
        n_ranges = max(2, -(-self.held // RANGE_BYTES))
        piv = pivots(tables, n_ranges) if rows else np.zeros(0, dtype=np.int64)
        self.n_ranges = len(piv) + 1
        self.n_layers = n_layers if layer_of is not None else 1
        self.cuts = [_cut(t, piv, layer_of, self.n_layers) for t in tables]
        schema = internal_schema(schemas)
        self.linear = linear_kernels_apply(f.type for f in schema if f.name != D_COL)
        perms = sum(c.perm.nbytes for c in self.cuts if c.perm is not None)
        largest = int(np.sum([c.range_rows() for c in self.cuts], axis=0).max()) if self.cuts else 0
        biggest = range_bytes(largest, per_row, row_layout(schemas)[1])
        room = budget - self.held - perms - 4 * plan.output_part_bytes
        self.in_flight = RANGES_IN_FLIGHT if RANGES_IN_FLIGHT * biggest <= room else 1
        self.fits = biggest <= room
        self.rows = rows
        self.peak_bytes = self.held + perms + self.in_flight * biggest + 4 * plan.output_part_bytes

    def _range(self, r: int) -> list[tuple[int, pa.Table]]:
        out: list[tuple[int, pa.Table]] = []
        for layer in range(self.n_layers):
            pieces = [p for p in (c.piece(r, layer) for c in self.cuts) if p is not None]
            if pieces:
                t = self._consolidated(pieces)
                if t.num_rows:
                    out.append((layer, t))
        return out

    def _consolidated(self, pieces: list[_Piece]) -> pa.Table:
        """The pieces of one group, consolidated: in linear time (no sort, no gather)
        when they are key-disjoint sorted pieces, else by one sort of all of them."""
        chain = _key_chain(pieces) if self.linear else None
        if chain is not None:
            t = chain[0] if len(chain) == 1 else pa.concat_tables(chain)
            done = consolidate_sorted(t)  # None: not sorted by (k, v, t) after all
            if done is not None:
                self.stats.presorted_rows += t.num_rows  # (one writer at a time: the GIL)
                return done
        return consolidate_pieces(pieces[0].table if len(pieces) == 1 else pa.concat_tables([p.table for p in pieces]))

    def tables(self) -> Iterator[tuple[int, pa.Table]]:
        """``(layer, rows)``: each key range's consolidated rows, layer by layer, the
        ranges in order (empty ones skipped). Within a layer, rows come in ``(k, v, t)``
        order across the whole iteration."""
        pool = _RANGE_POOL.get()
        pending: deque[Future[list[tuple[int, pa.Table]]]] = deque()
        try:
            for r in range(self.n_ranges + self.in_flight - 1):
                if r < self.n_ranges:
                    pending.append(pool.submit(self._range, r))
                if len(pending) < self.in_flight and r < self.n_ranges:
                    continue
                for layer, out in pending.popleft().result():
                    self.stats.output_rows += out.num_rows
                    yield layer, out
        finally:
            cancel_and_wait(pending)  # (the tables must outlive the threads reading them)
            self.cuts = []


def plan_by_ranges(
    blob: Blob, schemas: Schemas, shard: str, runs_parts: list[list[PartMeta]], since_t: int | None,
    stats: MergeStats, plan: MemoryPlan, budget: int, layer_of: LayerOf | None = None, n_layers: int = 1,
) -> RangeMerge | None:
    """Decodes every part and cuts the rows into key ranges (and time layers: see
    ``RangeMerge``). None when the decoded parts turn out larger than the budget
    allows or a key range would not fit (a leading key shared by too many rows):
    nothing is kept, the caller streams."""
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
    merge = RangeMerge([t for t in tables if t.num_rows], stats, budget, plan, schemas, layer_of, n_layers)
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
