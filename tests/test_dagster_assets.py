"""Dagster assets and checks against the embedded default location (a temp PERSIST_HOME).

Each asset is materialized in-process with a temporary Dagster instance and its metadata
(upper, since, batches, bytes, records appended, source frontier and lag, the spine as
markdown) is checked; the GE check passes on good data and fails (blocking) on bad data;
a rendition backfill hands over while a collection reader keeps one consistent
collection.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import dagster as dg
import pandas as pd
import pytest

from dagster_project.assets import SOURCE_ASSETS, persist_shard
from dagster_project.checks import validate_frame
from dagster_project.definitions import defs
from dagster_project.resources import PersistResource
from dagster_project.sample import order_rows, write_orders_file
from dagster_project.sources import ORDERS

pytestmark = pytest.mark.dagster
pytest_plugins = ["tests.dagster_fixtures"]

ORDERS_ASSETS = SOURCE_ASSETS["orders"]


@pytest.fixture
def landing_dir(home: Path) -> Path:
    return home / "landing" / "orders"


def ingest(resources: dict[str, object], instance: dg.DagsterInstance, **kw: object):
    return dg.materialize(
        [ORDERS_ASSETS.ingest, *ORDERS_ASSETS.checks],
        resources=resources,
        instance=instance,
        **kw,  # type: ignore[arg-type]
    )


def metadata_of(res: dg.ExecuteInProcessResult, key: str) -> dict[str, object]:
    mats = [m for m in res.get_asset_materialization_events() if m.asset_key == dg.AssetKey(key)]
    assert mats, f"no materialization of {key}"
    return {k: v.value for k, v in mats[-1].materialization.metadata.items()}


def check_results(res: dg.ExecuteInProcessResult) -> dict[str, dg.AssetCheckEvaluation]:
    return {e.check_name: e for e in res.get_asset_check_evaluations()}


def test_definitions_load() -> None:
    dg.Definitions.validate_loadable(defs)
    jobs = {j.name for j in defs.resolve_all_job_defs()}
    assert {
        "ingest_orders_job",
        "orders_rendition_job",
        "orders_summary_job",
        "compaction_job",
        "gc_job",
        "lease_expiry_job",
        "txn_maintenance_job",
    } <= jobs
    assert {s.name for s in defs.schedules} == {"gc_schedule", "lease_expiry_schedule", "txn_maintenance_schedule"}
    assert {s.name for s in defs.sensors} == {
        "orders_arrival_sensor",
        "compaction_debt_sensor",
        "orders_summary_sensor",
    }
    keys = {k.to_user_string() for k in defs.resolve_asset_graph().get_all_asset_keys()}
    assert {
        "orders_landing",
        "orders_remap",
        "orders_raw",
        "orders",
        "orders_errors",
        "orders_rendition",
        "orders_summary",
        "persist_shard",
    } <= keys
    # The GE check on the collection is blocking; the decode-errors check only warns.
    checks = {c.name: c for c in defs.resolve_asset_graph().asset_check_keys}
    assert "ge_contents" in checks and "no_decode_errors" in checks


def test_ingestion_materializes_with_metadata(
    resources: dict[str, object], instance: dg.DagsterInstance, landing_dir: Path
) -> None:
    write_orders_file(landing_dir, 0, 300)
    write_orders_file(landing_dir, 1, 300, bad_rows=2)
    res = ingest(resources, instance)
    assert res.success
    data = metadata_of(res, "orders")
    assert data["records_appended"] == 602
    assert data["num_shards"] == 4 and data["rendition"] == "r0"
    assert isinstance(data["upper"], int) and data["upper"] > 0
    assert isinstance(data["since"], int)
    # the upper is a time in ms since the epoch: also a Dagster timestamp (seconds)
    (mat,) = [m.materialization for m in res.get_asset_materialization_events() if m.asset_key == dg.AssetKey("orders")]
    assert isinstance(mat.metadata["upper_time"], dg.TimestampMetadataValue)
    assert data["upper_time"] == data["upper"] / 1000
    assert ("since_time" in data) == (data["since"] >= 10**11)
    assert data["batches"] >= 4 and data["bytes"] > 0 and data["updates"] > 0
    assert "orders-000001.jsonl" in str(data["source_frontier"])
    assert data["lag_bytes"] == 0 and isinstance(data["lag_ms"], int)
    assert str(data["spine"]).startswith("| # | shard |") and str(data["spine"]).count("\n") == 5
    remap = metadata_of(res, "orders_remap")
    assert remap["bindings_applied"] >= 1 and remap["upper"] == data["upper"]
    assert remap["upper_time"] == data["upper_time"]
    assert "| batch | level |" in str(remap["spine"])
    raw = metadata_of(res, "orders_raw")
    assert raw["updates"] == 602 and raw["records_appended"] == 602
    errors = metadata_of(res, "orders_errors")
    assert errors["errors_appended"] == 2
    checks = check_results(res)
    assert checks["ge_contents"].passed
    assert checks["ge_contents"].metadata["rows"].value > 0
    assert not checks["no_decode_errors"].passed  # WARN only: the run still succeeded
    assert checks["no_decode_errors"].severity == dg.AssetCheckSeverity.WARN
    # Partitions for the UI: the collection's renditions and shards.
    assert instance.get_dynamic_partitions("orders_renditions") == ["r0"]
    assert len(instance.get_dynamic_partitions("persist_shards")) == 5

    # A second run appends only what landed since.
    write_orders_file(landing_dir, 2, 100)
    res2 = ingest(resources, instance)
    assert metadata_of(res2, "orders")["records_appended"] == 100
    assert metadata_of(res2, "orders")["upper"] > data["upper"]


def test_ge_check_blocks_bad_data(
    resources: dict[str, object], instance: dg.DagsterInstance, landing_dir: Path
) -> None:
    bad = [
        {"order_id": 1, "customer": "alice", "amount": 10.0, "status": "new"},
        {"order_id": 2, "customer": "bob", "amount": -5.0, "status": "new"},  # out of range
        {"order_id": 3, "customer": None, "amount": 3.0, "status": "paid"},  # null customer
    ]
    write_orders_file(landing_dir, 0, 0, rows=bad)
    res = dg.materialize(
        [ORDERS_ASSETS.ingest, *ORDERS_ASSETS.checks, ORDERS_ASSETS.summary],
        resources=resources,
        instance=instance,
        raise_on_error=False,
    )
    assert not res.success
    ev = check_results(res)["ge_contents"]
    assert not ev.passed and ev.severity == dg.AssetCheckSeverity.ERROR
    failed = {f["expectation"] for f in ev.metadata["failures"].value}
    assert failed == {"expect_column_values_to_be_between", "expect_column_values_to_not_be_null"}
    # Blocking: the downstream asset did not run.
    assert not [
        m
        for m in res.get_asset_materialization_events()
        if m.asset_key == dg.AssetKey("orders_summary")
    ]


def test_ge_validation_pass_and_fail() -> None:
    good = pd.DataFrame(
        {
            "order_id": [1, 2, 3],
            "customer": ["a", "b", "c"],
            "amount": [1.0, 2.5, 999.0],
            "status": ["new", "paid", "new"],
            "ts": [5, 5, 5],
            "diff": [1, 1, 1],
        }
    )
    assert validate_frame(good, ORDERS.rules).passed
    dup = good.assign(order_id=[1, 1, 3])
    out = validate_frame(dup, ORDERS.rules)
    assert not out.passed
    assert [f["expectation"] for f in out.failures] == ["expect_column_values_to_be_unique"]
    neg = good.assign(diff=[1, -1, 1])
    out = validate_frame(neg, ORDERS.rules)
    assert not out.passed
    assert out.failures[0]["kwargs"]["column"] == "diff"


def test_summary_and_shard_assets(
    resources: dict[str, object], instance: dg.DagsterInstance, landing_dir: Path
) -> None:
    write_orders_file(landing_dir, 0, 200)
    assert ingest(resources, instance).success
    # The expected summary, from the generator's records: the upsert envelope keeps the
    # last record of each order id.
    latest = {r["order_id"]: r for r in order_rows(0, 200)}
    by_status = Counter(r["status"] for r in latest.values())
    res = dg.materialize(
        [ORDERS_ASSETS.summary], resources=resources, instance=instance, selection=None
    )
    meta = metadata_of(res, "orders_summary")
    assert meta["rows"] == len(latest)
    assert meta["amount_total"] == pytest.approx(sum(r["amount"] for r in latest.values()))
    assert meta["by_status"] == "\n".join(
        ["| status | rows |", "|---|---|"] + [f"| {k} | {by_status[k]} |" for k in sorted(by_status)]
    )

    # The shard asset of the orders data shard: the engine follows from the debt it had
    # (threshold 0: any debt is compacted in process), and the metadata is the shard's.
    persist = resources["persist"]
    assert isinstance(persist, PersistResource)
    with persist.read_only_controller() as ro:
        d = ro.describe("orders")
    shard = d["renditions"][d["active_rendition"]]["shards"][0]
    assert shard in instance.get_dynamic_partitions("persist_shards")
    client = persist.client()
    debt_before = int(client.inspect(shard)["compaction_debt"])
    res = dg.materialize(
        [persist_shard],
        resources=resources,
        instance=instance,
        partition_key=shard,
        run_config={"ops": {"persist_shard": {"config": {"debt_threshold": 0}}}},
    )
    meta = metadata_of(res, "persist_shard")
    after = client.inspect(shard)
    assert meta["shard"] == shard
    assert meta["compaction_engine"] == ("in-process" if debt_before > 0 else "skipped")
    assert meta["compaction_debt_before"] == debt_before
    assert (meta["batches"], meta["bytes"], meta["compaction_debt"]) == (
        after["num_batches"], after["bytes"], after["compaction_debt"]
    )
    assert meta["upper"] == after["upper"][0] and meta["since"] == after["since"][0]
    assert meta["updates"] == after["num_updates"] > 0


def test_rendition_backfill_hands_over_under_a_reader(
    resources: dict[str, object], instance: dg.DagsterInstance, landing_dir: Path
) -> None:
    for b in range(3):
        write_orders_file(landing_dir, b, 150, id_space=200)
    assert ingest(resources, instance).success
    persist = resources["persist"]
    assert isinstance(persist, PersistResource)
    mine = PersistResource(home=persist.home)
    ctl = mine.controller()
    reader = ctl.acquire_read_handle("orders")
    up = ctl.describe("orders")["metadata_upper"][0]
    before = reader.snapshot(up - 1)
    listen = reader.listen(up - 1)

    instance.add_dynamic_partitions("orders_renditions", ["r1"])
    res = dg.materialize(
        [ORDERS_ASSETS.rendition],
        resources=resources,
        instance=instance,
        partition_key="r1",
        run_config={"ops": {"orders_rendition": {"config": {"num_shards": 8}}}},
    )
    assert res.success
    meta = metadata_of(res, "orders_rendition")
    assert meta["rendition"] == "r1" and meta["active_rendition"] == "r1"
    assert meta["num_shards"] == 8 and meta["previous_rendition"] == "r0"
    assert meta["raw_records_replayed"] == 450
    at = meta["handover_at"]
    assert isinstance(at, int) and at >= up

    desc = ctl.describe("orders")
    assert desc["active_rendition"] == "r1"
    assert desc["renditions"]["r1"]["num_shards"] == 8
    # The reader sees one definite collection: the same contents across the hand-over,
    # and its listen emits no spurious change (a re-shard changes no record).
    up2 = desc["metadata_upper"][0]
    after = reader.snapshot(up2 - 1)
    key = ["order_id", "customer", "amount", "status"]
    assert (
        before.drop(["ts"])
        .sort_by([(k, "ascending") for k in key])
        .equals(after.drop(["ts"]).sort_by([(k, "ascending") for k in key]))
    )
    assert reader.active_rendition(at - 1) == "r0" and reader.active_rendition(at) == "r1"
    assert listen.read_until(up2).num_rows == 0
    # The reader holds r0 (it may still read before the hand-over): not collected yet,
    # and not claimed ready either.
    assert desc["renditions"]["r0"]["status"] == "retired"
    reader.expire()
    mine.close()  # a controller keeps a hold on the metadata shard until released
    ctl = mine.controller()
    collected = ctl.collect_renditions("orders")
    assert "r0" in collected.get("orders", {})
    # retired renditions are no longer partitions (neither "Missing" nor green)
    assert instance.get_dynamic_partitions("orders_renditions") == ["r1"]

    # New data after the hand-over goes to r1 and passes the checks.
    write_orders_file(landing_dir, 3, 50, id_space=200)
    res = ingest(resources, instance)
    assert res.success and metadata_of(res, "orders")["rendition"] == "r1"
    assert check_results(res)["ge_contents"].passed
    assert ctl.describe("orders")["renditions"]["r0"]["status"] == "dropped"
    mine.close()


def test_corrupt_part_quarantines_the_merge_fails_the_run_and_shows_in_metadata(
    resources: dict[str, object], instance: dg.DagsterInstance, home: Path
) -> None:
    """Issue 13 defect 3 (Dagster side): a merge that fails on a corrupt part fails the
    compaction run once, with the quarantine in its failure metadata; later runs skip the
    merge (and say so in the materialization metadata) instead of failing forever, and
    the compaction sensor stops asking for runs that have nothing to do."""
    import pyarrow as pa

    from dagster_project.operations import shard_debts
    from persist_lib import ShardId

    client = resources["persist"].client()  # type: ignore[attr-defined]
    shard = str(ShardId.new())
    key, val = pa.schema([("k", pa.int64())]), pa.schema([("v", pa.int64())])
    w, _ = client.open(shard, key, val)
    for t in range(2):
        # Big enough for a part in blob (appends inline parts up to 16 KiB).
        w.compare_and_append([(((i,), (t,)), t, 1) for i in range(8000)], t, t + 1)
    part = next(iter(client.machine(shard).fetch_latest().batches.values())).parts[0]
    assert part.key is not None
    data = client.blob.get(part.key)
    client.raw_blob.set(part.key, data[: len(data) // 2])
    instance.add_dynamic_partitions("persist_shards", [shard])
    run_config = {"ops": {"persist_shard": {"config": {"debt_threshold": 0}}}}
    res = dg.materialize(
        [persist_shard], resources=resources, instance=instance, partition_key=shard,
        run_config=run_config, raise_on_error=False,
    )
    assert not res.success
    (failure,) = res.get_step_failure_events()
    user = failure.step_failure_data.user_failure_data
    assert user is not None and "quarantined" in (user.description or "")
    assert user.metadata["quarantined_merges"].value == 1
    res = dg.materialize(
        [persist_shard], resources=resources, instance=instance, partition_key=shard,
        run_config=run_config,
    )
    meta = metadata_of(res, "persist_shard")
    assert meta["quarantined_merges"] == 1 and "CorruptionError" in str(meta["quarantine"])
    (d,) = [d for d in shard_debts(client) if d.shard == shard]
    assert d.quarantined == 1 and d.pending_merges == 0
