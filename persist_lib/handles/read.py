"""``ReadHandle``: a leased reader of one shard, and what it reads.

The handle is assembled from layers, one concept per module: the lease, since and
seqno holds (``handles.leased_reader``), snapshots and time ranges within a memory
budget (``handles.snapshot``), and here the distributed reads (``snapshot_splits``,
``range_splits``: the ``handles.splits`` a Spark executor fetches) and ``listen``
(``handles.listen``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from persist_lib.errors import InvalidUsage
from persist_lib.frontier import check_time
from persist_lib.handles.listen import Listen
from persist_lib.handles.pushdown import ReadPushdown
from persist_lib.handles.read_plan import concatenating_batch, parts_in_range
from persist_lib.handles.snapshot import SnapshotReader
from persist_lib.handles.splits import RangeSplit, SnapshotSplit, balance
from persist_lib.shard.metrics import track_listen
from persist_lib.shard.predicate import Predicate
from persist_lib.shard.runs import batch_runs


class ReadHandle(SnapshotReader):
    """A leased reader of one shard."""

    def snapshot_splits(
        self, as_of: int, num_splits: int, timeout_s: float | None = None, *, filter: Any = None
    ) -> list[SnapshotSplit]:
        """Splits of the snapshot at ``as_of`` that other processes (Spark executors) fetch.

        ``filter`` (as for ``snapshot``): parts whose statistics rule it out are left
        out of the splits, and each split filters its rows by it.

        This handle keeps a seqno hold for the splits until ``release_splits`` (or
        ``expire``), so their parts can't be garbage collected while they're fetched.
        """
        self._check_open()
        as_of = check_time(as_of, "as_of")
        if num_splits < 1:
            raise InvalidUsage(f"shard {self.shard_id}: num_splits must be >= 1, got {num_splits}")
        pd = ReadPushdown.plan(self.schemas, None, filter, shard=self.shard_id)
        pred = Predicate.of(filter)
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
        parts = [
            p
            for _, b in state.trace_batches()
            if b.lower.less_equal(as_of)
            for p in b.parts
            if p.tmin <= as_of and pd.keeps_part(p)
        ] if pd.snapshot_time_ok(as_of) else []
        # All kept parts in one batch of (k, v)-disjoint runs: each split knows each
        # part's run (parts of different runs share no record).
        one = concatenating_batch(state, as_of, pd.keeps_part) if parts else None
        run_of = {id(p): i for i, run in enumerate(batch_runs(one)) for p in run} if one is not None else None
        sj = self.schemas.to_json()
        return [
            SnapshotSplit(
                self._client.blob_uri, self.shard_id, sj, as_of, tuple(b), pred,
                runs=tuple(run_of[id(p)] for p in b) if run_of is not None else None,
            )
            for b in balance(parts, num_splits)
        ]

    def range_splits(
        self, lower: int, upper: int, num_splits: int, timeout_s: float | None = None, *, filter: Any = None
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
        pd = ReadPushdown.plan(self.schemas, None, filter, shard=self.shard_id)
        pred = Predicate.of(filter)
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
        parts = [p for p in parts_in_range(state, lower, upper) if pd.keeps_range_part(p)] if upper > lower else []
        sj = self.schemas.to_json()
        return [
            RangeSplit(self._client.blob_uri, self.shard_id, sj, lower, upper, tuple(b), pred)
            for b in [b for b in balance(parts, num_splits) if b] or [[]]
        ]

    def _drop_last_split_hold(self, held: int) -> None:
        """Undoes the split hold of a planning call that failed."""
        with self._lock:
            if held in self._split_holds:
                self._split_holds.remove(held)
                self._holds[held] -= 1
                if self._holds[held] <= 0:
                    del self._holds[held]

    def release_splits(self) -> None:
        """Releases the seqno holds taken by ``snapshot_splits``."""
        with self._lock:
            for s in self._split_holds:
                self._holds[s] -= 1
                if self._holds[s] <= 0:
                    del self._holds[s]
            self._split_holds.clear()

    def listen(
        self, as_of: int, *, memory_budget: int | None = None, columns: Sequence[str] | None = None,
        filter: Any = None,
    ) -> Listen:
        """Every update at times ``> as_of``, in time order, with progress events.

        Together with ``snapshot(as_of)`` it reproduces the collection at every later time.
        A ``next`` call decodes about ``memory_budget`` at most (see ``Listen.next``).
        ``columns`` and ``filter`` as for ``updates_between`` (a listen's updates are
        its ranges').
        """
        self._check_open()
        as_of = check_time(as_of, "as_of")
        budget = self._read_budget(memory_budget)
        pd = ReadPushdown.plan(self.schemas, columns, filter, shard=self.shard_id)
        state = self._machine.cached()
        if not state.exists:
            state = self._machine.fetch_latest()
        self._check_as_of(state, as_of)
        listen = Listen(self, as_of, budget, pd)
        if self._client.metrics is not None:
            track_listen(listen, self)  # its lag, for metrics
        return listen

    def __repr__(self) -> str:
        return f"ReadHandle(shard={self.shard_id}, reader={self.reader_id})"

