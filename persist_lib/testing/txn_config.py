"""The configuration of a transactions history and the rows its writers write.

A transactions history (``txn_history``) drives transactional *collections*, not one
shard: ``COLLECTIONS`` (name -> shards of the first rendition) on one location, written
by ``ctl.insert``, multi-collection ``ctl.transaction()`` and ``CollectionWriter
.compare_and_append`` from several processes. Every row is traceable: the key of row
``i`` of operation ``op`` in collection ``c`` is ``{op}/{c}/{i}`` with value ``i``, so
the checker (``txn_checker``) attributes every row of the final collections to the
operation that wrote it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

import pyarrow as pa

from persist_lib.testing.history_config import HistoryConfig

KEY = pa.schema([pa.field("k", pa.string(), nullable=False)])
VAL = pa.schema([pa.field("v", pa.int64(), nullable=False)])
COLLECTIONS: dict[str, int] = {"a": 4, "b": 2, "c": 1}
HANDOVER_COLLECTION = "a"  # the collection the handover actor moves between renditions
# Where a committer may be killed (``txn_actors.KillSwitch``): right after its commit CAS
# landed, between two applies to data shards, before or after tidy's log CAS.
KILL_POINTS = ("after_commit_cas", "between_applies", "before_tidy_cas", "after_tidy_cas")


@dataclass(repr=False)  # HistoryConfig's redacting __repr__ (the URI may hold a password)
class TxnHistoryConfig(HistoryConfig):
    """``HistoryConfig`` plus the knobs of a transactions history (``shard_id`` names the
    txn log: the one shard every transaction goes through)."""

    txn_kill_rate: float = 0.1  # chance a writer op arms a kill at one of ``txn_kill_points``
    txn_kill_points: list[str] = field(default_factory=lambda: list(KILL_POINTS))
    txn_read_timeout_s: float = 3.0  # a snapshot at a committed time must not wait longer
    txn_maintenance: bool = True  # an actor applying and tidying the log
    txn_handovers: bool = True  # an actor handing collection ``a`` over to new renditions
    txn_writer_pause_s: tuple[float, float] = (0.02, 0.15)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, s: str) -> TxnHistoryConfig:
        d = json.loads(s)
        for k in ("outage_s", "long_write_pause_s", "txn_writer_pause_s"):
            d[k] = tuple(d[k])
        return cls(**d)

    @property
    def truth_path(self) -> str:
        return f"{self.root}/truth.json"

    @property
    def lock_path(self) -> str:
        return f"{self.root}/handover.lock"


def row_key(op_id: str, coll: str, i: int) -> str:
    return f"{op_id}/{coll}/{i}"


def parse_key(k: str) -> tuple[str, str, int] | None:
    """``(op id, collection, i)`` of a row key (None: not a key any writer writes)."""
    parts = k.rsplit("/", 2)
    if len(parts) != 3 or not parts[2].isdigit():
        return None
    return parts[0], parts[1], int(parts[2])


def rows_table(op_id: str, coll: str, n: int) -> pa.Table:
    """The ``n`` rows an insert of ``op_id`` writes to ``coll``."""
    return pa.table(
        {"k": pa.array([row_key(op_id, coll, i) for i in range(n)], pa.string()),
         "v": pa.array(list(range(n)), pa.int64())},
        schema=pa.schema([*KEY, *VAL]),
    )


def caa_updates(op_id: str, coll: str, n: int, lower: int) -> list[Any]:
    """The ``n`` updates a compare-and-append of ``op_id`` writes: row ``i`` at
    ``lower + i % 2`` (the batch covers ``[lower, lower + 2)``)."""
    return [(((row_key(op_id, coll, i),), (i,)), lower + i % 2, 1) for i in range(n)]


def committed_upper(ctl: Any, coll: str) -> int:
    """The collection's upper counting every committed transaction (applied or not),
    read from the txn log, not through the reader path (which applies first)."""
    # Two catalog reads: a handover between them can make ``active`` a rendition the
    # first read's spec doesn't hold yet (seen in a SEEDS=30 soak): read again then.
    for _ in range(20):
        spec = ctl._spec(coll)
        active = ctl._active_rendition_at_upper(coll)
        if active in spec["renditions"]:
            break
    else:
        raise AssertionError(f"collection {coll}: active rendition {active} never in its catalog spec")
    view = ctl.txns.log.read()
    upper = min(ctl.txns.logical_upper(s, view) for s in spec["renditions"][active]["shards"])
    assert upper.time is not None, f"collection {coll} is closed"
    return upper.time
