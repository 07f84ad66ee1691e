"""``StorageController.describe``: what a collection is made of, for people and tools.

The catalog entry, the metadata shard's frontiers and handover timeline (with what the
catalog remembers of handovers compacted out of it), and each rendition's status,
shards, frontiers and sizes. Read-only: opens nothing it leaves behind.
"""

from __future__ import annotations

from typing import Any

from persist_lib.storage.catalog import Spec
from persist_lib.storage.metadata import METADATA_KEY, METADATA_VAL, Handover, timeline_from_updates
from persist_lib.storage.readable import readable_since
from persist_lib.storage.schema_evolution import collection_schemas, rendition_schemas
from persist_lib.storage.status import rendition_status


def describe_collection(ctl: Any, name: str) -> dict[str, Any]:
    """The collection: schemas, metadata frontiers, active rendition, every handover
    (``timeline``: ``at``, ``from``, ``to``) and each rendition's status, shards,
    frontiers and sizes. A rendition's ``status`` is one word of
    ``persist_lib.storage.status`` (``creating``, ``ready``, ``active``, ``retired``,
    ``dropping``, ``dropped``); ``active`` is true for the one whose status is
    ``active``. ``readable_since``: the earliest time a collection reader can read
    (``persist_lib.storage.readable``), not the since of any one shard."""
    spec = ctl._spec(name)
    meta = spec["metadata_shard"]
    ms = ctl.client.machine(meta).fetch_latest()
    timeline = history(spec, *meta_timeline(ctl, spec))
    active = timeline[-1].new if timeline else None
    renditions = {}
    for r, info in sorted(spec["renditions"].items()):
        if spec.get("transactional") and info["status"] == "ready":
            ctl.txns.ensure_applied(info["shards"])  # show what committed
        states = [ctl.client.machine(s).fetch_latest() for s in info["shards"]]
        live = [s for s in states if s.exists and not s.tombstone]
        renditions[r] = {
            "schemas": rendition_schemas(spec, r).describe(),
            "status": rendition_status(info, active=r == active),
            "active": r == active,
            "num_shards": len(info["shards"]),
            "shards": info["shards"],
            "since": max(s.since for s in live).elements if live else None,
            "upper": min(s.upper for s in live).elements if live else None,
            "batches": sum(len(s.batches) for s in live),
            "updates": sum(b.len for s in live for b in s.batches.values()),
            "bytes": sum(b.size for s in live for b in s.batches.values()),
            "retired_at": info.get("retired_at"),
        }
    return {
        "name": name,
        "schemas": ctl._schemas(spec).describe(),
        "schema_version": collection_schemas(spec).version,
        "metadata_shard": meta,
        "metadata_since": ms.since.elements,
        "metadata_upper": ms.upper.elements,
        "active_rendition": active,
        "timeline": [{"at": h.at, "from": h.old, "to": h.new} for h in timeline],
        "renditions": renditions,
        "readable_since": readable_since(
            ms.since.elements, [{"at": h.at, "to": h.new} for h in timeline], renditions
        ),
    }


def meta_timeline(ctl: Any, spec: Spec) -> tuple[list[Handover], int]:
    """The handovers in the metadata shard's history and the time ``lo`` it starts at.

    History before the metadata since is compacted: the first entry is then the
    rendition active at ``lo`` with no ``old`` (``history`` puts back what the
    catalog remembers). Reads through the controller's own metadata reader if it
    has one, else through a reader expired right after (nothing is left behind).
    """
    meta = spec["metadata_shard"]
    own = ctl._meta_readers.get(meta)
    r = own or ctl.client.open_leased_reader(
        meta, METADATA_KEY, METADATA_VAL, purpose="storage-inspect"
    )
    try:
        upper = r._machine.fetch_latest().upper
        if upper.time is None or upper.time == 0:
            return [], 0
        lo = min(r.since.time or 0, upper.time - 1)
        rows: list[dict] = []
        if lo > 0:
            rows = [dict(x, ts=lo) for x in r.snapshot(lo).to_pylist()]
            rows = [x for x in rows if x["diff"]]
        rows += r.updates_between(lo + (1 if lo > 0 else 0), upper.time).to_pylist()
        return timeline_from_updates(rows), lo
    finally:
        if own is None:
            r.expire()


def history(spec: Spec, timeline: list[Handover], lo: int) -> list[Handover]:
    """Every handover of the collection: the metadata shard's ``timeline`` from
    ``lo`` on, and before it (compacted away there) what the catalog records: each
    rendition retired at ``t <= lo`` was active until ``t`` and handed over to the
    next one retired, the last one to the rendition active at ``lo``."""
    if lo == 0 or not timeline or timeline[0].old is not None or timeline[0].at != lo:
        return timeline
    active_at_lo = timeline[0].new
    retired = sorted(
        (info["retired_at"], r)
        for r, info in spec["renditions"].items()
        if info.get("retired_at") is not None and info["retired_at"] <= lo
    )
    chain = [r for _, r in retired] + [active_at_lo]
    out = [Handover(0, None, chain[0])]
    out += [Handover(at, chain[i], chain[i + 1]) for i, (at, _) in enumerate(retired)]
    return out + timeline[1:]
