"""Time travel metadata: what a materialization records, and which time an input reads.

Each materialization records its persist time (``persist/time``: the collection holds the
output exactly as of it) and the collection's upper after the write, and its data version
is that time, so the lineage in the UI shows data versions that are readable times. An
input is read, by default, as of the time its upstream materialization recorded:

* the materialization the same run (or, for a re-execution, the parent run that produced
  the upstream output) recorded for the asset and partitions, when there is one;
* else the latest recorded materialization of each partition read (the largest time).

Or, with input metadata ``persist/as_of: <run id>``, as of the time a given run's
materialization recorded (``time_as_of_run``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import dagster as dg

from dagster_project.io_manager.errors import RunDidNotMaterialize, UnknownAsOfRun
from persist_lib.timefmt import time_text

TIME = "persist/time"
UPPER = "persist/upper"
COLLECTION = "persist/collection"


def data_version(t: int) -> dg.DataVersion:
    return dg.DataVersion(f"persist@{t}")


def output_metadata(
    collection: str, t: int, upper: int, mode: str, counts: dict[str, int], write_id: str,
    handler: str, partitions: str | None, reads: dict[str, int], replayed: bool,
) -> dict[str, Any]:
    md: dict[str, Any] = {
        COLLECTION: collection,
        TIME: dg.MetadataValue.int(t),
        "persist/time_text": time_text(t),
        UPPER: dg.MetadataValue.int(upper),
        "persist/mode": mode,
        "persist/type": handler,
        "persist/write_id": write_id,
        "persist/replayed": replayed,
        **{f"persist/{k}": dg.MetadataValue.int(v) for k, v in counts.items()},
    }
    if partitions is not None:
        md["persist/partitions"] = partitions
    for name, rt in sorted(reads.items()):
        md[f"persist/read/{name}"] = dg.MetadataValue.int(rt)
    return md


def _time_of(record: Any) -> int | None:
    mat = record.event_log_entry.asset_materialization
    if mat is None:
        return None
    v = mat.metadata.get(TIME)
    value = getattr(v, "value", v)
    return int(value) if isinstance(value, int) else None


def _partition_of(record: Any) -> str | None:
    mat = record.event_log_entry.asset_materialization
    return None if mat is None else mat.partition


def time_in_run(
    instance: dg.DagsterInstance, run_id: str, key: dg.AssetKey, partitions: Sequence[str] | None
) -> int | None:
    """The largest persist time run ``run_id`` recorded for ``key`` (and ``partitions``)."""
    res = instance.get_records_for_run(run_id, of_type=dg.DagsterEventType.ASSET_MATERIALIZATION, limit=10_000)
    times = []
    for rec in res.records:
        mat = rec.event_log_entry.asset_materialization
        if mat is None or mat.asset_key != key:
            continue
        if partitions is not None and mat.partition not in partitions:
            continue
        t = _time_of(rec)
        if t is not None:
            times.append(t)
    return max(times) if times else None


def latest_recorded_time(
    instance: dg.DagsterInstance, key: dg.AssetKey, partitions: Sequence[str] | None
) -> int | None:
    """The largest persist time of the latest recorded materialization of each partition
    (of the asset when unpartitioned)."""
    if partitions is None:
        res = instance.fetch_materializations(key, limit=1)
        return _time_of(res.records[0]) if res.records else None
    wanted = set(partitions)
    seen: dict[str, int | None] = {}
    cursor = None
    flt = dg.AssetRecordsFilter(asset_key=key, asset_partitions=list(partitions))
    while len(seen) < len(wanted):
        res = instance.fetch_materializations(flt, limit=1000, cursor=cursor)
        for rec in res.records:
            p = _partition_of(rec)
            if p is not None and p not in seen:
                seen[p] = _time_of(rec)
        if not res.has_more:
            break
        cursor = res.cursor
    times = [t for t in seen.values() if t is not None]
    return max(times) if times else None


def run_lineage(instance: dg.DagsterInstance, run_id: str) -> Iterable[str]:
    """The run and its parents (a re-execution reads what its parent produced)."""
    rid: str | None = run_id
    while rid:
        yield rid
        run = instance.get_run_by_id(rid)
        rid = run.parent_run_id if run is not None else None


def time_as_of_run(
    instance: dg.DagsterInstance, run_id: str, key: dg.AssetKey, partitions: Sequence[str] | None, where: str
) -> int:
    """The persist time run ``run_id`` recorded for ``key`` (the largest of ``partitions``'),
    looked up in the instance's event log; for a re-execution that did not run the
    upstream step, the time its parent run recorded (what that run read). Typed errors
    for a run the instance does not know and a run that recorded no such time."""
    if instance.get_run_by_id(run_id) is None:
        raise UnknownAsOfRun(
            f"{where}: persist/as_of names run {run_id!r}, which this Dagster instance does not know; "
            f"give the id of a run that materialized {key.to_user_string()} (or 'recorded', 'latest' or a persist time)"
        )
    for rid in run_lineage(instance, run_id):
        t = time_in_run(instance, rid, key, partitions)
        if t is not None:
            return t
    which = "" if partitions is None else f" partition(s) {', '.join(partitions[:3])}{'...' if len(partitions) > 3 else ''} of"
    raise RunDidNotMaterialize(
        f"{where}: run {run_id!r} recorded no persist time for{which} {key.to_user_string()} (it did not "
        "materialize it through PersistIOManager); give a run that did, or 'recorded', 'latest' or a persist time"
    )
