"""``WriteHandle``: compare-and-append and definite append (docs/design.md section 6).

A writer has one outstanding state change at a time (backpressure). Its batches are
built (and their parts uploaded) before the compare-and-set. A batch's blobs are
deleted again only when the compare-and-set is *known* not to have applied: it lost
(``UpperMismatch``), or it failed before any CAS was sent. On anything else (an
indeterminate error, an interrupt such as KeyboardInterrupt or a run cancellation, a
failure after the CAS) the blobs are kept, since the CAS may have landed, and the
leaked-blob sweeper collects them if it did not. Each append carries an idempotency
token, so a retry after an indeterminate consensus error never applies the write twice.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc

from persist_lib.errors import InvalidUsage, UpperMismatch
from persist_lib.frontier import Antichain, FrontierLike, as_frontier
from persist_lib.shard import transitions as tr
from persist_lib.shard.batch_builder import BatchBuilder, build_batch, delete_batch_blobs
from persist_lib.shard.batch_meta import HollowBatch, PartMeta
from persist_lib.shard.codec import CheckedUpdates, Schemas, normalize_checked
from persist_lib.shard.machine import ApplyProgress, Machine
from persist_lib.shard.parts import blob_form, part_blob_key
from persist_lib.shard.state import ShardState

if TYPE_CHECKING:  # pragma: no cover
    from persist_lib.handles.context import HandleContext


class WriteHandle:
    """Writes batches of updates to one shard."""

    def __init__(
        self, client: HandleContext, machine: Machine, writer_id: str, schemas: Schemas, purpose: str
    ) -> None:
        self._client = client
        self._machine = machine
        self.writer_id = writer_id
        self.schemas = schemas
        self.purpose = purpose
        self._lock = threading.Lock()  # one outstanding state change at a time
        self._expired = False
        self.last_heartbeat_monotonic = 0.0
        # The seqno of the state version the last write call committed (None: it
        # committed nothing, or a retry found it already committed): for audits/tests.
        self.last_commit_seqno: int | None = None
        # Whether the last ``append`` wrote nothing because the shard already held its
        # times (written before, by another instance or an earlier call): for audits/tests.
        self.last_append_skipped = False

    # ----- frontiers ----------------------------------------------------------------

    @property
    def shard_id(self) -> str:
        return self._machine.shard_id

    @property
    def client(self) -> HandleContext:
        """The client this handle was opened from (its locations and config)."""
        return self._client

    @property
    def upper(self) -> Antichain:
        """The shard upper as last seen by this process (see ``fetch_recent_upper``)."""
        return self._machine.cached().upper

    def fetch_recent_upper(self) -> Antichain:
        """The shard upper, read from consensus now."""
        return self._machine.fetch_latest().upper

    # ----- writes -------------------------------------------------------------------

    def compare_and_append(
        self, updates: Any, expected_upper: FrontierLike, new_upper: FrontierLike
    ) -> None:
        """Appends ``updates`` and advances the upper to ``new_upper`` iff it is ``expected_upper``.

        Raises ``UpperMismatch`` (with ``.current``) if the shard upper is something else;
        nothing is written in that case. Every update time must lie in
        ``[expected_upper, new_upper)``.
        """
        expected = as_frontier(expected_upper, "expected_upper")
        new = as_frontier(new_upper, "new_upper")
        with self._lock:
            self._check_open()
            self.last_commit_seqno = None
            self._check_frontiers(expected, new)
            checked = normalize_checked(updates, self.schemas, shard=self.shard_id)
            self._check_times(checked.table, expected, new)
            batch = self._build(checked, expected, new)
            self._commit_or_delete(batch, expected, new)

    def append(self, updates: Any, lower: FrontierLike, upper: FrontierLike) -> None:
        """Definite append for replicated writers that all write the identical collection.

        If the shard upper is already ``>= upper`` the call is a successful no-op (another
        instance wrote these times). If it lies inside ``(lower, upper)``, only the updates
        at times ``>= shard upper`` are added. If it is below ``lower`` the batch would
        leave a gap, and ``UpperMismatch`` is raised.
        """
        lo = as_frontier(lower, "lower")
        hi = as_frontier(upper, "upper")
        with self._lock:
            self._check_open()
            self.last_commit_seqno = None
            self.last_append_skipped = False
            self._check_frontiers(lo, hi)
            checked = normalize_checked(updates, self.schemas, shard=self.shard_id)
            self._check_times(checked.table, lo, hi)
            cur = self._machine.cached().upper
            while True:
                if cur >= hi:
                    self.last_append_skipped = True
                    return
                if cur < lo:
                    cur = self._machine.fetch_latest().upper
                    if cur < lo:
                        raise UpperMismatch(self.shard_id, lo, cur)
                    continue
                part = checked
                if cur > lo:
                    assert cur.time is not None
                    part = checked.filter(pc.greater_equal(checked.table["t"], cur.time))
                batch = self._build(part, cur, hi)
                try:
                    self._commit_or_delete(batch, cur, hi)
                    return
                except UpperMismatch as e:
                    cur = e.current

    def builder(self, lower: FrontierLike) -> BatchBuilder:
        """A bounded-memory builder for batches too large to pass in one table.

        Feed it with ``add`` (normalized via ``normalize``) and hand the result of
        ``finish(upper)`` to ``compare_and_append_batch``.
        """
        cfg = self._client.config
        return BatchBuilder(
            self._client.blob,
            self.schemas,
            shard=self.shard_id,
            writer=self.writer_id,
            lower=as_frontier(lower, "lower"),
            target_part_bytes=cfg.blob_target_size,
            max_inflight_uploads=cfg.max_inflight_uploads,
            inline_threshold=self._inline_threshold(),
            executor=self._client.upload_executor(),
            unsorted_min_bytes=cfg.unsorted_min_bytes,
            key_range_min_bytes=cfg.key_range_min_bytes,
        )

    def normalize(self, updates: Any) -> CheckedUpdates:
        """Validates ``updates`` against the shard schemas, once: a ``builder``'s ``add``
        (and ``compare_and_append``/``append``) take the result without checking it again.
        Its ``table`` is the update table (internal layout)."""
        return normalize_checked(updates, self.schemas, shard=self.shard_id)

    def compare_and_append_batch(
        self,
        batch: HollowBatch,
        expected_upper: FrontierLike,
        new_upper: FrontierLike,
        *,
        release_part_writer: str | None = None,
    ) -> None:
        """Commits a batch built by ``builder`` (or by Spark executors) with one CAS.

        Its parts must have been written by a registered writer: this handle, or a part
        writer (``persist_lib.shard.part_writers``) that the same CAS may release
        (``release_part_writer``)."""
        expected = as_frontier(expected_upper, "expected_upper")
        new = as_frontier(new_upper, "new_upper")
        with self._lock:
            self._check_open()
            self.last_commit_seqno = None
            self._check_frontiers(expected, new)
            if batch.lower != expected or batch.upper != new:
                raise InvalidUsage(
                    f"shard {self.shard_id}: the batch covers [{batch.lower}, {batch.upper}) but "
                    f"was appended as [{expected}, {new}); build it with the same bounds"
                )
            for p in batch.parts:
                if p.tmin < (expected.time or 0) or not (new.is_empty() or p.tmax < (new.time or 0)):
                    raise InvalidUsage(
                        f"shard {self.shard_id}: the batch has updates at times [{p.tmin}, {p.tmax}] "
                        f"outside [{expected}, {new})"
                    )
            self._commit_or_delete(batch, expected, new, release_part_writer)

    def heartbeat(self) -> None:
        self._check_open()
        self._machine.apply(
            "heartbeat_writer", lambda s, now: tr.heartbeat_writer(s, now, writer_id=self.writer_id)
        )

    def expire(self) -> None:
        """Unregisters this writer. The handle can't be used afterwards."""
        if self._expired:
            return
        self._expired = True
        self._client.forget_lease(self)
        self._machine.apply(
            "expire_writer", lambda s, now: tr.expire_writer(s, now, writer_id=self.writer_id)
        )

    close = expire

    def __enter__(self) -> WriteHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.expire()

    def __repr__(self) -> str:
        return f"WriteHandle(shard={self.shard_id}, writer={self.writer_id})"

    # ----- internals ------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._expired:
            raise InvalidUsage(
                f"shard {self.shard_id}: write handle {self.writer_id} was expired; open a new one"
            )

    def _check_frontiers(self, lower: Antichain, upper: Antichain) -> None:
        if upper < lower:
            raise InvalidUsage(
                f"shard {self.shard_id}: new upper {upper} is before the expected upper/lower "
                f"{lower}; an upper never moves backwards"
            )
        if lower.is_empty():
            raise InvalidUsage(
                f"shard {self.shard_id}: can't append at the empty frontier: the shard is closed "
                "for writes once its upper is []"
            )

    def _check_times(self, table: pa.Table, lower: Antichain, upper: Antichain) -> None:
        if table.num_rows == 0:
            return
        mm = pc.min_max(table["t"]).as_py()
        tmin, tmax = int(mm["min"]), int(mm["max"])
        lo = lower.time or 0
        bad = None
        if tmin < lo:
            bad = tmin
        elif upper.time is not None and tmax >= upper.time:
            bad = tmax
        if bad is not None:
            raise InvalidUsage(
                f"shard {self.shard_id}: update time {bad} is outside the batch interval "
                f"[{lower}, {upper}) (update times must be >= the expected upper/lower and < the "
                "new upper); nothing was written"
            )

    def _inline_threshold(self) -> int:
        """The inline threshold of this write: ``inline_append_threshold`` (0 when
        ``inline_threshold`` turns inlining off), lowered to the inline room the shard
        has left as last seen, so that a part which would pass ``inline_max_total`` goes
        to blob at once instead of being refused by the transition and moved after."""
        cfg = self._client.config
        if cfg.inline_threshold <= 0:
            return 0
        room = cfg.inline_max_total - self._machine.cached().inline_bytes
        return max(0, min(cfg.inline_append_threshold, room))

    def _build(self, table: CheckedUpdates, lower: Antichain, upper: Antichain) -> HollowBatch:
        cfg = self._client.config
        return build_batch(
            self._client.blob,
            self.schemas,
            table,
            shard=self.shard_id,
            writer=self.writer_id,
            lower=lower,
            upper=upper,
            target_part_bytes=cfg.blob_target_size,
            max_inflight_uploads=cfg.max_inflight_uploads,
            inline_threshold=self._inline_threshold(),
            executor=self._client.upload_executor(),
            unsorted_min_bytes=cfg.unsorted_min_bytes,
            key_range_min_bytes=cfg.key_range_min_bytes,
        )

    def _commit_or_delete(
        self, batch: HollowBatch, expected: Antichain, new: Antichain, release: str | None = None
    ) -> None:
        """Commits ``batch``; deletes its blobs only if the CAS certainly did not apply."""
        progress = ApplyProgress()
        uninlined: list[HollowBatch] = []
        try:
            self._commit(batch, expected, new, progress, uninlined, release)
        except UpperMismatch:
            # Definite: the transition saw a current state (after any indeterminate CAS,
            # re-read from consensus) without our token and with another upper.
            self._delete_uncommitted(batch, uninlined)
            raise
        except Exception:
            if not progress.cas_issued:
                self._delete_uncommitted(batch, uninlined)  # nothing can reference them
            raise
        # BaseException (KeyboardInterrupt, SystemExit, a run cancellation): the CAS
        # may have landed, so the blobs stay; the leaked-blob sweeper collects them if
        # it did not.

    def _delete_uncommitted(self, batch: HollowBatch, uninlined: list[HollowBatch]) -> None:
        delete_batch_blobs(self._client.blob, batch)
        for b in uninlined:
            delete_batch_blobs(self._client.blob, b)

    def _commit(
        self,
        batch: HollowBatch,
        expected: Antichain,
        new: Antichain,
        progress: ApplyProgress,
        uninlined: list[HollowBatch],
        release: str | None = None,
    ) -> None:
        token = uuid.uuid4().hex
        cfg = self._client.config
        while True:
            def caa(s: ShardState, now: int, b: HollowBatch = batch) -> tr.Result:
                return tr.compare_and_append(
                    s, now, writer_id=self.writer_id, batch=b, token=token,
                    inline_max_total=cfg.inline_max_total, release_writer=release,
                    schemas=self.schemas,
                )

            res, state = self._machine.apply("compare_and_append", caa, progress)
            self.last_heartbeat_monotonic = time.monotonic()
            if res.outcome is tr.CaaOutcome.APPLIED:
                self.last_commit_seqno = state.seqno
                return
            if res.outcome is tr.CaaOutcome.ALREADY_COMMITTED:
                return
            if res.outcome is tr.CaaOutcome.UPPER_MISMATCH:
                raise UpperMismatch(self.shard_id, expected, res.current_upper)
            # Inline backpressure: move tiny parts to blob (recorded first, so that a
            # failure below still deletes what was uploaded).
            moved = self._uninline(batch, uninlined)
            batch = moved

    def _uninline(self, batch: HollowBatch, uninlined: list[HollowBatch]) -> HollowBatch:
        parts: list[PartMeta] = []
        written: list[PartMeta] = []
        try:
            for p in batch.parts:
                if p.inline is None:
                    parts.append(p)
                    continue
                key = part_blob_key(self.shard_id, self.writer_id)
                data, as_blob = blob_form(p, self.shard_id)
                moved = replace(as_blob, key=key, inline=None)
                written.append(moved)  # before the upload: a partial upload is deleted too
                self._client.blob.set(key, data)
                parts.append(moved)
        finally:
            uninlined.append(replace(batch, parts=tuple(written)))
        return replace(batch, parts=tuple(parts))
