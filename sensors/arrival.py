"""Source-arrival sensors: one per configured source, launching its ingestion job.

Landing zones: the cursor is the name of the last landed file seen (files are ingested
in name order). Each tick lists the files after the cursor and leaves out those the
ingestion has already bound (the remap shard's frontier, ``source_progress.py``: a run
launched by hand may have taken them); the rest make **one** run request whose
``run_key`` is derived from the batch (``<source>:<last new file>``), so re-evaluating
the same arrivals never launches twice, and the returned cursor moves past them. When
every new file is already bound, the cursor moves past them and no run is requested.

Postgres CDC: the cursor is the server's WAL flush LSN seen last. When it moved, the
sensor peeks at the replication slot (without consuming) for a pending transaction on
the published table; if there is one, it requests one run with ``run_key =
<source>:<LSN>``; either way the cursor moves to the new LSN. Before the first
ingestion (no slot yet) the first run is requested (it takes the initial snapshot).

Kafka (a lag sensor): the consumer group ``persist_<source>`` holds the durable frontier
as its committed offsets, so ``high watermark - committed`` per partition is the lag.
With a lag, one run is requested with ``run_key = <source>:<sum of high watermarks>``
(the same end offsets never launch twice); the cursor is that sum.

No run storms: one request per tick at most (the run ingests everything that landed,
not just the files of the request), and none while an ingestion run of the source is
queued or running (the cursor then stays put, so the files are picked up next time).
"""

from __future__ import annotations

import dagster as dg

from dagster_project.assets import SOURCE_ASSETS
from dagster_project.resources import LandingZoneResource, PersistResource
from dagster_project.source_progress import LandingProgress, landing_progress
from dagster_project.sources import SourceSpec
from jobs.ingestion import INGESTION_JOBS
from persist_lib.errors import Timeout
from persist_lib.ingest.errors import IngestConfigError, SourceUnavailable
from persist_lib.ingest.pgoutput import int_to_lsn
from sensors.compaction import IN_FLIGHT


def ingestion_in_flight(instance: dg.DagsterInstance, job_name: str) -> bool:
    return bool(
        instance.get_runs(filters=dg.RunsFilter(job_name=job_name, statuses=IN_FLIGHT), limit=1)
    )


def build_arrival_sensor(
    source: str,
    job: dg.UnresolvedAssetJobDefinition | dg.JobDefinition,
    *,
    minimum_interval_seconds: int = 30,
) -> dg.SensorDefinition:
    """The arrival sensor of one landing-zone source."""

    @dg.sensor(
        name=f"{source}_arrival_sensor",
        job=job,
        minimum_interval_seconds=minimum_interval_seconds,
        default_status=dg.DefaultSensorStatus.RUNNING,
        description=f"Launches {job.name} when new files land for {source!r}.",
    )
    def _sensor(
        context: dg.SensorEvaluationContext, landing: LandingZoneResource, persist: PersistResource
    ) -> dg.SensorResult:
        cursor = context.cursor or ""
        files = landing.list_files(source, after=cursor)
        if not files:
            return dg.SensorResult(skip_reason=f"no new files after {cursor!r}", cursor=cursor)
        # What an ingestion has bound already (e.g. one launched by hand) is not an arrival.
        progress = (
            landing_progress(persist.existing_client(), source)
            if persist.location_exists()
            else LandingProgress()
        )
        bound = [f for f in files if progress.bound(f.name)]
        files = [f for f in files if not progress.bound(f.name)]
        if not files:
            last_bound = bound[-1].name
            return dg.SensorResult(
                skip_reason=(
                    f"{len(bound)} new file(s) up to {last_bound!r} already ingested by another "
                    f"run (bound: {progress.text()})"
                ),
                cursor=last_bound,
            )
        if ingestion_in_flight(context.instance, job.name):
            return dg.SensorResult(
                skip_reason=f"{len(files)} new file(s); waiting for the running ingestion",
                cursor=cursor,
            )
        last = files[-1].name
        request = dg.RunRequest(
            run_key=f"{source}:{last}",
            tags={
                "persist/source": source,
                "persist/first_file": files[0].name,
                "persist/last_file": last,
                "persist/files": str(len(files)),
                "persist/bytes": str(sum(f.size for f in files)),
            },
        )
        return dg.SensorResult(run_requests=[request], cursor=last)

    return _sensor


def cdc_pending(spec: SourceSpec) -> tuple[int, bool]:
    """(the source's WAL flush LSN, whether a transaction on the table awaits ingestion)."""
    from persist_lib.ingest.pg_cdc import PgCdcSource

    src = PgCdcSource(spec.dsn(), spec.table)
    src.attach(None, spec.name)  # type: ignore[arg-type]  # only derives slot/publication names
    try:
        lsn = src.current_lsn()
        slot = (
            src.conn()
            .execute("SELECT 1 FROM pg_replication_slots WHERE slot_name = %s", (src.slot,))
            .fetchone()
        )
        if slot is None:
            return lsn, True  # never ingested: the first run takes the snapshot
        return lsn, bool(src.peek(None, 1))
    finally:
        src.close()


def build_cdc_arrival_sensor(
    spec: SourceSpec,
    job: dg.UnresolvedAssetJobDefinition | dg.JobDefinition,
    *,
    minimum_interval_seconds: int = 30,
) -> dg.SensorDefinition:
    """The arrival sensor of one Postgres CDC source (cursor = WAL LSN)."""
    source = spec.name

    @dg.sensor(
        name=f"{source}_arrival_sensor",
        job=job,
        minimum_interval_seconds=minimum_interval_seconds,
        default_status=dg.DefaultSensorStatus.RUNNING,
        description=f"Launches {job.name} when {spec.table} has new committed changes.",
    )
    def _sensor(context: dg.SensorEvaluationContext) -> dg.SensorResult:
        cursor = context.cursor or "0"
        if not spec.dsn():
            return dg.SensorResult(skip_reason=f"{spec.dsn_env} is not set", cursor=cursor)
        try:
            lsn, pending = cdc_pending(spec)
        except (SourceUnavailable, IngestConfigError, OSError) as e:
            return dg.SensorResult(skip_reason=f"source not readable now: {e}", cursor=cursor)
        if lsn <= int(cursor):
            return dg.SensorResult(skip_reason="no new WAL", cursor=cursor)
        if not pending:
            return dg.SensorResult(
                skip_reason=f"WAL moved to {int_to_lsn(lsn)}, nothing for {spec.table}",
                cursor=str(lsn),
            )
        if ingestion_in_flight(context.instance, job.name):
            return dg.SensorResult(skip_reason="waiting for the running ingestion", cursor=cursor)
        request = dg.RunRequest(
            run_key=f"{source}:{int_to_lsn(lsn)}",
            tags={"persist/source": source, "persist/lsn": int_to_lsn(lsn)},
        )
        return dg.SensorResult(run_requests=[request], cursor=str(lsn))

    return _sensor


def kafka_lag(spec: SourceSpec) -> tuple[int, int]:
    """(sum of the topic's high watermarks, records not yet ingested) for a Kafka source."""
    from persist_lib.ingest.kafka import KafkaSource

    src = KafkaSource(spec.bootstrap(), spec.topic, key_format=spec.key_format, timeout_s=10.0)
    src.attach(None, spec.name)  # type: ignore[arg-type]  # only derives the group id
    lag = src.group_lag()
    return sum(hi for _, hi in lag.values()), sum(max(0, hi - c) for c, hi in lag.values())


def build_kafka_lag_sensor(
    spec: SourceSpec,
    job: dg.UnresolvedAssetJobDefinition | dg.JobDefinition,
    *,
    minimum_interval_seconds: int = 30,
) -> dg.SensorDefinition:
    """The lag sensor of one Kafka source (cursor = the sum of the high watermarks)."""
    source = spec.name

    @dg.sensor(
        name=f"{source}_lag_sensor",
        job=job,
        minimum_interval_seconds=minimum_interval_seconds,
        default_status=dg.DefaultSensorStatus.RUNNING,
        description=f"Launches {job.name} when topic {spec.topic} has messages not ingested yet.",
    )
    def _sensor(context: dg.SensorEvaluationContext) -> dg.SensorResult:
        cursor = context.cursor or "0"
        if not spec.bootstrap():
            return dg.SensorResult(skip_reason=f"{spec.bootstrap_env} is not set", cursor=cursor)
        try:
            ends, lag = kafka_lag(spec)
        except (SourceUnavailable, IngestConfigError, Timeout, OSError) as e:
            return dg.SensorResult(skip_reason=f"topic not readable now: {e}", cursor=cursor)
        if lag == 0:
            return dg.SensorResult(skip_reason=f"caught up (end offsets sum to {ends})", cursor=str(ends))
        if ingestion_in_flight(context.instance, job.name):
            return dg.SensorResult(skip_reason=f"lag {lag}: waiting for the running ingestion", cursor=cursor)
        request = dg.RunRequest(
            run_key=f"{source}:{ends}",
            tags={"persist/source": source, "persist/lag_records": str(lag)},
        )
        return dg.SensorResult(run_requests=[request], cursor=str(ends))

    return _sensor


def build_source_sensor(
    spec: SourceSpec, job: dg.UnresolvedAssetJobDefinition | dg.JobDefinition
) -> dg.SensorDefinition:
    if spec.kind == "postgres_cdc":
        return build_cdc_arrival_sensor(spec, job)
    if spec.kind == "kafka":
        return build_kafka_lag_sensor(spec, job)
    return build_arrival_sensor(spec.name, job)


ARRIVAL_SENSORS = {
    name: build_source_sensor(sa.spec, INGESTION_JOBS[name]) for name, sa in SOURCE_ASSETS.items()
}
