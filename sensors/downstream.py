"""Asset sensors for downstream work: ``<src>_summary`` after each good ``<src>``.

Each new materialization of the collection asset ``<src>`` launches ``<src>_summary_job``
once (``run_key`` = the materialization's storage id) **after its run succeeded**: the
GE checks on ``<src>`` are blocking, and they run after the materialization is recorded.
``@asset_sensor`` always advances its cursor past the latest materialization, so it
can't wait for a run that is still checking; this sensor reads the materializations
itself (``instance.fetch_materializations``) and keeps its cursor (a storage id) before
the first one whose run has not finished. Materializations of failed runs (a blocking
check failed) are skipped, and so are those of ingestions that appended nothing to the
collection (metadata ``updates_appended`` = 0: a 0-record ingestion, or one whose
records all failed to decode): its contents did not change, so a summary would be the
same. Materializations without that entry (a handover recorded by a rendition backfill,
whose rebuilt rendition may decode differently) do launch it. And a materialization only
counts once its run evaluated and passed the collection's blocking check
(``<src>/ge_contents``): a rendition backfill validates the rebuilt rendition before the
handover and records that evaluation in its run, so nothing downstream runs on a
rendition nobody checked.
"""

from __future__ import annotations

from collections.abc import Sequence

import dagster as dg
from dagster._core.storage.asset_check_execution_record import AssetCheckExecutionRecordStatus

from dagster_project.assets import SOURCE_ASSETS
from dagster_project.rendition_check import CHECK_NAME
from jobs.ingestion import SUMMARY_JOBS


def changed_contents(rec: dg.EventLogRecord) -> bool:
    """Whether a materialization of a collection may have changed its contents: not an
    ingestion that appended no update (``updates_appended`` = 0)."""
    mat = rec.asset_materialization
    if mat is None:
        return True
    appended = mat.metadata.get("updates_appended")
    if appended is None or not isinstance(appended.value, int | float):
        return True
    return int(appended.value) != 0


def checked_runs(instance: dg.DagsterInstance, checks: Sequence[dg.AssetCheckKey], limit: int = 200) -> set[str]:
    """The runs in which every check of ``checks`` was evaluated and passed (its latest
    evaluation in that run), among each check's ``limit`` latest executions."""
    runs: set[str] | None = None
    for key in checks:
        passed: dict[str, bool] = {}
        for rec in instance.event_log_storage.get_asset_check_execution_history(key, limit=limit):
            if rec.run_id in passed:  # sorted by recency: the first one is the latest
                continue
            passed[rec.run_id] = rec.status == AssetCheckExecutionRecordStatus.SUCCEEDED
        good = {run for run, ok in passed.items() if ok}
        runs = good if runs is None else runs & good
    return runs or set()


def build_downstream_sensor(
    upstream: dg.AssetKey,
    job: dg.UnresolvedAssetJobDefinition | dg.JobDefinition,
    *,
    name: str,
    minimum_interval_seconds: int = 30,
    limit: int = 100,
    blocking_checks: Sequence[dg.AssetCheckKey] = (),
) -> dg.SensorDefinition:
    """An asset sensor launching ``job`` after each successful materialization of
    ``upstream`` whose run evaluated and passed every check of ``blocking_checks``."""

    @dg.sensor(
        name=name,
        job=job,
        minimum_interval_seconds=minimum_interval_seconds,
        default_status=dg.DefaultSensorStatus.RUNNING,
        description=f"Launches {job.name} after each materialization of "
        f"{upstream.to_user_string()} whose checks passed.",
    )
    def _sensor(context: dg.SensorEvaluationContext) -> dg.SensorResult:
        after = int(context.cursor) if context.cursor else None
        records = context.instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=upstream, after_storage_id=after),
            limit=limit,
            ascending=True,
        ).records
        cursor = after
        latest_good = None
        skipped = unchecked = unchanged = 0
        passed = checked_runs(context.instance, blocking_checks) if blocking_checks else set()
        for rec in records:
            run = context.instance.get_run_by_id(rec.run_id)
            if run is not None and not run.is_finished:
                break  # wait: its blocking checks may still fail
            cursor = rec.storage_id
            if run is not None and not run.is_success:
                skipped += 1
            elif blocking_checks and rec.run_id not in passed:
                unchecked += 1  # e.g. a rebuilt rendition nobody validated
            elif not changed_contents(rec):
                unchanged += 1  # nothing appended: the summary would be the same
            else:
                latest_good = rec
        requests = []
        if latest_good is not None:  # one run covers every good materialization before it
            requests.append(
                dg.RunRequest(
                    run_key=f"{upstream.to_user_string()}:{latest_good.storage_id}",
                    tags={"persist/upstream_run": latest_good.run_id},
                )
            )
        return dg.SensorResult(
            run_requests=requests,
            skip_reason=None
            if requests
            else f"no new successful materialization of {upstream.to_user_string()} that "
            "changed it"
            + (f"; {skipped} from failed runs skipped" if skipped else "")
            + (f"; {unchecked} whose blocking checks did not run and pass skipped" if unchecked else "")
            + (f"; {unchanged} that appended nothing skipped" if unchanged else ""),
            cursor=str(cursor) if cursor is not None else None,
        )

    return _sensor


DOWNSTREAM_SENSORS = {
    name: build_downstream_sensor(
        sa.collection_key,
        SUMMARY_JOBS[name],
        name=f"{name}_summary_sensor",
        blocking_checks=[dg.AssetCheckKey(sa.collection_key, CHECK_NAME)],
    )
    for name, sa in SOURCE_ASSETS.items()
}
