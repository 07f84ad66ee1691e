"""The write ledger: which write identities already landed, so a retried step never
writes twice.

A write's identity is ``run id / step key / asset key / partitions``: the same for every
attempt of one step of one run (a Dagster retry), different for a new run. The ledger is a
collection of its own (key ``collection``, ``write_id``; value the persist ``time`` the
write landed at and the collection's ``upper`` after it). Before writing, the I/O manager
looks its identity up and, if it landed, reports the recorded time instead of writing
again.

The ledger and the collections the I/O manager creates are transactional: a write and
its ledger entry are ONE transaction (``atomic_commit.py``), so there is no window in
which the data landed and the entry did not. A data collection (or a ledger) created
non-transactional by an earlier version keeps the old two-commit path: the data's
compare-and-append, then the entry's; a process killed between the two writes again on
retry (a window of one small commit).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import pyarrow as pa

from dagster_project.io_manager.atomic_commit import logical_upper
from dagster_project.io_manager.collection_setup import ensure_collection
from persist_lib.errors import UpperMismatch
from persist_lib.storage import StorageController
from persist_lib.storage.writer import CollectionWriter

LEDGER_KEY = pa.schema([("collection", pa.string()), ("write_id", pa.string())])
LEDGER_VAL = pa.schema([("time", pa.int64()), ("upper", pa.int64())])


@dataclass(frozen=True)
class LandedWrite:
    time: int
    upper: int


def now_ms() -> int:
    return int(time.time() * 1000)


class WriteLedger:
    def __init__(self, ctl: StorageController, name: str) -> None:
        self.ctl = ctl
        self.name = name

    def lookup(self, collection: str, write_id: str, *, writer: CollectionWriter | None = None) -> LandedWrite | None:
        """The landed write ``write_id`` of ``collection``, if the ledger holds it.
        ``writer``: an open writer of the (transactional) ledger the caller holds."""
        if writer is not None:
            logical_upper(writer)  # a killed committer's entry made readable
        else:
            if self.name not in self.ctl.list_collections():
                return None
            if self.ctl.is_transactional(self.name):
                with self.ctl.open_writer(self.name) as w:
                    logical_upper(w)
        with self.ctl.acquire_read_handle(self.name) as r:
            upper = r.upper.time
            if not upper:
                return None
            hit = r.snapshot_batches(
                upper - 1, filter=[("collection", "==", collection), ("write_id", "==", write_id)]
            ).read_all()
        if hit.num_rows == 0:
            return None
        return LandedWrite(int(hit["time"][0].as_py()), int(hit["upper"][0].as_py()))

    def ensure(self) -> None:
        """Creates the ledger (transactional) unless it exists."""
        ensure_collection(self.ctl, self.name, LEDGER_KEY, LEDGER_VAL, 1, transactional=True)

    def record(self, collection: str, write_id: str, landed: LandedWrite) -> None:
        """The entry as a commit of its own (the two-commit path of non-transactional
        collections)."""
        self.ensure()
        with self.ctl.open_writer(self.name) as w:
            while True:
                upper = w.upper.time
                assert upper is not None
                t = max(upper, now_ms())
                ts = entry(collection, write_id, landed, t)
                try:
                    w.compare_and_append(ts, upper, t + 1)
                    return
                except UpperMismatch:
                    continue


def entry(collection: str, write_id: str, landed: LandedWrite, at: int) -> pa.Table:
    """The ledger row of a landed write, as an update at time ``at``."""
    return pa.table(
        {
            "collection": [collection],
            "write_id": [write_id],
            "time": pa.array([landed.time], pa.int64()),
            "upper": pa.array([landed.upper], pa.int64()),
            "ts": pa.array([at], pa.int64()),
            "diff": pa.array([1], pa.int64()),
        }
    )
