"""The rendition metadata shard: ``(rendition, t, +1/-1)`` updates.

At every time exactly one rendition accumulates to +1: the active one. A handover at
``t`` is ``(old, t, -1), (new, t, +1)``. The metadata shard's *upper* is how far the
assignment is decided: readers may read a rendition only at times below it, and a
handover must happen at or beyond it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from persist_lib.errors import InvalidUsage

METADATA_KEY = pa.schema([pa.field("rendition", pa.string(), nullable=False)])
METADATA_VAL = pa.schema([])


@dataclass(frozen=True)
class Handover:
    at: int
    old: str | None
    new: str


def timeline_from_updates(rows: list[dict]) -> list[Handover]:
    """Active-rendition changes, in time order, from raw metadata updates."""
    by_time: dict[int, Counter[str]] = {}
    for r in rows:
        by_time.setdefault(r["ts"], Counter())[r["rendition"]] += r["diff"]
    acc: Counter[str] = Counter()
    out: list[Handover] = []
    for t in sorted(by_time):
        before = _active(acc, t)
        acc.update(by_time[t])
        acc = +acc
        after = _active(acc, t)
        if after != before and after is not None:
            out.append(Handover(t, before, after))
    return out


def active_in(snapshot_rows: list[dict], at: int, shard: str) -> str:
    """The one rendition with multiplicity +1 in a metadata snapshot."""
    live = [r["rendition"] for r in snapshot_rows if r["diff"] != 0]
    if len(live) != 1 or snapshot_rows[[r["rendition"] for r in snapshot_rows].index(live[0])]["diff"] != 1:
        raise InvalidUsage(
            f"metadata shard {shard}: expected exactly one active rendition at {at}, found "
            f"{[(r['rendition'], r['diff']) for r in snapshot_rows]}"
        )
    return live[0]


def _active(acc: Counter[str], t: int) -> str | None:
    live = [k for k, v in acc.items() if v]
    return live[0] if len(live) == 1 else None


def active_rendition(client: Any, metadata_shard: str) -> str | None:
    """The rendition active at the latest decided time of a collection whose metadata
    shard is ``metadata_shard``, read through a reader expired right after (nothing is
    left registered); None while nothing is decided yet."""
    machine = client.machine(metadata_shard)
    state = machine.fetch_latest()
    if not state.exists or state.upper.time is None or state.upper.time == 0:
        return None
    r = client.open_leased_reader(
        metadata_shard, METADATA_KEY, METADATA_VAL, purpose="storage-inspect"
    )
    try:
        t = machine.fetch_latest().upper.time
        assert t is not None and t > 0
        return active_in(r.snapshot(t - 1).to_pylist(), t - 1, metadata_shard)
    finally:
        r.expire()
