"""A collection listen: one collection's updates after an ``as_of``, across handovers,
within a memory budget.

At a handover at ``h`` from ``old`` to ``new`` the listener has emitted ``old``'s
updates at times ``< h``, so its output accumulates to ``old@(h-1)``; it then emits at
time ``h`` the negation of ``old``'s snapshot at ``h-1`` plus ``new``'s snapshot at
``h``, so the output accumulates to ``new@h`` — the active rendition's contents — and
continues with ``new``'s updates after ``h``.

**Memory.** Every range is read as streams (``ReadHandle.updates_between_batches``
shard by shard, ``handover_diff`` at a handover), so a listener far behind, or one
crossing a handover of a large collection, decodes about its budget at once. ``next``
hands out up to about 1/8 of the budget of updates per call (at least one chunk) and
picks up where it stopped on the next call, as a shard ``Listen`` does; a range being
handed out holds seqno holds on the shards it reads until it is done or the listen is
closed. ``batches(upper)`` streams the record batches themselves.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol, TypeVar

import pyarrow as pa

from persist_lib.errors import InvalidUsage, Timeout
from persist_lib.frontier import Antichain
from persist_lib.handles.batch_stream import HeldIterator
from persist_lib.handles.listen import ListenEvent, ListenProgress, ListenUpdates, read_until
from persist_lib.handles.read import ReadHandle
from persist_lib.shard.codec import Schemas
from persist_lib.shard.memory_plan import MergeStats
from persist_lib.storage.metadata import Handover, timeline_from_updates

T = TypeVar("T")


class ListenedCollection(Protocol):
    """What a ``CollectionListen`` reads through (a ``CollectionReader``)."""

    name: str
    schemas: Schemas
    _meta: ReadHandle

    def _guard(self, fn: Callable[[], T]) -> T: ...

    def _active_at(self, as_of: int, timeout_s: float | None) -> str: ...

    def _readers_for(self, rendition: str, *, apply: bool = True) -> list[ReadHandle]: ...

    def _rendition_upper(self, rendition: str, *, apply: bool = True) -> Antichain: ...

    def _handover_diff(
        self, old: str, new: str, at: int, budget: int, timeout_s: float | None,
        stats: MergeStats | None = None,
    ) -> Iterator[pa.RecordBatch]: ...


class CollectionListen:
    """Follows a collection from ``as_of``: update chunks and progress, across handovers."""

    def __init__(self, reader: ListenedCollection, as_of: int, memory_budget: int) -> None:
        self._r = reader
        self.as_of = as_of
        self._budget = memory_budget
        self._frontier = Antichain([as_of + 1])
        self._current = reader._active_at(as_of, None)
        self._as_of_rendition = self._current
        self._meta_listen = reader._meta.listen(as_of)
        self._meta_upper = Antichain([as_of + 1])
        self._handovers: list[Handover] = []
        self._meta_rows: list[dict[str, Any]] = []
        # A range (or a handover's diff) being handed out over several calls.
        self._pending: HeldIterator[ListenEvent] | None = None
        self._partial = False  # updates handed out since the last progress
        self._dead: str | None = None  # why next() can't go on (closed, or failed mid-range)
        # The handover diffs' accounting (the most they held at once, what they spilled).
        self.stats = MergeStats()

    @property
    def frontier(self) -> Antichain:
        return self._frontier

    @property
    def current_rendition(self) -> str:
        return self._current

    def _poll_metadata(self, timeout_s: float) -> None:
        for e in self._meta_listen.next(timeout_s):
            if isinstance(e, ListenUpdates):
                self._meta_rows.extend(e.table.to_pylist())
            else:
                self._meta_upper = e.upper
        # Handovers strictly after as_of, relative to the rendition active at as_of.
        base = [{"rendition": self._as_of_rendition, "ts": self.as_of, "diff": 1}]
        self._handovers = [h for h in timeline_from_updates(base + self._meta_rows) if h.at > self.as_of]

    def next(self, timeout_s: float = 1.0) -> list[ListenEvent]:
        """Events since the last call, waiting up to ``timeout_s`` for progress.

        Updates of a range are handed out up to about 1/8 of the memory budget per call;
        the rest comes with the next calls (a ``ListenProgress`` follows each range).
        If reading fails, nothing of this call is handed out and the frontier stays; the
        listen can go on from it unless an earlier call handed out part of the range
        after it (then it refuses to continue: ``InvalidUsage``)."""
        if self._dead is not None:
            raise InvalidUsage(self._dead)
        start = (self._frontier, self._current, self._partial)
        try:
            return self._r._guard(lambda: self._next(timeout_s))
        except BaseException as err:
            if self._pending is not None:
                self._pending.close()
                self._pending = None
            self._frontier, self._current, self._partial = start
            if self._partial:
                self._dead = (
                    f"collection {self._r.name}: listen at frontier {self._frontier} failed "
                    f"({type(err).__name__}) after handing out part of the updates before its "
                    "next progress; going on would repeat them. Open a new listen at an as_of "
                    ">= the since, dropping the updates received after the last progress"
                )
            raise

    def _next(self, timeout_s: float) -> list[ListenEvent]:
        r = self._r
        deadline = time.monotonic() + timeout_s
        events: list[ListenEvent] = []
        held = 0
        while True:
            if self._pending is not None:
                held = self._drain(events, held)
                if self._pending is not None:
                    return events  # this call's share of the budget is handed out
                continue
            f = self._frontier.time
            if f is None:
                return events
            self._poll_metadata(0.0)
            handover = next((h for h in self._handovers if h.at >= f), None)
            decided_through_f = not self._meta_upper.less_equal(f)
            if handover is not None and handover.at == f and decided_through_f:
                # The metadata is decided through f and says: switch at f. Wait until
                # the new rendition is readable at f and the old one complete before f.
                new = handover.new
                ready = not r._rendition_upper(new).less_equal(f) and not r._rendition_upper(
                    self._current
                ).less_than(f)
                if ready:
                    self._pending = HeldIterator(self._handover_events(f, new), lambda: None)
                    continue
            target = self._meta_upper
            if handover is not None:
                target = min(target, Antichain([handover.at]))
            target = min(target, self._current_upper(read_log=not events))
            if target > self._frontier and target.time is not None:
                self._pending = HeldIterator(self._range_events(f, target), lambda: None)
                continue
            if events:
                return events
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return events
            # Nothing to do yet: wait for the metadata or the rendition to move.
            self._poll_metadata(min(remaining, 0.05))
            if self._meta_upper <= self._frontier or (handover is None and target == self._frontier):
                time.sleep(min(remaining, 0.02))

    def _current_upper(self, read_log: bool) -> Antichain:
        """The current rendition's upper. A transactional collection's txn log is read
        (what dead committers left is applied, their metadata moves included) only when
        the listen can't move without it (the shards' and metadata's uppers are not past
        its frontier) and this call has nothing to hand out yet (``read_log``). A shard's
        upper only ever counts applied transactions, so a read below it never shows a
        time that is not wholly applied."""
        f = self._frontier
        upper = self._r._rendition_upper(self._current, apply=False)
        if (upper > f and self._meta_upper > f) or not read_log:
            return upper
        return self._r._rendition_upper(self._current)

    def _drain(self, events: list[ListenEvent], held: int) -> int:
        """Moves events of the pending range into ``events`` until they hold about 1/8
        of the budget (progress moves the frontier); returns the bytes they hold."""
        p = self._pending
        assert p is not None
        while held < self._budget // 8:
            try:
                e = next(p)
            except StopIteration:
                self._pending = None
                return held
            events.append(e)
            if isinstance(e, ListenProgress):
                self._frontier, self._partial = e.upper, False
            else:
                held += e.table.nbytes
                self._partial = True
        if p.closed:
            self._pending = None
        return held

    def _range_events(self, f: int, target: Antichain) -> Iterator[ListenEvent]:
        """The current rendition's updates in ``[f, target)`` read shard by shard, in
        chunks of about 1/8 of the budget each sorted by time (a range that small comes
        as one chunk); then progress to ``target``."""
        hi = target.time
        assert hi is not None

        def batches() -> Iterator[pa.RecordBatch]:
            for reader in self._r._readers_for(self._current, apply=False):  # below the upper
                with reader.updates_between_batches(f, hi, memory_budget=self._budget) as stream:
                    yield from stream

        for t in self._chunks(batches()):
            yield ListenUpdates(t.sort_by([("ts", "ascending")]), Antichain([f]), target)
        yield ListenProgress(target)

    def _handover_events(self, f: int, new: str) -> Iterator[ListenEvent]:
        """The handover at ``f`` to ``new``: the diff, then the switch and progress."""
        lower, upper = Antichain([f]), Antichain([f + 1])
        for t in self._chunks(self._r._handover_diff(self._current, new, f, self._budget, None, self.stats)):
            yield ListenUpdates(t, lower, upper)
        self._current = new
        yield ListenProgress(upper)

    def _chunks(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.Table]:
        """Record batches joined into tables of about 1/8 of the budget (empty ones dropped)."""
        pending: list[pa.RecordBatch] = []
        held = 0
        for b in batches:
            if not b.num_rows:
                continue
            pending.append(b)
            held += b.nbytes
            if held >= self._budget // 8:
                yield pa.Table.from_batches(pending)
                pending, held = [], 0
        if pending:
            yield pa.Table.from_batches(pending)

    def batches(self, upper: int, timeout_s: float = 30.0) -> Iterator[pa.RecordBatch]:
        """The updates from the frontier on until the frontier reaches ``upper``, as
        record batches (key fields, value fields, ``ts``, ``diff``), read as they are
        iterated: a streaming ``read_until``. Raises ``Timeout`` when the frontier does
        not get there within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while self._frontier.less_than(upper):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise Timeout(
                    f"collection {self._r.name}: listen did not reach {upper} within {timeout_s}s "
                    f"(frontier {self._frontier})"
                )
            for e in self.next(min(remaining, 1.0)):
                if isinstance(e, ListenUpdates):
                    yield from e.table.to_batches()

    def read_until(self, upper: int, timeout_s: float = 30.0) -> pa.Table:
        """Every update from the frontier on, until the frontier reaches ``upper``."""
        return read_until(self, self._r.schemas, upper, timeout_s, f"collection {self._r.name}")

    def close(self) -> None:
        """Ends the listen: releases what a range being handed out holds; ``next`` then
        raises ``InvalidUsage``."""
        if self._dead is None:
            self._dead = f"collection {self._r.name}: this listen was closed; open a new one"
        if self._pending is not None:
            self._pending.close()
            self._pending = None

    def __enter__(self) -> CollectionListen:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
