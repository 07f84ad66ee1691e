"""Read handles: leased readers (snapshot, splits, listen) and critical since handles.

A leased ``ReadHandle`` holds a ``since`` (compaction may not forward times past it)
and a *seqno hold* (GC may not delete anything a state version at or after the hold
references). Every read registers the seqno of the state version it reads from until
it is done, and the hold only moves up to the oldest such registration, so a blob a
read is fetching can't be deleted under it — unless the lease lapses, in which case
the read fails with ``LeaseExpired`` rather than returning partial data.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from persist_lib import state as st
from persist_lib import transitions as tr
from persist_lib.batch_meta import PartMeta
from persist_lib.codec import Schemas, to_user_table
from persist_lib.consolidate import consolidate, snapshot_at, time_range
from persist_lib.errors import BlobNotFound, InvalidUsage, LeaseExpired, Timeout
from persist_lib.frontier import Antichain, FrontierLike, as_frontier, check_time
from persist_lib.location.base import Blob
from persist_lib.machine import Machine
from persist_lib.parts import fetch_part

if TYPE_CHECKING:  # pragma: no cover
    from persist_lib.client import PersistClient


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


def _parts_in_range(state: st.ShardState, lower: int, upper: int) -> list[PartMeta]:
    """The parts that may hold updates at times in ``[lower, upper)``."""
    return [
        p
        for _, b in state.trace_batches()
        if (b.upper.is_empty() or (b.upper.time or 0) > lower) and (b.lower.time or 0) < upper
        for p in b.parts
        if p.tmax >= lower and p.tmin < upper
    ]


def _concat(tables: list[pa.Table], schemas: Schemas) -> pa.Table:
    from persist_lib.codec import empty_updates

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

    def snapshot(self, as_of: int, timeout_s: float | None = None) -> pa.Table:
        """The shard's contents at ``as_of``: every update at ``t <= as_of``, consolidated.

        Waits (up to ``timeout_s``) while ``as_of`` is not yet complete (``as_of >= upper``);
        ``as_of`` below this reader's since is an ``InvalidUsage``.
        """
        self._check_open()
        as_of = check_time(as_of, "as_of")
        with self._hold():
            state = self._wait_for_upper_beyond(as_of, timeout_s)
            self._check_as_of(state, as_of)
            parts = [p for _, b in state.trace_batches() if b.lower.less_equal(as_of) for p in b.parts]
            tables = self._fetch_all(parts, lambda t: snapshot_at(t, as_of))
        return to_user_table(consolidate(_concat(tables, self.schemas)), self.schemas)

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

    def updates_between(self, lower: int, upper: int, timeout_s: float | None = None) -> pa.Table:
        """Every update at times in ``[lower, upper)``, consolidated (times not forwarded).

        Waits until the shard upper reaches ``upper``. ``lower`` must be *beyond* this
        reader's since (or both 0): compaction forwards older updates to the since, so the
        updates at the since itself are not the ones that happened then. The building
        block of incremental (listen-range) reads.
        """
        self._check_open()
        lower = check_time(lower, "lower")
        upper = check_time(upper, "upper")
        if upper < lower:
            raise InvalidUsage(f"shard {self.shard_id}: range [{lower}, {upper}) is backwards")
        if upper == lower:
            return to_user_table(_concat([], self.schemas), self.schemas)
        with self._hold():
            state = self._wait_for_upper_beyond(upper - 1, timeout_s)
            self._check_range_lower(state, lower)
            parts = _parts_in_range(state, lower, upper)
            tables = self._fetch_all(parts, lambda t: time_range(t, lower, upper))
        internal = consolidate(_concat(tables, self.schemas))
        return to_user_table(internal.sort_by([("t", "ascending")]), self.schemas)

    # ----- listen -------------------------------------------------------------------

    def listen(self, as_of: int) -> Listen:
        """Every update at times ``> as_of``, in time order, with progress events.

        Together with ``snapshot(as_of)`` it reproduces the collection at every later time.
        """
        self._check_open()
        as_of = check_time(as_of, "as_of")
        state = self._machine.cached()
        if not state.exists:
            state = self._machine.fetch_latest()
        self._check_as_of(state, as_of)
        return Listen(self, as_of)

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
    def _hold(self) -> Iterator[None]:
        """Holds the cached seqno while a read runs.

        Taken *before* the read picks the state version it reads, so a concurrent
        heartbeat can never move this reader's durable seqno hold past that version.
        """
        with self._lock:
            seqno = self._machine.cached().seqno
            self._holds[seqno] += 1
        try:
            yield
        finally:
            with self._lock:
                self._holds[seqno] -= 1
                if self._holds[seqno] <= 0:
                    del self._holds[seqno]

    def _fetch_all(self, parts: list[PartMeta], post: Any) -> list[pa.Table]:
        blob = self._client.blob

        def one(p: PartMeta) -> pa.Table:
            return post(fetch_part(blob, p, self.schemas, self.shard_id))

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

    def __init__(self, handle: ReadHandle, as_of: int) -> None:
        self._h = handle
        self.as_of = as_of
        self._frontier: Antichain = Antichain([as_of + 1])

    @property
    def frontier(self) -> Antichain:
        """Every update at a time before this has been emitted."""
        return self._frontier

    def next(self, timeout_s: float = 1.0) -> list[ListenEvent]:
        """New events, waiting up to ``timeout_s`` for the upper to advance ([] if it didn't)."""
        h = self._h
        h._check_open()
        if self._frontier.is_empty():
            return []
        f = self._frontier.time
        assert f is not None
        deadline = time.monotonic() + timeout_s
        with h._hold():
            return self._next_held(f, deadline)

    def _next_held(self, f: int, deadline: float) -> list[ListenEvent]:
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
        parts = [
            p
            for _, b in s.trace_batches()
            if (b.upper.is_empty() or (b.upper.time or 0) > f)
            and (hi is None or (b.lower.time or 0) < hi)
            for p in b.parts
            if p.tmax >= f and (hi is None or p.tmin < hi)
        ]
        tables = h._fetch_all(parts, lambda t: time_range(t, f, hi))
        events: list[ListenEvent] = []
        internal = consolidate(_concat(tables, h.schemas))
        if internal.num_rows:
            internal = internal.sort_by([("t", "ascending")])
            events.append(ListenUpdates(to_user_table(internal, h.schemas), self._frontier, upper))
        events.append(ListenProgress(upper))
        self._frontier = upper
        return events

    def __iter__(self) -> Iterator[ListenEvent]:
        """Blocks forever (until the shard upper becomes empty), yielding events."""
        while not self._frontier.is_empty():
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
        from persist_lib.codec import empty_updates

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
