"""persist_lib: durable, definite time-varying collections on Blob + Consensus.

Public entry points::

    from persist_lib import PersistClient, ShardId, Antichain
    client = PersistClient.open(blob_uri, consensus_uri)   # or PersistClient.default()
    write, read = client.open(ShardId.new(), key_schema, val_schema)

Names are imported lazily so that importing a submodule (``persist_lib.location``)
doesn't pull in pyarrow and the whole client.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "Antichain": "persist_lib.frontier",
    "ShardId": "persist_lib.ids",
    "PersistClient": "persist_lib.handles.client",
    "PersistConfig": "persist_lib.config",
    "ReadHandle": "persist_lib.handles.read",
    "SinceHandle": "persist_lib.handles.since",
    "SnapshotSplit": "persist_lib.handles.splits",
    "ListenUpdates": "persist_lib.handles.listen",
    "ListenProgress": "persist_lib.handles.listen",
    "WriteHandle": "persist_lib.handles.write",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'persist_lib' has no attribute {name!r}")
    return getattr(importlib.import_module(mod), name)
