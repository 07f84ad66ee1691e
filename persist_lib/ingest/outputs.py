"""Where an ingestion writes: a small output interface with two adapters.

The driver only needs, per output (data, errors, raw, state): the upper, a *verified*
definite append, a snapshot (to rehydrate state) and a since to downgrade.

*Verified* append: the recipe says two instances write identical updates, and an
instance may assert so on any write that finds the times already written. So an
append of ``[lower, upper)`` is a ``compare_and_append`` at the shard's upper; for
every part of the range another writer already committed, the committed updates are
read back and compared with ours, and a difference raises ``NeedsNewRendition``
(the committed data stays as it is). Where the output's since has passed the start of
the range, compaction may have folded the committed updates into the since: the range
is then checked on its contents at the since (possible when it starts at time 0), and
otherwise the append stops with ``ReplayUnverifiable``. Every time range is thus either
written by this instance or checked equal to what it would have written (at the since,
for times the since has passed), or the ingestion stops.

Adapters:
- ``ShardOutputs``: plain persist shards whose ids derive from the ingestion name and
  the role (``uuid5``), so every instance finds the same shards without a catalog.
- ``StorageOutputs``: STORAGE collections (``name``, ``name.errors``, ``name.raw``,
  ``name.state``) written through their renditions' shards, routed by key hash, with
  the collection's metadata upper advanced after each append. They are transactional
  collections, so an append to one is one transaction over its shards.

The ingestion driver appends every output of a flush as ONE transaction
(``atomic_append.py``): each output only splits its updates over its shards
(``shard_pieces``) and is told when the commit landed (``committed``).
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import pyarrow as pa
import pyarrow.compute as pc

from persist_lib.errors import InvalidUsage, UpperMismatch
from persist_lib.frontier import Antichain
from persist_lib.ids import ShardId
from persist_lib.ingest.atomic_append import append_atomically
from persist_lib.ingest.errors import (
    IngestConfigError,
    IngestInvariantError,
    NeedsNewRendition,
    ReplayUnverifiable,
)
from persist_lib.shard.codec import Schemas, normalize_updates
from persist_lib.shard.consolidate import consolidate
from persist_lib.txn.txns import Txns

if TYPE_CHECKING:  # pragma: no cover
    from persist_lib.handles.client import PersistClient
    from persist_lib.handles.read import ReadHandle
    from persist_lib.handles.write import WriteHandle

log = logging.getLogger(__name__)

_NS = uuid.UUID("6f1c2a52-0f5e-4d8e-9a51-6c0f3a1e9b77")

ROLES = ("data", "errors", "raw", "state", "remap")


def shard_id_for(name: str, role: str) -> ShardId:
    """The deterministic shard id of ``role`` (data, errors, raw, state, remap) of ingestion ``name``."""
    return ShardId("s" + str(uuid.uuid5(_NS, f"persist-ingest/{name}/{role}")))


@dataclass
class AppendStats:
    written: int = 0  # time ranges this instance committed
    verified: int = 0  # time ranges found committed by another writer and checked equal


class Output(Protocol):
    role: str
    label: str
    schemas: Schemas
    stats: AppendStats

    def upper(self) -> int:
        """The upper (a time), read from consensus now."""
        ...

    def since(self) -> int: ...

    def append(self, updates: pa.Table, lower: int, upper: int) -> None:
        """Verified definite append of ``updates`` (times in ``[lower, upper)``)."""
        ...

    def snapshot(self, as_of: int) -> pa.Table: ...

    def updates_between(self, lower: int, upper: int) -> pa.Table:
        """Every update at times in ``[lower, upper)`` (user layout, times not forwarded)."""
        ...

    def downgrade_since(self, since: int) -> None: ...

    def shard_outputs(self) -> list[ShardOutput]:
        """This output's shards."""
        ...

    def shard_pieces(self, updates: pa.Table) -> list[tuple[ShardOutput, pa.Table]]:
        """``updates`` split over this output's shards (for ``append_atomically``)."""
        ...

    def committed(self, upper: int) -> None:
        """After ``append_atomically`` committed this output up to ``upper``."""
        ...

    def heartbeat(self) -> None:
        """Extends the leases of this output's handles."""
        ...

    def describe(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


class OutputFactory(Protocol):
    def open(self, role: str, key_schema: pa.Schema, val_schema: pa.Schema) -> Output: ...

    def describe(self) -> dict[str, Any]: ...


def txns_of(factory: OutputFactory) -> Txns | None:
    """The transactions a factory's outputs commit through (``StorageOutputs``: its
    controller's); None: the caller opens ``Txns(client)`` on the same location."""
    txns = getattr(factory, "txns", None)
    return txns if isinstance(txns, Txns) else None


def _time(f: Antichain, what: str) -> int:
    if f.time is None:
        raise IngestInvariantError(
            f"{what}: the frontier is empty (the shard was closed for writes); an ingestion "
            "output can't be closed: this shard is not one the pipeline owns"
        )
    return f.time


def _same_updates(ours: pa.Table, theirs: pa.Table, schemas: Schemas, label: str) -> str | None:
    """None when both (user layout) tables consolidate to the same updates, else a detail."""
    a = normalize_updates(ours, schemas, shard=label)
    b = normalize_updates(theirs, schemas, shard=label)
    b = b.set_column(b.num_columns - 1, a.schema.field("d"), pc.negate(b.column("d")))
    diff = consolidate(pa.concat_tables([a, b]))
    if diff.num_rows == 0:
        return None
    sample = diff.slice(0, 3).to_pylist()
    return (
        f"{diff.num_rows} update(s) differ, e.g. {sample} (positive d: only this instance has "
        "them; negative: only the committed data)"
    )


class ShardOutput:
    """One persist shard as an output (writer + leased reader for checks and snapshots)."""

    def __init__(
        self,
        client: PersistClient,
        shard: ShardId | str,
        key_schema: pa.Schema,
        val_schema: pa.Schema,
        *,
        role: str,
        label: str,
    ) -> None:
        self.role = role
        self.label = label
        self.shard_id = str(shard)
        self.schemas = Schemas.create(key_schema, val_schema)
        purpose = f"ingest:{label}"
        self._w: WriteHandle = client.open_writer(shard, key_schema, val_schema, purpose=purpose)
        self._r: ReadHandle = client.open_leased_reader(shard, key_schema, val_schema, purpose=purpose)
        self.stats = AppendStats()
        # Appends of at least this many Arrow bytes are written as unsorted parts (None:
        # the client's ``PersistConfig.unsorted_min_bytes``); set from ``IngestConfig``.
        self.unsorted_min_bytes: int | None = None

    def upper(self) -> int:
        return _time(self._w.fetch_recent_upper(), self.label)

    def since(self) -> int:
        return self._r.since.time or 0

    def append(self, updates: pa.Table, lower: int, upper: int) -> None:
        if upper <= lower:
            return
        lo = lower
        while True:
            part = updates if lo == lower else updates.filter(pc.greater_equal(updates["ts"], lo))
            try:
                self._compare_and_append(part, lo, upper)
                self.stats.written += 1
                return
            except UpperMismatch as e:
                cur = _time(e.current, self.label)
            if cur < lo:
                raise IngestInvariantError(
                    f"{self.label} (shard {self.shard_id}): its upper is {cur}, below {lo} where this "
                    "instance resumes: another writer rewound or the driver lost track; nothing was "
                    "written"
                )
            hi = min(cur, upper)
            self._verify(part, lo, hi)
            if cur >= upper:
                return
            lo = cur

    def _compare_and_append(self, part: pa.Table, lo: int, upper: int) -> None:
        """``compare_and_append``, with parts of ``unsorted_min_bytes`` or more written as
        they come: the append then costs the Parquet encoding but no sort, and the sort
        moves to the compactor (reads consolidate either way; see docs/ingestion.md)."""
        if self.unsorted_min_bytes is None:
            self._w.compare_and_append(part, lo, upper)
            return
        b = self._w.builder(lo)
        b.unsorted_min_bytes = self.unsorted_min_bytes  # (the builder reads it per part)
        b.key_range_min_bytes = None  # unsorted as asked, not sorted by key ranges
        try:
            b.add(self._w.normalize(part))
            batch = b.finish(upper)
        except BaseException:
            b.abort()
            raise
        self._w.compare_and_append_batch(batch, lo, upper)  # (deletes the parts if it certainly lost)

    def _verify(self, ours: pa.Table, lo: int, hi: int) -> None:
        """Checks ``ours`` (times from ``lo``) against what another writer committed at
        times in ``[lo, hi)``; raises ``NeedsNewRendition`` on a difference and
        ``ReplayUnverifiable`` where no check is possible. Never accepts unchecked."""
        if hi <= lo:
            return
        mine = ours.filter(pc.less(ours["ts"], hi)) if ours.num_rows else ours
        since = self._r.since.time
        if since is not None and (since < lo or since == lo == 0):
            # Times in the range were never forwarded: the committed updates are exact.
            detail = _same_updates(mine, self._r.updates_between(lo, hi), self.schemas, self.label)
        else:
            detail = self._verify_at_since(mine, lo, hi, since)
        if detail is not None:
            raise NeedsNewRendition(self.label, lo, hi, detail)
        self.stats.verified += 1

    def _verify_at_since(self, mine: pa.Table, lo: int, hi: int, since: int | None) -> str | None:
        """The range reaches the since: compaction may have forwarded the committed
        updates at times <= since to the since, folded together with every older update.
        Decidable when the range starts at 0 (then nothing older exists): the contents
        at the since must be ours advanced to it, and the updates after it must be ours
        exactly. Otherwise ``ReplayUnverifiable``."""
        if since is None:
            raise ReplayUnverifiable(self.label, lo, hi, since, "the shard can't be read any more")
        if lo > 0:
            raise ReplayUnverifiable(
                self.label, lo, hi, since,
                f"updates before {lo} were folded into the since with the committed ones",
            )
        if since >= hi:
            raise ReplayUnverifiable(
                self.label, lo, hi, since,
                f"the contents at the since include committed times [{hi}, {since}] this "
                "instance has not computed yet",
            )
        below = mine.filter(pc.less_equal(mine["ts"], since)) if mine.num_rows else mine
        i = below.schema.get_field_index("ts")
        below = below.set_column(
            i, below.schema.field(i), pa.array([since] * below.num_rows, below.schema.field(i).type)
        )
        detail = _same_updates(below, self._r.snapshot(since), self.schemas, self.label)
        if detail is not None or since + 1 >= hi:
            return detail
        above = mine.filter(pc.greater(mine["ts"], since)) if mine.num_rows else mine
        return _same_updates(above, self._r.updates_between(since + 1, hi), self.schemas, self.label)

    def snapshot(self, as_of: int) -> pa.Table:
        return self._r.snapshot(as_of)

    def updates_between(self, lower: int, upper: int) -> pa.Table:
        return self._r.updates_between(lower, upper)

    def downgrade_since(self, since: int) -> None:
        if self._r.since < Antichain([since]):
            self._r.downgrade_since(since)

    def shard_outputs(self) -> list[ShardOutput]:
        return [self]

    def shard_pieces(self, updates: pa.Table) -> list[tuple[ShardOutput, pa.Table]]:
        return [(self, updates)]

    def committed(self, upper: int) -> None:
        return None

    def heartbeat(self) -> None:
        self._r.heartbeat()
        self._w.heartbeat()

    def describe(self) -> dict[str, Any]:
        return {"role": self.role, "shard": self.shard_id}

    def close(self) -> None:
        for h in (self._w, self._r):
            try:
                h.expire()
            except Exception as e:  # noqa: BLE001 - best effort: leases lapse anyway
                log.debug("expiring %r failed: %s", h, e)


class ShardOutputs:
    """Outputs as plain persist shards with ids derived from the ingestion name."""

    def __init__(self, client: PersistClient, name: str) -> None:
        self.client = client
        self.name = name

    def open(self, role: str, key_schema: pa.Schema, val_schema: pa.Schema) -> Output:
        return ShardOutput(
            self.client, shard_id_for(self.name, role), key_schema, val_schema,
            role=role, label=f"{self.name}/{role}",
        )

    def describe(self) -> dict[str, Any]:
        return {"kind": "shards", "name": self.name}


def collection_name(name: str, role: str) -> str:
    return name if role == "data" else f"{name}.{role}"


class CollectionOutput:
    """A STORAGE collection's rendition as an output: one ``ShardOutput`` per shard."""

    def __init__(self, ctl: Any, name: str, role: str, rendition: str | None = None) -> None:
        from persist_lib.storage.routing import split_by_shard

        self._split = split_by_shard
        self.role = role
        self.label = name
        self._cw = ctl.open_writer(name, rendition)
        self._txns: Txns | None = self._cw.txns if self._cw.transactional else None
        self.rendition = self._cw.rendition
        self.schemas: Schemas = self._cw.schemas
        self._shards = [
            ShardOutput(
                ctl.client, sid, self.schemas.key, self.schemas.val,
                role=role, label=f"{name}/{self.rendition}/{i}",
            )
            for i, sid in enumerate(self._cw.shard_ids)
        ]
        self.stats = AppendStats()

    @property
    def unsorted_min_bytes(self) -> int | None:
        return self._shards[0].unsorted_min_bytes if self._shards else None

    @unsorted_min_bytes.setter
    def unsorted_min_bytes(self, v: int | None) -> None:
        for s in self._shards:
            s.unsorted_min_bytes = v

    def upper(self) -> int:
        return min(s.upper() for s in self._shards)

    def since(self) -> int:
        return max(s.since() for s in self._shards)

    def append(self, updates: pa.Table, lower: int, upper: int) -> None:
        if upper <= lower:
            return
        if self._txns is not None:  # every shard in one transaction
            append_atomically(self._txns, list(self.shard_pieces(updates)), lower, upper)
            self.committed(upper)
            return
        for s, part in self.shard_pieces(updates):
            s.append(part, lower, upper)
        self._cw.append([], upper, upper)  # advances the collection's metadata upper
        self.committed(upper)

    def shard_outputs(self) -> list[ShardOutput]:
        return list(self._shards)

    def shard_pieces(self, updates: pa.Table) -> list[tuple[ShardOutput, pa.Table]]:
        parts = self._split(updates, self.schemas.key_names, len(self._shards))
        return list(zip(self._shards, parts, strict=True))

    def committed(self, upper: int) -> None:
        self._cw.advance_metadata(Antichain([upper]))
        self.stats.written = sum(s.stats.written for s in self._shards)
        self.stats.verified = sum(s.stats.verified for s in self._shards)

    def snapshot(self, as_of: int) -> pa.Table:
        tables = [s.snapshot(as_of) for s in self._shards]
        return pa.concat_tables(tables)

    def updates_between(self, lower: int, upper: int) -> pa.Table:
        return pa.concat_tables([s.updates_between(lower, upper) for s in self._shards])

    def downgrade_since(self, since: int) -> None:
        for s in self._shards:
            s.downgrade_since(since)

    def heartbeat(self) -> None:
        for s in self._shards:
            s.heartbeat()

    def describe(self) -> dict[str, Any]:
        return {
            "role": self.role,
            "collection": self.label,
            "rendition": self.rendition,
            "shards": [s.shard_id for s in self._shards],
        }

    def close(self) -> None:
        for s in self._shards:
            s.close()
        try:
            self._cw.expire()
        except Exception as e:  # noqa: BLE001
            log.debug("expiring the collection writer of %s failed: %s", self.label, e)


class StorageOutputs:
    """Outputs as STORAGE collections, created on first use.

    ``rendition`` selects the rendition to write (default: the active one), e.g. a new
    rendition being rebuilt before a handover; the raw collection always uses its
    active rendition (raw records don't depend on the decoding logic).
    """

    def __init__(
        self, ctl: Any, name: str, *, num_shards: int = 1, rendition: str | None = None
    ) -> None:
        self.ctl = ctl
        self.name = name
        self.num_shards = num_shards
        self.rendition = rendition

    @property
    def txns(self) -> Txns:
        """The controller's: a binding's outputs commit as one transaction of its log."""
        txns: Txns = self.ctl.txns
        return txns

    def open(self, role: str, key_schema: pa.Schema, val_schema: pa.Schema) -> Output:
        cname = collection_name(self.name, role)
        ensure_collection(
            self.ctl, cname, key_schema, val_schema, self.num_shards,
            rendition=None if role == "raw" else self.rendition,
        )
        # The raw collection doesn't depend on the decoding logic: it is never rebuilt,
        # so it is always written in its active rendition.
        return CollectionOutput(self.ctl, cname, role, None if role == "raw" else self.rendition)

    def describe(self) -> dict[str, Any]:
        return {"kind": "storage", "name": self.name, "num_shards": self.num_shards}


def ensure_collection(
    ctl: Any, name: str, key_schema: pa.Schema, val_schema: pa.Schema, num_shards: int,
    *, rendition: str | None = None,
) -> None:
    """Creates collection ``name`` unless it exists (then its schemas, or those of
    ``rendition`` when given and it exists, must match), as a transactional collection:
    the outputs of a binding commit as one transaction. An existing non-transactional
    one (an older version made it) is made transactional."""
    want = Schemas.create(key_schema, val_schema)
    for _ in range(3):
        if name in ctl.list_collections():
            d = ctl.describe(name)
            have = d["renditions"].get(rendition, d)["schemas"] if rendition else d["schemas"]
            if have != want.describe():
                from persist_lib.ingest.schema_follow import check_not_evolved

                check_not_evolved(ctl, name, want)
                raise IngestConfigError(
                    f"collection {name!r} exists with schemas {have}, but the ingestion writes "
                    f"{want.describe()}; use another ingestion name or a new collection for the new "
                    "schema"
                )
            if not ctl.is_transactional(name):
                ctl.make_transactional(name)
            return
        try:
            ctl.create_collection(name, key_schema, val_schema, num_shards, transactional=True)
            return
        except InvalidUsage:
            continue  # created concurrently by another instance: re-check
    raise IngestInvariantError(f"could not create or find collection {name!r}")
