"""The controller's catalog, kept in persist itself (a catalog shard).

The catalog shard holds ``(name, spec_json)`` records; a command is one
``compare_and_append`` that retracts a collection's old spec and asserts its new one
at the catalog's upper, so every command is durable, totally ordered and atomic, and
two controllers racing each other serialize on the catalog's upper. The current
catalog is the snapshot at ``upper - 1``.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any

import pyarrow as pa

from persist_lib.errors import InvalidUsage, PersistError, UpperMismatch
from persist_lib.frontier import Antichain
from persist_lib.handles.read import ReadHandle
from persist_lib.handles.write import WriteHandle
from persist_lib.ids import ShardId

CATALOG_KEY = pa.schema([pa.field("name", pa.string(), nullable=False)])
CATALOG_VAL = pa.schema([pa.field("spec", pa.string(), nullable=False)])
_NAMESPACE = uuid.UUID("6d1f0c5e-7a7b-4c2e-9a8e-2f5b1c0d9e11")


def default_catalog_shard() -> ShardId:
    """The well-known catalog shard of a location (the same for every controller)."""
    return ShardId("s" + str(uuid.uuid5(_NAMESPACE, "persist-storage-catalog")))


Spec = dict[str, Any]
Catalog = dict[str, Spec]


class CatalogStore:
    """Reads and atomically updates the catalog shard.

    Its writer and leased reader are registered on first use and released by
    ``close()``. A ``transient`` store (a read-only controller's) never keeps them: each
    ``load`` registers a reader, reads and expires it, so nothing is left behind to hold
    the catalog's since or seqno (and GC) back; a catalog that does not exist yet reads
    as empty and is not created.
    """

    def __init__(self, client: Any, shard: ShardId, *, transient: bool = False) -> None:
        self.client = client
        self.shard = shard
        self.transient = transient
        self._handles: tuple[WriteHandle, ReadHandle] | None = None

    def _open(self) -> tuple[WriteHandle, ReadHandle]:
        if self.transient:
            raise InvalidUsage(f"catalog shard {self.shard}: this controller is read-only")
        if self._handles is None:
            self._handles = self.client.open(
                self.shard, CATALOG_KEY, CATALOG_VAL, purpose="storage-catalog"
            )
        return self._handles

    @property
    def write(self) -> WriteHandle:
        return self._open()[0]

    @property
    def read(self) -> ReadHandle:
        return self._open()[1]

    def close(self) -> None:
        """Expires this store's writer and reader (if it registered them)."""
        handles, self._handles = self._handles, None
        for h in handles or ():
            try:
                h.expire()
            except PersistError:  # e.g. already expired: its lease lapsed
                pass

    def load(self) -> tuple[Catalog, Antichain]:
        """The current catalog and the catalog upper it was read at."""
        if self._handles is not None or not self.transient:
            w, r = self._open()
            return self._load(w.fetch_recent_upper(), r)
        machine = self.client.machine(self.shard)
        if not machine.fetch_latest().exists:
            return {}, Antichain([0])
        r = self.client.open_leased_reader(
            self.shard, CATALOG_KEY, CATALOG_VAL, purpose="storage-catalog (read-only)"
        )
        try:
            return self._load(machine.fetch_latest().upper, r)
        finally:
            r.expire()

    def _load(self, upper: Antichain, reader: ReadHandle) -> tuple[Catalog, Antichain]:
        t = upper.time
        if t is None:
            raise InvalidUsage(f"catalog shard {self.shard} is closed")
        if t == 0:
            return {}, upper
        snap = reader.snapshot(t - 1)
        out: Catalog = {}
        for row in snap.to_pylist():
            if row["diff"] != 1 or row["name"] in out:
                raise InvalidUsage(
                    f"catalog shard {self.shard} is inconsistent at {t - 1}: {row['name']!r} "
                    f"has diff {row['diff']}"
                )
            out[row["name"]] = json.loads(row["spec"])
        return out, upper

    def update(self, fn: Callable[[Catalog], dict[str, Spec | None]]) -> Catalog:
        """Applies ``fn`` (catalog -> {name: new spec or None to remove}) atomically.

        ``fn`` is re-run against the fresh catalog if another controller committed
        first; it may raise to abort. Returns the catalog after the change.
        """
        while True:
            cat, upper = self.load()
            changes = fn(cat)
            if not changes:
                return cat
            t = upper.time
            assert t is not None
            updates = []
            for name, spec in changes.items():
                old = cat.get(name)
                if old is not None:
                    updates.append((((name,), (_dump(old),)), t, -1))
                if spec is not None:
                    updates.append((((name,), (_dump(spec),)), t, 1))
            try:
                self.write.compare_and_append(updates, t, t + 1)
            except UpperMismatch:
                continue
            self.read.downgrade_since(t)
            new = dict(cat)
            for name, spec in changes.items():
                if spec is None:
                    new.pop(name, None)
                else:
                    new[name] = spec
            return new


def _dump(spec: Spec) -> str:
    return json.dumps(spec, sort_keys=True, separators=(",", ":"))
