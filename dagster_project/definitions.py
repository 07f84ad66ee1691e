"""The code location: ``defs`` (loaded by workspace.yaml and the docker code server).

Resources come from the environment, read when the code location loads:

- persist: ``PERSIST_BLOB_URI`` / ``PERSIST_CONSENSUS_URI`` (else the embedded default
  under ``PERSIST_HOME``, else ``./.persist``), resolved in the process that uses them;
- landing zone: ``PERSIST_LANDING_URI`` (a directory or ``s3://bucket/prefix?...``; else
  ``$PERSIST_HOME/landing``), listed through dagster-aws's ``S3Resource``;
- Spark: ``SPARK_MASTER_URL`` (unset: no Spark, ingestion and compaction run in-process).
"""

from __future__ import annotations

import dagster as dg
from dagster_aws.s3 import S3Resource

from dagster_project.assets import SOURCE_ASSETS, persist_shard
from dagster_project.io_manager import PersistIOManager
from dagster_project.resources import (
    LandingZoneResource,
    PersistResource,
    SparkResource,
    spark_config_from_env,
)
from dagster_project.revenue import IO_MANAGER_KEY, REVENUE_ASSETS, REVENUE_JOBS
from jobs import JOBS, SCHEDULES
from sensors import SENSORS


def build_resources(
    *,
    persist: PersistResource | None = None,
    spark: SparkResource | None = None,
    landing: LandingZoneResource | None = None,
    persist_io: PersistIOManager | None = None,
) -> dict[str, object]:
    """The resources of the code location (environment defaults, overridable; the keys
    are the resource keys, so ``build_defs(**build_resources(...))`` round-trips)."""
    persist = persist or PersistResource()
    return {
        "persist": persist,
        # Assets of users stored in persist (the demo's revenue assets; docs/dagster.md).
        IO_MANAGER_KEY: persist_io or PersistIOManager(persist=persist),
        "spark": spark or SparkResource(spark_config=spark_config_from_env()),
        "landing": landing or LandingZoneResource(s3=S3Resource()),
    }


def build_defs(**resources: object) -> dg.Definitions:
    """``Definitions`` with the given resource overrides (tests, scripts)."""
    assets: list[object] = [persist_shard, *REVENUE_ASSETS]
    checks: list[dg.AssetChecksDefinition] = []
    for sa in SOURCE_ASSETS.values():
        assets += sa.assets()
        checks += sa.checks
    return dg.Definitions(
        # One process per run for every job, the implicit ``__ASSET_JOB`` of the UI's
        # Materialize included (one Spark session, no process per step).
        executor=dg.in_process_executor,
        assets=assets,  # type: ignore[arg-type]
        asset_checks=checks,
        jobs=[*JOBS, *REVENUE_JOBS],
        schedules=SCHEDULES,
        sensors=SENSORS,
        resources=build_resources(**resources),  # type: ignore[arg-type]
    )


defs = build_defs()
