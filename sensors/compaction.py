"""The compaction-debt sensor: compacts shards whose debt passes a threshold.

Each tick inspects every live shard (``operations.shard_debts``) and requests one run of
``compaction_job`` (partition = shard id) per shard whose ``compaction_debt`` is above the
threshold. New shards become partitions in the same tick (``dynamic_partitions_requests``),
each with a materialization saying what it is (collection / rendition / shard i of n:
``partition_sync``); finalized shards stop being partitions. The sensor only reads: a
read-only STORAGE controller (nothing left registered), and a location that does not
exist yet is a skip, not a reason to create one.

No run storms:
- the run key is ``compact-<shard>-<seqno>``: the same shard state never launches twice,
  and a compaction that reduced the debt below the threshold stops further requests;
- a shard with a compaction run still queued or running is skipped;
- at most ``max_runs_per_tick`` requests per tick (largest debt first).

The cursor (JSON ``{shard: seqno requested}``) records what was requested, for the UI and
``dagster sensor cursor``; correctness relies on the run keys.
"""

import json
import os

import dagster as dg

from dagster_project.operations import shard_debts
from dagster_project.partition_sync import PartitionSync, catalog_directory, plan_shard_partitions
from dagster_project.partitions import shard_partitions
from dagster_project.resources import PersistResource
from dagster_project.sources import SOURCES
from jobs.maintenance import compaction_job
from persist_lib.location.redaction import SensitiveUrl

DEFAULT_DEBT_THRESHOLD = int(os.environ.get("PERSIST_COMPACTION_DEBT_THRESHOLD", "4096"))
IN_FLIGHT = [
    dg.DagsterRunStatus.QUEUED,
    dg.DagsterRunStatus.NOT_STARTED,
    dg.DagsterRunStatus.STARTING,
    dg.DagsterRunStatus.STARTED,
]


def compaction_in_flight(instance: dg.DagsterInstance, shard: str) -> bool:
    """True if a compaction run for ``shard`` is queued or running."""
    runs = instance.get_runs(
        filters=dg.RunsFilter(
            job_name=compaction_job.name,
            statuses=IN_FLIGHT,
            tags={"dagster/partition": shard},
        ),
        limit=1,
    )
    return bool(runs)


def build_compaction_debt_sensor(
    threshold: int = DEFAULT_DEBT_THRESHOLD,
    *,
    name: str = "compaction_debt_sensor",
    max_runs_per_tick: int = 8,
    minimum_interval_seconds: int = 60,
) -> dg.SensorDefinition:
    """A sensor requesting compaction of shards whose debt is above ``threshold``."""

    @dg.sensor(
        name=name,
        job=compaction_job,
        minimum_interval_seconds=minimum_interval_seconds,
        default_status=dg.DefaultSensorStatus.RUNNING,
        description=f"Compacts shards whose compaction debt exceeds {threshold}.",
    )
    def _sensor(context: dg.SensorEvaluationContext, persist: PersistResource) -> dg.SensorResult:
        previous: dict[str, int] = json.loads(context.cursor) if context.cursor else {}
        if not persist.location_exists():
            return dg.SensorResult(
                skip_reason=f"no persist location at {SensitiveUrl(persist.uris()[1])} yet",
                cursor=context.cursor,
            )
        client = persist.existing_client()
        debts = shard_debts(client)
        known = set(context.instance.get_dynamic_partitions(shard_partitions.name or ""))
        live = {d.shard for d in debts}
        finalized = set(client.list_shards()) - live
        sync = PartitionSync()
        if live - known or finalized & known:
            with persist.read_only_controller() as ro:
                directory = catalog_directory(ro, [s.name for s in SOURCES])
            plan_shard_partitions(sync, known, directory, live, finalized)
        # A shard whose only pending merges are quarantined has nothing to run.
        over = sorted(
            (d for d in debts if d.debt > threshold and d.pending_merges > 0), key=lambda d: -d.debt
        )
        requests: list[dg.RunRequest] = []
        for d in over:
            if len(requests) >= max_runs_per_tick:
                break
            if compaction_in_flight(context.instance, d.shard):
                continue
            requests.append(
                dg.RunRequest(
                    run_key=f"compact-{d.shard}-{d.seqno}",
                    partition_key=d.shard,
                    run_config={
                        "ops": {"persist_shard": {"config": {"debt_threshold": threshold}}}
                    },
                    tags={"persist/compaction_debt": str(d.debt)},
                )
            )
        cursor = {s: q for s, q in previous.items() if s in live}
        for r in requests:
            assert r.partition_key is not None
            cursor[r.partition_key] = int(r.run_key.rsplit("-", 1)[1]) if r.run_key else 0
        return dg.SensorResult(
            run_requests=requests,
            skip_reason=None
            if requests
            else f"no shard above the compaction-debt threshold {threshold} with merges to run "
            f"({len(debts)} shards, max debt {max((d.debt for d in debts), default=0)}, "
            f"{sum(d.quarantined for d in debts)} quarantined merge(s))",
            cursor=json.dumps(cursor, sort_keys=True),
            dynamic_partitions_requests=sync.sensor_requests(),
            asset_events=sync.events,
        )

    return _sensor


compaction_debt_sensor = build_compaction_debt_sensor()
