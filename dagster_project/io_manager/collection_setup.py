"""Creating a collection that concurrent runs may be creating too.

``create_collection`` records the new collection as ``creating`` before it makes its
shards; a second creator meanwhile gets "already exists". Whoever loses waits (bounded)
until the winner's collection is ``ready`` and then uses it, schemas checked by the caller.
"""

from __future__ import annotations

import time

import pyarrow as pa

from persist_lib.errors import InvalidUsage, Timeout
from persist_lib.storage import StorageController

READY_WAIT_S = 60.0


def _status(ctl: StorageController, name: str) -> str | None:
    cat, _ = ctl.catalog.load()
    spec = cat.get(name)
    return None if spec is None else str(spec["status"])


def ensure_collection(
    ctl: StorageController, name: str, key: pa.Schema, val: pa.Schema, num_shards: int,
    *, transactional: bool = False, wait_s: float = READY_WAIT_S,
) -> bool:
    """Creates ``name`` unless it exists; returns whether this call created it."""
    deadline = time.monotonic() + wait_s
    delay = 0.01
    while True:
        status = _status(ctl, name)
        if status == "ready":
            return False
        if status is None:
            try:
                ctl.create_collection(name, key, val, num_shards=num_shards, transactional=transactional)
                return True
            except InvalidUsage:
                if _status(ctl, name) is None:
                    raise
        if time.monotonic() > deadline:
            raise Timeout(
                f"collection {name!r} stayed '{status}' for {wait_s:.0f} s (another process is creating or "
                "deleting it, or crashed doing so: `persist` commands that open a controller recover it)"
            )
        time.sleep(delay)  # a bounded wait for another process's creation to finish
        delay = min(delay * 2, 0.5)
