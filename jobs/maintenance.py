"""Maintenance jobs (compaction, GC, lease expiry) and the schedules that launch them.

- ``compaction_job``: materializes partitions of ``persist_shard`` (one per shard): the
  shard's pending merges run in-process, or on Spark for big shards when Spark is
  configured. Launched by the compaction-debt sensor (``sensors.compaction``).
- ``gc_job``: ``client.gc`` on every shard, the leaked-blob sweep with a grace period
  (``unreferenced_blobs(delete=True)``) and the collection of retired renditions; the
  partitions of dropped renditions and of their finalized shards are then removed.
- ``lease_expiry_job``: ``client.expire_leases()`` on every shard.
- ``txn_maintenance_job``: the txn log's upkeep (``operations.finish_transactions``):
  applies what dead committers committed, tidies the log, releases the part writers of
  transactions that can never commit.

GC runs hourly, lease expiry and txn maintenance every five minutes; all are
idempotent, cheap when there is nothing to do, and safe to run concurrently with
writers and readers.
"""

import dagster as dg

from dagster_project.assets import SOURCE_ASSETS, persist_shard
from dagster_project.metadata import blob_requests, request_metadata
from dagster_project.operations import collect_garbage, expire_leases, finish_transactions
from dagster_project.partition_sync import sync_source_partitions
from dagster_project.resources import PersistResource

compaction_job = dg.define_asset_job(
    "compaction_job",
    selection=dg.AssetSelection.assets(persist_shard),
    description="Compacts one shard (partition = shard id): in-process, or Spark for big shards.",
    executor_def=dg.in_process_executor,
)


class GcConfig(dg.Config):
    """Leaked blobs younger than ``grace_period_ms`` are never deleted (writers upload
    parts before their CAS commits them)."""

    grace_period_ms: int = 60 * 60 * 1000
    delete_leaked: bool = True


@dg.op(description="GC every shard, sweep leaked blobs, collect retired renditions.")
def collect_garbage_op(
    context: dg.OpExecutionContext, config: GcConfig, persist: PersistResource
) -> dict:
    start = blob_requests(persist.client())
    ctl = persist.controller()
    out = collect_garbage(
        persist.client(),
        ctl,
        grace_period_ms=config.grace_period_ms,
        delete_leaked=config.delete_leaked,
    )
    existing = set(ctl.list_collections())
    for name, sa in SOURCE_ASSETS.items():
        if name in existing:
            sync_source_partitions(context, persist.client(), ctl, name, sa.renditions_partitions)
    context.add_output_metadata(
        {
            "shards": out["shards"],
            "blobs_deleted": out["blobs_deleted"],
            "bytes_deleted": out["bytes_deleted"],
            "leaked_blobs_deleted": out["leaked_blobs_deleted"],
            "renditions_collected": dg.MetadataValue.json(out["renditions_collected"]),
            "errors": out["errors"],
            **request_metadata(persist.client(), start),
        }
    )
    return out


@dg.op(description="Expire lapsed reader and writer leases on every shard.")
def expire_leases_op(context: dg.OpExecutionContext, persist: PersistResource) -> dict:
    start = blob_requests(persist.client())
    out = expire_leases(persist.client())
    context.add_output_metadata(
        {
            "shards_scanned": out["shards_scanned"],
            "readers_expired": out["readers_expired"],
            "writers_expired": out["writers_expired"],
            "expired": dg.MetadataValue.json(out["expired"]),
            **request_metadata(persist.client(), start),
        }
    )
    return out


@dg.op(description="Apply committed transactions, tidy the txn log, release dead transactions' writers.")
def finish_transactions_op(context: dg.OpExecutionContext, persist: PersistResource) -> dict:
    start = blob_requests(persist.client())
    out = finish_transactions(persist.client())
    context.add_output_metadata({**out, **request_metadata(persist.client(), start)})
    return out


@dg.job(description="Garbage collection of every shard.", executor_def=dg.in_process_executor)
def gc_job() -> None:
    collect_garbage_op()


@dg.job(description="Lease expiry on every shard.", executor_def=dg.in_process_executor)
def lease_expiry_job() -> None:
    expire_leases_op()


@dg.job(description="Txn log upkeep: apply, tidy, recover.", executor_def=dg.in_process_executor)
def txn_maintenance_job() -> None:
    finish_transactions_op()


gc_schedule = dg.ScheduleDefinition(
    name="gc_schedule",
    job=gc_job,
    cron_schedule="17 * * * *",
    default_status=dg.DefaultScheduleStatus.RUNNING,
    description="Hourly GC (idempotent).",
)

lease_expiry_schedule = dg.ScheduleDefinition(
    name="lease_expiry_schedule",
    job=lease_expiry_job,
    cron_schedule="*/5 * * * *",
    default_status=dg.DefaultScheduleStatus.RUNNING,
    description="Lease expiry every 5 minutes (idempotent).",
)

txn_maintenance_schedule = dg.ScheduleDefinition(
    name="txn_maintenance_schedule",
    job=txn_maintenance_job,
    cron_schedule="*/5 * * * *",
    default_status=dg.DefaultScheduleStatus.RUNNING,
    description="Txn log upkeep every 5 minutes (idempotent).",
)
