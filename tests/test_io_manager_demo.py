"""The demo's revenue assets in the code location: orders ingested, today's revenue per
status stored through PersistIOManager, and the trend reading it as of the time that
materialization recorded, also after more orders arrived and the day was re-materialized
outside the trend's run."""

import datetime as dt
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dagster as dg
import pytest
from dagster_aws.s3 import S3Resource

from dagster_project.assets import SOURCE_ASSETS
from dagster_project.definitions import build_resources, defs
from dagster_project.resources import LandingZoneResource, PersistResource, SparkResource
from dagster_project.revenue import orders_daily_revenue, orders_revenue_trend, revenue_per_status
from dagster_project.sample import write_orders_file

pytestmark = pytest.mark.dagster


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for var in ("PERSIST_BLOB_URI", "PERSIST_CONSENSUS_URI", "PERSIST_LANDING_URI", "SPARK_MASTER_URL"):
        monkeypatch.delenv(var, raising=False)
    h = tmp_path / "persist"
    monkeypatch.setenv("PERSIST_HOME", str(h))
    return h


@pytest.fixture
def instance(tmp_path: Path) -> Iterator[dg.DagsterInstance]:
    (tmp_path / "dagster").mkdir()
    with dg.instance_for_test(temp_dir=str(tmp_path / "dagster")) as inst:
        yield inst


def _meta(res: dg.ExecuteInProcessResult, key: list[str]) -> dict[str, Any]:
    (ev,) = [e for e in res.get_asset_materialization_events() if e.asset_key == dg.AssetKey(key)]
    return {k: v.value for k, v in ev.materialization.metadata.items()}


def test_the_code_location_registers_the_revenue_assets() -> None:
    keys = {k.to_user_string() for k in defs.resolve_asset_graph().get_all_asset_keys()}
    assert {"demo/orders_daily_revenue", "demo/orders_revenue_trend"} <= keys
    assert "persist_io" in defs.resources


def test_daily_revenue_and_trend_read_as_of_recorded_times(home: Path, instance: dg.DagsterInstance) -> None:
    persist = PersistResource(home=str(home))
    resources = build_resources(
        persist=persist, landing=LandingZoneResource(uri=str(home / "landing"), s3=S3Resource()), spark=SparkResource()
    )
    landing = home / "landing" / "orders"
    ingest = SOURCE_ASSETS["orders"].ingest
    write_orders_file(landing, 0, 60)
    assert dg.materialize([ingest], resources=resources, instance=instance).success
    today = dt.datetime.now(dt.UTC).date().isoformat()
    both = [orders_daily_revenue, orders_revenue_trend]
    r1 = dg.materialize(both, partition_key=today, selection=[orders_daily_revenue], resources=resources, instance=instance)
    assert r1.success
    day1 = _meta(r1, ["demo", "orders_daily_revenue"])
    # the stored rows are the revenue of the orders as of the time the asset read them
    with persist.controller().acquire_read_handle("orders") as r:
        snap = r.snapshot(day1["orders_as_of"])
    want = revenue_per_status(snap.drop_columns(["ts", "diff"]), dt.date.fromisoformat(today))
    with persist.controller().acquire_read_handle("demo.orders_daily_revenue") as r:
        got = r.snapshot(day1["persist/time"]).drop_columns(["ts", "diff"])
    got_rows = got.sort_by("status").to_pylist()
    want_rows = want.sort_by("status").to_pylist()
    assert [(x["day"], x["status"], x["orders"]) for x in got_rows] == [(x["day"], x["status"], x["orders"]) for x in want_rows]
    assert [x["revenue"] for x in got_rows] == pytest.approx([x["revenue"] for x in want_rows])
    assert want.num_rows >= 2
    # more orders arrive; the day is materialized again at a later time
    write_orders_file(landing, 1, 60)
    assert dg.materialize([ingest], resources=resources, instance=instance).success
    r2 = dg.materialize(both, partition_key=today, selection=[orders_daily_revenue], resources=resources, instance=instance)
    day2 = _meta(r2, ["demo", "orders_daily_revenue"])
    assert day2["persist/time"] > day1["persist/time"]
    # the trend reads the day as of the latest recorded materialization
    r3 = dg.materialize(both, selection=[orders_revenue_trend], resources=resources, instance=instance)
    assert r3.success
    trend = _meta(r3, ["demo", "orders_revenue_trend"])
    assert trend["persist/read/demo.orders_daily_revenue"] == day2["persist/time"]
    with persist.controller().acquire_read_handle("demo.orders_revenue_trend") as r:
        rows = r.snapshot(trend["persist/time"]).to_pylist()
    with persist.controller().acquire_read_handle("demo.orders_daily_revenue") as r:
        day_rows = r.snapshot(day2["persist/time"]).to_pylist()
    assert {x["status"]: x["revenue"] for x in rows} == pytest.approx({x["status"]: x["revenue"] for x in day_rows})
    persist.close()
