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

from persist_lib.errors import InvalidUsage, UpperMismatch
from persist_lib.frontier import Antichain
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
    """Reads and atomically updates the catalog shard."""

    def __init__(self, client: Any, shard: ShardId) -> None:
        self.shard = shard
        self.write, self.read = client.open(shard, CATALOG_KEY, CATALOG_VAL, purpose="storage-catalog")

    def load(self) -> tuple[Catalog, Antichain]:
        """The current catalog and the catalog upper it was read at."""
        upper = self.write.fetch_recent_upper()
        t = upper.time
        if t is None:
            raise InvalidUsage(f"catalog shard {self.shard} is closed")
        if t == 0:
            return {}, upper
        snap = self.read.snapshot(t - 1)
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
