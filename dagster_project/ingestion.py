"""Running the ingestion of a configured source (``persist_lib.ingest``) from Dagster.

``ingest_source`` is one run-once pass of the recipe: what landed since the last pass is
reclocked (bound to times in the remap shard) and appended to the STORAGE collections
``<name>`` (data), ``<name>.raw``, ``<name>.errors`` and ``<name>.state`` (upsert). With a
Spark session (``SparkResource`` configured) the bound files, or the bound Kafka offset
ranges, are decoded on executors (``persist_lib.spark.ingest.SparkIngestion``); otherwise
the pass runs in-process (always, for Postgres CDC: a replication stream is read by one
process).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from dagster_project.schema_changes import follow_declared_schema
from dagster_project.sources import SourceSpec
from persist_lib.ingest import (
    IngestConfig,
    IngestConfigError,
    Ingestion,
    LandingZoneSource,
    StorageOutputs,
)
from persist_lib.ingest.outputs import shard_id_for
from persist_lib.ingest.progress import IngestProgress
from persist_lib.storage import StorageController

log = logging.getLogger(__name__)

ProgressFn = Callable[[IngestProgress], None]


def ingest_config(spec: SourceSpec) -> IngestConfig:
    """The ingestion's tunables: the raw collection is always kept (renditions rebuild from it)."""
    return IngestConfig(keep_raw=True)


def make_ingestion(
    spec: SourceSpec,
    ctl: StorageController,
    landing_uri: str,
    *,
    outputs: Any | None = None,
    progress: ProgressFn | None = None,
    spark: Callable[[], Any] | None = None,
) -> Ingestion:
    """An ``Ingestion`` of ``spec`` from its landing zone into STORAGE collections.

    With ``spark`` (a function returning a session) it is ``persist_lib.spark``'s
    ``SparkIngestion``: the same recipe, with the bound files (or Kafka offset ranges)
    decoded on executors.
    """
    args = (ctl.client, spec.name, make_source(spec, landing_uri), spec.key_schema, spec.val_schema)
    kwargs: dict[str, Any] = {
        "envelope": spec.envelope,
        "delete_field": spec.delete_field,
        "outputs": outputs or StorageOutputs(ctl, spec.name, num_shards=spec.num_shards),
        "config": ingest_config(spec),
        "transform": spec.transform,
        "progress": progress,
    }
    if spark is not None and spec.kind in ("landing_zone", "kafka"):
        from persist_lib.spark.ingest import SparkIngestion

        return SparkIngestion(spark(), *args, **kwargs)
    return Ingestion(*args, **kwargs)


def make_source(spec: SourceSpec, landing_uri: str) -> Any:
    """The ``persist_lib.ingest`` source of ``spec``: a landing zone, Postgres CDC or Kafka."""
    if spec.kind == "kafka":
        from persist_lib.ingest.kafka import KafkaSource

        bootstrap = spec.bootstrap()
        if not bootstrap:
            raise IngestConfigError(
                f"source {spec.name!r} reads Kafka topic {spec.topic!r}: set {spec.bootstrap_env} to "
                "HOST:PORT (or kafka://USER:PASSWORD@HOST:PORT?security_protocol=...)"
            )
        return KafkaSource(bootstrap, spec.topic, key_format=spec.key_format)
    if spec.kind == "postgres_cdc":
        from persist_lib.ingest.pg_cdc import PgCdcSource

        dsn = spec.dsn()
        if not dsn:
            raise IngestConfigError(
                f"source {spec.name!r} reads Postgres CDC: set {spec.dsn_env} to a postgresql:// "
                "URL of a REPLICATION role on a server with wal_level=logical"
            )
        return PgCdcSource(dsn, spec.table)
    return LandingZoneSource(landing_uri, format=spec.format)


def ingest_source(
    spec: SourceSpec,
    ctl: StorageController,
    landing_uri: str,
    *,
    spark: Callable[[], Any] | None = None,
    progress: ProgressFn | None = None,
) -> dict[str, Any]:
    """One run-once ingestion pass; returns the driver's summary plus ``engine``."""
    if spec.kind == "landing_zone":
        _ensure_landing_dir(landing_uri)
    elif spec.kind == "postgres_cdc":
        spark = None  # a replication stream is read by the driver only
    t0 = time.monotonic()
    evolved = follow_declared_schema(spec, ctl)  # schemas changed in code: evolve first
    with make_ingestion(spec, ctl, landing_uri, progress=progress, spark=spark) as ing:
        summary = ing.run_once()
    if evolved:
        summary["schema_evolved"] = evolved
    summary["engine"] = "spark" if spark is not None else "in-process"
    summary.setdefault("duration_s", round(time.monotonic() - t0, 3))
    summary.setdefault("remap_shard", str(shard_id_for(spec.name, "remap")))
    return summary


def _ensure_landing_dir(uri: str) -> None:
    """A local landing zone that does not exist yet is created (empty, nothing to ingest)."""
    if uri.startswith("s3://"):
        return
    from pathlib import Path

    Path(uri[len("file://") :] if uri.startswith("file://") else uri).mkdir(
        parents=True, exist_ok=True
    )


class ThrottledProgress:
    """A progress callback that logs at most every ``interval_s`` (and the final event)."""

    def __init__(self, emit: Callable[[str], None], interval_s: float = 2.0) -> None:
        self.emit = emit
        self.interval_s = interval_s
        self.last: IngestProgress | None = None
        self._t = 0.0

    def __call__(self, p: IngestProgress) -> None:
        self.last = p
        now = time.monotonic()
        if not p.done and now - self._t < self.interval_s:
            return
        self._t = now
        lag = "" if p.lag_bytes is None else f", lag {p.lag_bytes} bytes"
        self.emit(
            f"{p.name}: {p.records} records, {p.bytes} bytes, {p.bindings} bindings, upper "
            f"{p.upper}{lag}{' (done)' if p.done else ''}"
        )
