"""The lease side of a read handle: its since, its seqno holds and the checks every
read makes.

A leased reader holds a ``since`` (compaction may not forward times past it) and a
*seqno hold* (GC may not delete anything a state version at or after the hold
references). Every read registers the seqno of the state version it reads from until
it is done, and the hold only moves up to the oldest such registration, so a blob a
read is fetching can't be deleted under it — unless the lease lapses, in which case
the read fails with ``LeaseExpired`` rather than returning partial data.
``LeasedReader`` is the base of ``ReadHandle``: the reads themselves live in
``handles.snapshot`` (snapshots and time ranges), ``handles.listen`` and
``handles.read`` (splits).
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from collections.abc import Iterator
from concurrent.futures import Executor
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Self

import pyarrow as pa

from persist_lib.errors import BlobNotFound, InvalidUsage, LeaseExpired, Timeout
from persist_lib.frontier import Antichain, FrontierLike, as_frontier, check_time
from persist_lib.handles.fetch_pool import fetch_pool
from persist_lib.handles.read_plan import MiB
from persist_lib.shard import state as st
from persist_lib.shard import transitions as tr
from persist_lib.shard.batch_meta import PartMeta
from persist_lib.shard.codec import Schemas
from persist_lib.shard.machine import Machine
from persist_lib.shard.parts import fetch_part

if TYPE_CHECKING:  # pragma: no cover
    from persist_lib.handles.context import HandleContext


class LeasedReader:
    """A leased reader of one shard: its lease, since and seqno holds (the base of
    ``ReadHandle``)."""

    def __init__(
        self, client: HandleContext, machine: Machine, reader_id: str, schemas: Schemas, purpose: str
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
    def client(self) -> HandleContext:
        """The client this handle was opened from (its locations and config)."""
        return self._client

    @property
    def since(self) -> Antichain:
        """This reader's since (it may read at any time at or beyond it)."""
        return self._me(self._machine.cached()).since

    @property
    def upper(self) -> Antichain:
        return self._machine.cached().upper

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
        self._client.forget_lease(self)
        self._machine.apply(
            "expire_reader", lambda s, now: tr.expire_reader(s, now, reader_id=self.reader_id)
        )

    close = expire

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.expire()

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

    def _fetch_all(self, parts: list[PartMeta], post: Any, fetch: Any = None) -> list[pa.Table]:
        """Fetches and decodes ``parts`` in parallel, each passed through ``post(table,
        part)``; in the order of ``parts``. ``fetch(part)``: how to fetch one (default:
        the whole part)."""
        blob = self._client.blob

        def one(p: PartMeta) -> pa.Table:
            t = fetch(p) if fetch is not None else fetch_part(blob, p, self.schemas, self.shard_id)
            return post(t, p)

        try:
            if len(parts) <= 1:
                return [one(p) for p in parts]
            # The process's shared fetch threads (``handles.fetch_pool``): no pool start
            # per read.
            return list(self._fetch_pool().map(one, parts))
        except BlobNotFound:
            self._blob_missing()
            raise

    def _fetch_pool(self) -> Executor:
        """The process's shared fetch threads for this client's ``fetch_parallelism``."""
        return fetch_pool(self._client.config.fetch_parallelism)

    def _guard_missing(self, it: Iterator[pa.Table]) -> Iterator[pa.Table]:
        """A missing blob we were entitled to read means our lease lapsed (expiry dropped
        our seqno hold and GC ran): that raises ``LeaseExpired``; anything else is a loss."""
        try:
            yield from it
        except BlobNotFound:
            self._blob_missing()
            raise

    def _blob_missing(self) -> None:
        """A part this read was entitled to fetch is gone. For a leased reader that means
        its lease lapsed (expiry dropped its seqno hold and GC ran): ``LeaseExpired``;
        otherwise it returns and the ``BlobNotFound`` propagates (a real loss). A read
        without a lease (``handles.one_shot``) decides differently."""
        self._me(self._machine.fetch_latest())

    def _read_budget(self, memory_budget: int | None) -> int:
        b = self._client.config.read_memory_budget if memory_budget is None else memory_budget
        if isinstance(b, bool) or not isinstance(b, int) or b < MiB:
            raise InvalidUsage(
                f"shard {self.shard_id}: memory_budget must be an int >= 1 MiB ({MiB} bytes), got {b!r}"
            )
        return b

    def _check_range_lower(self, state: st.ShardState, lower: int) -> None:
        since = self._me(state).since
        if not (since.less_than(lower) or since.time == lower == 0):
            raise InvalidUsage(
                f"shard {self.shard_id}: can't read updates from {lower}: it is not beyond "
                f"this reader's since {since} (updates before the since may have been "
                f"forwarded to it by compaction); read from {since} + 1 on, and take a "
                "snapshot at the since for what came before"
            )

    def _check_range_args(self, lower: int, upper: int) -> tuple[int, int]:
        lower = check_time(lower, "lower")
        upper = check_time(upper, "upper")
        if upper < lower:
            raise InvalidUsage(f"shard {self.shard_id}: range [{lower}, {upper}) is backwards")
        return lower, upper

