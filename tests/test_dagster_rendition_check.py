"""Issue 30 item 1: a rendition backfill runs the blocking Great Expectations check on the
rebuilt rendition before the handover.

- a passing check: the backfilled partition's ``orders_rendition/ge_contents`` passed
  on the new rendition at the handover time, and ``orders/ge_contents`` is evaluated (in
  the backfill run) on what ``orders`` reads since the handover; the summary sensor
  launches a run for the handover;
- a failing check (a decoding change that breaks the rules) stops the handover: the old
  rendition stays active, the new one stays ``ready``, the failed check and the refused
  handover are on the asset, the run fails with the reason, and nothing downstream runs;
- the summary sensor ignores a materialization whose run did not evaluate the blocking
  check.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dagster as dg
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from dagster_aws.s3 import S3Resource

from dagster_project.assets import SOURCE_ASSETS, build_source_assets
from dagster_project.definitions import build_resources
from dagster_project.resources import LandingZoneResource, PersistResource, SparkResource
from dagster_project.sample import write_orders_file
from dagster_project.sources import ORDERS
from sensors.downstream import DOWNSTREAM_SENSORS

pytestmark = pytest.mark.dagster

SA = SOURCE_ASSETS["orders"]
RENDITION = dg.AssetKey("orders_rendition")
ORDERS_CHECK = dg.AssetCheckKey(dg.AssetKey("orders"), "ge_contents")
RENDITION_CHECK = dg.AssetCheckKey(RENDITION, "ge_contents")


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for var in ("PERSIST_BLOB_URI", "PERSIST_CONSENSUS_URI", "PERSIST_LANDING_URI"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.delenv("SPARK_MASTER_URL", raising=False)
    h = tmp_path / "persist"
    monkeypatch.setenv("PERSIST_HOME", str(h))
    return h


@pytest.fixture
def resources(home: Path) -> dict[str, object]:
    return build_resources(
        persist=PersistResource(home=str(home)),
        landing=LandingZoneResource(uri=str(home / "landing"), s3=S3Resource()),
        spark=SparkResource(),
    )


@pytest.fixture
def instance(tmp_path: Path) -> Iterator[dg.DagsterInstance]:
    (tmp_path / "dagster").mkdir()
    with dg.instance_for_test(temp_dir=str(tmp_path / "dagster")) as inst:
        yield inst


def summary_sensor(instance: dg.DagsterInstance, cursor: str | None) -> dg.SensorResult:
    with dg.build_sensor_context(instance=instance, cursor=cursor) as ctx:
        result = DOWNSTREAM_SENSORS["orders"](ctx)
    assert isinstance(result, dg.SensorResult)
    return result


def ingest_checked(
    home: Path, resources: dict[str, object], instance: dg.DagsterInstance
) -> tuple[str, int]:
    """Lands and ingests 120 orders (with the checks); returns the summary sensor's cursor
    after the summary run it requests for them, and the rows the check saw."""
    write_orders_file(home / "landing" / "orders", 0, 120)
    res = dg.materialize([SA.ingest, *SA.checks], resources=resources, instance=instance)
    assert res.success
    first = summary_sensor(instance, None)
    assert len(first.run_requests) == 1 and first.cursor
    return first.cursor, int(evaluations(res)[ORDERS_CHECK].metadata["rows"].value)  # type: ignore[arg-type]


def backfill(assets: Any, resources: dict[str, object], instance: dg.DagsterInstance, r: str) -> dg.ExecuteInProcessResult:
    instance.add_dynamic_partitions("orders_renditions", [r])
    return dg.materialize(
        [assets.rendition],
        resources=resources,
        instance=instance,
        partition_key=r,
        run_config={"ops": {"orders_rendition": {"config": {"num_shards": 2}}}},
        raise_on_error=False,
    )


def describe(home: Path) -> dict[str, Any]:
    persist = PersistResource(home=str(home))
    try:
        return persist.controller().describe("orders")
    finally:
        persist.close()


def evaluations(res: dg.ExecuteInProcessResult) -> dict[dg.AssetCheckKey, dg.AssetCheckEvaluation]:
    return {e.asset_check_key: e for e in res.get_asset_check_evaluations()}


def test_backfill_checks_the_new_rendition_before_the_handover(
    home: Path, resources: dict[str, object], instance: dg.DagsterInstance
) -> None:
    cursor, rows = ingest_checked(home, resources, instance)
    res = backfill(SA, resources, instance, "r1")
    assert res.success
    d = describe(home)
    assert d["active_rendition"] == "r1"
    (handover,) = [h for h in d["timeline"] if h["to"] == "r1"]
    ev = evaluations(res)
    on_rendition = ev[RENDITION_CHECK]
    assert on_rendition.passed and on_rendition.blocking
    assert on_rendition.metadata["rendition"].value == "r1"
    assert on_rendition.metadata["as_of"].value == handover["at"]  # what readers see from then
    assert on_rendition.metadata["rows"].value == rows > 0  # the same contents, rebuilt
    on_orders = ev[ORDERS_CHECK]  # the collection's own check: evaluated, not "Not Evaluated"
    assert on_orders.passed and on_orders.metadata["rendition"].value == "r1"
    latest = instance.event_log_storage.get_latest_asset_check_execution_by_key([ORDERS_CHECK])
    assert latest[ORDERS_CHECK].run_id == res.run_id
    # the summary runs on the checked rendition: one request, for the handover
    after = summary_sensor(instance, cursor)
    assert len(after.run_requests) == 1
    assert after.run_requests[0].tags["persist/upstream_run"] == res.run_id


def negative_amounts(t: pa.Table) -> pa.Table:
    """A 'decoding fix' gone wrong: every amount comes out negative."""
    i = t.schema.get_field_index("amount")
    return t.set_column(i, "amount", pc.negate(t.column("amount")))


def test_a_failing_check_stops_the_handover(
    home: Path, resources: dict[str, object], instance: dg.DagsterInstance
) -> None:
    cursor, rows = ingest_checked(home, resources, instance)
    broken = build_source_assets(dataclasses.replace(ORDERS, transform=negative_amounts))
    res = backfill(broken, resources, instance, "r1")
    assert not res.success
    d = describe(home)
    assert d["active_rendition"] == "r0"  # nothing was handed over
    assert d["renditions"]["r1"]["status"] == "ready"
    assert [h["to"] for h in d["timeline"]] == ["r0"]
    # the reason is on the asset: the failed blocking check and the partition's metadata
    ev = evaluations(res)
    failed = ev[RENDITION_CHECK]
    assert not failed.passed and failed.blocking
    assert f"expect_column_values_to_be_between(amount): {rows} row(s)" in (failed.description or "")
    assert "not handed over" in (failed.description or "")
    assert ORDERS_CHECK not in ev
    recs = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=RENDITION, asset_partitions=["r1"]), limit=1
    ).records
    meta = recs[0].asset_materialization.metadata  # type: ignore[union-attr]
    assert meta["status"].value == "ready"
    assert str(meta["handover"].value).startswith("refused: orders: rendition 'r1' failed its check")
    (failure,) = res.get_step_failure_events()
    text = failure.step_failure_data.user_failure_data.description  # type: ignore[union-attr]
    assert "failed its check" in text and "'r0' stays active" in text
    # no materialization of orders, nothing downstream
    assert not summary_sensor(instance, cursor).run_requests


def test_summary_sensor_ignores_an_unchecked_materialization(
    home: Path, resources: dict[str, object], instance: dg.DagsterInstance
) -> None:
    cursor, _ = ingest_checked(home, resources, instance)
    write_orders_file(home / "landing" / "orders", 1, 10)
    # a successful run that materialized orders without evaluating its blocking check
    assert dg.materialize([SA.ingest], resources=resources, instance=instance).success
    r = summary_sensor(instance, cursor)
    assert not r.run_requests
    assert r.skip_reason is not None and "blocking checks did not run" in (r.skip_reason.skip_message or "")
    assert r.cursor is not None and int(r.cursor) > int(cursor)


def test_commands_report_the_since_a_reader_gets_after_a_handover(
    home: Path, resources: dict[str, object], instance: dg.DagsterInstance
) -> None:
    """Issue 30 item 2: ``persist collections`` reported the active rendition's since
    while ``AS OF`` a later time failed: after a handover (with a reader holding the old
    rendition, then GC) the collection's history starts at the handover. Every command
    and the Dagster metadata now report the since ``AS OF`` actually has."""
    import json
    import os
    import re
    import subprocess
    import sys

    ingest_checked(home, resources, instance)
    holder = PersistResource(home=str(home))
    reader = holder.controller().acquire_read_handle("orders")  # like `persist tail orders`
    assert backfill(SA, resources, instance, "r1").success
    reader.expire()
    holder.close()
    persist = PersistResource(home=str(home))
    persist.controller().collect_renditions("orders")  # what gc_job does
    persist.close()

    env = {k: v for k, v in os.environ.items() if not k.startswith("PERSIST_")}
    env.update(PERSIST_HOME=str(home), PYTHONPATH=str(Path(__file__).resolve().parents[1]))

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "persist_lib.cli.main", *args],
            env=env, capture_output=True, text=True, timeout=120,
        )

    d = json.loads(cli("describe", "orders", "--json").stdout)
    since = d["readable_since"]
    (handover,) = [h for h in d["timeline"] if h["to"] == "r1"]
    assert since == handover["at"] + 1  # what the handover costs: history before it
    assert d["renditions"]["r1"]["since"] == [0]  # although r1's shards hold raw times
    # `persist collections` shows that since, and AS OF it works while one before fails
    table = cli("collections").stdout
    row = next(ln for ln in table.splitlines() if ln.startswith("orders "))
    assert re.search(rf"\b{since}\b", row), table
    ok = cli("sql", "--json", f"SELECT count(*) AS n FROM orders AS OF {since}")  # noqa: S608
    assert ok.returncode == 0 and json.loads(ok.stdout)[0]["n"] > 0, ok.stderr
    bad = cli("sql", "--json", f"SELECT count(*) AS n FROM orders AS OF {since - 1}")  # noqa: S608
    assert bad.returncode != 0 and "Traceback" not in bad.stderr
    assert "readable" in bad.stderr and str(since) in bad.stderr, bad.stderr
    text = cli("describe", "orders").stdout
    assert re.search(rf"readable since\s+{since}\b", text), text
    # the UI: the orders asset's since (recorded by the next ingestion) is that one too
    write_orders_file(home / "landing" / "orders", 1, 5)
    assert dg.materialize([SA.ingest, *SA.checks], resources=resources, instance=instance).success
    now = json.loads(cli("describe", "orders", "--json").stdout)["readable_since"]
    recs = instance.fetch_materializations(dg.AssetKey("orders"), limit=1, ascending=False).records
    meta = recs[0].asset_materialization.metadata  # type: ignore[union-attr]
    assert meta["since"].value == now == meta["readable_since"].value
    assert now >= since > d["renditions"]["r1"]["since"][0]
