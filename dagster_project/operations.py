"""Maintenance operations on a persist location, as plain functions returning JSON.

Assets, jobs, sensors and ``scripts/run_pipeline.py`` share these; none of them needs a
Dagster context, so they are easy to test and to reuse.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from persist_lib.errors import InvalidUsage, PersistError
from persist_lib.handles.client import PersistClient
from persist_lib.storage import StorageController

log = logging.getLogger(__name__)

MiB = 1 << 20


@dataclass(frozen=True)
class ShardDebt:
    """A shard's compaction debt as seen at one state version."""

    shard: str
    seqno: int
    debt: int
    bytes: int
    batches: int
    pending_merges: int = 0  # merges compaction would run now (quarantined ones excluded)
    quarantined: int = 0


def shard_debts(client: PersistClient) -> list[ShardDebt]:
    """Compaction debt of every live shard of the location (tombstones skipped)."""
    out = []
    for sid in client.list_shards():
        try:
            st = client.inspect(sid)
        except InvalidUsage:
            continue
        if st.get("tombstone"):
            continue
        out.append(
            ShardDebt(
                sid,
                int(st["seqno"]),
                int(st.get("compaction_debt", 0)),
                int(st["bytes"]),
                int(st["num_batches"]),
                len({b["pending_request"] for b in st.get("spine", []) if b.get("pending_request") is not None}),
                len(st.get("quarantined_merges", [])),
            )
        )
    return out


def compact_shard(
    client: PersistClient,
    shard: str,
    *,
    threshold: int = 0,
    spark: Callable[[], Any] | None = None,
    spark_min_bytes: int = 256 * MiB,
) -> dict[str, Any]:
    """Compacts ``shard`` if its debt exceeds ``threshold``.

    Big shards (``>= spark_min_bytes``) compact on Spark when ``spark`` (a function
    returning a session, called only then) is given and ``persist_lib.spark`` offers
    distributed compaction; everything else runs the in-process compactor.
    """
    before = client.inspect(shard)
    debt = int(before.get("compaction_debt", 0))
    if before.get("tombstone") or debt <= threshold:
        return {
            "shard": shard,
            "engine": "skipped",
            "compaction_debt_before": debt,
            "compaction_debt_after": debt,
            "merges_applied": 0,
            "batches_before": before["num_batches"],
            "batches_after": before["num_batches"],
        }
    spark_compact = _spark_compactor() if spark is not None else None
    if spark is not None and spark_compact is not None and int(before["bytes"]) >= spark_min_bytes:
        res = dict(spark_compact(spark(), client, shard, min_bytes=spark_min_bytes))
        res.setdefault("engine", "spark")
        res.setdefault(
            "merges_applied",
            int(res.get("spark_merges_applied", 0)) + int(res.get("local_merges_applied", 0)),
        )
        res.setdefault("bytes_written", int(res.get("spark_bytes_written", 0)))
    else:
        # Deterministic failures (corrupt/missing parts) are quarantined and listed in
        # ``failed``; the caller records them and fails the run.
        res = dict(client.compact(shard, raise_on_failure=False))
        res["engine"] = "in-process"
    res.setdefault("compaction_debt_before", debt)
    return res


def _spark_compactor() -> Any | None:
    """``persist_lib.spark``'s compaction entry point, if that module provides one."""
    try:
        from persist_lib import spark as pspark
    except ImportError:
        return None
    fn = getattr(pspark, "compact_shard", None)
    return fn if callable(fn) else None


def collect_garbage(
    client: PersistClient,
    ctl: StorageController | None,
    *,
    grace_period_ms: int | None = None,
    delete_leaked: bool = True,
) -> dict[str, Any]:
    """GC on every shard, the leaked-blob sweep (older than the grace period), and the
    collection of renditions every reader has moved past."""
    shards = client.list_shards()
    totals = {
        "shards": 0,
        "blobs_deleted": 0,
        "bytes_deleted": 0,
        "leaked_blobs_deleted": 0,
        "errors": 0,
    }
    per_shard: dict[str, Any] = {}
    collected: dict[str, Any] = {}
    if ctl is not None:
        try:
            collected = ctl.collect_renditions()
        except PersistError as e:
            log.warning("collecting old renditions failed: %s", e)
            totals["errors"] += 1
    for sid in shards:
        try:
            st = client.inspect(sid)
            if st.get("tombstone"):
                continue
            g = client.gc(sid)
            leaked = client.unreferenced_blobs(sid, grace_period_ms, delete=delete_leaked)
        except PersistError as e:
            log.warning("GC of shard %s failed: %s", sid, e)
            totals["errors"] += 1
            continue
        totals["shards"] += 1
        deleted = int(g.get("blobs_deleted", 0) or 0)
        totals["blobs_deleted"] += deleted
        totals["bytes_deleted"] += int(g.get("bytes_deleted", 0) or 0)
        totals["leaked_blobs_deleted"] += len(leaked) if delete_leaked else 0
        if deleted or leaked:
            per_shard[sid] = {"gc": g, "leaked": len(leaked)}
    return {**totals, "renditions_collected": collected, "per_shard": per_shard}


def expire_leases(client: PersistClient, now_ms: int | None = None) -> dict[str, Any]:
    """Expires lapsed readers and writers on every shard; counts what went."""
    expired = client.expire_leases(None, now_ms)
    return {
        "shards_scanned": len(client.list_shards()),
        "shards_with_expiries": len(expired),
        "readers_expired": sum(len(v["readers"]) for v in expired.values()),
        "writers_expired": sum(len(v["writers"]) for v in expired.values()),
        "expired": expired,
    }


def finish_transactions(client: PersistClient) -> dict[str, Any]:
    """The txn log's maintenance (``persist_lib.txn``): applies every committed
    transaction a dead committer left unapplied, tidies the log, and releases the part
    writers of transactions that can never commit (their committer's log lease lapsed)."""
    from persist_lib.txn.txns import Txns

    txns = Txns(client)
    try:
        applied = txns.apply_all()
        tidied = txns.tidy()
        released = txns.recover_orphans()
        view = txns.log.read()
        return {
            "applied": applied,
            "tidied": tidied,
            "released_part_writers": released,
            "registered_shards": len(view.registered),
            "pending": len(view.pending),
            "log_upper": view.upper,
        }
    finally:
        txns.close()
