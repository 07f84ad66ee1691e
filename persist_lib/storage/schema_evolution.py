"""Evolving a collection's schemas in place: the catalog's schemas and every shard's.

A collection's schemas live in its catalog entry (``schemas``, with the earlier
``versions``: the collection's schema version is their count). Each shard of each live
rendition keeps its own registry (``shard.schema_registry``). An evolution is
three durable steps, each idempotent, so a crash anywhere leaves a state that any
writable controller completes (``StorageController.recover`` rolls it forward):

1. **intent**: one catalog command checks the change against the collection's
   schemas and history (``schema_compat.check_evolution``: an incompatible change is
   refused here, before anything changed) and records ``schema_evolving`` (the target
   schemas and version);
2. every shard of every ready rendition is evolved with ``compare_and_evolve`` from the
   collection's current schemas to the target (a shard already there answers
   ``ALREADY``: the step resumes where a crash left it);
3. one catalog command makes the target the collection's schemas and drops the intent.

Between 1 and 3 the catalog still names the old version, and some shards may already be
at the new one. Nothing reads or writes a mix: a writer of the old version is refused
by every evolved shard (``StaleSchema``, nothing written), a reader of the old version
fails typed on an evolved shard, and ``open_writer`` / ``acquire_read_handle`` of a
writable controller finish the pending evolution first (a read-only one refuses with
``StaleSchema`` naming the pending version).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import pyarrow as pa

from persist_lib.errors import InvalidUsage, SchemaMismatch, StaleSchema
from persist_lib.shard.codec import Schemas
from persist_lib.shard.schema_compat import check_evolution
from persist_lib.shard.schema_registry import EvolveOutcome

if TYPE_CHECKING:  # pragma: no cover
    from persist_lib.handles.client import PersistClient
    from persist_lib.storage.catalog import Catalog, CatalogStore, Spec

EVOLVING = "schema_evolving"


class StorageController(Protocol):
    """What an evolution needs of the controller (which imports this module)."""

    client: PersistClient
    catalog: CatalogStore
    read_only: bool

    def _check_writable(self, what: str) -> None: ...

    def _spec(self, name: str) -> Spec: ...


class UnknownCollectionForSchema(InvalidUsage):
    """The collection to evolve does not exist (or is being created or deleted)."""


def collection_schemas(spec: Spec) -> Schemas:
    """The collection's current schemas with its earlier versions."""
    return Schemas.from_json(spec["schemas"])


# ----- renditions with schemas of their own (the rebuild path) ---------------------------
#
# A change that can't be made in place goes through a new rendition created with the new
# schemas (``create_rendition(..., key_schema=, val_schema=)``): its catalog entry records
# them (``schemas``), its shards are created with them, a backfill (e.g. a rebuild from
# the raw collection) writes under them, and a handover to it makes them the collection's
# schemas. The renditions it replaces keep theirs (pinned in their entries), so a reader
# of the new schemas refuses their times (``StaleSchema``) instead of misreading them.


def rendition_schemas(spec: Spec, rendition: str) -> Schemas:
    """The schemas rendition ``rendition`` is written and read with."""
    own = spec["renditions"][rendition].get("schemas")
    return Schemas.from_json(own) if own is not None else collection_schemas(spec)


def create_with_history(
    client: PersistClient, shard: str, schemas: Schemas, create: Callable[[str, pa.Schema, pa.Schema], None]
) -> None:
    """Creates ``shard`` (``create``: the controller's, with its since hold) with the
    collection's registry: at its first version, then evolved through the later ones, so a
    new rendition's shards number versions as the collection does (and name the same
    version in a ``StaleSchema``). Idempotent: a resumed step answers ``ALREADY``."""
    versions = [*schemas.history, Schemas(schemas.key, schemas.val)]
    state = client.machine(shard).fetch_latest()
    if state.exists and state.schemas is not None:
        start = Schemas.from_json(state.schemas).version  # resumed after a crash
    else:
        create(shard, versions[0].key, versions[0].val)
        start = 0
    for i in range(start, len(versions) - 1):
        prev, nxt = versions[i], versions[i + 1]
        res = client.compare_and_evolve_schema(shard, (prev.key, prev.val), (nxt.key, nxt.val))
        if res.outcome is EvolveOutcome.MISMATCH:
            raise SchemaMismatch(
                f"new shard {shard}: has schemas {res.schemas.describe()}, expected version {i} "
                f"({prev.describe()})"
            )


def schemas_after_handover(spec: Spec, to: str) -> Spec | None:
    """The collection entry once rendition ``to``, with schemas of its own, is active: its
    schemas become the collection's, every other rendition keeps its own. None when
    ``to`` has none (nothing changes): idempotent, so recovery can re-apply it."""
    info = spec["renditions"].get(to)
    if info is None or info.get("schemas") is None:
        return None
    old = spec["schemas"]
    rs = {}
    for r, i in spec["renditions"].items():
        if r == to:
            rs[r] = {k: v for k, v in i.items() if k != "schemas"}
        elif i.get("schemas") is None:
            rs[r] = dict(i, schemas=old)
        else:
            rs[r] = i
    return dict(spec, schemas=info["schemas"], renditions=rs)


def pending_version(spec: Spec) -> int | None:
    """The version an interrupted evolution is moving the collection to (None: none)."""
    p = spec.get(EVOLVING)
    return None if p is None else int(p["version"])


def evolve_collection(
    ctl: StorageController, name: str, key_schema: pa.Schema, val_schema: pa.Schema
) -> dict[str, Any]:
    """Evolves collection ``name`` to ``(key_schema, val_schema)`` in place (see the
    module docstring). ``IncompatibleSchemaChange``, with nothing changed, for a change
    that needs a new rendition; the same schemas again is a no-op (``unchanged``)."""
    ctl._check_writable("evolve_schema")
    new = Schemas.create(key_schema, val_schema)

    def intent(cat: Catalog) -> dict[str, Spec | None]:
        spec = cat.get(name)
        if spec is None or spec["status"] != "ready":
            raise UnknownCollectionForSchema(f"collection {name!r} does not exist")
        pending = spec.get(EVOLVING)
        if pending is not None:
            if Schemas.from_json(pending["to"]) == new:
                return {}  # resume it
            raise InvalidUsage(
                f"collection {name!r}: an evolution to version {pending['version']} was "
                "interrupted; finish it first (`persist schema evolve "
                f"{name} --resume`, or start a StorageController: recovery finishes it)"
            )
        cur = collection_schemas(spec)
        if cur == new:
            return {}
        changes = check_evolution(cur, new, shard=f"collection {name!r}")
        target = Schemas(new.key, new.val, (*cur.history, Schemas(cur.key, cur.val)))
        return {
            name: dict(
                spec,
                **{
                    EVOLVING: {
                        "to": target.to_json(),
                        "version": target.version,
                        "changes": [c.describe() for c in changes],
                    }
                },
            )
        }

    cat = ctl.catalog.update(intent)
    spec = cat[name]
    if spec.get(EVOLVING) is None:
        cur = collection_schemas(spec)
        return {"name": name, "version": cur.version, "outcome": "unchanged", "changes": []}
    return finish_evolution(ctl, name, spec)


def finish_evolution(ctl: StorageController, name: str, spec: Spec) -> dict[str, Any]:
    """Steps 2 and 3 of a recorded evolution (idempotent: resumes after a crash)."""
    pending = spec[EVOLVING]
    target = Schemas.from_json(pending["to"])
    cur = collection_schemas(spec)
    evolved = already = 0
    for r, info in sorted(spec["renditions"].items()):
        if info["status"] != "ready" or info.get("schemas") is not None:
            continue  # creating ones are rolled back, dropping ones finalized; renditions
            # with schemas of their own (rebuilt for another schema) keep them
        for s in info["shards"]:
            res = ctl.client.compare_and_evolve_schema(s, (cur.key, cur.val), (target.key, target.val))
            if res.outcome is EvolveOutcome.MISMATCH:
                raise SchemaMismatch(
                    f"collection {name!r}: shard {s} of rendition {r!r} has schemas "
                    f"{res.schemas.describe()}, neither the collection's version {cur.version} "
                    f"({cur.describe()}) nor the target; the evolution stays pending"
                )
            if res.outcome is EvolveOutcome.APPLIED:
                evolved += 1
            else:
                already += 1

    def done(cat: Catalog) -> dict[str, Spec | None]:
        spec = cat.get(name)
        if spec is None or spec.get(EVOLVING) is None:
            return {}
        rest = {k: v for k, v in spec.items() if k != EVOLVING}
        return {name: dict(rest, schemas=spec[EVOLVING]["to"])}

    ctl.catalog.update(done)
    return {
        "name": name,
        "version": target.version,
        "outcome": "evolved",
        "changes": list(pending.get("changes", [])),
        "shards_evolved": evolved,
        "shards_already_evolved": already,
    }


def settle(ctl: StorageController, name: str, spec: Spec) -> Spec:
    """``spec`` with no evolution pending: a writable controller finishes one, a
    read-only one refuses (``StaleSchema``) rather than read a half-evolved collection."""
    if spec.get(EVOLVING) is None:
        return spec
    if ctl.read_only:
        raise StaleSchema(
            f"collection {name!r}: an evolution of its schemas to version "
            f"{spec[EVOLVING]['version']} was interrupted (some shards may be at the new "
            f"version, others at {collection_schemas(spec).version}); finish it with `persist "
            f"schema evolve {name} --resume` (or start a StorageController), then read",
            current_version=collection_schemas(spec).version,
        )
    finish_evolution(ctl, name, spec)
    return ctl._spec(name)


def schema_info(spec: Spec) -> dict[str, Any]:
    """The collection's schema versions for ``persist schema show``."""
    cur = collection_schemas(spec)
    versions = [*cur.history, cur]
    return {
        "name": spec["name"],
        "version": cur.version,
        "schemas": cur.describe(),
        "versions": [
            {"version": i, "schemas": v.describe(), "fingerprint": v.fingerprint()[:16]}
            for i, v in enumerate(versions)
        ],
        "pending_version": pending_version(spec),
    }
