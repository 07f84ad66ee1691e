"""Schema changes from Dagster (dagster_project/schema_changes.py, jobs/schema.py).

A source whose schemas change in code: the next ingestion evolves its collections in
place when persist can (new JSON fields land in the new column, old rows read null);
when it can't, the run fails with one typed error and nothing changes, and the
rendition backfill rebuilds under the new schemas and hands over, after which ingestion
goes on. ``evolve_schema_job`` evolves a collection from run config; a bad or
incompatible change fails the run and changes nothing.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import dagster as dg
import pyarrow as pa
import pytest

from dagster_project.assets import build_source_assets
from dagster_project.definitions import defs
from dagster_project.resources import PersistResource
from dagster_project.sample import order_rows, write_orders_file
from dagster_project.schema_changes import SourceSchemaChanged, SourceSchemaNeedsRendition
from dagster_project.sources import ORDERS

pytestmark = pytest.mark.dagster
pytest_plugins = ["tests.dagster_fixtures"]

V2 = pa.schema([*ORDERS.val_schema, pa.field("channel", pa.string())])


def _ingest(spec: object, resources: dict[str, object], instance: dg.DagsterInstance) -> dg.ExecuteInProcessResult:
    sa = build_source_assets(spec)  # type: ignore[arg-type]
    return dg.materialize([sa.ingest], resources=resources, instance=instance, raise_on_error=False)


def _contents(resources: dict[str, object], name: str = "orders") -> pa.Table:
    persist = resources["persist"]
    assert isinstance(persist, PersistResource)
    ctl = persist.controller()
    up = ctl.describe(name)["metadata_upper"][0]
    return ctl.acquire_read_handle(name).snapshot(up - 1).drop(["ts", "diff"]).sort_by("order_id")


def _error_text(res: dg.ExecuteInProcessResult) -> str:
    failures = [e for e in res.all_events if e.is_step_failure]
    assert failures, "the run did not fail"
    err = failures[0].step_failure_data.error
    parts = []
    while err is not None:  # Dagster wraps the op's exception: follow the causes
        parts.append(f"{err.cls_name}: {err.message}")
        err = err.cause
    return "\n".join(parts)


def test_a_compatible_change_in_code_evolves_on_the_next_ingestion(
    resources: dict[str, object], instance: dg.DagsterInstance, home: Path
) -> None:
    landing = home / "landing" / "orders"
    write_orders_file(landing, 0, 40, id_space=1000)
    assert _ingest(ORDERS, resources, instance).success
    first = _contents(resources)

    rows = [dict(r, order_id=5000 + i, channel="web") for i, r in enumerate(order_rows(1, 30))]
    write_orders_file(landing, 1, 0, rows=rows)
    v2 = dataclasses.replace(ORDERS, val_schema=V2)
    res = _ingest(v2, resources, instance)
    assert res.success

    persist = resources["persist"]
    assert isinstance(persist, PersistResource)
    assert persist.controller().schema("orders")["version"] == 1
    after = _contents(resources)
    assert after.schema.names == ["order_id", "customer", "amount", "status", "channel"]
    old = after.filter(pa.compute.less(after["order_id"], 5000))
    new = after.filter(pa.compute.greater_equal(after["order_id"], 5000))
    assert old.num_rows == first.num_rows and old["channel"].null_count == old.num_rows
    assert old.drop(["channel"]).equals(first)
    assert new.num_rows == 30 and set(new["channel"].to_pylist()) == {"web"}

    # The same declaration again changes nothing; the old declaration is now refused.
    assert _ingest(v2, resources, instance).success
    assert persist.controller().schema("orders")["version"] == 1
    stale = _ingest(ORDERS, resources, instance)
    assert not stale.success and "IngestSchemaStale" in _error_text(stale)


def test_on_schema_change_fail_stops_the_run_and_changes_nothing(
    resources: dict[str, object], instance: dg.DagsterInstance, home: Path
) -> None:
    write_orders_file(home / "landing" / "orders", 0, 20)
    assert _ingest(ORDERS, resources, instance).success
    strict = dataclasses.replace(ORDERS, val_schema=V2, on_schema_change="fail")
    res = _ingest(strict, resources, instance)
    assert not res.success
    text = _error_text(res)
    assert SourceSchemaChanged.__name__ in text and "evolve_schema_job" in text
    persist = resources["persist"]
    assert isinstance(persist, PersistResource)
    assert persist.controller().schema("orders")["version"] == 0


def test_an_incompatible_change_needs_a_rendition_backfill_which_hands_over(
    resources: dict[str, object], instance: dg.DagsterInstance, home: Path
) -> None:
    landing = home / "landing" / "orders"
    write_orders_file(landing, 0, 30, id_space=1000)
    assert _ingest(ORDERS, resources, instance).success
    persist = resources["persist"]
    assert isinstance(persist, PersistResource)
    before = persist.controller().describe("orders")

    # amount float64 -> float32 (narrowing) can't be made in place.
    v = pa.schema([pa.field("customer", pa.string()), pa.field("amount", pa.float32()), pa.field("status", pa.string())])
    changed = dataclasses.replace(ORDERS, val_schema=v)
    res = _ingest(changed, resources, instance)
    assert not res.success
    text = _error_text(res)
    assert SourceSchemaNeedsRendition.__name__ in text and "orders_rendition" in text
    after = persist.controller().describe("orders")
    assert after["renditions"] == before["renditions"] and after["schemas"] == before["schemas"]

    sa = build_source_assets(changed)
    instance.add_dynamic_partitions("orders_renditions", ["r1"])
    res = dg.materialize([sa.rendition], resources=resources, instance=instance, partition_key="r1")
    assert res.success
    ctl = persist.controller()
    assert ctl.describe("orders")["active_rendition"] == "r1"
    write_orders_file(landing, 1, 10, id_space=1000)
    assert _ingest(changed, resources, instance).success
    got = _contents(resources)
    assert got.schema.field("amount").type == pa.float32()
    assert got.num_rows == len(set(r["order_id"] for b in (0, 1) for r in order_rows(b, (30, 10)[b], id_space=1000)))


def test_evolve_schema_job_from_run_config(
    resources: dict[str, object], instance: dg.DagsterInstance, home: Path
) -> None:
    write_orders_file(home / "landing" / "orders", 0, 20)
    assert _ingest(ORDERS, resources, instance).success
    job = defs.resolve_job_def("evolve_schema_job")

    def run(cfg: dict[str, object]) -> dg.ExecuteInProcessResult:
        return job.execute_in_process(
            run_config={"ops": {"evolve_schema_op": {"config": cfg}}},
            resources=resources, instance=instance, raise_on_error=False,
        )

    dry = run({"collection": "orders", "add": ["channel:string"], "dry_run": True})
    assert dry.success and dry.output_for_node("evolve_schema_op")["version"] == 1
    persist = resources["persist"]
    assert isinstance(persist, PersistResource)
    assert persist.controller().schema("orders")["version"] == 0

    bad = run({"collection": "orders", "widen": ["amount:int8"]})  # narrowing: refused
    assert not bad.success and "IncompatibleSchemaChange" in _error_text(bad)
    typo = run({"collection": "orders", "add": ["channel:strng"]})
    assert not typo.success and "unknown type 'strng'" in _error_text(typo)
    assert persist.controller().schema("orders")["version"] == 0

    ok = run({"collection": "orders", "add": ["channel:string"]})
    assert ok.success
    out = ok.output_for_node("evolve_schema_op")
    assert out["outcome"] == "evolved" and out["version"] == 1
    assert _contents(resources).schema.names[-1] == "channel"
