"""``CollectionWriter``: writes one rendition of a collection, routing rows by key hash.

Each shard of the rendition gets the rows whose key hashes to it (``routing.route``);
every shard advances to the same upper, so the rendition's upper (the minimum over its
shards) moves with each write. ``append`` is the definite, replicated-writer append of
persist, shard by shard; ``compare_and_append`` is atomic only for a one-shard
rendition (a multi-shard rendition has no cross-shard transaction: a writer that lost
midway simply retries with identical data, which definite appends make harmless).

After writing, the writer of the *active* rendition advances the metadata shard's
upper, declaring that no handover happens before it. A writer of a rendition that is
not (yet) active leaves the metadata alone, so a backfill can't block a handover.
"""

from __future__ import annotations

from typing import Any

from persist_lib.errors import InvalidUsage, UpperMismatch
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


class CollectionWriter:
    def __init__(
        self,
        ctl: ActiveRendition,
        name: str,
        rendition: str,
        shard_writers: list[WriteHandle],
        schemas: Schemas,
        metadata_writer: WriteHandle,
    ) -> None:
        self._ctl = ctl
        self.name = name
        self.rendition = rendition
        self._writers = shard_writers
        self.schemas = schemas
        self._meta = metadata_writer
        self._expired = False

    @property
    def num_shards(self) -> int:
        return len(self._writers)

    @property
    def shard_ids(self) -> list[str]:
        return [w.shard_id for w in self._writers]

    @property
    def shard_writers(self) -> tuple[WriteHandle, ...]:
        """The rendition's shard writers, in routing order (shard ``i`` gets the keys that
        ``routing.split_by_shard`` sends to ``i``): for writers that build batches
        themselves (Spark), followed by ``advance_metadata``."""
        return tuple(self._writers)

    @property
    def upper(self) -> Antichain:
        """The rendition upper: the minimum of its shards' uppers (read from consensus)."""
        return min(w.fetch_recent_upper() for w in self._writers)

    def _split(self, updates: Any) -> list[CheckedUpdates]:
        """``updates`` checked once and routed: each shard writer takes its piece as it is.
        Routing on the internal key columns gives the same routes as on the user ones
        (the same values and types)."""
        internal = normalize_checked(updates, self.schemas, shard=f"{self.name}/{self.rendition}")
        key_cols = [KEY_PREFIX + n for n in self.schemas.key_names]
        return split_by_shard(internal, key_cols, len(self._writers))

    def append(self, updates: Any, lower: FrontierLike, upper: FrontierLike) -> None:
        """Definite append of ``updates`` (times in ``[lower, upper)``) to every shard."""
        self._check_open()
        lo, hi = as_frontier(lower, "lower"), as_frontier(upper, "upper")
        for w, part in zip(self._writers, self._split(updates), strict=True):
            w.append(part, lo, hi)
        self.advance_metadata(hi)

    def compare_and_append(
        self, updates: Any, expected_upper: FrontierLike, new_upper: FrontierLike
    ) -> None:
        """Appends iff every shard's upper is ``expected_upper`` (atomic for one shard)."""
        self._check_open()
        expected = as_frontier(expected_upper, "expected_upper")
        new = as_frontier(new_upper, "new_upper")
        parts = self._split(updates)
        uppers = [w.fetch_recent_upper() for w in self._writers]
        if any(u != expected for u in uppers):
            raise UpperMismatch(f"{self.name}/{self.rendition}", expected, min(uppers))
        for w, part in zip(self._writers, parts, strict=True):
            w.compare_and_append(part, expected, new)
        self.advance_metadata(new)

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
