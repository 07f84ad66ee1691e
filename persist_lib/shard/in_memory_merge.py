"""The in-memory merge: every part decoded at once and all rows sorted once.

When a merge's rows and working set fit its budget, decoding every part (in parallel,
on a process-wide pool) and consolidating their concatenation with one sort costs less
than the k-way merge (``kway_merge``) — unless the inputs are a few sorted runs of flat
key types, which the linear merge steps combine without sorting. The decoded bytes are
checked against the budget as parts are decoded; past it, everything is dropped and the
caller streams instead. Used by the compactor (``compactor.merge_batches``).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pyarrow as pa

from persist_lib.location.base import Blob
from persist_lib.shard.batch_meta import PartMeta
from persist_lib.shard.codec import Schemas, internal_schema
from persist_lib.shard.consolidate import consolidation_plan
from persist_lib.shard.kernels import RowSource
from persist_lib.shard.kway_merge import few_linear_runs
from persist_lib.shard.memory_plan import (
    MemoryPlan,
    MergeStats,
    byte_width,
    estimate_decoded_bytes,
    row_layout,
)
from persist_lib.shard.part_fetch import (
    DECODED_CACHE,
    decode_whole,
    fetch_part_bytes,
    fetch_small_part,
    release_unused_memory,
)
from persist_lib.shard.runs import RunSource
from persist_lib.shard.time_filters import advance_to_since, time_range

log = logging.getLogger(__name__)

MiB = 1 << 20
_POOL_LOCK = threading.Lock()



# Bytes per row of the in-memory merge's working set beside the decoded rows, measured
# (tracemalloc and RSS, 5.2M rows of (int64, string)): the sort's numpy arrays peak at
# ~50 (packed keys, the permutation, tie groups, the diffs gathered and summed) with
# ~23 of them held until the output is written (row indices, summed diffs); polars'
# sort buffers ~16. Rounded up for what the allocators keep.
SORT_BYTES_PER_ROW = 96
# polars' copy of a string or binary column (for fast gathers): 16-byte views per row
# plus the bytes.
VIEW_BYTES_PER_ROW = 16
# Output parts of in-memory merges (Arrow bytes).
IN_MEMORY_PART_BYTES = 8 * MiB
# In-memory merges of at least this many encoded bytes decode their parts in parallel.
PARALLEL_DECODE_MIN_BYTES = 1 * MiB

_DECODE_POOL: ThreadPoolExecutor | None = None


def _reset_pool_in_child() -> None:
    """A forked child has none of the pool's threads: it makes a new pool when needed."""
    global _DECODE_POOL
    _DECODE_POOL = None


os.register_at_fork(after_in_child=_reset_pool_in_child)


def _decode_pool() -> ThreadPoolExecutor:
    """One process-wide pool for decoding the parts of in-memory merges (Parquet
    decoding, SHA-256 and Arrow's casts release the GIL)."""
    global _DECODE_POOL
    with _POOL_LOCK:
        if _DECODE_POOL is None:
            workers = max(2, min(4, os.cpu_count() or 2))
            _DECODE_POOL = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="persist-decode")
        return _DECODE_POOL


def _in_memory_overhead(rows: int, schemas: Schemas, plan: MemoryPlan) -> int:
    """What an in-memory merge of ``rows`` rows holds beside the decoded rows and the
    bytes of their variable-width columns: the sort's working set, polars' views of the
    variable-width columns and the output slices being gathered and encoded (~4 output
    parts)."""
    variable = row_layout(schemas)[1]
    return rows * (SORT_BYTES_PER_ROW + variable * VIEW_BYTES_PER_ROW) + 4 * plan.output_part_bytes


def may_merge_in_memory(
    runs_parts: list[list[PartMeta]], sources: list[RunSource], schemas: Schemas, budget: int, plan: MemoryPlan
) -> bool:
    """Whether to try the in-memory merge (one sort of all rows) rather than the
    streaming k-way merge: when the rows' fixed-width bytes and the working set fit the
    budget (the variable-width bytes are only known once decoded: ``plan_in_memory``
    checks them as it decodes), unless the inputs are a few sorted runs of flat key
    types, which the linear merge steps combine without sorting their rows."""
    rows = sum(r.rows for r in sources)
    fixed = row_layout(schemas)[0]
    if rows * fixed + _in_memory_overhead(rows, schemas, plan) > budget:
        return False
    unsorted = any(not p.sorted for run in runs_parts for p in run)
    return unsorted or not few_linear_runs(len(runs_parts), schemas)


def row_slices(n: int, table: pa.Table, part_bytes: int) -> Iterator[tuple[int, int]]:
    """Row ranges of about ``part_bytes`` of ``table``'s rows each."""
    per_row = max(table.nbytes / max(table.num_rows, 1), 1.0)
    step = max(1, int(part_bytes / per_row))
    for lo in range(0, n, step):
        yield lo, min(n, lo + step)


def decode_parts(
    blob: Blob, schemas: Schemas, shard: str, runs: list[list[PartMeta]], since_t: int | None,
    *, lower: int | None = None, upper: int | None = None, purpose: str = "compaction",
    limit: int | None = None, count_views: bool = True,
) -> list[pa.Table] | None:
    """Every part of ``runs``, verified and decoded whole, filtered to ``[lower, upper)``
    and forwarded to ``since_t`` — on the decode pool when there is enough to decode,
    the largest parts first (a big part submitted last would decode alone on one core
    after the small ones), returned in the parts' order. ``limit``: the most the
    decoded tables may hold, counting their variable-width columns twice when
    ``count_views`` (polars copies them for the one-sort merge's gathers); past it,
    None (the rest is not decoded)."""
    parts = [p for run in runs for p in run]

    def load(p: PartMeta, threads: bool) -> pa.Table:
        if estimate_decoded_bytes(p, schemas) <= DECODED_CACHE.max_entry:
            t = fetch_small_part(blob, p, schemas, shard, purpose)
        else:
            data = fetch_part_bytes(blob, p, shard, purpose)
            t = decode_whole(data, p, schemas, shard, use_threads=threads)
            del data
        if lower is not None or upper is not None:
            t = time_range(t, lower, upper)
        return advance_to_since(t, since_t) if since_t is not None else t

    def held(t: pa.Table) -> int:
        # (get_total_buffer_size: ~100x cheaper than nbytes; the same for unsliced tables)
        n = t.get_total_buffer_size()
        if count_views:
            n += sum(c.get_total_buffer_size() for c, f in zip(t.columns, t.schema, strict=True) if byte_width(f.type) is None)
        return n

    if len(parts) <= 1 or sum(p.size for p in parts) < PARALLEL_DECODE_MIN_BYTES:
        out: list[pa.Table] = []
        total = 0
        for p in parts:
            out.append(load(p, True))
            total += held(out[-1])
            if limit is not None and total > limit:
                return None
        return out
    pool = _decode_pool()
    groups = _decode_groups([p.size for p in parts])

    def load_group(group: list[int]) -> list[pa.Table]:
        return [load(parts[i], False) for i in group]

    futures = [pool.submit(load_group, g) for g in groups]
    decoded: dict[int, pa.Table] = {}
    total = 0
    try:
        for g, f in zip(groups, futures, strict=True):
            for i, t in zip(g, f.result(), strict=True):
                decoded[i] = t
                total += held(t)
            if limit is not None and total > limit:
                return None
        return [decoded[i] for i in range(len(parts))]
    finally:
        for f in futures:
            f.cancel()  # (no-op for those done) only on an early return or an error


# Parts smaller than this are decoded in groups of about this many encoded bytes.
DECODE_GROUP_BYTES = 1 * MiB
DECODE_GROUP_PARTS = 64


def _decode_groups(sizes: list[int]) -> list[list[int]]:
    """The parts (by index) in the tasks that decode them, largest parts first: a big
    part submitted last would decode alone on one core after the small ones. Small
    parts go in groups (up to ``DECODE_GROUP_BYTES`` / ``DECODE_GROUP_PARTS``): a task
    per tiny part costs a hand-off between threads, and under CPU contention each
    hand-off waits for the scheduler (200 tiny parts: ~40% of a merge's wall time)."""
    order = sorted(range(len(sizes)), key=lambda i: sizes[i], reverse=True)
    groups: list[list[int]] = []
    cur: list[int] = []
    cur_bytes = 0
    for i in order:
        if sizes[i] >= DECODE_GROUP_BYTES:
            groups.append([i])
            continue
        cur.append(i)
        cur_bytes += sizes[i]
        if cur_bytes >= DECODE_GROUP_BYTES or len(cur) >= DECODE_GROUP_PARTS:
            groups.append(cur)
            cur, cur_bytes = [], 0
    if cur:
        groups.append(cur)
    return groups


def _concat_to_one_chunk(tables: list[pa.Table], schema: pa.Schema) -> pa.Table:
    """The tables concatenated into one chunk per column, column by column, each
    column's pieces let go once copied (``tables`` is emptied): the copy costs one
    column at a time, and every gather afterwards reads one contiguous array (Arrow's
    ``take`` on a chunked array concatenates it again on every call)."""
    pieces = [[c for t in tables for c in t.column(i).chunks] for i in range(len(schema))]
    tables.clear()
    cols: list[pa.Array] = []
    for i, f in enumerate(schema):
        chunks, pieces[i] = pieces[i], []
        cols.append(pa.concat_arrays(chunks) if chunks else pa.array([], f.type))
        del chunks
    return pa.Table.from_arrays(cols, schema=schema)


def plan_in_memory(
    blob: Blob, schemas: Schemas, shard: str, runs: list[list[PartMeta]], since_t: int | None,
    stats: MergeStats, plan: MemoryPlan, budget: int,
) -> tuple[RowSource, np.ndarray, np.ndarray] | None:
    """Decodes every part and sorts all rows once: the concatenation (as a
    ``RowSource`` to gather the output from), and the rows and summed diffs of its
    consolidation (``consolidation_plan``). None when the decoded parts turn out not to
    fit the budget beside the working set (nothing is kept)."""
    parts = [p for run in runs for p in run]
    rows_in = sum(p.count for p in parts)
    limit = budget - _in_memory_overhead(rows_in, schemas, plan)
    tables = decode_parts(blob, schemas, shard, runs, since_t, limit=limit)
    if tables is None:
        log.info("shard %s: the merge's parts decode larger than its budget allows in memory; streaming", shard)
        release_unused_memory()
        return None
    held = sum(t.nbytes for t in tables)
    stats.bytes_read += sum(p.size for p in parts)
    stats.rows_read += sum(t.num_rows for t in tables)
    stats.unsorted_parts_sorted += sum(1 for p in parts if not p.sorted)
    table = _concat_to_one_chunk(tables, internal_schema(schemas))
    rows = table.num_rows
    stats.peak_rows_held = max(stats.peak_rows_held, rows)
    var_bytes = sum(c.nbytes for c, f in zip(table.columns, table.schema, strict=True) if byte_width(f.type) is None)
    stats.peak_bytes_held = max(
        stats.peak_bytes_held, max(held, table.nbytes) + var_bytes + _in_memory_overhead(rows, schemas, plan)
    )
    source = RowSource(table)
    if rows == 0:
        return source, np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    keep, diffs = consolidation_plan(table, source)
    return source, keep, diffs
