"""``StorageController``: collections made of renditions made of shards.

Every command is durable: it is recorded in the catalog shard (``catalog.py``) before
and after its side effects, and a controller that starts (``recover``) finishes or
rolls back whatever a crashed predecessor left half done:

* ``create_collection`` / ``create_rendition`` record the new shards with status
  ``creating`` first, create them, then flip to ``ready``. Recovery rolls a
  ``creating`` entry *back* (finalizes whatever shards exist, drops the entry), so a
  half-made collection is never visible.
* ``handover`` is one compare-and-append on the metadata shard (atomic); the catalog
  learns about it afterwards and recovery re-derives it from the metadata shard.
* ``delete_collection`` records ``deleting`` and then rolls *forward*: every shard is
  released (handles dropped, frontiers emptied) and finalized, then the entry is
  removed.

The controller holds a critical since handle on every shard of a collection (opaque
``storage-controller``): the collection keeps its whole history until
``allow_compaction(name, t)``; rendition shards are never allowed past the metadata
shard's since, so a reader registered on the metadata shard can always read the
renditions it needs.

Holds: a controller registers a writer and a leased reader on the catalog shard and a
leased reader per metadata shard it writes through (``handover``, ``allow_compaction``,
``collect_renditions``), and releases them in ``close()`` (use it as a context
manager). Inspection (``describe``, ``list_collections``) leaves nothing behind: without
such a reader it reads the metadata through a reader it expires at once. A
``read_only`` controller (the ``persist`` CLI, sensors, metadata helpers) never keeps a
registration at all, never recovers, never creates the catalog and refuses commands.
"""

from __future__ import annotations

import re
import time
from typing import Any

import pyarrow as pa

from persist_lib.errors import InvalidUsage, PersistError, UpperMismatch
from persist_lib.frontier import Antichain, FrontierLike, as_frontier, check_time
from persist_lib.handles.client import PersistClient
from persist_lib.handles.read import ReadHandle
from persist_lib.ids import ShardId
from persist_lib.shard.codec import Schemas
from persist_lib.storage import shard_ops
from persist_lib.storage.catalog import Catalog, CatalogStore, Spec, default_catalog_shard
from persist_lib.storage.describe import describe_collection, meta_timeline
from persist_lib.storage.make_transactional import make_transactional
from persist_lib.storage.metadata import (
    METADATA_KEY,
    METADATA_VAL,
    Handover,
    active_in,
)
from persist_lib.storage.reader import CollectionDeleted, CollectionReader
from persist_lib.storage.schema_evolution import (
    EVOLVING,
    create_with_history,
    evolve_collection,
    finish_evolution,
    rendition_schemas,
    schema_info,
    schemas_after_handover,
    settle,
)
from persist_lib.storage.transactions import Transaction
from persist_lib.storage.writer import CollectionWriter
from persist_lib.txn.txns import Txns

_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]{0,127}$")
CONTROLLER_OPAQUE = "storage-controller"
# One critical reader id per shard, derived from the shard id so a restarted
# controller re-opens the same registration.
_CRIT_PREFIX = "c00000000-0000-4000-8000-"


class UnknownCollection(InvalidUsage):
    pass


def _crit_id(shard: str) -> str:
    return _CRIT_PREFIX + shard[-12:]


def check_name(what: str, name: str) -> str:
    """``name`` if it is a valid collection, rendition or source name (``what`` says which),
    else ``InvalidUsage`` saying the rule; public for the Dagster settings checks."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidUsage(
            f"{what} name {name!r} is not valid: use 1-128 characters, a letter first, then "
            "letters, digits, '_', '-' or '.' (no commas, spaces or JSON: names become Dagster "
            "partition keys)"
        )
    return name


class StorageController:
    """Creates, hands over, reads and deletes collections; its catalog lives in persist."""

    def __init__(
        self,
        client: PersistClient,
        *,
        catalog_shard: ShardId | str | None = None,
        recover: bool = True,
        read_only: bool = False,
    ) -> None:
        self.client = client
        self.read_only = read_only
        self.catalog = CatalogStore(
            client,
            ShardId.parse(catalog_shard) if catalog_shard else default_catalog_shard(),
            transient=read_only,
        )
        self._meta_readers: dict[str, ReadHandle] = {}
        self._active_cache: dict[str, tuple[Antichain, str]] = {}
        self._txns_obj: Txns | None = None
        self._transactional: dict[str, bool] = {}  # True once seen: the flag never goes back
        self._meta_shards: dict[str, str] = {}  # a collection's metadata shard never changes
        if recover and not read_only:
            self.recover()

    def _check_writable(self, what: str) -> None:
        if self.read_only:
            raise InvalidUsage(
                f"{what}: this StorageController is read-only (opened for inspection); open "
                "one with StorageController(client) to change collections"
            )

    # ----- catalog helpers ----------------------------------------------------------

    def _spec(self, name: str) -> Spec:
        cat, _ = self.catalog.load()
        spec = cat.get(name)
        if spec is None or spec["status"] != "ready":
            raise UnknownCollection(
                f"collection {name!r} does not exist; known collections: "
                f"{sorted(k for k, v in cat.items() if v['status'] == 'ready')}"
            )
        return spec

    def _collection_exists(self, name: str) -> bool:
        cat, _ = self.catalog.load()
        return name in cat and cat[name]["status"] == "ready"

    @staticmethod
    def _schemas(spec: Spec) -> Schemas:
        return Schemas.from_json(spec["schemas"])

    # ----- commands -------------------------------------------------------------------

    def create_collection(
        self,
        name: str,
        key_schema: pa.Schema,
        val_schema: pa.Schema,
        num_shards: int = 1,
        *,
        rendition: str = "r0",
        transactional: bool | None = None,
    ) -> dict[str, Any]:
        """Creates a collection with a first rendition of ``num_shards`` shards, active from 0.

        ``transactional``: its shards are registered in the location's txn log and written
        only through transactions (atomic ``compare_and_append`` over all shards, ``insert``,
        ``transaction()``; docs/architecture.md, "Transactions"). Default: transactional
        iff it has more than one shard (one shard is atomic with one compare-and-set)."""
        self._check_writable("create_collection")
        check_name("collection", name)
        check_name("rendition", rendition)
        self._check_num_shards(num_shards)
        if transactional is None:
            transactional = num_shards > 1
        schemas = Schemas.create(key_schema, val_schema)
        meta = str(ShardId.new())
        shards = [str(ShardId.new()) for _ in range(num_shards)]

        def intent(cat: Catalog) -> dict[str, Spec | None]:
            if name in cat:
                raise InvalidUsage(
                    f"collection {name!r} already exists (status {cat[name]['status']}); pick another "
                    "name or delete it first"
                )
            return {
                name: {
                    "name": name,
                    "status": "creating",
                    "schemas": schemas.to_json(),
                    "metadata_shard": meta,
                    "renditions": {
                        rendition: {"shards": shards, "status": "creating", "created_ms": _now()}
                    },
                    "created_ms": _now(),
                    **({"transactional": True} if transactional else {}),
                }
            }

        self.catalog.update(intent)
        # Side effects (each idempotent): create the shards, hold them, activate r0 at 0.
        self._create_shard(meta, METADATA_KEY, METADATA_VAL)
        for s in shards:
            self._create_shard(s, key_schema, val_schema)
        if transactional:
            self.txns.register(shards)
        mw = self.client.open_writer(meta, METADATA_KEY, METADATA_VAL, purpose=f"storage:{name}")
        try:
            if mw.fetch_recent_upper() == Antichain([0]):
                try:
                    mw.compare_and_append([(((rendition,), ()), 0, 1)], 0, 1)
                except UpperMismatch:
                    pass
        finally:
            mw.expire()

        def done(cat: Catalog) -> dict[str, Spec | None]:
            spec = cat.get(name)
            if spec is None or spec["metadata_shard"] != meta:
                raise InvalidUsage(f"collection {name!r} was changed concurrently while being created")
            spec = dict(spec, status="ready")
            spec["renditions"] = {rendition: dict(spec["renditions"][rendition], status="ready")}
            return {name: spec}

        self.catalog.update(done)
        return self.describe(name)

    def create_rendition(
        self,
        name: str,
        rendition: str,
        num_shards: int,
        *,
        key_schema: pa.Schema | None = None,
        val_schema: pa.Schema | None = None,
    ) -> dict[str, Any]:
        """Adds a rendition (empty shards) that a backfill can fill before a handover.

        ``key_schema``/``val_schema``: the rendition's own schemas (default: the
        collection's), for a change that can't be made in place (``evolve_schema``
        refuses it): rebuild the rendition under them, then a handover to it makes them
        the collection's (``storage/schema_evolution.py``). A multi-shard rendition of a
        non-transactional collection makes the collection transactional first
        (``make_transactional``), so its writes are atomic."""
        self._check_writable("create_rendition")
        check_name("rendition", rendition)
        self._check_num_shards(num_shards)
        if num_shards > 1 and not self.is_transactional(name):
            self.make_transactional(name)
        shards = [str(ShardId.new()) for _ in range(num_shards)]
        own = None
        if key_schema is not None or val_schema is not None:
            cur = self._schemas(self._spec(name))
            mine = Schemas.create(
                key_schema if key_schema is not None else cur.key,
                val_schema if val_schema is not None else cur.val,
            )
            own = None if mine == cur else mine.to_json()

        def intent(cat: Catalog) -> dict[str, Spec | None]:
            spec = cat.get(name)
            if spec is None or spec["status"] != "ready":
                raise UnknownCollection(f"collection {name!r} does not exist")
            if rendition in spec["renditions"]:
                raise InvalidUsage(f"collection {name!r} already has a rendition {rendition!r}")
            rs = dict(spec["renditions"])
            rs[rendition] = {"shards": shards, "status": "creating", "created_ms": _now()}
            if own is not None:
                rs[rendition]["schemas"] = own
            return {name: dict(spec, renditions=rs)}

        cat = self.catalog.update(intent)
        for s in shards:
            create_with_history(self.client, s, rendition_schemas(cat[name], rendition), self._create_shard)
        if cat[name].get("transactional"):
            self.txns.register(shards)

        def done(cat: Catalog) -> dict[str, Spec | None]:
            spec = cat[name]
            rs = dict(spec["renditions"])
            rs[rendition] = dict(rs[rendition], status="ready")
            return {name: dict(spec, renditions=rs)}

        self.catalog.update(done)
        return self.describe(name)

    def open_writer(self, name: str, rendition: str | None = None) -> CollectionWriter:
        """A writer for ``rendition`` (default: the rendition active at the metadata upper)."""
        self._check_writable("open_writer")
        spec = settle(self, name, self._spec(name))
        r = rendition if rendition is not None else self._active_rendition_at_upper(name)
        info = spec["renditions"].get(r)
        if info is None or info["status"] != "ready":
            raise InvalidUsage(
                f"collection {name!r} has no rendition {r!r}; renditions: "
                f"{sorted(k for k, v in spec['renditions'].items() if v['status'] == 'ready')}"
            )
        schemas = rendition_schemas(spec, r)
        meta_purpose = f"storage:{name}"
        if spec.get("transactional"):
            self.txns.register(info["shards"])  # (a no-op but for a rendition made mid-conversion)
            mw = self.client.open_writer(spec["metadata_shard"], METADATA_KEY, METADATA_VAL, purpose=meta_purpose)
            return CollectionWriter(
                self, name, r, [], schemas, mw, txns=self.txns, shard_ids=list(info["shards"])
            )
        writers = [
            self.client.open_writer(s, schemas.key, schemas.val, purpose=f"storage:{name}/{r}")
            for s in info["shards"]
        ]
        meta = self.client.open_writer(
            spec["metadata_shard"], METADATA_KEY, METADATA_VAL, purpose=f"storage:{name}"
        )
        return CollectionWriter(self, name, r, writers, schemas, meta)

    def handover(self, name: str, to: str, at: int) -> dict[str, Any]:
        """Makes rendition ``to`` the active one from time ``at`` on (atomically).

        Refused (and nothing changes) when ``to`` is unknown or already active, when
        ``at`` is below the metadata upper (the assignment before it is decided), when
        ``to`` is not readable at ``at`` (its upper must be beyond ``at``), or when the
        active rendition is not complete before ``at`` (its upper must reach ``at``).
        """
        self._check_writable("handover")
        at = check_time(at, "at")
        spec = self._spec(name)
        info = spec["renditions"].get(to)
        if info is None or info["status"] != "ready":
            raise InvalidUsage(
                f"collection {name!r}: can't hand over to unknown rendition {to!r}; renditions: "
                f"{sorted(k for k, v in spec['renditions'].items() if v['status'] == 'ready')}"
            )
        mw = self.client.open_writer(
            spec["metadata_shard"], METADATA_KEY, METADATA_VAL, purpose=f"storage:{name}:handover"
        )
        try:
            while True:
                meta_upper = mw.fetch_recent_upper()
                if meta_upper.time is None or at < meta_upper.time:
                    raise InvalidUsage(
                        f"collection {name!r}: can't hand over at {at}: it is below the metadata "
                        f"upper {meta_upper} (the active rendition is already decided up to there); "
                        f"hand over at a time >= {meta_upper}"
                    )
                old = self._active_rendition_at_upper(name)
                if old == to:
                    raise InvalidUsage(f"collection {name!r}: rendition {to!r} is already active")
                new_upper = self._rendition_upper(spec, to)
                if not new_upper > Antichain([at]):
                    raise InvalidUsage(
                        f"collection {name!r}: can't hand over to {to!r} at {at}: it is not "
                        f"readable there (its upper is {new_upper}); catch it up past {at} first"
                    )
                old_upper = self._rendition_upper(spec, old)
                if old_upper < Antichain([at]):
                    raise InvalidUsage(
                        f"collection {name!r}: can't hand over at {at}: the active rendition "
                        f"{old!r} is only complete up to {old_upper}, which would leave times "
                        f"[{old_upper.time}, {at}) undefined; hand over at {old_upper.time} or "
                        "later once it has caught up"
                    )
                try:
                    mw.compare_and_append(
                        [(((old,), ()), at, -1), (((to,), ()), at, 1)], meta_upper, at + 1
                    )
                    break
                except UpperMismatch:
                    continue
        finally:
            mw.expire()
        self._active_cache.pop(name, None)
        self._record_handover(name, Handover(at, old, to))
        return self.describe(name)

    def acquire_read_handle(self, name: str) -> CollectionReader:
        spec = settle(self, name, self._spec(name))
        r = self.client.open_leased_reader(
            spec["metadata_shard"], METADATA_KEY, METADATA_VAL, purpose=f"storage-reader:{name}"
        )
        return CollectionReader(self, name, self._schemas(spec), r)

    def evolve_schema(self, name: str, key_schema: pa.Schema, val_schema: pa.Schema) -> dict[str, Any]:
        """Evolves the collection's schemas in place (add a nullable value field, widen
        one, drop one) in its catalog entry and every shard, crash-safe
        (``storage/schema_evolution.py``); ``IncompatibleSchemaChange`` with nothing
        changed for anything else (build a new rendition with the new schemas instead)."""
        return evolve_collection(self, name, key_schema, val_schema)

    def schema(self, name: str) -> dict[str, Any]:
        """The collection's schema version, its schemas and every earlier version."""
        return schema_info(self._spec(name))

    def allow_compaction(self, name: str, since: FrontierLike) -> None:
        """Lets the controller's holds on the collection advance to ``since``.

        Rendition shards never go past the metadata shard's since (what every reader
        of the collection still holds).
        """
        self._check_writable("allow_compaction")
        target = as_frontier(since, "since")
        spec = self._spec(name)
        meta = spec["metadata_shard"]
        self._downgrade_critical(meta, METADATA_KEY, METADATA_VAL, target)
        self._sync_own_reader(name, meta)
        meta_since = self.client.machine(meta).fetch_latest().since
        cap = min(target, meta_since)
        for r, info in spec["renditions"].items():
            if info["status"] != "ready":
                continue
            schemas = rendition_schemas(spec, r)
            for s in info["shards"]:
                self._downgrade_critical(s, schemas.key, schemas.val, cap)

    def delete_collection(self, name: str) -> dict[str, Any]:
        """Deletes a collection: readers and writers get a clear error; every blob is removed."""
        self._check_writable("delete_collection")

        def intent(cat: Catalog) -> dict[str, Spec | None]:
            spec = cat.get(name)
            if spec is None:
                raise UnknownCollection(f"collection {name!r} does not exist")
            return {name: dict(spec, status="deleting")}

        cat = self.catalog.update(intent)
        return self._finish_delete(name, cat[name])

    def collect_renditions(self, name: str | None = None) -> dict[str, Any]:
        """Finalizes renditions that were handed over away from once every reader passed.

        A rendition retired at ``h`` is collected when every hold on the metadata shard
        (readers and the controller's) has a since beyond ``h``.
        """
        self._check_writable("collect_renditions")
        names = [name] if name else self.list_collections()
        out: dict[str, Any] = {}
        for n in names:
            spec = self._spec(n)
            self._reconcile_handovers(n)
            spec = self._spec(n)
            self._sync_own_reader(n, spec["metadata_shard"])
            meta_since = self.client.machine(spec["metadata_shard"]).fetch_latest().since
            done: dict[str, Any] = {}
            for r, info in spec["renditions"].items():
                retired_at = info.get("retired_at")
                if info["status"] != "ready" or retired_at is None:
                    continue
                if not (meta_since > Antichain([retired_at])):
                    continue
                done[r] = self._drop_rendition(n, r)
            if done:
                out[n] = done
        return out

    # ----- inspection -----------------------------------------------------------------

    def list_collections(self) -> list[str]:
        cat, _ = self.catalog.load()
        return sorted(k for k, v in cat.items() if v["status"] == "ready")

    def describe(self, name: str) -> dict[str, Any]:
        """The collection: schemas, metadata frontiers, active rendition, every handover
        (``timeline``: ``at``, ``from``, ``to``) and each rendition's status, shards,
        frontiers and sizes. A rendition's ``status`` is one word of
        ``persist_lib.storage.status`` (``creating``, ``ready``, ``active``, ``retired``,
        ``dropping``, ``dropped``); ``active`` is true for the one whose status is
        ``active``. ``readable_since``: the earliest time a collection reader can read
        (``persist_lib.storage.readable``), not the since of any one shard."""
        return describe_collection(self, name)

    # ----- recovery -------------------------------------------------------------------

    def recover(self) -> dict[str, Any]:
        """Finishes or rolls back commands a crashed controller left half done."""
        self._check_writable("recover")
        cat, _ = self.catalog.load()
        report: dict[str, Any] = {"rolled_back": [], "deleted": [], "renditions_rolled_back": []}
        for name, spec in sorted(cat.items()):
            if spec["status"] == "creating":
                self._rollback_create(name, spec)
                report["rolled_back"].append(name)
            elif spec["status"] == "deleting":
                self._finish_delete(name, spec)
                report["deleted"].append(name)
            else:
                for r, info in spec["renditions"].items():
                    if info["status"] == "creating":
                        self._rollback_rendition(name, r, info)
                        report["renditions_rolled_back"].append(f"{name}/{r}")
                    elif info["status"] == "dropping":
                        self._drop_rendition(name, r)
                if spec.get(EVOLVING) is not None:  # an evolution a crash interrupted
                    finish_evolution(self, name, self._spec(name))
                    report.setdefault("schema_evolutions_finished", []).append(name)
                self._reconcile_handovers(name)
        return report

    # ----- internals -------------------------------------------------------------------

    @staticmethod
    def _check_num_shards(n: int) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 1024:
            raise InvalidUsage(f"num_shards must be an int in [1, 1024], got {n!r}")

    def _create_shard(self, shard: str, key: pa.Schema, val: pa.Schema) -> None:
        """Creates the shard (if new) and the controller's critical since hold on it."""
        self.client.open_critical_since(
            shard, key, val, reader_id=_crit_id(shard), initial_opaque=CONTROLLER_OPAQUE,
            purpose="storage-controller",
        )

    def _downgrade_critical(self, shard: str, key: pa.Schema, val: pa.Schema, since: Antichain) -> None:
        h = self.client.open_critical_since(
            shard, key, val, reader_id=_crit_id(shard), initial_opaque=CONTROLLER_OPAQUE
        )
        if h.since < since:
            h.compare_and_downgrade_since(CONTROLLER_OPAQUE, CONTROLLER_OPAQUE, since)

    def _sync_own_reader(self, name: str, meta: str) -> None:
        """Moves the controller's own metadata reader up to its critical since.

        It never passes ``upper - 1``: the controller reads the metadata there.
        """
        own = self._meta_reader(name, meta)
        state = own._machine.fetch_latest()
        crit = state.critical_readers.get(_crit_id(meta))
        target = crit.since if crit is not None else state.since
        if state.upper.time is not None:
            target = min(target, Antichain([max(state.upper.time - 1, 0)]))
        if own.since < target:
            own.downgrade_since(target)

    def close(self) -> None:
        """Releases the controller's own metadata readers and its catalog writer and
        reader (its critical holds stay: they are the collections' own)."""
        for r in self._meta_readers.values():
            try:
                r.expire()
            except PersistError:
                pass
        self._meta_readers.clear()
        self._active_cache.clear()
        self.catalog.close()
        if self._txns_obj is not None:
            self._txns_obj.close()
            self._txns_obj = None

    # ----- transactions (persist_lib.txn) -----------------------------------------------

    @property
    def txns(self) -> Txns:
        """The location's transactions (the txn log opened on first use)."""
        if self._txns_obj is None:
            self._txns_obj = Txns(self.client, read_only=self.read_only)
        return self._txns_obj

    def transaction(self) -> Transaction:
        """A transaction over transactional collections: ``with ctl.transaction() as tx:
        tx.insert(a, rows); tx.insert(b, rows)`` commits every insert at one time chosen
        by the controller, all or nothing (``storage/transactions.py``)."""
        self._check_writable("transaction")
        return Transaction(self)

    def insert(self, name: str, rows: Any) -> int:
        """Inserts ``rows`` (key and value columns, no time) into transactional collection
        ``name`` at a time the controller picks; returns that time."""
        tx = self.transaction()
        try:
            tx.insert(name, rows)
        except BaseException:
            tx.abandon()
            raise
        return tx.commit()

    def is_transactional(self, name: str) -> bool:
        """Whether ``name`` is written through transactions. Only ``True`` is cached: a
        collection becomes transactional (``make_transactional``) and never stops being."""
        if self._transactional.get(name):
            return True
        flag = bool(self._spec(name).get("transactional"))
        if flag:
            self._transactional[name] = True
        return flag

    def _txns_if_transactional(self, name: str) -> Txns | None:
        return self.txns if self.is_transactional(name) else None

    def make_transactional(self, name: str) -> dict[str, Any]:
        """Makes an existing collection transactional: registers its shards in the txn
        log, fences its direct writers, flips its catalog flag (crash-safe, idempotent;
        ``storage/make_transactional.py``). Returns a report."""
        self._check_writable("make_transactional")
        return make_transactional(self, name)

    def _txn_prepare_read(self, name: str, shard_ids: list[str]) -> None:
        """Before a read of a transactional collection's shards: every committed
        transaction touching them is applied (whoever committed it), and so are the
        committed moves of its metadata upper (a committer killed after its commit CAS
        left them to whoever comes next)."""
        try:
            transactional = self.is_transactional(name)
            meta = self._meta_shards.get(name) or self._meta_shards.setdefault(
                name, self._spec(name)["metadata_shard"]
            )
        except UnknownCollection:
            return  # deleted meanwhile: the read itself reports it
        if transactional:
            self.txns.ensure_applied([*shard_ids, meta])

    def __enter__(self) -> StorageController:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _meta_reader(self, name: str, meta: str) -> ReadHandle:
        r = self._meta_readers.get(meta)
        if r is None:
            r = self.client.open_leased_reader(meta, METADATA_KEY, METADATA_VAL, purpose="storage-controller")
            self._meta_readers[meta] = r
        return r

    def _timeline(self, name: str) -> list[Handover]:
        """The handovers the metadata shard still shows (see ``_meta_timeline``)."""
        return meta_timeline(self, self._spec(name))[0]

    def _active_rendition_at_upper(self, name: str) -> str:
        """The rendition active at the latest decided time (metadata upper - 1)."""
        spec = self._spec(name)
        meta = spec["metadata_shard"]
        r = self._meta_reader(name, meta)
        upper = r._machine.fetch_latest().upper
        cached = self._active_cache.get(name)
        if cached is not None and cached[0] == upper:
            return cached[1]
        t = upper.time
        if t is None or t == 0:
            raise InvalidUsage(f"collection {name!r}: its metadata shard has no decided time yet")
        active = active_in(r.snapshot(t - 1).to_pylist(), t - 1, meta)
        self._active_cache[name] = (upper, active)
        return active

    def _note_active(self, name: str, upper: Antichain, rendition: str) -> None:
        """Remembers that ``rendition`` is active at ``upper`` (a writer of the active
        rendition just advanced the metadata shard to it)."""
        self._active_cache[name] = (upper, rendition)

    def _rendition_upper(self, spec: Spec, rendition: str) -> Antichain:
        shards = spec["renditions"][rendition]["shards"]
        if spec.get("transactional"):
            self.txns.ensure_applied(shards)  # its upper counts what committed
        return min(self.client.machine(s).fetch_latest().upper for s in shards)

    def _open_rendition_readers(self, name: str, rendition: str) -> list[ReadHandle]:
        spec = self._spec(name)
        info = spec["renditions"].get(rendition)
        if info is None:
            raise CollectionDeleted(f"collection {name!r}: rendition {rendition!r} no longer exists")
        schemas = rendition_schemas(spec, rendition)
        return [
            self.client.open_leased_reader(s, schemas.key, schemas.val, purpose=f"storage-reader:{name}/{rendition}")
            for s in info["shards"]
        ]

    def _record_handover(self, name: str, h: Handover) -> None:
        def fn(cat: Catalog) -> dict[str, Spec | None]:
            spec = cat.get(name)
            if spec is None or h.old is None or h.old not in spec["renditions"]:
                return {}
            rs = dict(spec["renditions"])
            info = rs[h.old]
            if info.get("retired_at") is not None and info["retired_at"] >= h.at:
                return {}
            rs[h.old] = dict(info, retired_at=h.at)
            if h.new in rs and rs[h.new].get("retired_at") is not None and rs[h.new]["retired_at"] <= h.at:
                rs[h.new] = {k: v for k, v in rs[h.new].items() if k != "retired_at"}
            spec = dict(spec, renditions=rs)
            return {name: schemas_after_handover(spec, h.new) or spec}

        self.catalog.update(fn)

    def _reconcile_handovers(self, name: str) -> None:
        for h in self._timeline(name):
            if h.old is not None:
                self._record_handover(name, h)

    def _rollback_create(self, name: str, spec: Spec) -> None:
        shards = [spec["metadata_shard"], *[x for r in spec["renditions"].values() for x in r["shards"]]]
        for s in shards:
            shard_ops.release_and_finalize(self.client, s)
        self._txn_forget(spec, shards)
        self.catalog.update(lambda cat: {name: None} if name in cat else {})

    def _rollback_rendition(self, name: str, rendition: str, info: dict[str, Any]) -> None:
        for s in info["shards"]:
            shard_ops.release_and_finalize(self.client, s)
        self._txn_forget(self._spec_any(name), info["shards"])

        def fn(cat: Catalog) -> dict[str, Spec | None]:
            spec = cat.get(name)
            if spec is None or rendition not in spec["renditions"]:
                return {}
            rs = {k: v for k, v in spec["renditions"].items() if k != rendition}
            return {name: dict(spec, renditions=rs)}

        self.catalog.update(fn)

    def _drop_rendition(self, name: str, rendition: str) -> dict[str, Any]:
        def mark(cat: Catalog) -> dict[str, Spec | None]:
            spec = cat[name]
            rs = dict(spec["renditions"])
            rs[rendition] = dict(rs[rendition], status="dropping")
            return {name: dict(spec, renditions=rs)}

        cat = self.catalog.update(mark)
        spec = cat[name]
        results = [shard_ops.release_and_finalize(self.client, s) for s in spec["renditions"][rendition]["shards"]]
        self._txn_forget(spec, spec["renditions"][rendition]["shards"])

        def drop(cat: Catalog) -> dict[str, Spec | None]:
            spec = cat[name]
            rs = dict(spec["renditions"])
            rs[rendition] = dict(rs[rendition], status="dropped")
            return {name: dict(spec, renditions=rs)}

        self.catalog.update(drop)
        return {
            "shards_finalized": len(results),
            "blobs_deleted": sum(r.get("blobs_deleted", 0) for r in results),
        }

    def _finish_delete(self, name: str, spec: Spec) -> dict[str, Any]:
        shards = [spec["metadata_shard"], *[x for r in spec["renditions"].values() for x in r["shards"]]]
        results = [shard_ops.release_and_finalize(self.client, s) for s in shards]
        self._txn_forget(spec, shards)
        self._meta_readers.pop(spec["metadata_shard"], None)
        self._active_cache.pop(name, None)
        self.catalog.update(lambda cat: {name: None} if name in cat else {})
        return {
            "name": name,
            "shards_finalized": len(results),
            "blobs_deleted": sum(r.get("blobs_deleted", 0) for r in results),
        }


    def _spec_any(self, name: str) -> Spec:
        """The catalog entry whatever its status (empty if it is gone)."""
        cat, _ = self.catalog.load()
        return cat.get(name) or {}

    def _txn_forget(self, spec: Spec, shards: list[str]) -> None:
        """After ``shards`` were finalized: their txn-log registrations are retracted
        (idempotent; the catalog still records the drop, so a crash before this step is
        finished by ``recover``)."""
        if spec.get("transactional"):
            self.txns.forget(shards)
            self.txns.tidy()  # their untidied entries are applied trivially now


def _now() -> int:
    return int(time.time() * 1000)



