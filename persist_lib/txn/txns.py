"""``Txns``: commit, apply, tidy and recover transactions over registered data shards.

The protocol and its crash cases are in the package docstring (``persist_lib.txn``).
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import TypeVar

import pyarrow.compute as pc

from persist_lib.errors import InvalidUsage, PersistError, UpperMismatch
from persist_lib.frontier import Antichain
from persist_lib.handles.client import PersistClient
from persist_lib.ids import ShardId
from persist_lib.shard import maintenance_transitions as mt
from persist_lib.shard import transitions as tr
from persist_lib.shard.batch_builder import build_batch, delete_batch_blobs
from persist_lib.shard.batch_meta import HollowBatch
from persist_lib.shard.codec import CheckedUpdates, Schemas
from persist_lib.shard.machine import Machine
from persist_lib.shard.part_writers import PartWriter
from persist_lib.shard.state import ShardState
from persist_lib.txn import apply as ap
from persist_lib.txn.log import Advance, LogRow, LogView, Pending, TxnLog, registration_row

T = TypeVar("T")
R = TypeVar("R")

log = logging.getLogger(__name__)

# A transaction part writer never lapses by itself: the transaction releases it (the
# apply CAS, a definite loss) or ``recover_orphans`` once it proved the commit can't land.
TXN_PART_WRITER_LEASE_MS = 10 * 365 * 24 * 3600 * 1000
_PURPOSE = "txn {txn} log-writer {log_writer}"


class NotRegistered(InvalidUsage):
    """A transaction touched a shard that is not registered in the txn log."""


@dataclass(frozen=True)
class ShardWrite:
    """One data shard's part of a transaction: ``updates`` at times in ``[lower, upper)``."""

    shard: str
    schemas: Schemas
    updates: CheckedUpdates
    lower: Antichain
    upper: Antichain
    # Parts of at least this many Arrow bytes written unsorted (None: the client's
    # ``PersistConfig.unsorted_min_bytes``), as ``WriteHandle`` builders do.
    unsorted_min_bytes: int | None = None


@dataclass(frozen=True)
class Prepared:
    """A transaction that registered its part writers and has not committed yet."""

    txn: str
    shards: tuple[str, ...]
    part_writers: tuple[PartWriter, ...]

    def part_writer(self, shard: str) -> str:
        """The writer id the parts of ``shard``'s batch must be written under."""
        return Pending.txn_part_writer(self.txn, shard)


@dataclass(frozen=True)
class Committed:
    """A committed transaction: its id and the log position it committed at."""

    txn: str
    log_position: int
    applied: bool  # whether every batch was applied before commit returned


class Txns:
    """Transactions over the data shards registered in one txn log."""

    def __init__(
        self, client: PersistClient, log_shard: ShardId | str | None = None, *, read_only: bool = False
    ) -> None:
        """``read_only``: reads the log through readers it expires at once and never
        writes it (it still applies committed transactions, which registers nothing)."""
        self.client = client
        self.log = TxnLog(client, log_shard, transient=read_only)

    # ----- registration ---------------------------------------------------------------

    def register(self, shards: Iterable[str]) -> None:
        """Registers data shards (idempotent; one log CAS for all that are new)."""
        want = [str(ShardId.parse(s)) for s in shards]
        while True:
            view = self.log.read()
            new = [s for s in want if s not in view.registered]
            if not new:
                return
            try:
                self.log.append([registration_row(s) for s in new], view.upper)
                return
            except UpperMismatch:
                continue

    def is_registered(self, shard: str) -> bool:
        return shard in self.log.read().registered

    def logical_upper(self, shard: str, view: LogView | None = None) -> Antichain:
        """The upper the shard has once every committed transaction is applied."""
        view = view or self.log.read()
        pending = view.pending_upper(shard)
        if pending is not None:
            return pending
        return self.client.machine(shard).fetch_latest().upper

    def logical_uppers(self, shards: list[str], view: LogView | None = None) -> list[Antichain]:
        """``logical_upper`` of each shard (the physical ones read in parallel)."""
        view = view or self.log.read()
        return _each(lambda s: self.logical_upper(s, view), shards)

    # ----- commit ---------------------------------------------------------------------

    def commit(
        self, writes: list[ShardWrite], advances: Sequence[tuple[str, Antichain]] = ()
    ) -> Committed:
        """Commits ``writes`` atomically, iff each shard's logical upper is its ``lower``.

        ``advances``: ``(shard, upper)`` follow-ups committed with it (``log.Advance``):
        whoever applies the transaction also moves each such shard's upper to ``upper``
        (a collection's metadata shard), so a committer that dies after the commit CAS
        leaves nothing behind that only it could have done.

        Raises ``UpperMismatch`` (nothing committed, the parts deleted) if one is not,
        ``NotRegistered`` for a shard outside the log. After the commit CAS the batches
        are applied and tidied; a failure there is logged, not raised: the transaction
        is committed and the next reader, writer or maintenance finishes it."""
        if len({w.shard for w in writes}) != len(writes):
            raise InvalidUsage("a transaction writes each shard at most once")
        for w in writes:
            _check_write(w)
        view = self.log.read()
        self._check_uppers([(w.shard, w.lower) for w in writes], view)  # fail before writing parts
        for w in writes:  # a writer of an earlier schema version: StaleSchema, nothing written
            # (the state as last read; an evolution racing this commit is benign: the
            # batch is of a registered version and is migrated when read)
            tr.check_schemas(self.client.machine(w.shard).cached(), w.schemas)
        prepared = self.prepare([w.shard for w in writes])
        try:
            batches = _each(lambda w: self._build(w, prepared.part_writer(w.shard)), writes)
        except Exception:
            self.abandon(prepared)
            raise
        return self.commit_batches(prepared, batches, view=view, advances=advances)

    def prepare(self, shards: list[str]) -> Prepared:
        """Starts a transaction over ``shards``: registers its part writer on each (in
        parallel; the parts of its batches must be written under those writer ids)."""
        if len(set(shards)) != len(shards):
            raise InvalidUsage("a transaction writes each shard at most once")
        txn = str(uuid.uuid4())
        purpose = _PURPOSE.format(txn=txn, log_writer=self.log.writer_id)
        done: list[PartWriter] = []

        def register(shard: str) -> PartWriter:
            pw = PartWriter.register(
                self.client.machine(shard), purpose=purpose,
                writer_id=Pending.txn_part_writer(txn, shard), lease_ms=TXN_PART_WRITER_LEASE_MS,
            )
            done.append(pw)
            return pw

        try:
            pws = _each(register, shards)
        except Exception:
            for pw in done:
                pw.release()
            raise
        return Prepared(txn, tuple(shards), tuple(pws))

    def commit_batches(
        self, prepared: Prepared, batches: list[HollowBatch], *, view: LogView | None = None,
        advances: Sequence[tuple[str, Antichain]] = (),
    ) -> Committed:
        """Commits one prepared transaction whose batches (one per shard of ``prepared``,
        in its order, written under its part writers) are built already: the commit CAS
        iff every shard's logical upper is its batch's ``lower``, then apply and tidy.
        On ``UpperMismatch`` / ``NotRegistered`` nothing committed and the parts and part
        writers are gone. ``advances``: as for ``commit``."""
        if len(batches) != len(prepared.shards):
            raise InvalidUsage(
                f"transaction {prepared.txn}: {len(batches)} batches for {len(prepared.shards)} shards"
            )
        txn = prepared.txn
        entries = [Pending(s, txn, b) for s, b in zip(prepared.shards, batches, strict=True)]
        follow = [Advance(str(ShardId.parse(sh)), txn, up) for sh, up in advances]
        try:
            position, view = self._publish(entries, [(e.shard, e.batch.lower) for e in entries], view, follow)
        except (UpperMismatch, NotRegistered):
            self.abandon(prepared, batches)  # definite: the log never held it
            raise
        # The log as of our commit: the view we committed against plus our entries
        # (everything committed before ours is in it; later commits apply their own).
        after = replace(
            view, upper=position + 1, seqno=-1, pending=view.pending + tuple(entries),
            advances=view.advances + tuple(follow),
        )
        try:
            self.ensure_applied([*prepared.shards, *(a.shard for a in follow)], after)
            if follow:
                self.tidy()  # the follow-ups too (a full tidy: reads the log and the shards)
            else:
                self._tidy_after(after, prepared.shards)
            return Committed(txn, position, True)
        except PersistError as e:  # committed: nothing after the CAS may report a failure
            log.warning("transaction %s committed at log position %d; applying it failed (the "
                        "next reader, writer or maintenance applies it): %s", txn, position, e)
            return Committed(txn, position, False)

    def _publish(
        self, entries: list[Pending], wants: list[tuple[str, Antichain]], view: LogView | None,
        follow: Sequence[Advance] = (),
    ) -> tuple[int, LogView]:
        """The commit CAS: the entries appended to the log iff every shard's logical upper
        is its batch's ``lower`` (re-checked whenever the log moved). Returns the log
        position it committed at and the view it committed against. ``view``: a view
        ``commit`` checked already (the check is not repeated against it); ``wants``:
        each entry's shard and the logical upper it needs."""
        checked = view is not None
        if view is None:
            view = self.log.read()
        while True:
            if not checked:
                self._check_uppers(wants, view)
            try:
                rows = [e.row(1) for e in entries] + [a.row(1) for a in follow]
                self.log.append(rows, view.upper)
                return view.upper, view
            except UpperMismatch:
                view = self.log.read()  # the log moved: check again, same batches
                checked = False

    def _check_uppers(self, wants: list[tuple[str, Antichain]], view: LogView) -> None:
        for shard, _ in wants:
            if shard not in view.registered:
                raise NotRegistered(
                    f"shard {shard} is not registered in txn log {self.log.shard}: register it "
                    "(Txns.register) before writing it through transactions"
                )
        # Shards with nothing pending: their physical upper, read now (in parallel).
        curs = self.logical_uppers([s for s, _ in wants], view)
        for (shard, lower), cur in zip(wants, curs, strict=True):
            if cur != lower:
                raise UpperMismatch(shard, lower, cur)

    def _build(self, w: ShardWrite, writer: str) -> HollowBatch:
        cfg = self.client.config
        return build_batch(
            self.client.blob, w.schemas, w.updates, shard=w.shard, writer=writer,
            lower=w.lower, upper=w.upper, target_part_bytes=cfg.blob_target_size,
            max_inflight_uploads=cfg.max_inflight_uploads, inline_threshold=0,
            executor=self.client.upload_executor(),
            unsorted_min_bytes=cfg.unsorted_min_bytes if w.unsorted_min_bytes is None else w.unsorted_min_bytes,
            # (a write that asks for unsorted parts gets them, not key-range parts)
            key_range_min_bytes=cfg.key_range_min_bytes if w.unsorted_min_bytes is None else None,
        )

    def build_batches(self, prepared: Prepared, writes: list[ShardWrite]) -> list[HollowBatch]:
        """Builds ``writes`` (each of a shard of ``prepared``) on this process under the
        transaction's part writers, checked as ``commit`` checks them: for a transaction
        whose other batches are built elsewhere (e.g. by Spark executors). On failure the
        parts built so far are deleted; ``prepared`` stays for the caller to abandon."""
        for w in writes:
            _check_write(w)
            if w.shard not in prepared.shards:
                raise InvalidUsage(f"transaction {prepared.txn}: shard {w.shard} is not one it prepared")
        built: list[HollowBatch] = []
        try:
            for w in writes:
                built.append(self._build(w, prepared.part_writer(w.shard)))
        except BaseException:
            for b in built:
                delete_batch_blobs(self.client.blob, b)
            raise
        return built

    def abandon(self, prepared: Prepared, batches: Iterable[HollowBatch] = ()) -> None:
        """The transaction certainly did not commit: delete its parts, release its writers."""
        for b in batches:
            delete_batch_blobs(self.client.blob, b)
        _each(lambda pw: pw.release(), list(prepared.part_writers))

    # ----- apply and tidy -------------------------------------------------------------

    def ensure_applied(self, shards: Iterable[str], view: LogView | None = None) -> int:
        """Applies every committed transaction's batch for ``shards``, in order (what a
        reader calls before reading them; shards in parallel), and their committed
        follow-ups (``Advance``, after the entries). Returns how many this call linked or
        advanced."""
        view = view or self.log.read()
        shards = list(dict.fromkeys(shards))

        def apply_shard(s: str) -> int:
            machine = self.client.machine(s)
            return sum(ap.apply_entry(machine, e) for e in view.pending_for(s))

        def advance_shard(s: str) -> int:
            machine = self.client.machine(s)
            return sum(ap.apply_advance(machine, a) for a in view.advances_for(s))

        # Every batch first, then the follow-ups: a metadata upper never passes data
        # that is not linked yet.
        n = sum(_each(apply_shard, [s for s in shards if view.pending_for(s)]))
        return n + sum(_each(advance_shard, [s for s in shards if view.advances_for(s)]))

    def apply_all(self) -> int:
        """Applies every pending entry of the log (maintenance)."""
        view = self.log.read()
        shards = {p.shard for p in view.pending} | {a.shard for a in view.advances}
        return self.ensure_applied(sorted(shards), view)

    def tidy(self) -> int:
        """Retracts the log entries (and follow-ups) that are applied; returns how many it
        retracted."""
        while True:
            view = self.log.read()
            entries: list[Pending | Advance] = [*view.pending, *view.advances]
            done = [p for p in entries if self._is_applied(p)]
            if not done:
                return 0
            try:
                self.log.append([p.row(-1) for p in done], view.upper)
            except UpperMismatch:
                continue
            self.log.allow_compaction(view.upper)
            return len(done)

    def _tidy_after(self, after: LogView, shards: Iterable[str]) -> None:
        """The committer's tidy: retracts the entries of ``shards`` that this process's
        cached shard states show applied (``ensure_applied`` just ran over ``after``; a
        cached state is a real, maybe older, state of the shard, so what it shows applied
        is applied) with one CAS right after the commit, reading neither the log nor the
        shards again. If the log moved meanwhile, a full ``tidy`` does it instead."""
        mine = set(shards)
        done = [
            p for p in after.pending
            if p.shard in mine and self.client.machine(p.shard).cached().upper >= p.batch.upper
        ]
        if not done:
            return
        gone = {(p.shard, p.txn) for p in done}
        rest = tuple(p for p in after.pending if (p.shard, p.txn) not in gone)
        try:
            self.log.append(
                [p.row(-1) for p in done], after.upper,
                then=replace(after, upper=after.upper + 1, pending=rest),
            )
        except UpperMismatch:
            self.tidy()
            return
        self.log.allow_compaction(after.upper)

    def _is_applied(self, p: Pending | Advance) -> bool:
        return self.client.machine(p.shard).fetch_latest().upper >= p.upper

    def forget(self, shards: Iterable[str]) -> int:
        """Retracts the registrations of ``shards`` (deleted or finalized: nothing can
        write them again), in one log CAS; idempotent. Returns how many it retracted.
        Their untidied entries are applied trivially (a finalized shard's upper is the
        empty frontier) and go with the next tidy."""
        want = {str(ShardId.parse(s)) for s in shards}
        while True:
            view = self.log.read()
            gone = sorted(want & view.registered)
            if not gone:
                return 0
            try:
                self.log.append([registration_row(s, -1) for s in gone], view.upper)
            except UpperMismatch:
                continue
            self.log.allow_compaction(view.upper)
            return len(gone)

    # ----- recovery ---------------------------------------------------------------------

    def recover_orphans(self, shards: Iterable[str] | None = None) -> int:
        """Releases the part writers of transactions that can never commit (their
        committer's log writer is gone from the log's state and the log holds no entry
        of theirs); the leaked-blob sweeper then collects their parts. Returns the count."""
        registered = self.log.read().registered
        seen: list[tuple[str, str, str]] = []  # (shard, part writer, its committer's log writer)
        for s in sorted(registered if shards is None else set(shards)):
            for wid, ws in self.client.machine(s).fetch_latest().writers.items():
                owner = _log_writer_of(ws.purpose)
                if owner is not None:
                    seen.append((s, wid, owner))
        if not seen:
            return 0
        # The log is read AFTER the part writers were seen: their committer registered its
        # log writer before them, so it is either still in this state of the log (alive:
        # keep) or gone for good; and a commit of theirs that landed is in it (keep). Read
        # before, a commit landing meanwhile would lose its part writer: never applicable.
        view = self.log.read()
        named = {(p.shard, p.part_writer) for p in view.pending}
        released = 0
        for s, wid, owner in seen:
            if owner in view.log_writers or (s, wid) in named:
                continue
            _release(self.client.machine(s), wid)
            released += 1
        return released

    def close(self) -> None:
        self.log.close()


_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()
_PARALLEL_SHARDS = 8  # consensus round trips of one transaction in flight at once


def _forget_pool_in_child() -> None:
    """After ``fork`` the pool's threads are gone (only the forking thread survives):
    the child starts its own pool on first use."""
    global _POOL, _POOL_LOCK
    _POOL, _POOL_LOCK = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool_in_child)


def _each(fn: Callable[[T], R], items: list[T] | tuple[T, ...]) -> list[R]:
    """``fn`` over ``items`` in order, in parallel when there are several: a transaction's
    per-shard steps (registrations, builds, applies, upper reads) are independent
    round trips to consensus and blob, one shard each."""
    if len(items) <= 1:
        return [fn(x) for x in items]
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=_PARALLEL_SHARDS, thread_name_prefix="persist-txn")
        pool = _POOL
    return list(pool.map(fn, items))


def _release(machine: Machine, writer_id: str) -> None:
    def release(st: ShardState, now: int) -> tr.Result:
        return mt.release_part_writer(st, now, writer_id=writer_id)

    machine.apply("release_part_writer", release)


def _log_writer_of(purpose: str) -> str | None:
    parts = purpose.split(" ")
    if len(parts) == 4 and parts[0] == "txn" and parts[2] == "log-writer":
        return parts[3]
    return None


def _check_write(w: ShardWrite) -> None:
    if w.lower.is_empty() or not (w.lower < w.upper):
        raise InvalidUsage(
            f"shard {w.shard}: a transaction batch needs lower < upper and a non-empty lower, "
            f"got [{w.lower}, {w.upper})"
        )
    t = w.updates.table
    if t.num_rows == 0:
        return
    mm = pc.min_max(t["t"]).as_py()
    lo, hi = int(mm["min"]), int(mm["max"])
    if lo < (w.lower.time or 0) or (w.upper.time is not None and hi >= w.upper.time):
        raise InvalidUsage(
            f"shard {w.shard}: update times [{lo}, {hi}] lie outside the batch interval "
            f"[{w.lower}, {w.upper}); nothing was written"
        )


__all__ = ["Committed", "LogRow", "NotRegistered", "Prepared", "ShardWrite", "Txns"]
