"""Shared by the time-layer tests: a ``mem://`` client, the model of a shard's history,
and the invariant of a (k, v)-disjoint batch's runs."""

from __future__ import annotations

import uuid
from collections import Counter
from typing import Any

import pyarrow as pa

from persist_lib import PersistClient, PersistConfig
from persist_lib.location.base import Blob
from persist_lib.shard.batch_meta import HollowBatch
from persist_lib.shard.codec import D_COL, T_COL, Schemas
from persist_lib.shard.consolidate import is_consolidated
from persist_lib.shard.parts import fetch_part
from persist_lib.shard.runs import batch_runs

Row = tuple[Any, str, int, int]


def mem_client(**cfg: Any) -> PersistClient:
    """A client on a fresh in-memory blob and consensus, small parts, layers of any size."""
    name = uuid.uuid4().hex
    base: dict[str, Any] = {"blob_target_size": 4 << 10, "inline_threshold": 0, "compaction_layer_min_rows": 1}
    return PersistClient.open(f"mem://{name}", f"mem://{name}", PersistConfig.for_tests(**{**base, **cfg}))


def model(log: list[Row], as_of: int) -> list[tuple[Any, str, int]]:
    """The contents at ``as_of`` of a history of ``(k, v, t, diff)`` updates."""
    c: Counter[tuple[Any, str]] = Counter()
    for k, v, t, d in log:
        if t <= as_of:
            c[(k, v)] += d
    return sorted((k, v, d) for (k, v), d in c.items() if d)


def rows(t: pa.Table) -> list[tuple[Any, str, int]]:
    """A snapshot's ``(k, v, diff)`` rows, sorted."""
    return sorted((r["k"], r["v"], r["diff"]) for r in t.to_pylist())


def kv_of(t: pa.Table) -> list[tuple[Any, ...]]:
    """The ``(k, v)`` of each row of an internal (or user) update table, in order."""
    names = [c for c in t.column_names if c not in (T_COL, D_COL, "ts", "diff")]
    return list(zip(*(t.column(c).to_pylist() for c in names), strict=True))


def assert_kv_layers(b: HollowBatch, blob: Blob, schemas: Schemas, shard: str) -> None:
    """A marked batch's runs: each consolidated, no ``(k, v)`` in two runs, and every
    ``(k, v)``'s oldest time in a run at or after the newest oldest time of the runs
    before it (so a read as of an old time may skip a run by its parts' ``tmin``)."""
    seen: set[tuple[Any, ...]] = set()
    prev_oldest = -1
    for run in batch_runs(b):
        t = pa.concat_tables([fetch_part(blob, p, schemas, shard) for p in run])
        assert is_consolidated(t), b
        oldest: dict[tuple[Any, ...], int] = {}
        for kv, time in zip(kv_of(t), t.column(T_COL).to_pylist(), strict=True):
            oldest.setdefault(kv, time)  # (k, v, t) order: the first is the oldest
        assert not seen & oldest.keys(), "a (k, v) is in two runs of a kv_disjoint batch"
        seen |= oldest.keys()
        assert min(oldest.values()) >= prev_oldest, b
        prev_oldest = max(oldest.values())
