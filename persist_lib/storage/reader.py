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

from collections.abc import Iterator, Sequence
from typing import Any

import pyarrow as pa

from persist_lib.errors import InvalidUsage, LeaseExpired, ShardTombstoned, StaleSchema
from persist_lib.frontier import Antichain, FrontierLike, as_frontier, check_time
from persist_lib.handles.batch_stream import BatchStream
from persist_lib.handles.pushdown import ReadPushdown
from persist_lib.handles.read import ReadHandle
from persist_lib.shard.codec import Schemas, empty_updates, to_user_table, user_schema
from persist_lib.shard.memory_plan import MergeStats
from persist_lib.storage.directory import RenditionDirectory
from persist_lib.storage.handover_diff import SnapshotSide, add_stream_stats, handover_diff
from persist_lib.storage.listen import CollectionListen
from persist_lib.storage.metadata import active_in, timeline_from_updates


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
        self, as_of: int, *, memory_budget: int | None = None, timeout_s: float | None = None,
        columns: Sequence[str] | None = None, filter: Any = None,
    ) -> BatchStream:
        """``snapshot(as_of)`` as a stream of record batches, within ``memory_budget`` per
        shard stream (``ReadHandle.snapshot_batches``): the active rendition's shards one
        after the other (records are routed to shards by key, so nothing consolidates
        across them). Arguments are checked, and every shard's upper waited for, before
        this returns; the stream holds a seqno hold on each shard until it is exhausted,
        closed or collected. Its ``stats`` add up the shard streams' as each ends (the
        peak is the largest one's: they run one after the other). ``columns`` and ``filter`` are pushed down to every shard's
        read (``ReadHandle.snapshot_batches``)."""
        as_of = check_time(as_of, "as_of")
        pd = ReadPushdown.plan(self.schemas, columns, filter, shard=f"collection {self.name}")

        def go() -> BatchStream:
            rendition = self._active_at(as_of, timeout_s)
            streams: list[BatchStream] = []
            try:
                for r in self._readers_for(rendition):
                    streams.append(
                        r.snapshot_batches(
                            as_of, memory_budget=memory_budget, timeout_s=timeout_s, columns=columns, filter=filter
                        )
                    )
            except BaseException:
                for st in streams:
                    st.close()
                raise

            stats = MergeStats()  # the shard streams' figures, added up as each ends

            def chain() -> Iterator[pa.RecordBatch]:
                for st in streams:
                    with st:
                        yield from st
                    add_stream_stats(stats, st.stats)

            def release() -> None:
                for st in streams:
                    st.close()

            return BatchStream(self._guard_iter(chain()), pd.user_schema(), release, stats)

        stream: BatchStream = self._guard(go)
        return stream

    @property
    def upper(self) -> Antichain:
        """The collection's upper: every time before it is readable (the metadata is
        decided there, and the rendition active at each such time has its data there).
        Read from consensus now (not cached)."""

        def go() -> Antichain:
            self._ctl._txn_prepare_read(self.name, [])  # a dead committer's metadata move
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
        time ``h``), streamed too (``handover_diff``: a merge of the two renditions'
        snapshots, spilling to local files, within the budget).

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
            budget = self._meta._read_budget(memory_budget)
            stats = MergeStats()  # the handover diffs' (the shard streams have their own)
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
                        yield from self._handover_diff(segments[i][0], h.new, h.at, budget, timeout_s, stats)

            def release() -> None:
                for ss in streams:
                    for st in ss:
                        st.close()

            return BatchStream(self._guard_iter(chain()), schema, release, stats)

        stream: BatchStream = self._guard(go)
        return stream

    def active_rendition(self, as_of: int, timeout_s: float | None = None) -> str:
        return self._guard(lambda: self._active_at(check_time(as_of, "as_of"), timeout_s))

    def listen(self, as_of: int, *, memory_budget: int | None = None) -> CollectionListen:
        """Follows the collection from ``as_of`` (``storage.listen.CollectionListen``):
        each ``next`` decodes about ``memory_budget`` at most (default
        ``PersistConfig.read_memory_budget``), handovers included."""
        as_of = check_time(as_of, "as_of")
        budget = self._meta._read_budget(memory_budget)
        return self._guard(lambda: CollectionListen(self, as_of, budget))

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
        # txn hook: a dead committer's metadata move is applied before waiting on it.
        self._ctl._txn_prepare_read(self.name, [])
        snap = self._meta.snapshot(as_of, timeout_s)
        return active_in(snap.to_pylist(), as_of, self._meta.shard_id)

    def rendition_readers(self, rendition: str, *, own_schemas: bool = False) -> list[ReadHandle]:
        """The leased readers of a rendition's shards (opened once, at this handle's since),
        in routing order: for readers that plan their own splits (Spark).

        ``own_schemas``: read the rendition with its own schemas even when they are not
        this handle's (a rendition rebuilt under other schemas, checked before the handover
        to it); by default such a rendition raises ``StaleSchema``."""
        return list(self._guard(lambda: self._readers_for(rendition, own_schemas=own_schemas)))

    def _readers_for(self, rendition: str, *, apply: bool = True, own_schemas: bool = False) -> list[ReadHandle]:
        """The rendition's shard readers; ``apply``: committed transactions on them are
        applied first (off only for reads below uppers already read: applied there)."""
        slot = "own:" + rendition if own_schemas else rendition  # ':' is not in a rendition name
        rs = self._renditions.get(slot)
        if rs is None:
            rs = self._ctl._open_rendition_readers(self.name, rendition)
            if not own_schemas and any(r.schemas != self.schemas for r in rs):  # evolved since opened
                for r in rs:
                    r.expire()
                raise StaleSchema(
                    f"collection {self.name}: rendition {rendition!r} has schemas "
                    f"{rs[0].schemas.describe()}, this reader reads {self.schemas.describe()}; "
                    "nothing was read. Either the collection's schemas evolved after the reader "
                    "was opened (open a new one: ctl.acquire_read_handle), or the time lies "
                    "before a handover to a rendition rebuilt with other schemas (times before "
                    "it are read through that rendition's shards, with its schemas)"
                )
            since = self._meta.since
            for r in rs:
                if r.since < since:
                    r.downgrade_since(since)
            self._renditions[slot] = rs
        if apply:  # txn hook (issue 27): committed transactions are applied first
            self._ctl._txn_prepare_read(self.name, [r.shard_id for r in rs])
        return rs

    def _rendition_snapshot(self, rendition: str, as_of: int, timeout_s: float | None) -> pa.Table:
        tables = [r.snapshot(as_of, timeout_s) for r in self._readers_for(rendition)]
        return pa.concat_tables(tables) if tables else to_user_table(empty_updates(self.schemas), self.schemas)

    def _handover_diff(
        self, old: str, new: str, at: int, budget: int, timeout_s: float | None,
        stats: MergeStats | None = None,
    ) -> Iterator[pa.RecordBatch]:
        """The change at a handover at ``at`` from ``old`` to ``new`` (``-old@(at-1) +
        new@at`` at time ``at``), streamed within ``budget`` (``handover_diff``)."""
        return handover_diff(
            SnapshotSide(self._readers_for(old), at - 1 if at > 0 else None, -1),
            SnapshotSide(self._readers_for(new), at, 1),
            at, self.schemas, memory_budget=budget, timeout_s=timeout_s, stats=stats,
        )

    def _rendition_upper(self, rendition: str, *, apply: bool = True) -> Antichain:
        """The rendition's upper (``apply=False``: as applied now, without reading the
        txn log; a shard's upper only ever counts applied transactions)."""
        return min(r._machine.fetch_latest().upper for r in self._readers_for(rendition, apply=apply))
