"""Making an existing collection transactional (issue 27): crash-safe, idempotent.

Collections with more than one shard are created transactional by default (their
``compare_and_append`` is then atomic over all shards); a one-shard collection is atomic
with one compare-and-set and does not pay the txn log. A collection created
non-transactional (explicitly, by an older version, or with one shard that later gets a
multi-shard rendition) is converted by ``make_transactional``, in three idempotent
steps, each safe to repeat after a crash at any point:

1. **register** every shard of every rendition (ready or being created) in the txn log.
   Registration alone changes nothing for direct writers: with no transaction pending
   a shard's logical upper is its physical upper;
2. **fence** the shards: every writer registered on them (direct ``WriteHandle``s, Spark
   jobs' part writers) is released, so its next write fails with ``LeaseExpired`` and
   its parts in flight are never linked; transaction part writers are kept;
3. **flip** the catalog flag ``transactional`` (one catalog CAS): from then on every
   ``open_writer`` returns a transactional writer and every read applies pending
   transactions first; then fence once more, for a writer that opened from a catalog read
   taken before the flip and registered between step 2 and the flip.

A crash before step 3 leaves the collection non-transactional with its shards
registered, which is harmless (direct writes keep logical == physical uppers) and the
command is simply run again. The one window it cannot close: a process that read the
catalog before the flip and registers a direct writer after the second fence (a stall
of that length between two of its own steps). Stop old writers before converting a
collection they write.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from persist_lib.shard import maintenance_transitions as mt
from persist_lib.shard import transitions as tr
from persist_lib.shard.state import ShardState
from persist_lib.storage.catalog import Catalog, CatalogStore, Spec
from persist_lib.txn.txns import Txns

if TYPE_CHECKING:  # pragma: no cover
    from persist_lib.handles.client import PersistClient


class _Controller(Protocol):
    """What the conversion needs of the ``StorageController``."""

    client: PersistClient
    catalog: CatalogStore

    @property
    def txns(self) -> Txns: ...

    def _spec(self, name: str) -> Spec: ...

TXN_PURPOSE_PREFIX = "txn "  # transaction part writers (persist_lib.txn.txns._PURPOSE)


def collection_shards(spec: Spec) -> list[str]:
    """Every shard of every rendition that is ready or being created."""
    return [
        s for info in spec["renditions"].values() if info["status"] in ("ready", "creating")
        for s in info["shards"]
    ]


def fence_writers(client: PersistClient, shards: list[str]) -> int:
    """Releases every writer registered on ``shards`` except transaction part writers;
    returns how many it released."""
    released = 0
    for s in shards:
        machine = client.machine(s)
        state = machine.fetch_latest()
        if not state.exists or state.tombstone:
            continue
        for wid, ws in state.writers.items():
            if ws.purpose.startswith(TXN_PURPOSE_PREFIX):
                continue

            def release(st: ShardState, now: int, wid: str = wid) -> tr.Result:
                return mt.release_part_writer(st, now, writer_id=wid)

            res, _ = machine.apply("fence_writer", release)
            released += bool(res)
    return released


def make_transactional(ctl: _Controller, name: str) -> dict[str, Any]:
    """Converts collection ``name`` (see the module docstring); a no-op report for a
    collection that is transactional already."""
    spec = ctl._spec(name)
    if spec.get("transactional"):
        return {"name": name, "converted": False, "writers_fenced": 0}
    shards = collection_shards(spec)
    ctl.txns.register(shards)
    fenced = fence_writers(ctl.client, shards)

    def flip(cat: Catalog) -> dict[str, Spec | None]:
        cur = cat.get(name)
        if cur is None or cur.get("transactional"):
            return {}
        return {name: dict(cur, transactional=True)}

    cat = ctl.catalog.update(flip)
    spec = cat.get(name, spec)
    more = collection_shards(spec)
    ctl.txns.register(more)  # a rendition created meanwhile
    fenced += fence_writers(ctl.client, more)
    return {"name": name, "converted": True, "shards": len(more), "writers_fenced": fenced}
