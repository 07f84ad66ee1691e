"""The collection reader (fat client): one definite collection across handovers.

It holds a leased reader on the metadata shard (its since is the reader's since, and
the controller only collects an old rendition once every such hold has passed its
handover) and leased readers on the shards of the renditions it reads (seqno holds,
so GC never deletes what it is fetching).

At a handover at ``h`` from ``old`` to ``new`` the listener has emitted ``old``'s
updates at times ``< h``, so its output accumulates to ``old@(h-1)``; it then emits at
time ``h`` the negation of ``old``'s snapshot at ``h-1`` plus ``new``'s snapshot at
``h``, so the output accumulates to ``new@h`` — the active rendition's contents — and
continues with ``new``'s updates after ``h``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pyarrow as pa
import pyarrow.compute as pc

from persist_lib.errors import InvalidUsage, LeaseExpired, ShardTombstoned
from persist_lib.frontier import Antichain, FrontierLike, as_frontier, check_time
from persist_lib.handles.batch_stream import BatchStream
from persist_lib.handles.listen import ListenEvent, ListenProgress, ListenUpdates, read_until
from persist_lib.handles.read import ReadHandle
from persist_lib.shard.codec import Schemas, empty_updates, to_user_table, user_schema
from persist_lib.shard.consolidate import consolidate
from persist_lib.storage.directory import RenditionDirectory
from persist_lib.storage.metadata import Handover, active_in, timeline_from_updates


class CollectionDeleted(InvalidUsage):
    """The collection was deleted: its readers and writers can't be used any more."""


class CollectionReader:
    def __init__(
        self, ctl: RenditionDirectory, name: str, schemas: Schemas, meta_reader: ReadHandle
    ) -> None:
        self._ctl = ctl
        self.name = name
        self.schemas = schemas
        self._meta = meta_reader
        self._renditions: dict[str, list[ReadHandle]] = {}
        self._expired = False

    # ----- frontiers -------------------------------------------------------------

    @property
    def since(self) -> Antichain:
        return self._guard(lambda: self._meta.since)

    def downgrade_since(self, new_since: FrontierLike) -> None:
        """Gives up reading before ``new_since`` on the metadata shard and every rendition."""
        since = as_frontier(new_since, "new_since")

        def go() -> None:
            self._meta.downgrade_since(since)
            for readers in self._renditions.values():
                for r in readers:
                    if r.since < since:
                        r.downgrade_since(since)

        self._guard(go)

    def expire(self) -> None:
        if self._expired:
            return
        self._expired = True
        for readers in self._renditions.values():
            for r in readers:
                try:
                    r.expire()
                except (LeaseExpired, ShardTombstoned):
                    pass
        try:
            self._meta.expire()
        except (LeaseExpired, ShardTombstoned):
            pass

    close = expire

    def __enter__(self) -> CollectionReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.expire()

    # ----- reads --------------------------------------------------------------------

    def snapshot(self, as_of: int, timeout_s: float | None = None) -> pa.Table:
        """The collection at ``as_of``: the snapshot of the rendition active then."""
        as_of = check_time(as_of, "as_of")

        def go() -> pa.Table:
            rendition = self._active_at(as_of, timeout_s)
            return self._rendition_snapshot(rendition, as_of, timeout_s)

        return self._guard(go)

    def snapshot_batches(
        self, as_of: int, *, memory_budget: int | None = None, timeout_s: float | None = None
    ) -> BatchStream:
        """``snapshot(as_of)`` as a stream of record batches, within ``memory_budget`` per
        shard stream (``ReadHandle.snapshot_batches``): the active rendition's shards one
        after the other (records are routed to shards by key, so nothing consolidates
        across them). Arguments are checked, and every shard's upper waited for, before
        this returns; the stream holds a seqno hold on each shard until it is exhausted,
        closed or collected."""
        as_of = check_time(as_of, "as_of")

        def go() -> BatchStream:
            rendition = self._active_at(as_of, timeout_s)
            streams: list[BatchStream] = []
            try:
                for r in self._readers_for(rendition):
                    streams.append(r.snapshot_batches(as_of, memory_budget=memory_budget, timeout_s=timeout_s))
            except BaseException:
                for st in streams:
                    st.close()
                raise

            def chain() -> Iterator[pa.RecordBatch]:
                for st in streams:
                    with st:
                        yield from st

            def release() -> None:
                for st in streams:
                    st.close()

            return BatchStream(self._guard_iter(chain()), user_schema(self.schemas), release)

        stream: BatchStream = self._guard(go)
        return stream

    @property
    def upper(self) -> Antichain:
        """The collection's upper: every time before it is readable (the metadata is
        decided there, and the rendition active at each such time has its data there).
        Read from consensus now (not cached)."""

        def go() -> Antichain:
            hi = self._meta._machine.fetch_latest().upper
            while hi.time is not None and hi.time > 0:
                t = hi.time - 1
                if not self._meta.since.less_equal(t):
                    return hi  # nothing readable below the since anyway
                ru = self._rendition_upper(self._active_at(t, 0.0))
                if ru > Antichain([t]):
                    # readable at t: so at every time before it too (a handover needs
                    # the old rendition complete before it and the new one readable at it)
                    return hi
                hi = ru
            return hi

        return self._guard(go)

    def updates_between_batches(
        self, lower: int, upper: int, *, memory_budget: int | None = None, timeout_s: float | None = None
    ) -> BatchStream:
        """Every update of the collection at times in ``[lower, upper)`` (times not
        forwarded), as a stream of record batches: what a listen from ``lower - 1`` emits
        up to ``upper``. Between handovers, the active rendition's updates, streamed shard
        by shard (``ReadHandle.updates_between_batches``: each record batch sorted by
        time, not the stream as a whole); at a handover at ``h`` in the range, the change
        from the old rendition to the new one (``-old@(h-1) + new@h``, consolidated, at
        time ``h``), which is built in memory (it is as large as the collection).

        ``lower`` must be beyond this reader's since (or both 0), as for a shard.
        Arguments are checked and the uppers waited for before this returns; the stream
        holds seqno holds on the shards it reads until it is exhausted, closed or
        collected."""
        lower = check_time(lower, "lower")
        upper = check_time(upper, "upper")
        if upper < lower:
            raise InvalidUsage(f"collection {self.name}: range [{lower}, {upper}) is backwards")
        schema = user_schema(self.schemas)

        def go() -> BatchStream:
            if upper == lower:
                return BatchStream(iter(()), schema, lambda: None)
            meta = self._meta.updates_between(lower, upper, timeout_s).to_pylist()
            start = self._active_at(lower - 1 if lower > 0 else 0, timeout_s)
            base = [{"rendition": start, "ts": max(lower - 1, 0), "diff": 1}]
            handovers = [h for h in timeline_from_updates(base + meta) if lower <= h.at < upper]
            # (rendition, lo, hi) segments read from shards; handovers between them.
            segments: list[tuple[str, int, int]] = []
            cur, t = start, lower
            for h in handovers:
                segments.append((cur, t, h.at))
                cur, t = h.new, h.at + 1
            segments.append((cur, t, upper))
            streams: list[list[BatchStream]] = []
            try:
                for rendition, lo, hi in segments:
                    streams.append(
                        [
                            r.updates_between_batches(lo, hi, memory_budget=memory_budget, timeout_s=timeout_s)
                            for r in self._readers_for(rendition)
                        ]
                        if hi > lo
                        else []
                    )
            except BaseException:
                for ss in streams:
                    for st in ss:
                        st.close()
                raise

            def chain() -> Iterator[pa.RecordBatch]:
                for i, ss in enumerate(streams):
                    for st in ss:
                        with st:
                            yield from st
                    if i < len(handovers):
                        h = handovers[i]
                        old = (
                            self._rendition_snapshot(segments[i][0], h.at - 1, timeout_s)
                            if h.at > 0
                            else to_user_table(empty_updates(self.schemas), self.schemas)
                        )
                        new = self._rendition_snapshot(h.new, h.at, timeout_s)
                        yield from _combine(old, new, h.at, self.schemas).to_batches()

            def release() -> None:
                for ss in streams:
                    for st in ss:
                        st.close()

            return BatchStream(self._guard_iter(chain()), schema, release)

        stream: BatchStream = self._guard(go)
        return stream

    def active_rendition(self, as_of: int, timeout_s: float | None = None) -> str:
        return self._guard(lambda: self._active_at(check_time(as_of, "as_of"), timeout_s))

    def listen(self, as_of: int) -> CollectionListen:
        as_of = check_time(as_of, "as_of")
        return self._guard(lambda: CollectionListen(self, as_of))

    # ----- internals ------------------------------------------------------------------

    def _guard(self, fn):  # type: ignore[no-untyped-def]
        if self._expired:
            raise InvalidUsage(f"collection {self.name}: this read handle was expired")
        try:
            return fn()
        except (LeaseExpired, ShardTombstoned) as e:
            if not self._ctl._collection_exists(self.name):
                raise CollectionDeleted(
                    f"collection {self.name} was deleted; its read handles can't be used any more"
                ) from e
            raise

    def _guard_iter(self, it: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        """``_guard`` for the iteration of a stream."""
        try:
            yield from it
        except (LeaseExpired, ShardTombstoned) as e:
            if not self._ctl._collection_exists(self.name):
                raise CollectionDeleted(
                    f"collection {self.name} was deleted; its read handles can't be used any more"
                ) from e
            raise

    def _active_at(self, as_of: int, timeout_s: float | None) -> str:
        snap = self._meta.snapshot(as_of, timeout_s)
        return active_in(snap.to_pylist(), as_of, self._meta.shard_id)

    def rendition_readers(self, rendition: str) -> list[ReadHandle]:
        """The leased readers of a rendition's shards (opened once, at this handle's since),
        in routing order: for readers that plan their own splits (Spark)."""
        return list(self._guard(lambda: self._readers_for(rendition)))

    def _readers_for(self, rendition: str) -> list[ReadHandle]:
        rs = self._renditions.get(rendition)
        if rs is None:
            rs = self._ctl._open_rendition_readers(self.name, rendition)
            since = self._meta.since
            for r in rs:
                if r.since < since:
                    r.downgrade_since(since)
            self._renditions[rendition] = rs
        # txn hook (issue 27): committed transactions on these shards are applied first.
        self._ctl._txn_prepare_read(self.name, [r.shard_id for r in rs])
        return rs

    def _rendition_snapshot(self, rendition: str, as_of: int, timeout_s: float | None) -> pa.Table:
        tables = [r.snapshot(as_of, timeout_s) for r in self._readers_for(rendition)]
        return pa.concat_tables(tables) if tables else to_user_table(empty_updates(self.schemas), self.schemas)

    def _rendition_range(self, rendition: str, lower: int, upper: int, timeout_s: float | None) -> pa.Table:
        tables = [r.updates_between(lower, upper, timeout_s) for r in self._readers_for(rendition)]
        return pa.concat_tables(tables)

    def _rendition_upper(self, rendition: str) -> Antichain:
        return min(r._machine.fetch_latest().upper for r in self._readers_for(rendition))


class CollectionListen:
    """Follows a collection from ``as_of``: update chunks and progress, across handovers."""

    def __init__(self, reader: CollectionReader, as_of: int) -> None:
        self._r = reader
        self.as_of = as_of
        self._frontier = Antichain([as_of + 1])
        self._current = reader._active_at(as_of, None)
        self._as_of_rendition = self._current
        self._meta_listen = reader._meta.listen(as_of)
        self._meta_upper = Antichain([as_of + 1])
        self._pending: list[Handover] = []
        self._meta_rows: list[dict] = []

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
        self._pending = [h for h in timeline_from_updates(base + self._meta_rows) if h.at > self.as_of]

    def next(self, timeout_s: float = 1.0) -> list[ListenEvent]:
        """Events since the last call, waiting up to ``timeout_s`` for progress."""
        r = self._r

        def go() -> list[ListenEvent]:
            deadline = time.monotonic() + timeout_s
            events: list[ListenEvent] = []
            while True:
                f = self._frontier.time
                if f is None:
                    return events
                self._poll_metadata(0.0)
                handover = next((h for h in self._pending if h.at >= f), None)
                decided_through_f = not self._meta_upper.less_equal(f)
                if handover is not None and handover.at == f and decided_through_f:
                    # The metadata is decided through f and says: switch at f. Wait until
                    # the new rendition is readable at f and the old one complete before f.
                    new = handover.new
                    ready = not r._rendition_upper(new).less_equal(f) and not r._rendition_upper(
                        self._current
                    ).less_than(f)
                    if ready:
                        old_snap = (
                            r._rendition_snapshot(self._current, f - 1, None)
                            if f > 0
                            else to_user_table(empty_updates(r.schemas), r.schemas)
                        )
                        new_snap = r._rendition_snapshot(new, f, None)
                        chunk = _combine(old_snap, new_snap, f, r.schemas)
                        if chunk.num_rows:
                            events.append(ListenUpdates(chunk, self._frontier, Antichain([f + 1])))
                        self._current = new
                        self._frontier = Antichain([f + 1])
                        events.append(ListenProgress(self._frontier))
                        continue
                target = self._meta_upper
                if handover is not None:
                    target = min(target, Antichain([handover.at]))
                target = min(target, r._rendition_upper(self._current))
                if target > self._frontier and target.time is not None:
                    tbl = r._rendition_range(self._current, f, target.time, None)
                    if tbl.num_rows:
                        events.append(ListenUpdates(tbl, self._frontier, target))
                    self._frontier = target
                    events.append(ListenProgress(target))
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

        return r._guard(go)

    def read_until(self, upper: int, timeout_s: float = 30.0) -> pa.Table:
        """Every update from the frontier on, until the frontier reaches ``upper``."""
        return read_until(self, self._r.schemas, upper, timeout_s, f"collection {self._r.name}")


def _combine(old_snap: pa.Table, new_snap: pa.Table, t: int, schemas: Schemas) -> pa.Table:
    """``-old + new`` with every time set to ``t``, consolidated (user layout)."""
    neg = old_snap.set_column(
        old_snap.schema.get_field_index("diff"), "diff", pc.negate(old_snap["diff"])
    )
    both = pa.concat_tables([neg, new_snap])
    both = both.set_column(both.schema.get_field_index("ts"), "ts", pa.array([t] * both.num_rows, pa.int64()))
    from persist_lib.shard.codec import normalize_updates

    internal = consolidate(normalize_updates(both, schemas, shard="handover"))
    return to_user_table(internal, schemas)
