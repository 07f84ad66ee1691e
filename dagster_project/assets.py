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

import datetime as dt
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import dagster as dg

from dagster_project.checks import (
    build_collection_check,
    build_errors_check,
    latest_as_of,
    read_latest,
    validate_collection,
)
from dagster_project.ingestion import ThrottledProgress, ingest_source
from dagster_project.metadata import (
    blob_requests,
    collection_metadata,
    inspect_shards,
    md_table,
    request_metadata,
    shard_metadata,
    time_metadata,
)
from dagster_project.operations import compact_shard
from dagster_project.partition_sync import catalog_directory, role_of, sync_source_partitions
from dagster_project.partitions import rendition_partitions, shard_partitions
from dagster_project.rendition_check import (
    collection_check_evaluation,
    make_rendition_check,
    rendition_check_result,
    rendition_check_spec,
)
from dagster_project.renditions import RenditionCheckFailed, backfill_rendition
from dagster_project.resources import LandingZoneResource, PersistResource, SparkResource
from dagster_project.run_config import rendition_config_schema
from dagster_project.sources import SOURCES, SourceSpec
from persist_lib.errors import InvalidUsage
from persist_lib.timefmt import time_text

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
        "One persist shard (partition = shard id). Each partition's metadata says what the "
        "shard is (`shard_of`: collection / rendition / shard i of n, a metadata shard, the "
        "catalog, a source's remap shard); it is recorded when the shard is registered. "
        "Materializing it runs the shard's pending compaction (in-process, or Spark for big "
        "shards) and records its state: frontiers, batches, bytes, compaction debt and the "
        "spine. Finalized shards (of dropped renditions) are removed from the partitions."
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
    start = blob_requests(client)
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
    with persist.read_only_controller() as ro:
        role = role_of(catalog_directory(ro, [s.name for s in SOURCES]), shard)
    metadata = {
        **role.metadata(),
        **shard_metadata(after),
        "compaction_engine": res["engine"],
        "compaction_debt_before": int(res.get("compaction_debt_before") or 0),
        "merges_applied": int(res.get("merges_applied") or 0),
        "bytes_written": int(res.get("bytes_written") or 0),
        **request_metadata(client, start),
    }
    failed = res.get("failed") or []
    if failed:
        # A merge failed deterministically (a corrupt or missing input part): it is
        # quarantined in shard state; the run fails so that someone looks.
        raise dg.Failure(
            description=(
                f"shard {shard}: {len(failed)} merge(s) failed deterministically and were "
                f"quarantined (first: batches {failed[0]['batch_ids']}: {failed[0]['error']}). "
                "Other merges ran. Repair or restore the part, then run `persist compact "
                f"{shard} --retry-quarantined`."
            ),
            metadata=metadata,
        )
    return dg.MaterializeResult(metadata=metadata)


# ----- per-source assets -------------------------------------------------------------


@dataclass(frozen=True)
class SourceAssets:
    """The definitions of one source (see the module docstring)."""

    spec: SourceSpec
    landing: dg.AssetSpec
    ingest: dg.AssetsDefinition
    rendition: dg.AssetsDefinition
    summary: dg.AssetsDefinition
    checks: tuple[dg.AssetChecksDefinition, ...]
    renditions_partitions: dg.DynamicPartitionsDefinition

    @property
    def collection_key(self) -> dg.AssetKey:
        return dg.AssetKey(self.spec.name)

    def assets(self) -> list[Any]:
        return [self.landing, self.ingest, self.rendition, self.summary]


def _summary_metadata(summary: dict[str, Any]) -> dict[str, Any]:
    frontier = summary.get("frontier") or {}
    return {
        "records_appended": int(summary.get("records") or 0),
        "updates_appended": int(summary.get("updates") or 0),
        "bytes_ingested": int(summary.get("bytes") or 0),
        "source_frontier": dg.MetadataValue.text(
            ", ".join(f"{p}: {a}" for p, a in sorted(frontier.items())) or "(start)"
        ),
        "lag_bytes": int(summary.get("lag_bytes") or 0),
        "lag_ms": int(summary.get("lag_ms") or 0),
        "bindings_applied": int(summary.get("bindings_applied") or 0),
        "engine": dg.MetadataValue.text(str(summary.get("engine", "in-process"))),
    }


def landing_kind(uri: str | None = None) -> str:
    """The kind badge of a landing zone: ``s3`` for an S3 zone, ``file`` for a local
    directory (``uri``, default ``PERSIST_LANDING_URI``, else the local
    ``$PERSIST_HOME/landing``; as ``LandingZoneResource`` picks it)."""
    uri = os.environ.get("PERSIST_LANDING_URI", "") if uri is None else uri
    return "s3" if uri.strip().lower().startswith("s3://") else "file"


def build_source_assets(spec: SourceSpec) -> SourceAssets:
    """The assets, checks and partitions of one configured source."""
    n = spec.name
    group = n
    cdc = spec.kind == "postgres_cdc"
    kafka = spec.kind == "kafka"
    landing_key = dg.AssetKey(f"{n}_table" if cdc else f"{n}_topic" if kafka else f"{n}_landing")
    remap_key, raw_key = dg.AssetKey(f"{n}_remap"), dg.AssetKey(f"{n}_raw")
    data_key, errors_key = dg.AssetKey(n), dg.AssetKey(f"{n}_errors")
    rendition_parts = rendition_partitions(n)
    landing = dg.AssetSpec(
        landing_key,
        group_name=group,
        kinds={"postgres"} if cdc else {"kafka"} if kafka else {landing_kind()},
        description=(
            f"Postgres table {spec.table} read by logical replication (external)."
            if cdc
            else f"Kafka topic {spec.topic} (external); the consumer group persist_{n} holds the "
            "durable frontier as its committed offsets."
            if kafka
            else f"Files of source {n!r} landing under <landing zone>/{n}/ (external)."
        ),
    )
    specs = [
        dg.AssetSpec(
            remap_key,
            deps=[landing_key],
            group_name=group,
            kinds={"persist"},
            description=f"Reclocking (remap) shard of {n!r}: source frontier bound at each time.",
        ),
        dg.AssetSpec(
            raw_key,
            deps=[remap_key],
            group_name=group,
            kinds={"persist"},
            description=f"Raw records of {n!r} (collection {n}.raw), kept to rebuild renditions.",
        ),
        dg.AssetSpec(
            data_key,
            deps=[remap_key],
            group_name=group,
            kinds={"persist"},
            description=spec.description or f"Collection {n!r}.",
        ),
        dg.AssetSpec(
            errors_key,
            deps=[remap_key],
            group_name=group,
            kinds={"persist"},
            description=f"Records of {n!r} that failed to decode (collection {n}.errors).",
        ),
    ]

    @dg.multi_asset(
        name=f"ingest_{n}",
        specs=specs,
        description=f"Run-once ingestion of {n!r}: reclock what landed and append it.",
    )
    def ingest(
        context: dg.AssetExecutionContext,
        persist: PersistResource,
        landing: LandingZoneResource,
        spark: SparkResource,
    ) -> Iterator[dg.MaterializeResult]:
        start = blob_requests(persist.client())
        ctl = persist.controller()
        progress = ThrottledProgress(context.log.info)
        summary = ingest_source(
            spec,
            ctl,
            landing.source_uri(n),
            spark=(lambda: spark.spark_session) if spark.enabled else None,
            progress=progress,
        )
        context.log.info(
            "%s: %s records (%s bytes) ingested, upper %s, %s",
            n,
            summary["records"],
            summary["bytes"],
            summary["upper"],
            summary["engine"],
        )
        for cname, res in (summary.get("schema_evolved") or {}).items():
            context.log.info(
                "%s: schemas changed in code: evolved to version %s (%s)",
                cname, res["version"], "; ".join(res.get("changes") or []) or res["outcome"],
            )
        client = persist.client()
        sync_source_partitions(context, client, ctl, n, rendition_parts)
        run_meta = _summary_metadata(summary)
        requests = request_metadata(client, start)  # this step's blob requests and cost
        remap = inspect_shards(client, [summary["remap_shard"]]).get(summary["remap_shard"])
        yield dg.MaterializeResult(
            asset_key=remap_key,
            metadata={
                **(shard_metadata(remap) if remap else {}),
                "source_frontier": run_meta["source_frontier"],
                "lag_bytes": run_meta["lag_bytes"],
                "lag_ms": run_meta["lag_ms"],
                "bindings_minted": int(summary.get("bindings_minted") or 0),
                "bindings_applied": run_meta["bindings_applied"],
                **requests,
            },
        )
        for key, cname in ((raw_key, f"{n}.raw"), (data_key, n), (errors_key, f"{n}.errors")):
            meta = collection_metadata(client, ctl.describe(cname))
            if key == errors_key:
                extra: dict[str, Any] = {"errors_appended": int(summary.get("errors") or 0)}
            elif key == raw_key:
                extra = {"records_appended": run_meta["records_appended"]}
            else:
                extra = run_meta
            yield dg.MaterializeResult(asset_key=key, metadata={**meta, **extra, **requests})

    @dg.asset(
        name=f"{n}_rendition",
        deps=[raw_key],
        partitions_def=rendition_parts,
        config_schema=rendition_config_schema(spec.default_rendition_shards),
        check_specs=[rendition_check_spec(dg.AssetKey(f"{n}_rendition"), n)],
        group_name=group,
        kinds={"persist"},
        description=(
            f"Renditions of {n!r} (partition = rendition name). Materializing a new partition "
            f"is a backfill: build it from {n}.raw with {spec.default_rendition_shards} shards "
            "(config num_shards), catch up, run the blocking GE check on it (a failure stops "
            "here), hand over, collect the old one. Partitions are the live renditions: "
            "retired and dropped ones are removed."
        ),
    )
    def rendition(
        context: dg.AssetExecutionContext,
        persist: PersistResource,
        landing: LandingZoneResource,
        spark: SparkResource,
    ) -> Iterator[dg.MaterializeResult]:
        start = blob_requests(persist.client())
        ctl = persist.controller()
        r = context.partition_key
        refused = rendition_refusal(spec, ctl.describe(n), r)
        if refused:
            raise dg.Failure(description=refused)
        try:
            res = backfill_rendition(
                spec,
                ctl,
                landing.source_uri(n),
                r,
                num_shards=int(context.op_execution_context.op_config["num_shards"]) or None,
                spark=(lambda: spark.spark_session) if spark.enabled else None,
                progress=context.log.info,
                check=make_rendition_check(persist, n, spec.rules),
            )
        except RenditionCheckFailed as e:
            # Recorded on the partition (built, not handed over) and as its failed blocking
            # check, then the run fails with the reason.
            desc = ctl.describe(n)
            yield dg.MaterializeResult(
                metadata={
                    **collection_metadata(persist.client(), desc, rendition=r),
                    "status": desc["renditions"][r]["status"],
                    "handover": dg.MetadataValue.text(f"refused: {e}"),
                },
                check_results=[rendition_check_result(e.outcome, r, e.at)],
            )
            raise dg.Failure(
                description=(
                    f"{e}. Fix the decoding logic (or the data) and backfill a new rendition "
                    "name; the failed check's metadata shows the failing expectations."
                )
            ) from None
        except InvalidUsage as e:
            raise dg.Failure(
                description=(
                    f"The backfill of rendition {r!r} of {n!r} was refused: {e}. Nothing was "
                    "handed over; fix the cause and launch it again (it resumes), or backfill "
                    "a new rendition name."
                )
            ) from None
        client = persist.client()
        desc = ctl.describe(n)
        built = res.get("built") or {}
        checked = res.get("check") or {}
        if checked.get("outcome") is not None:
            result = rendition_check_result(checked["outcome"], r, checked["at"])
        else:  # already active (checked when it was handed over to): its latest contents
            as_of = latest_as_of(persist, n)
            outcome = validate_collection(persist, n, spec.rules, as_of) if as_of is not None else None
            result = rendition_check_result(outcome, r, as_of, note="already active: latest contents")
        yield dg.MaterializeResult(
            check_results=[result],
            metadata={
                **collection_metadata(client, desc, rendition=r),
                "status": desc["renditions"][r]["status"],
                "previous_rendition": str(res.get("previous") or "-"),
                "handover_at": int(res["handover_at"]) if res.get("handover_at") else 0,
                **time_metadata("handover_at", res.get("handover_at")),
                "raw_records_replayed": int(built.get("records") or 0),
                "raw_times_replayed": int(built.get("times") or 0),
                "build_engine": str(built.get("engine", "-")),
                "collected": dg.MetadataValue.json(res.get("collected") or {}),
                **handover_cost(n, res.get("handover_at"), desc),
                **request_metadata(client, start),
            }
        )
        # The collections handed over now read through ``r``: record that on their assets
        # too, so their latest metadata shows the active rendition, not the retired one.
        handed = res.get("handovers") or {}
        for key, cname in ((data_key, n), (errors_key, f"{n}.errors")):
            if cname in handed:
                context.log_event(
                    dg.AssetMaterialization(
                        asset_key=key,
                        description=f"{cname}: handed over from {res.get('previous')} to {r}",
                        metadata={
                            **collection_metadata(client, ctl.describe(cname)),
                            "previous_rendition": str(res.get("previous") or "-"),
                            "handover_at": int(handed[cname]),
                            **time_metadata("handover_at", handed[cname]),
                        },
                    )
                )
        if n in handed and checked.get("outcome") is not None:
            context.log_event(collection_check_evaluation(data_key, checked["outcome"], r, checked["at"]))
        sync_source_partitions(context, client, ctl, n, rendition_parts, materializing=r)

    @dg.asset(
        name=f"{n}_summary",
        deps=[data_key],
        group_name=group,
        kinds={"pandas"},
        description=f"Downstream work on {n!r}: contents summary at the latest time.",
    )
    def summary(persist: PersistResource) -> dg.MaterializeResult:
        start = blob_requests(persist.client())
        df, as_of = read_latest(persist, n)
        meta = {**contents_summary(df, as_of, spec), **request_metadata(persist.client(), start)}
        return dg.MaterializeResult(metadata=meta)

    checks = (
        build_collection_check(data_key, n, spec.rules),
        build_errors_check(errors_key, f"{n}.errors"),
    )
    return SourceAssets(spec, landing, ingest, rendition, summary, checks, rendition_parts)


def rendition_refusal(spec: SourceSpec, desc: Mapping[str, Any], rendition: str) -> str | None:
    """Why a backfill of ``rendition`` can't run (one paragraph for a ``dg.Failure``), or
    None. A rendition is built once: a retired or dropped one can't be rebuilt."""
    info = desc["renditions"].get(rendition)
    if info is None or info["status"] in ("creating", "ready", "active"):
        return None
    name = desc["name"]
    to = next((h["to"] for h in desc["timeline"] if h["from"] == rendition), None)
    numbers = [int(r[1:]) for r in desc["renditions"] if re.fullmatch(r"r\d+", r)]
    suggest = f"r{max(numbers, default=0) + 1}"
    state = {
        "retired": "retired: it is waiting for the readers still before the handover, then "
        "the GC job drops it",
        "dropping": "being dropped",
        "dropped": "dropped: its shards are finalized and its data deleted",
    }.get(info["status"], info["status"])
    at = info.get("retired_at")
    when = f"time {at}"
    if isinstance(at, int) and at > 10**12:  # ingested times are ms since the epoch
        when += f" ({dt.datetime.fromtimestamp(at / 1000, dt.UTC):%Y-%m-%d %H:%M:%S} UTC)"
    return (
        f"Rendition {rendition!r} of collection {name!r} can't be built: it was handed over "
        f"away from at {when}"
        + (f" (to {to!r}, the active rendition is {desc['active_rendition']!r})" if to else "")
        + f" and is {state}. A rendition is built once; it is never rebuilt or reactivated "
        f"under its old name. To rebuild {name!r} (e.g. after a decoding fix), backfill a "
        f"new rendition name: in the UI, Materialize {name}_rendition and add a partition "
        f"such as {suggest!r}; or run `dagster job launch -w workspace.yaml -j "
        f"{spec.name}_rendition_job --tags '{{\"dagster/partition\": \"{suggest}\"}}'`."
    )


def handover_cost(name: str, at: int | None, desc: Mapping[str, Any]) -> dict[str, Any]:
    """What a handover costs, as ``history`` metadata: the collection's history before it
    (docs/dagster.md, "What a handover costs")."""
    if at is None:
        return {}
    return {
        "history": dg.MetadataValue.text(
            f"AS OF a time at or before the handover ({time_text(int(at))}) stops being "
            f"readable on {name!r} once the previous rendition is collected (now readable "
            f"from {time_text(desc.get('readable_since'))}); {name}.raw keeps every record "
            "at its time."
        )
    }


def contents_summary(df: Any, as_of: int | None, spec: SourceSpec) -> dict[str, Any]:
    """Metadata summarising a collection snapshot: rows, per-status counts and amounts."""
    if as_of is None or df is None or len(df) == 0:
        return {"rows": 0, "as_of": dg.MetadataValue.text("-")}
    meta: dict[str, Any] = {
        "rows": int(df["diff"].sum()),
        "as_of": int(as_of),
        **time_metadata("as_of", as_of),
    }
    numeric = [c for c in spec.val_schema.names if str(df[c].dtype).startswith(("float", "int"))]
    text = [c for c in spec.val_schema.names if df[c].dtype == object]
    for c in numeric:
        meta[f"{c}_total"] = float((df[c] * df["diff"]).sum())
    if text:
        col = text[-1]
        grouped = df.groupby(col)["diff"].sum().sort_index()
        table = md_table([col, "rows"], [(k, int(v)) for k, v in grouped.items()])
        meta[f"by_{col}"] = dg.MetadataValue.md(table)
    return meta


SOURCE_ASSETS: dict[str, SourceAssets] = {s.name: build_source_assets(s) for s in SOURCES}
