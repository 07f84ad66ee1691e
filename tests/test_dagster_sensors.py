"""Sensors and schedules: source arrivals, compaction debt, downstream work, GC, leases,
txn maintenance; and the insert job.

Sensors are evaluated directly with ``build_sensor_context`` against a temporary
instance; schedules with ``evaluate_tick(build_schedule_context(...))``; the maintenance
jobs they launch run in-process against a temp PERSIST_HOME.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import dagster as dg
import pyarrow as pa
import pytest

from dagster_project.assets import SOURCE_ASSETS, persist_shard
from dagster_project.resources import PersistResource
from dagster_project.sample import write_orders_file
from jobs.maintenance import (
    compaction_job,
    gc_job,
    gc_schedule,
    lease_expiry_job,
    lease_expiry_schedule,
)
from persist_lib import PersistClient, ShardId
from persist_lib.config import PersistConfig
from sensors.arrival import ARRIVAL_SENSORS
from sensors.compaction import build_compaction_debt_sensor
from sensors.downstream import DOWNSTREAM_SENSORS

pytestmark = pytest.mark.dagster
pytest_plugins = ["tests.dagster_fixtures"]


def evaluate(
    sensor: dg.SensorDefinition,
    instance: dg.DagsterInstance,
    resources: dict[str, object],
    cursor: str | None,
) -> dg.SensorResult:
    with dg.build_sensor_context(instance=instance, cursor=cursor, resources=resources) as ctx:
        result = sensor(ctx)
    assert isinstance(result, dg.SensorResult)
    return result


def test_arrival_sensor_one_request_per_new_batch(
    home: Path, resources: dict[str, object], instance: dg.DagsterInstance
) -> None:
    sensor = ARRIVAL_SENSORS["orders"]
    landing = home / "landing" / "orders"
    r = evaluate(sensor, instance, resources, None)
    assert not r.run_requests and r.cursor == ""  # nothing landed (the zone doesn't exist)

    write_orders_file(landing, 0, 10)
    write_orders_file(landing, 1, 10)
    (landing / ".orders-000002.jsonl.tmp").write_text("{}\n")  # being written: ignored
    r1 = evaluate(sensor, instance, resources, None)
    assert len(r1.run_requests) == 1
    req = r1.run_requests[0]
    assert req.run_key == "orders:orders-000001.jsonl"
    assert req.tags["persist/files"] == "2"
    assert r1.cursor == "orders-000001.jsonl"
    # Re-evaluating with the returned cursor: nothing new, no request, cursor kept.
    r2 = evaluate(sensor, instance, resources, r1.cursor)
    assert not r2.run_requests and r2.cursor == r1.cursor
    # The same arrivals evaluated again from scratch give the same run key (dedup).
    assert evaluate(sensor, instance, resources, None).run_requests[0].run_key == req.run_key
    # A new arrival: exactly one new request.
    write_orders_file(landing, 2, 10)
    r3 = evaluate(sensor, instance, resources, r2.cursor)
    assert [q.run_key for q in r3.run_requests] == ["orders:orders-000002.jsonl"]
    assert r3.cursor == "orders-000002.jsonl"
    assert not evaluate(sensor, instance, resources, r3.cursor).run_requests


def test_arrival_sensor_waits_for_a_running_ingestion(
    home: Path, resources: dict[str, object], instance: dg.DagsterInstance
) -> None:
    write_orders_file(home / "landing" / "orders", 0, 10)
    instance.add_run(
        dg.DagsterRun(
            job_name="ingest_orders_job", run_id="r-running", status=dg.DagsterRunStatus.STARTED
        )
    )
    r = evaluate(ARRIVAL_SENSORS["orders"], instance, resources, "")
    assert not r.run_requests and r.cursor == ""  # picked up on a later tick


def test_arrival_sensor_skips_files_a_manual_ingestion_took(
    home: Path, resources: dict[str, object], instance: dg.DagsterInstance
) -> None:
    """Issue 30 item 3: after ``dagster job launch -j ingest_orders_job`` took a new file,
    the sensor (cursor behind) requested a run that ingested 0 records. It judges
    arrivals by what the ingestion bound (the remap frontier), not its cursor alone."""
    sensor = ARRIVAL_SENSORS["orders"]
    landing = home / "landing" / "orders"
    write_orders_file(landing, 0, 10)
    first = evaluate(sensor, instance, resources, None)
    assert [q.run_key for q in first.run_requests] == ["orders:orders-000000.jsonl"]
    ingest = [SOURCE_ASSETS["orders"].ingest]
    assert dg.materialize(ingest, resources=resources, instance=instance).success  # the sensor's run
    write_orders_file(landing, 1, 4)
    # launched by hand (no sensor involved): ingests the 4 new records
    assert dg.materialize(ingest, resources=resources, instance=instance).success
    persist = PersistResource(home=str(home))
    before = {s: persist.client().inspect(s).get("leased_readers", {}) for s in persist.client().list_shards()}
    r = evaluate(sensor, instance, resources, first.cursor)
    assert not r.run_requests, [q.tags for q in r.run_requests]
    assert r.cursor == "orders-000001.jsonl"
    assert r.skip_reason is not None and "already ingested" in (r.skip_reason.skip_message or "")
    after = {s: persist.client().inspect(s).get("leased_readers", {}) for s in persist.client().list_shards()}
    assert after == before  # the sensor only read: no reader left behind
    # a file that lands afterwards is an arrival again
    write_orders_file(landing, 2, 3)
    r2 = evaluate(sensor, instance, resources, first.cursor)  # even from the stale cursor
    assert [q.run_key for q in r2.run_requests] == ["orders:orders-000002.jsonl"]
    assert r2.run_requests[0].tags["persist/files"] == "1"
    assert r2.cursor == "orders-000002.jsonl"
    persist.close()


def _shard_with_debt(home: Path, appends: int) -> tuple[str, int]:
    """A shard made of ``appends`` one-row batches (no background compaction)."""
    client = PersistClient.default(home, PersistConfig.for_tests())
    key = pa.schema([("k", pa.int64())])
    val = pa.schema([("v", pa.int64())])
    shard = ShardId.new()
    w, r = client.open(shard, key, val)
    for i in range(appends):
        w.compare_and_append([(((i,), (i,)), i, 1)], i, i + 1)
    debt = client.inspect(shard)["compaction_debt"]
    w.expire()
    r.expire()
    client.close()
    return str(shard), int(debt)


def test_compaction_sensor_fires_only_above_threshold(
    home: Path, resources: dict[str, object], instance: dg.DagsterInstance
) -> None:
    shard, debt = _shard_with_debt(home, 40)
    assert debt > 0
    quiet = build_compaction_debt_sensor(threshold=debt, name="quiet")
    r = evaluate(quiet, instance, resources, None)
    assert not r.run_requests
    assert r.dynamic_partitions_requests  # the shard becomes a partition anyway

    loud = build_compaction_debt_sensor(threshold=debt - 1, name="loud")
    r = evaluate(loud, instance, resources, None)
    assert [q.partition_key for q in r.run_requests] == [shard]
    req = r.run_requests[0]
    assert req.run_key is not None and req.run_key.startswith(f"compact-{shard}-")
    assert r.cursor and shard in r.cursor

    # Run the requested compaction (the job materializes the shard's partition).
    instance.add_dynamic_partitions("persist_shards", [shard])
    job = dg.Definitions(
        assets=[persist_shard], jobs=[compaction_job], resources=resources
    ).resolve_job_def("compaction_job")
    res = job.execute_in_process(instance=instance, partition_key=shard, run_config=req.run_config)
    assert res.success
    mat = res.get_asset_materialization_events()[0].materialization
    assert mat.metadata["compaction_engine"].value == "in-process"
    assert mat.metadata["compaction_debt"].value <= debt - 1
    assert mat.metadata["batches"].value < 40
    # Below the threshold now: no further request.
    assert not evaluate(loud, instance, resources, r.cursor).run_requests


def test_schedules_launch_gc_and_lease_expiry(
    home: Path, resources: dict[str, object], instance: dg.DagsterInstance
) -> None:
    when = dt.datetime(2026, 1, 1, 12, 17, tzinfo=dt.UTC)
    for schedule, job in ((gc_schedule, gc_job), (lease_expiry_schedule, lease_expiry_job)):
        data = schedule.evaluate_tick(dg.build_schedule_context(scheduled_execution_time=when))
        assert data.run_requests is not None and len(data.run_requests) == 1
        assert schedule.job_name == job.name

    # A reader whose lease lapsed, left behind by a "crashed" process.
    shard, _ = _shard_with_debt(home, 3)
    crashed = PersistClient.default(home, PersistConfig.for_tests(reader_lease_ms=1))
    crashed.open_leased_reader(
        shard, pa.schema([("k", pa.int64())]), pa.schema([("v", pa.int64())])
    )
    crashed.close()
    res = lease_expiry_job.execute_in_process(resources=resources, instance=instance)
    assert res.success
    out = res.output_for_node("expire_leases_op")
    assert out["readers_expired"] == 1 and shard in out["expired"]

    # GC: compaction leaves garbage; GC deletes it and the leak sweep runs.
    client = PersistClient.default(home, PersistConfig.for_tests())
    client.compact(shard)
    garbage = client.inspect(shard)["garbage"]["blobs"]
    client.close()
    res = gc_job.execute_in_process(
        resources=resources,
        instance=instance,
        run_config={"ops": {"collect_garbage_op": {"config": {"grace_period_ms": 0}}}},
    )
    assert res.success
    out = res.output_for_node("collect_garbage_op")
    assert out["shards"] >= 1 and out["errors"] == 0
    assert out["blobs_deleted"] >= garbage
    client = PersistClient.default(home, PersistConfig.for_tests())
    assert client.inspect(shard)["garbage"]["blobs"] == 0
    client.close()


def test_downstream_sensor_waits_for_checks(
    home: Path, resources: dict[str, object], instance: dg.DagsterInstance
) -> None:
    sensor = DOWNSTREAM_SENSORS["orders"]
    sa = SOURCE_ASSETS["orders"]
    r = evaluate(sensor, instance, {}, None)
    assert not r.run_requests
    write_orders_file(home / "landing" / "orders", 0, 20)
    res = dg.materialize([sa.ingest, *sa.checks], resources=resources, instance=instance)
    assert res.success
    r1 = evaluate(sensor, instance, {}, None)
    assert len(r1.run_requests) == 1 and r1.cursor
    assert not evaluate(sensor, instance, {}, r1.cursor).run_requests

    # A run whose blocking check failed: its materialization starts no downstream run.
    write_orders_file(
        home / "landing" / "orders",
        1,
        0,
        rows=[{"order_id": 1, "customer": "x", "amount": -1.0, "status": "new"}],
    )
    res = dg.materialize(
        [sa.ingest, *sa.checks], resources=resources, instance=instance, raise_on_error=False
    )
    assert not res.success
    r2 = evaluate(sensor, instance, {}, r1.cursor)
    assert not r2.run_requests and r2.cursor != r1.cursor


def test_no_summary_run_after_an_ingestion_that_appended_nothing(
    home: Path, resources: dict[str, object], instance: dg.DagsterInstance
) -> None:
    """Issue 17 (In the UI): an ingestion with nothing new (0 records) still records a
    materialization of ``orders`` (frontiers, lag), but the summary sensor requests no
    ``orders_summary`` run for it: the collection did not change."""
    sensor = DOWNSTREAM_SENSORS["orders"]
    sa = SOURCE_ASSETS["orders"]
    landing = home / "landing" / "orders"
    write_orders_file(landing, 0, 20)
    assert dg.materialize([sa.ingest, *sa.checks], resources=resources, instance=instance).success
    r1 = evaluate(sensor, instance, {}, None)
    assert len(r1.run_requests) == 1 and r1.cursor

    # nothing landed since: a 0-record ingestion
    res = dg.materialize([sa.ingest, *sa.checks], resources=resources, instance=instance)
    assert res.success
    (mat,) = [
        m.materialization
        for m in res.get_asset_materialization_events()
        if m.asset_key == dg.AssetKey("orders")
    ]
    assert mat.metadata["records_appended"].value == 0
    assert mat.metadata["updates_appended"].value == 0
    r2 = evaluate(sensor, instance, {}, r1.cursor)
    assert not r2.run_requests
    assert r2.cursor is not None and int(r2.cursor) > int(r1.cursor)  # moved past it
    assert r2.skip_reason is not None and "appended nothing" in (r2.skip_reason.skip_message or "")
    assert not evaluate(sensor, instance, {}, r2.cursor).run_requests

    # new records: a summary run again (one, for the latest good materialization)
    write_orders_file(landing, 1, 5)
    assert dg.materialize([sa.ingest, *sa.checks], resources=resources, instance=instance).success
    assert dg.materialize([sa.ingest, *sa.checks], resources=resources, instance=instance).success
    r3 = evaluate(sensor, instance, {}, r2.cursor)
    assert len(r3.run_requests) == 1
    key = r3.run_requests[0].run_key or ""
    recs = instance.fetch_materializations(dg.AssetKey("orders"), limit=10).records
    appended = {
        rec.storage_id: rec.asset_materialization.metadata["updates_appended"].value
        for rec in recs
        if rec.asset_materialization is not None
    }
    newest_good = max(sid for sid, n in appended.items() if n)
    assert appended[max(appended)] == 0  # the newest one appended nothing ...
    assert key == f"orders:{newest_good}"  # ... the run is for the one that did


def test_txn_maintenance_schedule_finishes_a_dead_committers_transaction(
    home: Path, resources: dict[str, object], instance: dg.DagsterInstance
) -> None:
    from jobs.maintenance import txn_maintenance_job, txn_maintenance_schedule
    from persist_lib.storage import StorageController

    when = dt.datetime(2026, 1, 1, 12, 20, tzinfo=dt.UTC)
    data = txn_maintenance_schedule.evaluate_tick(dg.build_schedule_context(scheduled_execution_time=when))
    assert data.run_requests is not None and len(data.run_requests) == 1
    assert txn_maintenance_schedule.job_name == txn_maintenance_job.name

    # A committer that stopped right after its commit CAS: committed, applied nowhere.
    client = PersistClient.default(home, PersistConfig.for_tests())
    ctl = StorageController(client)
    ctl.create_collection("t", pa.schema([("k", pa.int64())]), pa.schema([("v", pa.string())]), 2)
    ctl.txns.ensure_applied = lambda *a, **k: 0  # type: ignore[method-assign]
    ctl.open_writer("t").compare_and_append([(((k,), ("a",)), 0, 1) for k in range(8)], 0, 1)
    shards = ctl.describe("t")["renditions"]["r0"]["shards"]
    assert len(ctl.txns.log.read().pending) == 2
    assert all(client.machine(s).fetch_latest().upper.time == 0 for s in shards)
    res = txn_maintenance_job.execute_in_process(resources=resources, instance=instance)
    assert res.success
    out = res.output_for_node("finish_transactions_op")
    assert out["applied"] == 2 and out["tidied"] == 2 and out["pending"] == 0
    assert all(client.machine(s).fetch_latest().upper.time == 1 for s in shards)
    again = txn_maintenance_job.execute_in_process(resources=resources, instance=instance)
    assert again.output_for_node("finish_transactions_op")["applied"] == 0  # idempotent
    client.close()


TK = pa.schema([("k", pa.int64())])
TV = pa.schema([("v", pa.string())])


def _insert_run(home: Path, instance: dg.DagsterInstance, rows: dict) -> dg.ExecuteInJobResult:
    from jobs.insert import insert_job

    return insert_job.execute_in_process(
        resources={"persist": PersistResource(home=str(home))}, instance=instance,
        run_config={"ops": {"insert_rows_op": {"config": {"rows": rows}}}}, raise_on_error=False,
    )


def test_insert_job_writes_two_collections_at_one_time(home: Path, instance: dg.DagsterInstance) -> None:
    from persist_lib.storage import StorageController

    with StorageController(PersistClient.default(home, PersistConfig.for_tests())) as ctl:
        ctl.create_collection("a", TK, TV, num_shards=3)
        ctl.create_collection("b", TK, TV, num_shards=2)
        ctl.create_collection("plain", TK, TV)  # one shard: not transactional
    res = _insert_run(home, instance, {"a": [{"k": i, "v": f"a{i}"} for i in range(5)], "b": [{"k": 1, "v": "b"}]})
    assert res.success
    out = res.output_for_node("insert_rows_op")
    assert out["rows"] == {"a": 5, "b": 1}
    t = out["time"]
    bad = _insert_run(home, instance, {"a": [{"k": 9, "v": "x"}], "plain": [{"k": 1, "v": "y"}]})
    assert not bad.success  # a non-transactional collection in the set: nothing written
    err = bad.get_step_failure_events()[0].step_failure_data.error
    assert err is not None and err.cause is not None and "not transactional" in err.cause.message
    with StorageController(PersistClient.default(home, PersistConfig.for_tests())) as ctl:
        for name, want in (("a", {(i, f"a{i}") for i in range(5)}), ("b", {(1, "b")})):
            r = ctl.acquire_read_handle(name)
            assert {(x["k"], x["v"]) for x in r.snapshot(t).to_pylist() if x["diff"] == 1} == want
            r.expire()
        assert ctl.open_writer("a").upper.time == t + 1  # the refused run wrote nothing
