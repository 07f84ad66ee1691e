"""``CollectionWriter``: writes one rendition of a collection, routing rows by key hash.

Each shard of the rendition gets the rows whose key hashes to it (``routing.route``);
every shard advances to the same upper, so the rendition's upper (the minimum over its
shards) moves with each write.

A *transactional* collection (every multi-shard one by default; ``make_transactional``
converts others) has its shards registered in the location's txn log
(``persist_lib.txn``): its writer writes every shard of the rendition as ONE
transaction, so ``compare_and_append`` is atomic for any number of shards and ``append``
is definite across crashes between shards (each shard from its own upper, so a write an
old direct writer left cut between shards is healed). Its shards are written only that
way (no direct shard writers). A one-shard collection that is not transactional writes
its shard directly: one compare-and-set is atomic already. A direct writer fenced by a
conversion (``LeaseExpired``) carries on through transactions.

After writing, the writer of the *active* rendition advances the metadata shard's
upper, declaring that no handover happens before it. A writer of a rendition that is
not (yet) active leaves the metadata alone, so a backfill can't block a handover.
"""

from __future__ import annotations

import logging
from typing import Any

import pyarrow.compute as pc

from persist_lib.errors import InvalidUsage, LeaseExpired, PersistError, UpperMismatch
from persist_lib.frontier import Antichain, FrontierLike, as_frontier
from persist_lib.handles.write import WriteHandle
from persist_lib.shard.codec import (
    KEY_PREFIX,
    CheckedUpdates,
    Schemas,
    normalize_checked,
)
from persist_lib.storage.directory import ActiveRendition
from persist_lib.storage.routing import split_by_shard
from persist_lib.txn.txns import ShardWrite, Txns

log = logging.getLogger(__name__)


class CollectionWriter:
    def __init__(
        self,
        ctl: ActiveRendition,
        name: str,
        rendition: str,
        shard_writers: list[WriteHandle],
        schemas: Schemas,
        metadata_writer: WriteHandle,
        txns: Txns | None = None,
        shard_ids: list[str] | None = None,
    ) -> None:
        self._ctl = ctl
        self.name = name
        self.rendition = rendition
        self._writers = shard_writers
        self.schemas = schemas
        self._meta = metadata_writer
        self._txns = txns
        self._shard_ids = shard_ids if shard_ids is not None else [w.shard_id for w in shard_writers]
        self._expired = False

    @property
    def transactional(self) -> bool:
        """Whether this rendition's shards are written through transactions."""
        return self._txns is not None

    @property
    def txns(self) -> Txns:
        """The transactions this writer commits through (a transactional collection's)."""
        if self._txns is None:
            raise InvalidUsage(f"collection {self.name}: it is not transactional")
        return self._txns

    @property
    def num_shards(self) -> int:
        return len(self._shard_ids)

    @property
    def shard_ids(self) -> list[str]:
        return list(self._shard_ids)

    @property
    def shard_writers(self) -> tuple[WriteHandle, ...]:
        """The rendition's shard writers, in routing order (shard ``i`` gets the keys that
        ``routing.split_by_shard`` sends to ``i``): for writers that build batches
        themselves (Spark), followed by ``advance_metadata``. A transactional collection
        has none: its shards are written only through transactions."""
        if self._txns is not None:
            raise InvalidUsage(
                f"collection {self.name}: it is transactional, so its shards are written only "
                "through transactions (compare_and_append / append / ctl.insert), not directly"
            )
        return tuple(self._writers)

    @property
    def upper(self) -> Antichain:
        """The rendition upper: the minimum of its shards' uppers (read from consensus;
        for a transactional collection, their logical uppers: committed, maybe not applied)."""
        if self._txns is not None:
            view = self._txns.log.read()
            return min(self._txns.logical_upper(s, view) for s in self._shard_ids)
        return min(w.fetch_recent_upper() for w in self._writers)

    def _split(self, updates: Any) -> list[CheckedUpdates]:
        """``updates`` checked once and routed: each shard writer takes its piece as it is.
        Routing on the internal key columns gives the same routes as on the user ones
        (the same values and types)."""
        internal = normalize_checked(updates, self.schemas, shard=f"{self.name}/{self.rendition}")
        key_cols = [KEY_PREFIX + n for n in self.schemas.key_names]
        return split_by_shard(internal, key_cols, len(self._shard_ids))

    def append(self, updates: Any, lower: FrontierLike, upper: FrontierLike) -> None:
        """Definite append of ``updates`` (times in ``[lower, upper)``) to every shard."""
        self._check_open()
        lo, hi = as_frontier(lower, "lower"), as_frontier(upper, "upper")
        if self._txns is None:
            try:
                for w, part in zip(self._writers, self._split(updates), strict=True):
                    w.append(part, lo, hi)
                self.advance_metadata(hi)
                return
            except LeaseExpired as e:
                self._switch_if_converted(e)  # (re-raises unless the collection converted)
        self._txn_append(updates, lo, hi)

    def compare_and_append(
        self, updates: Any, expected_upper: FrontierLike, new_upper: FrontierLike
    ) -> None:
        """Appends iff every shard's upper is ``expected_upper`` (atomic for one shard)."""
        self._check_open()
        expected = as_frontier(expected_upper, "expected_upper")
        new = as_frontier(new_upper, "new_upper")
        if self._txns is None:
            parts = self._split(updates)
            try:
                uppers = [w.fetch_recent_upper() for w in self._writers]
                if any(u != expected for u in uppers):
                    raise UpperMismatch(f"{self.name}/{self.rendition}", expected, min(uppers))
                for w, part in zip(self._writers, parts, strict=True):
                    w.compare_and_append(part, expected, new)
                self.advance_metadata(new)
                return
            except LeaseExpired as e:
                self._switch_if_converted(e)
        self._txn_commit(self._split(updates), expected, new)
        self.advance_metadata_after_commit(new)

    def _switch_if_converted(self, fenced: LeaseExpired) -> None:
        """A direct shard writer was fenced: if the collection became transactional
        (``make_transactional``), this writer continues through transactions; otherwise
        the ``LeaseExpired`` stands (re-raised)."""
        txns = self._ctl._txns_if_transactional(self.name)
        if txns is None:
            raise fenced
        self._txns = txns
        for w in self._writers:
            try:
                w.expire()
            except PersistError:
                pass
        self._writers = []

    def _txn_commit(self, parts: list[CheckedUpdates], expected: Antichain, new: Antichain) -> None:
        """One transaction writing every shard (an empty batch where no row routes)."""
        assert self._txns is not None
        writes = [
            ShardWrite(s, self.schemas, p, expected, new)
            for s, p in zip(self._shard_ids, parts, strict=True)
        ]
        try:
            self._txns.commit(writes, self.metadata_advances(new))
        except UpperMismatch as e:
            raise UpperMismatch(f"{self.name}/{self.rendition}", expected, e.current) from e

    def _txn_append(self, updates: Any, lo: Antichain, hi: Antichain) -> None:
        """Definite append through transactions: the times the collection holds already
        are skipped (another instance wrote them), the rest committed in one transaction."""
        checked = normalize_checked(updates, self.schemas, shard=f"{self.name}/{self.rendition}")
        assert self._txns is not None
        key_cols = [KEY_PREFIX + n for n in self.schemas.key_names]
        pieces = split_by_shard(checked, key_cols, len(self._shard_ids))
        while True:
            view = self._txns.log.read()
            uppers = [self._txns.logical_upper(s, view) for s in self._shard_ids]
            if all(u >= hi for u in uppers):
                break
            low = min(uppers)
            if low < lo:
                raise UpperMismatch(f"{self.name}/{self.rendition}", lo, low)
            # Each shard from its own upper: shards of a collection converted from direct
            # writes may disagree (a writer fenced between shards); one transaction then
            # brings them all to ``hi``.
            writes = []
            for s, piece, cur in zip(self._shard_ids, pieces, uppers, strict=True):
                if cur >= hi:
                    continue
                if cur > lo:
                    assert cur.time is not None
                    piece = piece.filter(pc.greater_equal(piece.table["t"], cur.time))
                writes.append(ShardWrite(s, self.schemas, piece, cur, hi))
            try:
                self._txns.commit(writes, self.metadata_advances(hi))
            except UpperMismatch:
                continue
            break
        self.advance_metadata_after_commit(hi)

    def advance_metadata_after_commit(self, upper: Antichain) -> None:
        """``advance_metadata`` after a transaction committed: a failure is logged, not
        raised (the write is committed; the move is a committed follow-up that whoever
        applies the transaction performs, ``metadata_advances``)."""
        try:
            self.advance_metadata(upper)
        except PersistError as e:
            log.warning("collection %s: committed up to %s; moving its metadata upper failed (the "
                        "next reader does it): %s", self.name, upper, e)

    def metadata_advances(self, upper: Antichain) -> list[tuple[str, Antichain]]:
        """The follow-up a transaction writing this rendition up to ``upper`` commits with
        (``Txns.commit(..., advances=)``): the metadata shard moved to ``upper`` by whoever
        applies it, so a committer killed after its commit CAS does not leave the
        collection's readers waiting. None for a rendition that is not active."""
        if upper.is_empty() or self._ctl._active_rendition_at_upper(self.name) != self.rendition:
            return []
        return [(self._meta.shard_id, upper)]

    def advance_metadata(self, upper: Antichain) -> None:
        """Moves the metadata upper to ``upper`` if this rendition is the active one (after
        every shard's upper reached it: ``append`` and ``compare_and_append`` call it)."""
        if upper.is_empty():
            return  # never close the metadata shard: a later handover must stay possible
        while True:
            cur = self._meta.fetch_recent_upper()
            if cur >= upper:
                return
            if self._ctl._active_rendition_at_upper(self.name) != self.rendition:
                return
            try:
                self._meta.compare_and_append([], cur, upper)
                self._ctl._note_active(self.name, upper, self.rendition)
                return
            except UpperMismatch:
                continue

    def expire(self) -> None:
        if self._expired:
            return
        self._expired = True
        for w in self._writers:
            w.expire()
        self._meta.expire()

    close = expire

    def _check_open(self) -> None:
        if self._expired:
            raise InvalidUsage(f"collection {self.name}: writer for {self.rendition} was expired")

    def __enter__(self) -> CollectionWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.expire()

    def __repr__(self) -> str:
        return f"CollectionWriter({self.name}/{self.rendition}, shards={len(self._writers)})"
