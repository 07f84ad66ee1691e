"""Listens: an ongoing subscription to a shard's updates after an ``as_of``, in time
order, with progress events.

A ``Listen`` whose next range is too large for its memory budget hands the updates
out over several ``next`` calls, batch by batch of the trace (in time order), in
chunks, holding its reader's seqno hold meanwhile.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from persist_lib.errors import InvalidUsage, Timeout
from persist_lib.frontier import Antichain
from persist_lib.handles.batch_stream import HeldIterator
from persist_lib.handles.leased_reader import LeasedReader
from persist_lib.handles.pushdown import ReadPushdown
from persist_lib.handles.read_plan import (
    batch_overlaps,
    concat_updates,
    part_overlaps,
    parts_in_range,
    whole_read_bytes,
)
from persist_lib.shard import state as st
from persist_lib.shard.codec import Schemas, to_user_table
from persist_lib.shard.consolidate import consolidate
from persist_lib.shard.read_merge import stream_merge
from persist_lib.shard.runs import batch_runs
from persist_lib.shard.time_filters import time_range


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


class Listen:
    """An ongoing subscription: ``next(timeout)`` returns the events since the last call."""

    def __init__(
        self, handle: LeasedReader, as_of: int, memory_budget: int | None = None,
        pushdown: ReadPushdown | None = None,
    ) -> None:
        self._h = handle
        # The columns and filter of the updates it hands out (parts whose statistics rule
        # the filter out are not fetched).
        self._pd = pushdown if pushdown is not None else ReadPushdown(handle.schemas, None, None)
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
        pd = self._pd
        parts = [p for p in parts_in_range(s, f, hi) if pd.keeps_range_part(p)]
        if whole_read_bytes(parts, h.schemas) > self._budget:
            # Too large to decode at once: hand it out over several calls. The stream
            # takes its own hold on the seqno held now (so it can't have been passed).
            seqno = h._take_hold(held)
            self._pending = HeldIterator(self._stream_events(s, f, upper), lambda: h._release_hold(seqno))
            return None
        tables = h._fetch_all(parts, lambda t, p: pd.filter_range(time_range(t, f, hi)))
        events: list[ListenEvent] = []
        internal = consolidate(concat_updates(tables, h.schemas))
        if internal.num_rows:
            internal = internal.sort_by([("t", "ascending")])
            events.append(ListenUpdates(pd.project(to_user_table(internal, h.schemas)), self._frontier, upper))
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
            if not batch_overlaps(b, f, hi):
                continue
            b_upper = upper if b.upper.is_empty() or not b.upper < upper else b.upper
            pd = self._pd
            runs = [[p for p in run if part_overlaps(p, f, hi) and pd.keeps_range_part(p)] for run in batch_runs(b)]
            for t in h._guard_missing(
                stream_merge(
                    h._client.blob, h.schemas, shard=h.shard_id, runs=runs, memory_budget=self._budget,
                    lower=f, upper=hi, purpose="listen read",
                )
            ):
                t = pd.filter_range(t)
                if t.num_rows:
                    user = to_user_table(t.sort_by([("t", "ascending")]), h.schemas)
                    yield ListenUpdates(pd.project(user), lower, b_upper)
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

