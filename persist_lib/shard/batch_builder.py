"""Building batches: buffer updates, cut sorted parts, upload them with bounded memory.

``BatchBuilder`` accepts update tables in any order and any chunking. When the
buffered Arrow bytes reach ``target_part_bytes`` the buffer is handed to a
background task that consolidates it, encodes a part and uploads it (or keeps it
inline when tiny). At most ``max_inflight_uploads`` such tasks run at once and
``add`` blocks while that many are pending, so a builder holds roughly
``(max_inflight_uploads + 1) x target_part_bytes`` of updates however large the
batch. Each part is sorted and consolidated on its own: a batch is a set of sorted
runs, not one globally sorted run. A single large chunk is cut into at least
``max_inflight_uploads`` parts so that they are sorted and encoded in parallel.

**Unsorted parts.** With ``unsorted_min_bytes`` set, a part of at least that many Arrow
bytes is encoded as it came — not sorted, not consolidated (``PartMeta.sorted`` false):
a bulk write then costs an encode, like a plain Parquet write, and the sort moves off
the writer's path to the compactor, which sorts such a part when it loads it. Reads
consolidate across parts either way. Small parts stay sorted (their sort is cheap and
keeps them cheap to merge).

**Key-range parts.** With ``key_range_min_bytes`` set (``PersistConfig``), a chunk of at
least that many Arrow bytes is instead cut at sampled quantiles of its leading key
into ranges of about ``KEY_RANGE_PART_BYTES`` (at least one per upload thread;
``sorted_ranges.SampledKeyRanges``), and each range is sorted, consolidated, encoded and
uploaded by its own task. An integer leading key cut into three or more ranges is sorted
once for the whole chunk and that order cut into slices instead (``sorted_ranges``:
cheaper than the cut and the per-range sorts). The parts are sorted and hold disjoint leading-key ranges,
which their recorded statistics show, so a read takes them as one sorted run laid end
to end (``disjoint_runs``): no merge and no sort (issue 28). The sort costs the writer
about what the smaller, sorted encoding saves on the two upload threads. A chunk that
arrives sorted already is recognised in linear time and cut where it lies, at
leading-key changes, without the sort and the gather (``presorted``).

Every blob key the builder might have written is remembered until the batch is
handed over, so any failure (an upload error, out-of-range times, a lost
compare-and-append via ``abort``) deletes what was written: no partial state is left
behind by the builder itself (a crash is left to the leaked-blob sweeper).
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Executor, Future, ThreadPoolExecutor, wait
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from persist_lib.allocator import keep_freed_pages
from persist_lib.errors import InvalidUsage
from persist_lib.frontier import Antichain, FrontierLike, as_frontier
from persist_lib.location.base import Blob
from persist_lib.shard import part_index
from persist_lib.shard.batch_meta import HollowBatch, PartMeta
from persist_lib.shard.codec import T_COL, Schemas, check_updates
from persist_lib.shard.consolidate import consolidate
from persist_lib.shard.part_fetch import remember_written_part
from persist_lib.shard.part_index import INDEXED_ROW_GROUP_ROWS
from persist_lib.shard.parts import encode_inline_part, encode_part, part_blob_key, part_meta_for
from persist_lib.shard.presorted import consolidate_presorted, cut_points, is_presorted
from persist_lib.shard.sorted_ranges import SampledKeyRanges, SortedKeyRanges
from persist_lib.shard.stats import StatsRecord, footer_part_stats, part_stats
from persist_lib.shard.thread_pools import SharedPool

log = logging.getLogger(__name__)

DEFAULT_TARGET_PART_BYTES = 128 << 20
DEFAULT_INLINE_THRESHOLD = 4096
# A part is tried as an inline IPC part when its table is at most this many times the
# inline threshold (1,000 rows of int64 key + short string: ~40 KB raw, ~10 KB encoded).
INLINE_TRY_RATIO = 8
# Chunks of at least twice this are split across the upload threads (see ``add``).
MIN_PARALLEL_PART_BYTES = 8 << 20
# Parts of at least this many rows that are not indexed (unsorted bulk parts) compute their
# statistics on another thread while they encode (both are Arrow kernels that release the
# GIL): almost all of it the min/max of string columns. Indexed parts read theirs from
# the row-group statistics of their footer (``stats.footer_part_stats``).
MIN_PARALLEL_STATS_ROWS = 1 << 16
# Key-range parts (``key_range_min_bytes``) hold about this many Arrow bytes at most
# (or ``target_part_bytes`` if less): small enough that a streaming read holds one per
# run within a read budget.
KEY_RANGE_PART_BYTES = 32 << 20
# Above this, ranges are gathered with Arrow's take instead of through a ``RowSource``,
# which would hold a converted copy of the chunk's string columns.
KEY_RANGE_SHARED_SOURCE_MAX_BYTES = 256 << 20
# From this many key ranges on, an integer leading key is sorted once for the whole chunk
# (``sorted_ranges``): measured on 4M rows in 5-8 ranges, the writer's CPU fell 16-29%;
# on 1M rows in two ranges it did not change.
SORTED_RANGES_MIN_PIECES = 3

# (never the builder's own executor, whose threads may all be waiting on this work)
_STATS = SharedPool(2, "persist-part-stats")


class BatchBuilder:
    """Builds one batch of a shard from chunks of updates (not thread-safe: one caller)."""

    def __init__(
        self,
        blob: Blob,
        schemas: Schemas,
        *,
        shard: str,
        writer: str,
        lower: FrontierLike,
        target_part_bytes: int = DEFAULT_TARGET_PART_BYTES,
        max_inflight_uploads: int = 2,
        inline_threshold: int = DEFAULT_INLINE_THRESHOLD,
        executor: Executor | None = None,
        consolidated: bool = False,
        unsorted_min_bytes: int | None = None,
        record_stats: bool = True,
        key_range_min_bytes: int | None = None,
    ) -> None:
        """``consolidated``: the caller promises that everything it adds, across all
        ``add`` calls, comes sorted by ``(k, v, t)`` with no duplicate ``(k, v, t)`` and
        no zero diff (the compactor's merge output): parts are then encoded as they
        are, not consolidated again.

        ``record_stats``: record each part's column statistics in its ``PartMeta``
        (``shard.stats``: min, max and null count per column, the time column
        included), so reads with a filter can skip it unfetched. False writes parts as
        writers did before statistics existed (tests of old parts).

        ``key_range_min_bytes``: a chunk of at least that many Arrow bytes is written as
        sorted parts of disjoint leading-key ranges (module docstring), not cut in row
        order (and left unsorted past ``unsorted_min_bytes``); None: never."""
        if target_part_bytes <= 0:
            raise InvalidUsage(
                f"shard {shard}: target_part_bytes must be > 0, got {target_part_bytes}"
            )
        if max_inflight_uploads < 1:
            raise InvalidUsage(
                f"shard {shard}: max_inflight_uploads must be >= 1, got {max_inflight_uploads}"
            )
        if key_range_min_bytes is not None and (
            isinstance(key_range_min_bytes, bool) or not isinstance(key_range_min_bytes, int) or key_range_min_bytes < 0
        ):
            raise InvalidUsage(
                f"shard {shard}: key_range_min_bytes must be None or an int >= 0 (Arrow bytes), "
                f"got {key_range_min_bytes!r}"
            )
        self.blob = blob
        self.schemas = schemas
        self.shard = shard
        self.writer = writer
        self.lower = as_frontier(lower, "lower")
        self.target_part_bytes = target_part_bytes
        self.max_inflight_uploads = max_inflight_uploads
        self.inline_threshold = inline_threshold
        self.consolidated = consolidated
        self.unsorted_min_bytes = unsorted_min_bytes
        self.record_stats = record_stats
        self.key_range_min_bytes = key_range_min_bytes
        self._own_executor = executor is None
        self._executor: Executor = executor or ThreadPoolExecutor(
            max_workers=max_inflight_uploads, thread_name_prefix=f"persist-part-{shard}"
        )
        self._buffer: list[pa.Table] = []
        self._buffered_bytes = 0
        self._futures: list[Future[PartMeta | None]] = []  # in part order
        self._keys: list[str] = []  # every key a task may have written
        self._keys_lock = threading.Lock()
        self._tmin: int | None = None
        self._tmax: int | None = None
        self._rows_added = 0
        self._state = "open"  # -> "finished" | "aborted"

    # -- public API ----------------------------------------------------------------

    @property
    def num_updates_added(self) -> int:
        """Rows added so far (before consolidation)."""
        return self._rows_added

    def add(self, updates: Any) -> None:
        """Buffers a chunk of updates (internal layout; other forms are normalized).

        ``CheckedUpdates`` of this builder's schemas (``WriteHandle.normalize``,
        ``codec.normalize_checked``) are taken as they are: they were checked where they
        entered. Blocks while ``max_inflight_uploads`` parts are being written. If a part
        upload failed, aborts the builder and raises that error. An invalid chunk raises
        ``InvalidUsage`` and is not added (the builder stays usable).
        """
        self._check_open("add")
        table = check_updates(updates, self.schemas, shard=self.shard).table
        n = table.num_rows
        if n == 0:
            return
        mm = pc.min_max(table.column(T_COL))
        lo, hi = int(mm["min"].as_py()), int(mm["max"].as_py())
        self._tmin = lo if self._tmin is None else min(self._tmin, lo)
        self._tmax = hi if self._tmax is None else max(self._tmax, hi)
        self._rows_added += n
        if (
            self.key_range_min_bytes is not None
            and not self.consolidated
            and table.nbytes >= self.key_range_min_bytes
        ):
            if self._buffer:
                self._flush()  # earlier small chunks: a part of their own
            if self._add_key_ranges(table, time=lo if lo == hi else None):
                return
        bytes_per_row = max(table.nbytes / n, 1.0)
        # A large chunk is cut into at least ``max_inflight_uploads`` parts, so that its
        # parts are sorted and encoded on as many threads at once (one 128 MiB part would
        # keep one core busy while the others wait). More, smaller sorted runs cost the
        # compactor little.
        cap = self.target_part_bytes
        if self.max_inflight_uploads > 1 and table.nbytes >= 2 * MIN_PARALLEL_PART_BYTES:
            cap = min(cap, max(MIN_PARALLEL_PART_BYTES, math.ceil(table.nbytes / self.max_inflight_uploads)))
        offset = 0
        while offset < n:
            room = cap - self._buffered_bytes
            rows = max(1, min(n - offset, math.ceil(room / bytes_per_row)))
            piece = table if rows == n else table.slice(offset, rows)
            self._buffer.append(piece)
            self._buffered_bytes += int(rows * bytes_per_row)
            offset += rows
            if self._buffered_bytes >= cap:
                self._flush()

    def finish(self, upper: FrontierLike, since: FrontierLike | None = None) -> HollowBatch:
        """Flushes, waits for every upload and returns the batch ``[lower, upper)``.

        Every added update time must lie in ``[lower, upper)``; otherwise (and on any
        upload failure) every part already written is deleted and the error raised.
        """
        self._check_open("finish")
        try:
            up = as_frontier(upper, "upper")
            sn = self.lower if since is None else as_frontier(since, "since")
            self._check_bounds(up)
            if self._buffer:
                # A batch of one part (every small commit) is written on this thread: a
                # hand-off to the pool and back would only add latency.
                self._flush(inline=not self._futures)
            parts: list[PartMeta] = []
            for fut in self._futures:
                meta = fut.result()  # raises the task's error, if any
                if meta is not None:
                    parts.append(meta)
        except BaseException:
            self.abort()
            raise
        self._state = "finished"
        self._shutdown()
        return HollowBatch(lower=self.lower, upper=up, since=sn, parts=tuple(parts))

    def abort(self) -> int:
        """Deletes every part this builder wrote (best effort); the builder is then closed.

        Also valid after ``finish`` (when the batch's compare-and-append lost). Returns
        the number of blob keys whose deletion was attempted successfully.
        """
        if self._state == "aborted":
            return 0
        self._state = "aborted"
        self._buffer.clear()
        self._buffered_bytes = 0
        for fut in self._futures:
            fut.cancel()
        for fut in self._futures:
            if not fut.cancelled():
                try:
                    fut.result()
                except BaseException:
                    pass  # cleaning up: the error was (or will be) raised by the caller
        self._shutdown()
        with self._keys_lock:
            keys = list(self._keys)
        deleted = 0
        for key in keys:
            try:
                self.blob.delete(key)
                deleted += 1
            except Exception as e:  # best effort: the leaked-blob sweeper catches the rest
                log.warning(
                    "shard %s: could not delete part %s while aborting: %s", self.shard, key, e
                )
        return deleted

    def __enter__(self) -> BatchBuilder:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        # A builder left unfinished (error or not) cleans up what it wrote. A finished
        # batch is the caller's: after an indeterminate append it may be committed.
        if self._state == "open":
            self.abort()

    # -- internals -----------------------------------------------------------------

    def _check_open(self, what: str) -> None:
        if self._state != "open":
            raise InvalidUsage(
                f"shard {self.shard}: batch builder of writer {self.writer} is {self._state}; "
                f"cannot {what}: start a new builder"
            )

    def _check_bounds(self, upper: Antichain) -> None:
        lower = self.lower
        if upper < lower:
            raise InvalidUsage(
                f"shard {self.shard}: batch upper {upper} is less than its lower {lower}"
            )
        if self._tmin is None or self._tmax is None:
            return
        bad: int | None = None
        if not lower.less_equal(self._tmin):
            bad = self._tmin
        elif upper.less_equal(self._tmax):
            bad = self._tmax
        if bad is not None:
            raise InvalidUsage(
                f"shard {self.shard}: update time {bad} is outside the batch bounds "
                f"[lower {lower}, upper {upper}) (times added range over [{self._tmin}, "
                f"{self._tmax}]); every update time t must satisfy lower <= t < upper; the parts "
                "already written were deleted"
            )

    def _raise_failures(self, done: set[Future[PartMeta | None]]) -> None:
        for fut in done:
            if not fut.done() or fut.cancelled():
                continue
            err = fut.exception()
            if err is not None:
                self.abort()
                raise err

    def _wait_for_capacity(self) -> None:
        while True:
            pending = [f for f in self._futures if not f.done()]
            self._raise_failures({f for f in self._futures if f.done()})
            if len(pending) < self.max_inflight_uploads:
                return
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            self._raise_failures(done)

    def _flush(self, *, inline: bool = False) -> None:
        buffered = self._buffer
        self._buffer = []
        self._buffered_bytes = 0
        table = buffered[0] if len(buffered) == 1 else pa.concat_tables(buffered)
        self._wait_for_capacity()
        key = part_blob_key(self.shard, self.writer)
        with self._keys_lock:
            self._keys.append(key)
        if not inline:
            self._futures.append(self._executor.submit(self._write_part, table, key))
            return
        fut: Future[PartMeta | None] = Future()
        self._futures.append(fut)
        try:
            fut.set_result(self._write_part(table, key))
        except BaseException as e:
            fut.set_exception(e)  # raised by finish, like a pool task's error
            if not isinstance(e, Exception):
                raise  # an interrupt: finish aborts the builder on its way out

    def _add_key_ranges(self, table: pa.Table, *, time: int | None) -> bool:
        """Writes ``table`` as sorted parts of disjoint leading-key ranges, each range on
        its own task (module docstring); False (nothing done) when its leading column
        can't be cut into ranges. ``time``: every row is at that time (``sorted_ranges``
        then builds the time column instead of gathering it)."""
        keep_freed_pages()  # the sort's few-MiB arrays reused, not faulted in again (``allocator``)
        cap = min(self.target_part_bytes, KEY_RANGE_PART_BYTES)
        k = max(self.max_inflight_uploads, math.ceil(table.nbytes / cap))
        if is_presorted(table):  # sorted already: cut where it lies (``presorted``)
            bounds = [0, *cut_points(table.column(0), k), table.num_rows]
            for lo, hi in zip(bounds, bounds[1:], strict=False):
                self._submit(self._write_presorted, table.slice(lo, hi - lo))
            return True
        shared = table.nbytes <= KEY_RANGE_SHARED_SOURCE_MAX_BYTES
        # An integer leading key cut into 3+ ranges: one sort of it, cut into slices
        # (``SortedKeyRanges``); else cut at sampled quantiles, each range sorted on its
        # own thread (``SampledKeyRanges``; two ranges: a cut at one pivot is as cheap as
        # the one sort, and the two sorts run in parallel).
        split: SortedKeyRanges | SampledKeyRanges | None = None
        if k >= SORTED_RANGES_MIN_PIECES:
            split = SortedKeyRanges.split(table, k, shared_source=shared, time=time)
        if split is None:
            split = SampledKeyRanges.split(table, k, shared_source=shared, time=time)
        if split is None:
            return False
        for i in range(len(split)):
            self._submit(self._write_range, split, i)
        return True

    def _submit(self, fn: Callable[..., PartMeta | None], *args: Any, **kw: Any) -> None:
        """Runs ``fn(*args, key, **kw)`` in the pool once a slot is free, ``key`` a fresh
        part key (remembered: ``abort`` deletes it)."""
        self._wait_for_capacity()
        key = part_blob_key(self.shard, self.writer)
        with self._keys_lock:
            self._keys.append(key)
        self._futures.append(self._executor.submit(fn, *args, key, **kw))

    def _write_presorted(self, piece: pa.Table, key: str) -> PartMeta | None:
        """Runs in the pool: consolidates a slice of a sorted chunk in place, then stores it."""
        return self._store_part(consolidate_presorted(piece), key, unsorted=False)

    def _write_range(self, split: SortedKeyRanges | SampledKeyRanges, i: int, key: str) -> PartMeta | None:
        """Runs in the pool: sorts and consolidates key range ``i``, then stores it."""
        return self._store_part(split.table(i), key, unsorted=False)

    def _write_part(self, table: pa.Table, key: str) -> PartMeta | None:
        """Runs in the pool: consolidate (unless unsorted), encode, then upload or keep inline."""
        unsorted = (
            not self.consolidated
            and self.unsorted_min_bytes is not None
            and table.nbytes >= self.unsorted_min_bytes
        )
        if unsorted:
            part = table
        else:
            part = table.combine_chunks() if self.consolidated else consolidate(table)
        return self._store_part(part, key, unsorted=unsorted)

    def _store_part(self, part: pa.Table, key: str, *, unsorted: bool) -> PartMeta | None:
        """Encodes a part (with its statistics), then uploads it or keeps it inline."""
        if part.num_rows == 0:
            return None
        ipc = self._inline_form(part)
        if ipc is not None:  # small: an IPC inline part, no Parquet encode at all
            ipc_stats = part_stats(part, self.schemas) if self.record_stats else None
            return part_meta_for(ipc, part, None, inline=True, sorted=not unsorted, stats=ipc_stats)
        # Sorted parts get the row-group index for ranged reads (with the statistics: a
        # builder told to record none writes parts as the writers before both did).
        indexed = self.record_stats and not unsorted
        # An indexed part's encode writes Parquet statistics per row group: its own
        # statistics are read from those (``stats.footer_part_stats``), not computed again.
        from_footer = indexed and part.num_rows > INDEXED_ROW_GROUP_ROWS
        pending: Future[Any] | None = None
        if self.record_stats and not from_footer and part.num_rows >= MIN_PARALLEL_STATS_ROWS:
            pending = _STATS.get().submit(part_stats, part, self.schemas)
        try:
            data = encode_part(part, self.schemas, indexed=indexed)
        except BaseException:
            if pending is not None:
                pending.cancel()
            raise
        md: pq.FileMetaData | None = None
        stats: StatsRecord | None
        if from_footer:
            md = pq.read_metadata(pa.BufferReader(data))
            stats = footer_part_stats(part, self.schemas, md)
        elif pending is not None:
            stats = pending.result()
        else:
            stats = part_stats(part, self.schemas) if self.record_stats else None
        inline = len(data) <= self.inline_threshold
        if not inline:
            self.blob.set(key, data)
        meta = part_meta_for(
            data, part, None if inline else key, inline=inline, sorted=not unsorted, stats=stats, md=md
        )
        remember_written_part(meta.sha256, self.schemas, part)
        return meta

    def _inline_form(self, part: pa.Table) -> bytes | None:
        """``part`` as an inline IPC part (``inline_format``) when it fits under the
        inline threshold; None (write Parquet) when it doesn't. Tried only on tables at
        most ``INLINE_TRY_RATIO`` times the threshold: zstd rarely shrinks more.

        Not offered to the decoded-part cache: decoding an IPC part costs a merge less
        than the copy the cache would need (``remember_written_part``) costs the writer."""
        if self.inline_threshold <= 0 or part.nbytes > INLINE_TRY_RATIO * self.inline_threshold:
            return None
        if self.record_stats and part.num_rows > part_index.INDEXED_ROW_GROUP_ROWS:
            return None  # it gets a row-group index (ranged reads): a Parquet part
        data = encode_inline_part(part, self.schemas)
        return data if len(data) <= self.inline_threshold else None

    def _shutdown(self) -> None:
        if self._own_executor:
            self._executor.shutdown(wait=False, cancel_futures=True)


def build_batch(
    blob: Blob,
    schemas: Schemas,
    table: Any,
    *,
    shard: str,
    writer: str,
    lower: FrontierLike,
    upper: FrontierLike,
    since: FrontierLike | None = None,
    **kw: Any,
) -> HollowBatch:
    """One-shot: builds a batch ``[lower, upper)`` from one table (or any update form)."""
    builder = BatchBuilder(blob, schemas, shard=shard, writer=writer, lower=lower, **kw)
    try:
        builder.add(table)
        return builder.finish(upper, since)
    except BaseException:
        builder.abort()
        raise


def delete_batch_blobs(blob: Blob, batch: HollowBatch) -> int:
    """Best-effort deletion of a batch's blob parts (e.g. after a lost compare-and-append).

    Returns the number of keys deleted without error; failures are logged and left to
    the leaked-blob sweeper.
    """
    deleted = 0
    for key in batch.blob_keys():
        try:
            blob.delete(key)
            deleted += 1
        except Exception as e:
            log.warning("could not delete part %s of an abandoned batch: %s", key, e)
    return deleted
