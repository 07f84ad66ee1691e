"""Source-arrival sensors: one per configured source, launching its ingestion job.

The cursor is the name of the last landed file seen (files are ingested in name order).
Each tick lists the files after the cursor; new files make **one** run request whose
``run_key`` is derived from the batch (``<source>:<last new file>``), so re-evaluating
the same arrivals never launches twice, and the returned cursor moves past them.

No run storms: one request per tick at most (the run ingests everything that landed,
not just the files of the request), and none while an ingestion run of the source is
queued or running (the cursor then stays put, so the files are picked up next time).
"""

from __future__ import annotations

import dagster as dg

from dagster_project.assets import SOURCE_ASSETS
from dagster_project.resources import LandingZoneResource
from jobs.ingestion import INGESTION_JOBS
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
    def _sensor(context: dg.SensorEvaluationContext, landing: LandingZoneResource):
        cursor = context.cursor or ""
        files = landing.list_files(source, after=cursor)
        if not files:
            return dg.SensorResult(skip_reason=f"no new files after {cursor!r}", cursor=cursor)
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


ARRIVAL_SENSORS = {
    name: build_arrival_sensor(name, INGESTION_JOBS[name])
    for name, sa in SOURCE_ASSETS.items()
    if sa.spec.kind == "landing_zone"
}
