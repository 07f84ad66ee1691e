"""Assets: ingested collections, their reclocking and raw collections, renditions, shards.

Per configured source (``sources.py``) the graph is::

    <src>_landing (external)  ->  ingest_<src>: <src>_remap, <src>_raw, <src>, <src>_errors
    <src>_raw  ->  <src>_rendition (partition = rendition name; a backfill builds one)
    <src>      ->  <src>_summary (downstream work, launched by an asset sensor)

plus ``persist_shard`` (partition = shard id) whose materialization compacts one shard
and records its state. Every materialization records what the UI should show: frontiers
(upper, since), batches, updates, bytes, records appended, source frontier and lag, and the
spine as a markdown table.
"""

import dagster as dg

from dagster_project.metadata import shard_metadata
from dagster_project.operations import compact_shard
from dagster_project.partitions import shard_partitions
from dagster_project.resources import PersistResource, SparkResource

MiB = 1 << 20


class CompactionConfig(dg.Config):
    """Compaction of one shard: only above ``debt_threshold``; on Spark from
    ``spark_min_bytes`` when Spark is configured."""

    debt_threshold: int = 0
    spark_min_bytes: int = 256 * MiB


@dg.asset(
    partitions_def=shard_partitions,
    group_name="maintenance",
    kinds={"persist"},
    description=(
        "One persist shard (partition = shard id). Materializing it runs the shard's pending "
        "compaction (in-process, or Spark for big shards) and records its state: frontiers, "
        "batches, bytes, compaction debt and the spine."
    ),
)
def persist_shard(
    context: dg.AssetExecutionContext,
    config: CompactionConfig,
    persist: PersistResource,
    spark: SparkResource,
) -> dg.MaterializeResult:
    shard = context.partition_key
    client = persist.client()
    res = compact_shard(
        client,
        shard,
        threshold=config.debt_threshold,
        spark=(lambda: spark.spark_session) if spark.enabled else None,
        spark_min_bytes=config.spark_min_bytes,
    )
    context.log.info(
        "shard %s: %s compaction, debt %s -> %s",
        shard,
        res["engine"],
        res.get("compaction_debt_before"),
        res.get("compaction_debt_after"),
    )
    after = client.inspect(shard)
    return dg.MaterializeResult(
        metadata={
            **shard_metadata(after),
            "compaction_engine": res["engine"],
            "compaction_debt_before": int(res.get("compaction_debt_before") or 0),
            "merges_applied": int(res.get("merges_applied") or 0),
            "bytes_written": int(res.get("bytes_written") or 0),
        }
    )
