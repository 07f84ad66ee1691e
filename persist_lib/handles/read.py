"""Read handles: leased readers (snapshot, splits, listen) and critical since handles.

A leased ``ReadHandle`` holds a ``since`` (compaction may not forward times past it)
and a *seqno hold* (GC may not delete anything a state version at or after the hold
references). Every read registers the seqno of the state version it reads from until
it is done, and the hold only moves up to the oldest such registration, so a blob a
read is fetching can't be deleted under it — unless the lease lapses, in which case
the read fails with ``LeaseExpired`` rather than returning partial data.

**Memory.** Reads have a budget (``memory_budget``, default
``PersistConfig.read_memory_budget``). A read whose parts, decoded whole, fit it is
done the simple way (fetch every part in parallel, one consolidate). A larger one
streams: ``snapshot_batches`` / ``updates_between_batches`` yield record batches from
the compactor's k-way merge of the parts' sorted runs (``compactor.stream_merge``),
holding about one decoded part per run plus the merge's chunks; runs that don't fit
together are first merged into spill files in the local temporary directory
(``$TMPDIR``), deleted when the stream ends. The stream holds its seqno hold
until it is exhausted, closed or garbage collected. ``snapshot`` and
``updates_between`` build their table from the stream when the read is large, and a
``Listen`` whose next range is large hands its updates out over several ``next``
calls, batch by batch of the trace (in time order), in chunks.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import Counter, deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import pyarrow as pa

from persist_lib.errors import BlobNotFound, InvalidUsage, LeaseExpired, Timeout
from persist_lib.frontier import Antichain, FrontierLike, as_frontier, check_time
from persist_lib.location.base import Blob
from persist_lib.shard import state as st
from persist_lib.shard import transitions as tr
from persist_lib.shard.batch_meta import HollowBatch, PartMeta
from persist_lib.shard.codec import Schemas, to_user_table, user_schema
from persist_lib.shard.consolidate import consolidate
from persist_lib.shard.kway_merge import FEW_RUNS, merges_linearly
from persist_lib.shard.machine import Machine
from persist_lib.shard.memory_plan import STEP_BYTES_PER_ROW, MergeStats, estimate_decoded_bytes
from persist_lib.shard.metrics import track_listen
from persist_lib.shard.parts import fetch_part
from persist_lib.shard.read_merge import merge_decoded_runs, stream_merge
from persist_lib.shard.runs import batch_runs
from persist_lib.shard.sorted_checks import SORTED_STRICT, SORTED_WITH_TIES, sorted_state
from persist_lib.shard.time_filters import snapshot_at, time_range

if TYPE_CHECKING:  # pragma: no cover
    from persist_lib.handles.client import PersistClient


@dataclass(frozen=True)
class ListenUpdates:
    """Updates with times in ``[lower, upper)``: key fields, value fields, ``ts``, ``diff``."""

    table: pa.Table
    lower: Antichain
    upper: Antichain


@dataclass(frozen=True)
class ListenProgress:
    """Every update at a time before ``upper`` has been emitted."""

    upper: Antichain


ListenEvent = ListenUpdates | ListenProgress

MiB = 1 << 20
T = TypeVar("T")
# Whole (in-memory) snapshots of at most this many sorted runs merge them instead of
# sorting their concatenation (``compactor.merge_decoded_runs``).
MERGE_DECODED_MAX_RUNS = FEW_RUNS


def _close_source(source: Iterator[Any], release: Callable[[], None]) -> None:
    try:
        close = getattr(source, "close", None)
        if close is not None:
            close()
    finally:
        release()


class HeldIterator(Generic[T]):
    """An iterator that holds something (a reader's seqno hold) while it is open.

    What it holds is released exactly once: when the iterator is exhausted, raises,
    is closed (``close()``, or leaving a ``with`` block) or is garbage collected.
    """

    def __init__(self, source: Iterator[T], release: Callable[[], None]) -> None:
        self._source = source
        # The finalizer references the source and the release callback, never self.
        self._finalizer = weakref.finalize(self, _close_source, source, release)

    def __iter__(self) -> HeldIterator[T]:
        return self

    def __next__(self) -> T:
        if not self._finalizer.alive:
            raise StopIteration
        try:
            return next(self._source)
        except BaseException:  # exhausted (StopIteration) or failed: release now
            self.close()
            raise

    def close(self) -> None:
        """Stops the iteration and releases what it holds (idempotent)."""
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def __enter__(self) -> HeldIterator[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class BatchStream(HeldIterator[pa.RecordBatch]):
    """Record batches of a streaming read (key fields, value fields, ``ts``, ``diff``).

    Iterate it (or ``read_all()``); close it (or use ``with``) when stopping early. It
    holds its reader's seqno hold until then, so the parts it reads can't be garbage
    collected under it. ``stats`` fills in as it is read (runs, passes, rows, the most
    the merge held at once; ``passes == 0``: the parts were small and read whole).
    """

    def __init__(
        self,
        source: Iterator[pa.RecordBatch],
        schema: pa.Schema,
        release: Callable[[], None],
        stats: MergeStats | None = None,
    ) -> None:
        super().__init__(source, release)
        self.schema = schema
        self.stats = stats if stats is not None else MergeStats()

    def __enter__(self) -> BatchStream:
        return self

    def read_all(self) -> pa.Table:
        """The rest of the stream as one table (then closed)."""
        with self:
            return pa.Table.from_batches(list(self), schema=self.schema)


def _whole_read_bytes(parts: list[PartMeta], schemas: Schemas) -> int:
    """What reading ``parts`` whole costs at peak: the decoded parts (fetched in
    parallel), their concatenation and the consolidated output, plus the consolidate's
    working set per row."""
    dec = sum(estimate_decoded_bytes(p, schemas) for p in parts)
    rows = sum(p.count for p in parts)
    return 3 * dec + rows * STEP_BYTES_PER_ROW


def _row_width(schemas: Schemas) -> int:
    """Bytes per row of the internal layout (variable-width fields counted as 32)."""
    from persist_lib.shard.codec import internal_schema

    w = 0
    for f in internal_schema(schemas):
        try:
            w += max(1, f.type.bit_width // 8)
        except ValueError:
            w += 32
    return w


# A single run with ties at most this long is consolidated by a sort rather than merged.
SMALL_TIED_RUN_ROWS = 1 << 16


def _single_run_snapshot(run_tables: list[pa.Table], schemas: Schemas) -> pa.Table | None:
    """The snapshot of a single consolidated run whose times were forwarded to the
    as-of (the usual old-time read of a compacted shard), or None to merge as usual.

    Rows strictly increasing by ``(k, v)`` consolidate with nothing (and none has a
    zero diff: parts are consolidated), so the run is the snapshot: a linear check
    instead of a merge. A short run with ties (the same record written at several
    times up to the as-of) is consolidated directly. Flat key types only
    (``compactor.merges_linearly``)."""
    if len(run_tables) != 1:
        return None
    table = run_tables[0]
    if table.num_rows < 2:
        return table
    n = len(schemas.key) + len(schemas.val)
    state = sorted_state(table.columns[:n])
    if state == SORTED_STRICT:
        return table
    if state == SORTED_WITH_TIES and table.num_rows <= SMALL_TIED_RUN_ROWS:
        return consolidate(table)
    return None


def _batch_overlaps(b: HollowBatch, lower: int, upper: int | None) -> bool:
    """Whether batch ``b`` may hold updates at times in ``[lower, upper)``."""
    return (b.upper.is_empty() or (b.upper.time or 0) > lower) and (upper is None or (b.lower.time or 0) < upper)


def _part_overlaps(p: PartMeta, lower: int, upper: int | None) -> bool:
    return p.tmax >= lower and (upper is None or p.tmin < upper)


@dataclass(frozen=True)
class SnapshotSplit:
    """A picklable piece of a snapshot that any process with the blob URI can fetch.

    Concatenating the fetched splits and consolidating gives the snapshot.
    """

    blob_uri: str
    shard_id: str
    schemas_json: dict[str, Any]
    as_of: int
    parts: tuple[PartMeta, ...]

    def __repr__(self) -> str:
        # The URI may carry credentials (an S3 secret key): never show it unredacted.
        from persist_lib.location.redaction import SensitiveUrl

        return (
            f"SnapshotSplit(blob_uri={SensitiveUrl(self.blob_uri).redacted!r}, shard_id={self.shard_id!r}, "
            f"as_of={self.as_of}, parts={len(self.parts)})"
        )

    def fetch(self, blob: Blob | None = None) -> pa.Table:
        from persist_lib.location.uri import open_blob

        schemas = Schemas.from_json(self.schemas_json)
        b = blob if blob is not None else open_blob(self.blob_uri)
        tables = [snapshot_at(fetch_part(b, p, schemas, self.shard_id), self.as_of) for p in self.parts]
        internal = consolidate(_concat(tables, schemas))
        return to_user_table(internal, schemas)


@dataclass(frozen=True)
class RangeSplit:
    """A picklable piece of the updates at times in ``[lower, upper)`` (times not
    forwarded), fetched by any process with the blob URI: the time-range counterpart of
    ``SnapshotSplit``. Concatenating the fetched splits and consolidating gives
    ``ReadHandle.updates_between(lower, upper)``."""

    blob_uri: str
    shard_id: str
    schemas_json: dict[str, Any]
    lower: int
    upper: int
    parts: tuple[PartMeta, ...]

    def __repr__(self) -> str:
        from persist_lib.location.redaction import SensitiveUrl

        return (
            f"RangeSplit(blob_uri={SensitiveUrl(self.blob_uri).redacted!r}, shard_id={self.shard_id!r}, "
            f"lower={self.lower}, upper={self.upper}, parts={len(self.parts)})"
        )

    def fetch(self, blob: Blob | None = None) -> pa.Table:
        from persist_lib.location.uri import open_blob

        schemas = Schemas.from_json(self.schemas_json)
        b = blob if blob is not None else open_blob(self.blob_uri)
        tables = [time_range(fetch_part(b, p, schemas, self.shard_id), self.lower, self.upper) for p in self.parts]
        return to_user_table(consolidate(_concat(tables, schemas)), schemas)


def _balance(parts: list[PartMeta], n: int) -> list[list[PartMeta]]:
    """Greedy: the largest part into the lightest of ``n`` splits."""
    buckets: list[list[PartMeta]] = [[] for _ in range(max(1, n))]
    sizes = [0] * len(buckets)
    for p in sorted(parts, key=lambda p: -p.size):
        i = sizes.index(min(sizes))
        buckets[i].append(p)
        sizes[i] += p.size
    return buckets


def _parts_in_range(state: st.ShardState, lower: int, upper: int | None) -> list[PartMeta]:
    """The parts that may hold updates at times in ``[lower, upper)`` (``None``: no
    upper bound)."""
    return [
        p
        for _, b in state.trace_batches()
        if _batch_overlaps(b, lower, upper)
        for p in b.parts
        if _part_overlaps(p, lower, upper)
    ]


def _concat(tables: list[pa.Table], schemas: Schemas) -> pa.Table:
    from persist_lib.shard.codec import empty_updates

    if not tables:
        return empty_updates(schemas)
    return pa.concat_tables(tables)


class ReadHandle:
    """A leased reader of one shard."""

    def __init__(
        self, client: PersistClient, machine: Machine, reader_id: str, schemas: Schemas, purpose: str
    ) -> None:
        self._client = client
        self._machine = machine
        self.reader_id = reader_id
        self.schemas = schemas
        self.purpose = purpose
        self._holds: Counter[int] = Counter()
        self._released: deque[int] = deque()  # holds released by streams, to apply
        self._split_holds: list[int] = []
        self._lock = threading.Lock()
        self._expired = False
        self.last_heartbeat_monotonic = time.monotonic()

    @property
    def shard_id(self) -> str:
        return self._machine.shard_id

    @property
    def client(self) -> PersistClient:
        """The client this handle was opened from (its locations and config)."""
        return self._client

    @property
    def since(self) -> Antichain:
        """This reader's since (it may read at any time at or beyond it)."""
        return self._me(self._machine.cached()).since

    @property
    def upper(self) -> Antichain:
        return self._machine.cached().upper

    # ----- snapshots ----------------------------------------------------------------

    def snapshot(
        self, as_of: int, timeout_s: float | None = None, *, memory_budget: int | None = None
    ) -> pa.Table:
        """The shard's contents at ``as_of``: every update at ``t <= as_of``, consolidated.

        Waits (up to ``timeout_s``) while ``as_of`` is not yet complete (``as_of >= upper``);
        ``as_of`` below this reader's since is an ``InvalidUsage``. The table is whole in
        memory; when decoding every part at once would exceed ``memory_budget`` it is
        built from ``snapshot_batches`` (the table plus about the budget at peak).
        """
        self._check_open()
        as_of = check_time(as_of, "as_of")
        budget = self._read_budget(memory_budget)
        with self._hold():
            state = self._wait_for_upper_beyond(as_of, timeout_s)
            self._check_as_of(state, as_of)
            tables = list(self._snapshot_tables(state, as_of, budget))
        return to_user_table(_concat(tables, self.schemas), self.schemas)

    def snapshot_batches(
        self, as_of: int, *, memory_budget: int | None = None, timeout_s: float | None = None
    ) -> BatchStream:
        """``snapshot(as_of)`` as a stream of record batches, within ``memory_budget``
        (default ``PersistConfig.read_memory_budget``, at least 1 MiB) however large the
        shard: the same rows (each ``(k, v)`` at most once, nonzero diffs, ``ts`` =
        ``as_of``), in ``(k, v)`` order.

        Arguments are checked, and the wait for the upper done, before this returns
        (``InvalidUsage``, ``Timeout`` as for ``snapshot``); parts are fetched as the
        stream is iterated. The stream holds this reader's seqno hold until it is
        exhausted, closed or garbage collected: close it when stopping early (``with``).
        """
        self._check_open()
        as_of = check_time(as_of, "as_of")
        budget = self._read_budget(memory_budget)
        seqno = self._take_hold()
        try:
            state = self._wait_for_upper_beyond(as_of, timeout_s)
            self._check_as_of(state, as_of)
        except BaseException:
            self._release_hold(seqno)
            raise
        stats = MergeStats()
        return self._stream(self._snapshot_tables(state, as_of, budget, stats), budget, seqno, stats)

    def _snapshot_tables(
        self, state: st.ShardState, as_of: int, budget: int, stats: MergeStats | None = None
    ) -> Iterator[pa.Table]:
        """The snapshot at ``as_of`` as consolidated tables (internal layout)."""
        stats = stats if stats is not None else MergeStats()
        runs = [
            [p for p in run if p.tmin <= as_of]
            for _, b in state.trace_batches()
            if b.lower.less_equal(as_of)
            for run in batch_runs(b)
        ]
        runs = [run for run in runs if run]
        parts = [p for run in runs for p in run]
        if _whole_read_bytes(parts, self.schemas) <= budget:
            stats.runs += len(runs)
            if 1 <= len(runs) <= MERGE_DECODED_MAX_RUNS and merges_linearly(self.schemas):
                # A few sorted runs (a compacted shard: one): merged, not sorted again.
                # Unsorted parts are sorted as they are fetched, in parallel.
                def post(t: pa.Table, p: PartMeta) -> pa.Table:
                    t = snapshot_at(t, as_of)
                    return t if p.sorted else consolidate(t)

                fetched = iter(self._fetch_all(parts, post))
                run_tables = [_concat([next(fetched) for _ in run], self.schemas) for run in runs]
                only = _single_run_snapshot(run_tables, self.schemas)
                if only is not None:
                    stats.output_rows += only.num_rows
                    if only.num_rows:
                        yield only
                    return
                before = stats.output_rows
                merged = merge_decoded_runs(self.schemas, self.shard_id, run_tables, budget, stats)
                if merged is not None:
                    yield from (t for t in merged if t.num_rows)
                    return
                stats.output_rows = before
                tables = run_tables  # a run was not sorted: consolidate the lot
            else:
                tables = self._fetch_all(parts, lambda t, p: snapshot_at(t, as_of))
            out = consolidate(_concat(tables, self.schemas))
            stats.output_rows += out.num_rows
            if out.num_rows:
                yield out
            return
        yield from self._guard_missing(
            stream_merge(
                self._client.blob, self.schemas, shard=self.shard_id, runs=runs, memory_budget=budget,
                since=as_of, upper=as_of + 1, stats=stats, purpose="snapshot read",
            )
        )

    def _range_tables(
        self, state: st.ShardState, lower: int, upper: int | None, budget: int, *, sort_by_time: bool,
        stats: MergeStats | None = None,
    ) -> Iterator[pa.Table]:
        """The updates at times in ``[lower, upper)`` as consolidated tables (internal
        layout), batch by batch of the trace, so in time order across tables (batches
        hold disjoint time ranges, so nothing consolidates across them); each table is
        sorted by time if ``sort_by_time``, else by ``(k, v, t)``."""
        stats = stats if stats is not None else MergeStats()
        parts = _parts_in_range(state, lower, upper)
        if _whole_read_bytes(parts, self.schemas) <= budget:
            tables = self._fetch_all(parts, lambda t, p: time_range(t, lower, upper))
            out = consolidate(_concat(tables, self.schemas))
            stats.output_rows += out.num_rows
            if out.num_rows:
                yield out.sort_by([("t", "ascending")]) if sort_by_time else out
            return
        for _, b in state.trace_batches():
            if not _batch_overlaps(b, lower, upper):
                continue
            runs = [[p for p in run if _part_overlaps(p, lower, upper)] for run in batch_runs(b)]
            for t in self._guard_missing(
                stream_merge(
                    self._client.blob, self.schemas, shard=self.shard_id, runs=runs,
                    memory_budget=budget, lower=lower, upper=upper, stats=stats, purpose="range read",
                )
            ):
                yield t.sort_by([("t", "ascending")]) if sort_by_time else t

    def _stream(self, tables: Iterator[pa.Table], budget: int, seqno: int, stats: MergeStats) -> BatchStream:
        """Wraps internal tables as a ``BatchStream`` that releases ``seqno`` when done."""
        schemas = self.schemas
        max_rows = max(1024, (budget // 32) // max(1, _row_width(schemas)))

        def batches() -> Iterator[pa.RecordBatch]:
            for t in tables:
                self._check_open()
                yield from to_user_table(t, schemas).to_batches(max_chunksize=max_rows)

        return BatchStream(batches(), user_schema(schemas), lambda: self._release_hold(seqno), stats)

    def _guard_missing(self, it: Iterator[pa.Table]) -> Iterator[pa.Table]:
        """A missing blob we were entitled to read means our lease lapsed (expiry dropped
        our seqno hold and GC ran): that raises ``LeaseExpired``; anything else is a loss."""
        try:
            yield from it
        except BlobNotFound:
            self._me(self._machine.fetch_latest())
            raise

    def _read_budget(self, memory_budget: int | None) -> int:
        b = self._client.config.read_memory_budget if memory_budget is None else memory_budget
        if isinstance(b, bool) or not isinstance(b, int) or b < MiB:
            raise InvalidUsage(
                f"shard {self.shard_id}: memory_budget must be an int >= 1 MiB ({MiB} bytes), got {b!r}"
            )
        return b

    def snapshot_splits(self, as_of: int, num_splits: int, timeout_s: float | None = None) -> list[SnapshotSplit]:
        """Splits of the snapshot at ``as_of`` that other processes (Spark executors) fetch.

        This handle keeps a seqno hold for the splits until ``release_splits`` (or
        ``expire``), so their parts can't be garbage collected while they're fetched.
        """
        self._check_open()
        as_of = check_time(as_of, "as_of")
        if num_splits < 1:
            raise InvalidUsage(f"shard {self.shard_id}: num_splits must be >= 1, got {num_splits}")
        with self._lock:  # hold first, then read state: the hold is <= that state's seqno
            held = self._machine.cached().seqno
            self._holds[held] += 1
            self._split_holds.append(held)
        try:
            state = self._wait_for_upper_beyond(as_of, timeout_s)
            self._check_as_of(state, as_of)
        except BaseException:
            self._drop_last_split_hold(held)
            raise
        parts = [p for _, b in state.trace_batches() if b.lower.less_equal(as_of) for p in b.parts]
        sj = self.schemas.to_json()
        return [
            SnapshotSplit(self._client.blob_uri, self.shard_id, sj, as_of, tuple(b))
            for b in _balance(parts, num_splits)
        ]

    def range_splits(
        self, lower: int, upper: int, num_splits: int, timeout_s: float | None = None
    ) -> list[RangeSplit]:
        """Splits of the updates at times in ``[lower, upper)`` (``updates_between``,
        distributed) that other processes fetch. Waits for the upper; ``lower`` must be
        beyond this reader's since (or both 0), as for ``updates_between``. Holds a seqno
        for the splits until ``release_splits``."""
        self._check_open()
        lower = check_time(lower, "lower")
        upper = check_time(upper, "upper")
        if upper < lower:
            raise InvalidUsage(f"shard {self.shard_id}: range [{lower}, {upper}) is backwards")
        if num_splits < 1:
            raise InvalidUsage(f"shard {self.shard_id}: num_splits must be >= 1, got {num_splits}")
        with self._lock:
            held = self._machine.cached().seqno
            self._holds[held] += 1
            self._split_holds.append(held)
        try:
            state = self._wait_for_upper_beyond(max(upper, 1) - 1, timeout_s)
            self._check_range_lower(state, lower)
        except BaseException:
            self._drop_last_split_hold(held)
            raise
        parts = _parts_in_range(state, lower, upper) if upper > lower else []
        sj = self.schemas.to_json()
        return [
            RangeSplit(self._client.blob_uri, self.shard_id, sj, lower, upper, tuple(b))
            for b in [b for b in _balance(parts, num_splits) if b] or [[]]
        ]

    def _drop_last_split_hold(self, held: int) -> None:
        """Undoes the split hold of a planning call that failed."""
        with self._lock:
            if held in self._split_holds:
                self._split_holds.remove(held)
                self._holds[held] -= 1
                if self._holds[held] <= 0:
                    del self._holds[held]

    def _check_range_lower(self, state: st.ShardState, lower: int) -> None:
        since = self._me(state).since
        if not (since.less_than(lower) or since.time == lower == 0):
            raise InvalidUsage(
                f"shard {self.shard_id}: can't read updates from {lower}: it is not beyond "
                f"this reader's since {since} (updates before the since may have been "
                f"forwarded to it by compaction); read from {since} + 1 on, and take a "
                "snapshot at the since for what came before"
            )

    def release_splits(self) -> None:
        """Releases the seqno holds taken by ``snapshot_splits``."""
        with self._lock:
            for s in self._split_holds:
                self._holds[s] -= 1
                if self._holds[s] <= 0:
                    del self._holds[s]
            self._split_holds.clear()

    def updates_between(
        self, lower: int, upper: int, timeout_s: float | None = None, *, memory_budget: int | None = None
    ) -> pa.Table:
        """Every update at times in ``[lower, upper)``, consolidated (times not forwarded),
        sorted by time.

        Waits until the shard upper reaches ``upper``. ``lower`` must be *beyond* this
        reader's since (or both 0): compaction forwards older updates to the since, so the
        updates at the since itself are not the ones that happened then. The building
        block of incremental (listen-range) reads.
        """
        self._check_open()
        lower, upper = self._check_range_args(lower, upper)
        budget = self._read_budget(memory_budget)
        if upper == lower:
            return to_user_table(_concat([], self.schemas), self.schemas)
        with self._hold():
            state = self._wait_for_upper_beyond(upper - 1, timeout_s)
            self._check_range_lower(state, lower)
            tables = list(self._range_tables(state, lower, upper, budget, sort_by_time=False))
        internal = _concat(tables, self.schemas)
        return to_user_table(internal.sort_by([("t", "ascending")]), self.schemas)

    def updates_between_batches(
        self, lower: int, upper: int, *, memory_budget: int | None = None, timeout_s: float | None = None
    ) -> BatchStream:
        """``updates_between(lower, upper)`` as a stream of record batches within
        ``memory_budget``: the same rows, in time order batch by batch of the shard's
        trace (each batch of the trace covers its own time range) and sorted by time
        within each record batch, but not globally (one large trace batch comes out in
        several record batches, each sorted by time).

        Arguments are checked and the upper waited for before this returns; the stream
        holds this reader's seqno hold until it is exhausted, closed or collected.
        """
        self._check_open()
        lower, upper = self._check_range_args(lower, upper)
        budget = self._read_budget(memory_budget)
        seqno = self._take_hold()
        try:
            if upper > lower:
                state = self._wait_for_upper_beyond(upper - 1, timeout_s)
                self._check_range_lower(state, lower)
        except BaseException:
            self._release_hold(seqno)
            raise
        stats = MergeStats()
        tables: Iterator[pa.Table] = (
            self._range_tables(state, lower, upper, budget, sort_by_time=True, stats=stats)
            if upper > lower
            else iter(())
        )
        return self._stream(tables, budget, seqno, stats)

    def _check_range_args(self, lower: int, upper: int) -> tuple[int, int]:
        lower = check_time(lower, "lower")
        upper = check_time(upper, "upper")
        if upper < lower:
            raise InvalidUsage(f"shard {self.shard_id}: range [{lower}, {upper}) is backwards")
        return lower, upper

    # ----- listen -------------------------------------------------------------------

    def listen(self, as_of: int, *, memory_budget: int | None = None) -> Listen:
        """Every update at times ``> as_of``, in time order, with progress events.

        Together with ``snapshot(as_of)`` it reproduces the collection at every later time.
        A ``next`` call decodes about ``memory_budget`` at most (see ``Listen.next``).
        """
        self._check_open()
        as_of = check_time(as_of, "as_of")
        budget = self._read_budget(memory_budget)
        state = self._machine.cached()
        if not state.exists:
            state = self._machine.fetch_latest()
        self._check_as_of(state, as_of)
        listen = Listen(self, as_of, budget)
        if self._client.metrics is not None:
            track_listen(listen, self)  # its lag, for metrics
        return listen

    # ----- since -----------------------------------------------------------------------

    def downgrade_since(self, new_since: FrontierLike) -> None:
        """Gives up reading at times before ``new_since`` (never moves backwards)."""
        self._check_open()
        since = as_frontier(new_since, "new_since")
        self._apply_since(since)

    def heartbeat(self) -> None:
        """Extends the lease (and moves the seqno hold up to the oldest outstanding read)."""
        self._check_open()
        self._apply_since(None)

    def _apply_since(self, since: Antichain | None) -> None:
        def fn(s: st.ShardState, now: int) -> tr.Result:
            target = since if since is not None else self._me(s).since
            return tr.downgrade_since(
                s, now, reader_id=self.reader_id, new_since=target, seqno_hold=self._hold_seqno(s)
            )

        self._machine.apply("downgrade_since", fn)
        self.last_heartbeat_monotonic = time.monotonic()

    def _hold_seqno(self, s: st.ShardState) -> int:
        with self._lock:
            self._apply_released()
            held = min(self._holds) if self._holds else None
        return s.seqno if held is None else min(held, s.seqno)

    def expire(self) -> None:
        """Unregisters this reader, releasing its since and seqno holds."""
        if self._expired:
            return
        self._expired = True
        self._client._forget_handle(self)
        self._machine.apply(
            "expire_reader", lambda s, now: tr.expire_reader(s, now, reader_id=self.reader_id)
        )

    close = expire

    def __enter__(self) -> ReadHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.expire()

    def __repr__(self) -> str:
        return f"ReadHandle(shard={self.shard_id}, reader={self.reader_id})"

    # ----- internals ------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._expired:
            raise InvalidUsage(
                f"shard {self.shard_id}: read handle {self.reader_id} was expired; open a new one"
            )

    def _me(self, s: st.ShardState) -> st.LeasedReaderState:
        r = s.leased_readers.get(self.reader_id)
        if r is None:
            if s.exists and not self._expired:
                # Maybe our cache is stale (we registered in a newer state): re-read once.
                s = self._machine.fetch_latest()
                r = s.leased_readers.get(self.reader_id)
            if r is None:
                raise LeaseExpired(
                    f"shard {self.shard_id}: reader {self.reader_id} is no longer registered (its "
                    "lease expired and maintenance expired it); open a new read handle"
                )
        return r

    def _check_as_of(self, s: st.ShardState, as_of: int) -> None:
        since = self._me(s).since
        if not since.less_equal(as_of):
            raise InvalidUsage(
                f"shard {self.shard_id}: can't read as of {as_of}: it is before this reader's since "
                f"{since} (history before the since may have been compacted away); read as of a "
                "time >= the since"
            )

    def _wait_for_upper_beyond(self, as_of: int, timeout_s: float | None) -> st.ShardState:
        timeout = self._client.config.snapshot_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        s = self._machine.cached()
        if not s.exists or s.upper.less_equal(as_of):
            s = self._machine.fetch_latest()
        while s.upper.less_equal(as_of):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise Timeout(
                    f"shard {self.shard_id}: waited {timeout:.1f}s for the upper to pass {as_of} "
                    f"but it is still {s.upper}; data at that time isn't complete yet"
                )
            s = self._machine.wait_for_newer(s.seqno, remaining)
        return s

    @contextmanager
    def _hold(self) -> Iterator[int]:
        """Holds the cached seqno while a read runs (yields it).

        Taken *before* the read picks the state version it reads, so a concurrent
        heartbeat can never move this reader's durable seqno hold past that version.
        """
        seqno = self._take_hold()
        try:
            yield seqno
        finally:
            with self._lock:
                self._holds[seqno] -= 1
                if self._holds[seqno] <= 0:
                    del self._holds[seqno]

    def _take_hold(self, seqno: int | None = None) -> int:
        """Registers a hold on ``seqno`` (default: the cached state's, taken before the
        read picks its state version; an explicit one must already be held)."""
        with self._lock:
            s = self._machine.cached().seqno if seqno is None else seqno
            self._holds[s] += 1
        return s

    def _release_hold(self, seqno: int) -> None:
        """Releases a hold taken by ``_take_hold`` for a stream. May run in a finalizer
        (any thread, at any allocation): it never waits for the lock; a release that
        can't take it now is applied by the next heartbeat (the only reader of holds)."""
        self._released.append(seqno)
        if self._lock.acquire(blocking=False):
            try:
                self._apply_released()
            finally:
                self._lock.release()

    def _apply_released(self) -> None:
        """Applies released stream holds (the lock is held)."""
        while True:
            try:
                s = self._released.popleft()
            except IndexError:
                return
            self._holds[s] -= 1
            if self._holds[s] <= 0:
                del self._holds[s]

    def _held_seqnos(self) -> dict[int, int]:
        """The seqnos this handle holds, with counts (for tests and ``inspect``)."""
        with self._lock:
            self._apply_released()
            return dict(self._holds)

    def _fetch_all(self, parts: list[PartMeta], post: Any) -> list[pa.Table]:
        """Fetches and decodes ``parts`` in parallel, each passed through ``post(table,
        part)``; in the order of ``parts``."""
        blob = self._client.blob

        def one(p: PartMeta) -> pa.Table:
            return post(fetch_part(blob, p, self.schemas, self.shard_id), p)

        try:
            if len(parts) <= 1:
                return [one(p) for p in parts]
            with ThreadPoolExecutor(max_workers=self._client.config.fetch_parallelism) as ex:
                return list(ex.map(one, parts))
        except BlobNotFound:
            # A missing blob we were entitled to read means our lease lapsed (expiry
            # dropped our seqno hold and GC ran); anything else is a real loss.
            self._me(self._machine.fetch_latest())
            raise


class Listen:
    """An ongoing subscription: ``next(timeout)`` returns the events since the last call."""

    def __init__(self, handle: ReadHandle, as_of: int, memory_budget: int | None = None) -> None:
        self._h = handle
        self.as_of = as_of
        self._frontier: Antichain = Antichain([as_of + 1])
        self._budget = handle._read_budget(memory_budget)
        # A range too large to decode at once, being handed out over several calls.
        self._pending: HeldIterator[ListenEvent] | None = None
        self._partial = False  # updates handed out since the last progress (pending range)
        self._dead: str | None = None  # why next() can't go on (closed, or failed mid-range)

    @property
    def frontier(self) -> Antichain:
        """Every update at a time before this has been emitted."""
        return self._frontier

    def next(self, timeout_s: float = 1.0) -> list[ListenEvent]:
        """New events, waiting up to ``timeout_s`` for the upper to advance ([] if it didn't).

        Updates come in time order: each ``ListenUpdates`` is sorted by time and covers
        ``[lower, upper)``; a ``ListenProgress(upper)`` follows all the updates before
        ``upper``. When the updates of the new range decoded at once would exceed the
        listen's memory budget, they are handed out over several calls instead (each
        decoding about the budget at most): batch by batch of the shard's trace, in time
        order, with a progress event after each batch; a large batch comes in several
        ``ListenUpdates`` with the same ``[lower, upper)``, each sorted by time.
        """
        h = self._h
        h._check_open()
        if self._dead is not None:
            raise InvalidUsage(self._dead)
        if self._pending is not None:
            return self._drain_pending()
        if self._frontier.is_empty():
            return []
        f = self._frontier.time
        assert f is not None
        deadline = time.monotonic() + timeout_s
        with h._hold() as held:
            events = self._next_held(f, deadline, held)
        if events is None:  # a large range: stream it (its own hold was taken above)
            return self._drain_pending()
        return events

    def _next_held(self, f: int, deadline: float, held: int) -> list[ListenEvent] | None:
        h = self._h
        s = h._machine.cached()
        if not s.exists or s.upper <= self._frontier:
            s = h._machine.fetch_latest()
        while s.upper <= self._frontier:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                h._me(s)  # a lapsed lease surfaces here too
                return []
            s = h._machine.wait_for_newer(s.seqno, remaining)
        since = h._me(s).since
        if not since.less_equal(f - 1):
            # Compaction may have forwarded updates from before the frontier to the since
            # (e.g. the handle downgraded past this listen, or its since was changed by a
            # downgrade that raised Indeterminate and this listen was opened from a stale
            # cache): reading on would return wrong times. Refuse instead.
            raise InvalidUsage(
                f"shard {h.shard_id}: listen at frontier {self._frontier} can't continue: reader "
                f"{h.reader_id}'s since is {since}, past the frontier (updates before it may have "
                "been forwarded); open a new listen at an as_of >= the since"
            )
        upper = s.upper
        hi = upper.time
        parts = _parts_in_range(s, f, hi)
        if _whole_read_bytes(parts, h.schemas) > self._budget:
            # Too large to decode at once: hand it out over several calls. The stream
            # takes its own hold on the seqno held now (so it can't have been passed).
            seqno = h._take_hold(held)
            self._pending = HeldIterator(self._stream_events(s, f, upper), lambda: h._release_hold(seqno))
            return None
        tables = h._fetch_all(parts, lambda t, p: time_range(t, f, hi))
        events: list[ListenEvent] = []
        internal = consolidate(_concat(tables, h.schemas))
        if internal.num_rows:
            internal = internal.sort_by([("t", "ascending")])
            events.append(ListenUpdates(to_user_table(internal, h.schemas), self._frontier, upper))
        events.append(ListenProgress(upper))
        self._frontier = upper
        return events

    def _stream_events(self, s: st.ShardState, f: int, upper: Antichain) -> Iterator[ListenEvent]:
        """The events of ``[f, upper)`` read from state ``s``: per trace batch (batches
        cover disjoint, increasing time ranges, so nothing consolidates across them) its
        updates in chunks sorted by time, then progress to the batch's upper."""
        h = self._h
        hi = upper.time
        lower = Antichain([f])
        for _, b in s.trace_batches():
            if not _batch_overlaps(b, f, hi):
                continue
            b_upper = upper if b.upper.is_empty() or not b.upper < upper else b.upper
            runs = [[p for p in run if _part_overlaps(p, f, hi)] for run in batch_runs(b)]
            for t in h._guard_missing(
                stream_merge(
                    h._client.blob, h.schemas, shard=h.shard_id, runs=runs, memory_budget=self._budget,
                    lower=f, upper=hi, purpose="listen read",
                )
            ):
                yield ListenUpdates(to_user_table(t.sort_by([("t", "ascending")]), h.schemas), lower, b_upper)
            if b_upper < upper and lower < b_upper:
                yield ListenProgress(b_upper)
                lower = b_upper
        yield ListenProgress(upper)

    def _drain_pending(self) -> list[ListenEvent]:
        """The next events of the pending range: updates up to about 1/8 of the budget
        (at least one chunk), and the progress events among them.

        If reading fails, nothing of this call is handed out and the frontier stays;
        the listen can go on from it unless updates after it were handed out by an
        earlier call (then it would repeat them: it refuses to continue instead)."""
        p = self._pending
        assert p is not None
        events: list[ListenEvent] = []
        held = 0
        frontier, partial = self._frontier, self._partial
        try:
            while held < self._budget // 8:
                try:
                    e = next(p)
                except StopIteration:
                    self._pending = None
                    break
                events.append(e)
                if isinstance(e, ListenProgress):
                    frontier, partial = e.upper, False
                else:
                    held += e.table.nbytes
                    partial = True
        except BaseException as err:
            p.close()
            self._pending = None
            if self._partial:
                self._dead = (
                    f"shard {self._h.shard_id}: listen at frontier {self._frontier} failed "
                    f"({type(err).__name__}) after handing out part of the updates before its "
                    "next progress; going on would repeat them. Open a new listen at an as_of "
                    ">= the since, dropping the updates received after the last progress"
                )
            raise
        if self._pending is not None and p.closed:
            self._pending = None
        self._frontier, self._partial = frontier, partial
        return events

    def close(self) -> None:
        """Ends the listen: releases what a range being handed out holds; ``next`` then
        raises ``InvalidUsage``."""
        if self._dead is None:
            self._dead = f"shard {self._h.shard_id}: this listen was closed; open a new one"
        if self._pending is not None:
            self._pending.close()
            self._pending = None

    def __enter__(self) -> Listen:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __iter__(self) -> Iterator[ListenEvent]:
        """Blocks forever (until the shard upper becomes empty), yielding events."""
        while not self._frontier.is_empty() and self._dead is None:
            yield from self.next(timeout_s=self._h._client.config.listen_poll_max_s)

    def read_until(self, upper: int, timeout_s: float = 30.0) -> pa.Table:
        """Every update from the frontier on, until the frontier reaches ``upper``."""
        return read_until(self, self._h.schemas, upper, timeout_s, f"shard {self._h.shard_id}")


def read_until(listen: Any, schemas: Schemas, upper: int, timeout_s: float, what: str) -> pa.Table:
    """Drains a listen (shard or collection) until its frontier reaches ``upper``."""
    deadline = time.monotonic() + timeout_s
    out: list[pa.Table] = []
    while listen.frontier.less_than(upper):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise Timeout(
                f"{what}: listen did not reach {upper} within {timeout_s}s "
                f"(frontier {listen.frontier})"
            )
        for e in listen.next(min(remaining, 1.0)):
            if isinstance(e, ListenUpdates):
                out.append(e.table)
    if not out:
        from persist_lib.shard.codec import empty_updates

        return to_user_table(empty_updates(schemas), schemas)
    return pa.concat_tables(out)


class SinceHandle:
    """A critical since handle: no lease, never expires, fenced by an opaque token."""

    def __init__(self, machine: Machine, reader_id: str, schemas: Schemas) -> None:
        self._machine = machine
        self.reader_id = reader_id
        self.schemas = schemas

    @property
    def shard_id(self) -> str:
        return self._machine.shard_id

    def _me(self) -> st.CriticalReaderState:
        s = self._machine.fetch_latest()
        r = s.critical_readers.get(self.reader_id)
        if r is None:
            raise InvalidUsage(
                f"shard {self.shard_id}: critical reader {self.reader_id} is not registered"
            )
        return r

    @property
    def since(self) -> Antichain:
        return self._me().since

    @property
    def opaque(self) -> str:
        return self._me().opaque

    def compare_and_downgrade_since(
        self, expected_opaque: str, new_opaque: str, new_since: FrontierLike
    ) -> tr.CriticalDowngradeResult:
        """Downgrades the since iff the recorded opaque is ``expected_opaque``.

        Returns a result with ``ok`` False (and the current opaque) when fenced out.
        """
        since = as_frontier(new_since, "new_since")
        res, _ = self._machine.apply(
            "compare_and_downgrade_since",
            lambda s, now: tr.compare_and_downgrade_since(
                s, now, reader_id=self.reader_id, expected_opaque=expected_opaque,
                new_opaque=new_opaque, new_since=since,
            ),
        )
        return res

    def expire(self) -> None:
        self._machine.apply(
            "expire_critical_reader",
            lambda s, now: tr.expire_critical_reader(s, now, reader_id=self.reader_id),
        )

    def __repr__(self) -> str:
        return f"SinceHandle(shard={self.shard_id}, reader={self.reader_id})"
