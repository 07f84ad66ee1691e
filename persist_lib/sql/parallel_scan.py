"""A SQL scan of a shard's snapshot with its parts fetched, verified, decoded and
consolidated in parallel (issue 28).

The streaming read (``ReadHandle.snapshot_batches``) of a compacted shard reads its
sorted run one part after another: one thread fetches and decodes the next part while
the caller's thread consolidates the current one, so a scan uses about one core where
DuckDB's own Parquet reader uses all of them. When the parts' statistics prove them
key-disjoint (``handles.split_overlap.disjoint_overlaps``: the ranges of an integer
first key field meet at most at shared endpoints - a compacted shard's run, or
key-disjoint bulk parts; for a batch of (k, v)-disjoint time layers, within each layer
only, ``grouped_overlaps``: parts of different layers share no record) every part is its own split (``ReadHandle.snapshot_splits``):
``SnapshotSplit.fetch`` verifies its SHA-256, decodes it, forwards its times to the
as-of, filters it and consolidates it on its own, on a pool of worker threads, a few
parts ahead of the consumer. A row whose first key field is an endpoint another part
shares may also sit in that part: those few rows are held back and consolidated
together at the end. The rows are the snapshot's exactly (each ``(key, value)`` once,
nonzero diffs), only not in key order, which a SQL relation doesn't have anyway.

Otherwise (overlapping runs, parts without statistics, a non-integer or nullable
first key field, a part too large for the memory budget, a collection) the scan is
the streaming read, as before.

Memory: at most ``in_flight`` parts decoded at once (two per worker, fewer when the
budget needs it), plus the held-back rows. The scan holds the reader's split hold
until it ends (``ScanHolds``: a table's holds are released once no scan of it runs).
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait

import numpy as np
import pyarrow as pa

from persist_lib.handles.batch_stream import BatchStream
from persist_lib.handles.pushdown import ReadPushdown
from persist_lib.handles.read import ReadHandle
from persist_lib.handles.read_plan import row_width
from persist_lib.handles.split_overlap import SplitOverlap, grouped_overlaps
from persist_lib.handles.splits import SnapshotSplit
from persist_lib.location.base import Blob
from persist_lib.shard.codec import Schemas, internal_schema, to_user_table
from persist_lib.shard.consolidate import consolidate
from persist_lib.shard.memory_plan import estimate_decoded_bytes
from persist_lib.shard.predicate import Predicate

# Decoded bytes a part in flight costs, as a multiple of its Arrow size: the fetched
# bytes, the decoded table and its consolidated copy.
_IN_FLIGHT_FACTOR = 2


def scan_workers() -> int:
    """Threads a scan decodes parts on: the machine's cores, 2 to 8."""
    return max(2, min(8, os.cpu_count() or 2))


_POOL: list[ThreadPoolExecutor] = []
_POOL_LOCK = threading.Lock()


def scan_pool() -> ThreadPoolExecutor:
    """The process's scan pool (``scan_workers`` threads, started once: a query does not
    pay for starting threads). Scans share it; each keeps at most ``in_flight`` parts
    queued on it."""
    with _POOL_LOCK:
        if not _POOL:
            _POOL.append(ThreadPoolExecutor(max_workers=scan_workers(), thread_name_prefix="persist-sql-scan"))
        return _POOL[0]


class ScanHolds:
    """The split holds of one reader shared by concurrent scans: ``snapshot_splits``
    holds a seqno until ``release_splits``, which releases every split hold of the
    reader, so they are released only when the last running scan ends."""

    def __init__(self, reader: ReadHandle) -> None:
        self._reader = reader
        self._lock = threading.RLock()  # re-entered by a finalizer in the same thread
        self._running = 0
        self.deferred: threading.Thread | None = None  # the last deferred release

    def begin(self) -> None:
        with self._lock:
            self._running += 1

    def end(self) -> None:
        # May run in a stream's finalizer, at any allocation of any thread, possibly one
        # inside the reader's own lock (``release_splits`` takes it): release now only
        # when that lock is free, else from another thread, which waits for it. Released
        # under this object's lock, so that no scan begins (and takes a split hold) between
        # the count reaching zero and the release.
        with self._lock:
            self._running -= 1
            if self._running:
                return
            lock = self._reader._lock
            if lock.acquire(blocking=False):
                lock.release()
                self._reader.release_splits()
                return
        self.deferred = threading.Thread(target=self._release_if_idle, name="persist-sql-release", daemon=True)
        self.deferred.start()

    def _release_if_idle(self) -> None:
        with self._lock:
            if not self._running:  # else a scan began since: its end releases
                self._reader.release_splits()


def _fetch_one(
    split: SnapshotSplit, overlap: SplitOverlap, blob: Blob
) -> tuple[pa.Table, pa.Table | None]:
    """One part fetched, verified, decoded and consolidated (user layout), cut into the
    rows no other part can hold and those another may (None when there are none)."""
    t = split.fetch(blob)
    if not overlap.los or t.num_rows == 0:
        return t, None
    mask = overlap.mask(t).to_numpy(zero_copy_only=False)
    marked = int(mask.sum())
    if not marked:
        return t, None
    # A part in key order holds a shared endpoint's rows at its start or its end:
    # slices, no copy of the rest.
    n = len(mask)
    head = n if mask.all() else int(np.argmin(mask))
    tail = n - head if head == n else int(np.argmin(mask[::-1]))
    if head + tail == marked:
        shared = pa.concat_tables([t.slice(0, head), t.slice(n - tail, tail)])
        return t.slice(head, n - head - tail), shared
    return t.filter(pa.array(~mask)), t.filter(pa.array(mask))


def parallel_snapshot(
    reader: ReadHandle,
    holds: ScanHolds,
    as_of: int,
    *,
    memory_budget: int | None,
    timeout_s: float | None,
    filter: Predicate | None,
    columns: list[str] | None,
    workers: int | None = None,
) -> BatchStream | None:
    """The snapshot at ``as_of`` as a stream of the same rows as ``snapshot_batches``
    (not in key order), read in parallel; None when the parts don't qualify (the
    caller then streams as before). ``workers`` (default ``scan_workers()``): parts
    are fetched up to twice that many ahead. Errors of the time (``InvalidUsage`` before the
    since, ``Timeout`` waiting for the upper) are raised here."""
    schemas = reader.schemas
    pd = ReadPushdown.plan(schemas, columns, filter, shard=reader.shard_id)
    holds.begin()
    done = False
    try:
        splits = reader.snapshot_splits(as_of, 1, timeout_s, filter=filter)
        parts = [p for s in splits for p in s.parts]
        runs = splits[0].runs  # (one split: its parts' runs, when known)
        planned = grouped_overlaps(parts, runs if len(splits) == 1 else None, schemas)
        budget = memory_budget if memory_budget is not None else reader.client.config.read_memory_budget
        biggest = max((estimate_decoded_bytes(p, schemas) for p in parts), default=0)
        w = workers or scan_workers()
        in_flight = min(2 * w, budget // max(1, _IN_FLIGHT_FACTOR * biggest))
        if planned is None or in_flight < 1 or len(parts) < 2:
            return None
        ordered, overlaps = planned
        base = splits[0]
        per_part = [dataclasses.replace(base, parts=(p,), runs=None) for p in ordered]
        max_rows = max(1024, (max(budget, 1 << 20) // 32) // max(1, row_width(schemas)))
        rows = _scan(per_part, overlaps, reader.client.blob, schemas, pd, in_flight, max_rows)
        stream = BatchStream(rows, pd.user_schema(), holds.end)
        done = True
        return stream
    finally:
        if not done:
            holds.end()


def _scan(
    splits: list[SnapshotSplit],
    overlaps: list[SplitOverlap],
    blob: Blob,
    schemas: Schemas,
    pd: ReadPushdown,
    in_flight: int,
    max_rows: int,
) -> Iterator[pa.RecordBatch]:
    """The parts' rows in part order, each part's fetched on the pool ``in_flight``
    parts ahead; the shared rows consolidated at the end. A generator: nothing is
    fetched before the first ``next``; closing it cancels what is queued and waits for
    what runs (the parts stay held until then)."""
    pool = scan_pool()
    queue: deque[Future[tuple[pa.Table, pa.Table | None]]] = deque()
    submit: Callable[[int], Future[tuple[pa.Table, pa.Table | None]]] = lambda i: pool.submit(  # noqa: E731
        _fetch_one, splits[i], overlaps[i], blob
    )
    try:
        nxt = min(in_flight, len(splits))
        queue.extend(submit(i) for i in range(nxt))
        shared: list[pa.Table] = []
        while queue:
            alone, maybe = queue.popleft().result()
            if nxt < len(splits):
                queue.append(submit(nxt))
                nxt += 1
            if maybe is not None:
                shared.append(maybe)
            if alone.num_rows:
                yield from pd.project(alone).to_batches(max_chunksize=max_rows)
            del alone
        if shared:
            target = internal_schema(schemas)
            internal = pa.Table.from_arrays(pa.concat_tables(shared).columns, schema=target)
            out = to_user_table(consolidate(internal), schemas)
            if out.num_rows:
                yield from pd.project(out).to_batches(max_chunksize=max_rows)
    finally:
        for f in queue:  # the parts stay held until no fetch of this scan runs
            if not f.cancel():
                wait([f])
