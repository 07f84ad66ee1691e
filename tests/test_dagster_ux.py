"""What the Dagster UI shows must be true (issue: defects 2, 3, 5, 6 and the Dagster side
of 1).

- after a handover the collection asset's latest metadata names the active rendition;
- a backfill of a retired rendition is a short ``dg.Failure`` saying so and what to do;
  retired/dropped renditions are not partitions (neither "Missing" nor green), the
  first rendition (made by ingestion) is not "Missing", ``status`` is never "ready" for
  a retired rendition and the timeline shows the real ``from`` (as ``persist describe``);
- Materialize on the rendition asset (the implicit ``__ASSET_JOB``, empty config) builds
  a rendition with the source's configured shard count;
- every shard partition says what it is (collection, rendition, shard index);
  finalized shards are not partitions;
- sensors and metadata helpers leave no reader or writer registered;
- issue 30: a bad shard count is refused when the run is created (item 4); one status
  word per rendition everywhere (item 5); the rendition backfill's check before the
  handover (item 1); the since every command reports is the one ``AS OF`` has (item 2).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import dagster as dg
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from dagster_project.assets import SOURCE_ASSETS, build_source_assets, persist_shard
from dagster_project.definitions import build_defs
from dagster_project.resources import PersistResource
from dagster_project.sample import write_orders_file
from dagster_project.sources import ORDERS
from persist_lib.timefmt import iso_utc
from sensors.compaction import build_compaction_debt_sensor
from sensors.downstream import DOWNSTREAM_SENSORS

pytestmark = pytest.mark.dagster
pytest_plugins = ["tests.dagster_fixtures"]

ORDERS_ASSETS = SOURCE_ASSETS["orders"]
RENDITION = dg.AssetKey("orders_rendition")


def ingest(resources: dict[str, object], instance: dg.DagsterInstance) -> None:
    res = dg.materialize(
        [ORDERS_ASSETS.ingest, *ORDERS_ASSETS.checks], resources=resources, instance=instance
    )
    assert res.success


def backfill(
    resources: dict[str, object], instance: dg.DagsterInstance, rendition: str, num_shards: int = 2
) -> dg.ExecuteInProcessResult:
    if not instance.has_dynamic_partition("orders_renditions", rendition):
        instance.add_dynamic_partitions("orders_renditions", [rendition])  # "Add partition"
    return dg.materialize(
        [ORDERS_ASSETS.rendition],
        resources=resources,
        instance=instance,
        partition_key=rendition,
        run_config={"ops": {"orders_rendition": {"config": {"num_shards": num_shards}}}},
        raise_on_error=False,
    )


def latest(instance: dg.DagsterInstance, key: str | dg.AssetKey, partition: str | None = None) -> dict[str, Any]:
    key = dg.AssetKey(key) if isinstance(key, str) else key
    recs = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=key, asset_partitions=[partition] if partition else None),
        limit=1,
        ascending=False,
    ).records
    assert recs, f"no materialization of {key.to_user_string()} {partition or ''}"
    mat = recs[0].asset_materialization
    assert mat is not None
    return {k: v.value for k, v in mat.metadata.items()}


def describe(home: Path, name: str) -> dict[str, Any]:
    persist = PersistResource(home=str(home))
    try:
        return persist.controller().describe(name)
    finally:
        persist.close()


def md_rows(md: object) -> list[list[str]]:
    lines = str(md).splitlines()[2:]
    return [[c.strip() for c in line.strip("|").split("|")] for line in lines]


def registrations(persist: PersistResource) -> dict[str, tuple[list[str], list[str]]]:
    client = persist.client()
    out = {}
    for s in client.list_shards():
        st = client.inspect(s)
        out[s] = (sorted(st.get("leased_readers", {})), sorted(st.get("writers", {})))
    return out


def test_collection_asset_shows_the_active_rendition_after_a_handover(
    home: Path, resources: dict[str, object], instance: dg.DagsterInstance
) -> None:
    """Defect 2: after a handover the ``orders`` asset kept showing the old rendition."""
    write_orders_file(home / "landing" / "orders", 0, 120)
    ingest(resources, instance)
    assert latest(instance, "orders")["rendition"] == "r0"
    assert backfill(resources, instance, "r1").success
    for key in ("orders", "orders_errors"):
        meta = latest(instance, key)
        assert meta["rendition"] == "r1" and meta["active_rendition"] == "r1", (key, meta)
        assert meta["num_shards"] == 2 and meta["previous_rendition"] == "r0"


def test_retired_rendition_backfill_is_a_clear_failure_and_partitions_tell_the_truth(
    home: Path, resources: dict[str, object], instance: dg.DagsterInstance
) -> None:
    """Defect 3."""
    write_orders_file(home / "landing" / "orders", 0, 120)
    ingest(resources, instance)
    # the first rendition, made by ingestion, exists: not "Missing"
    assert instance.get_dynamic_partitions("orders_renditions") == ["r0"]
    assert instance.get_materialized_partitions(RENDITION) == {"r0"}
    assert latest(instance, RENDITION, "r0")["status"] == "active"

    res = backfill(resources, instance, "r1")
    assert res.success
    # r0 is retired and collected: no longer a partition; r1 is, and materialized
    assert instance.get_dynamic_partitions("orders_renditions") == ["r1"]
    meta = latest(instance, RENDITION, "r1")
    assert meta["status"] == "active" and meta["previous_rendition"] == "r0"
    renditions = {row[0]: row for row in md_rows(meta["renditions"])}
    assert renditions["r0"][1] == "dropped" and renditions["r1"][1] == "active"
    desc = describe(home, "orders")
    timeline = [[str(h["at"]), h["from"] or "-", h["to"]] for h in desc["timeline"]]
    rows = md_rows(meta["timeline"])
    assert [r[:3] for r in rows] == timeline  # the UI agrees with `persist describe`
    assert timeline[-1][1:] == ["r0", "r1"] and int(timeline[-1][0]) == meta["handover_at"]
    # handover times are epoch ms: with their UTC timestamp in the table and as metadata
    assert rows[-1][3] == iso_utc(meta["handover_at"])
    assert meta["handover_at_time"] == meta["handover_at"] / 1000

    # `dagster job launch -j orders_rendition_job --tags '{"dagster/partition": "r0"}'`
    job = build_defs(**resources).resolve_job_def("orders_rendition_job")
    res = job.execute_in_process(
        instance=instance, tags={"dagster/partition": "r0"}, raise_on_error=False
    )
    assert not res.success
    (failure,) = res.get_step_failure_events()
    data = failure.step_failure_data
    assert data.user_failure_data is not None, data.error  # a dg.Failure, not a crash
    text = data.user_failure_data.description or ""
    assert "'r0'" in text and "dropped" in text and "handed over" in text
    assert "r2" in text and "orders_rendition_job" in text  # what to do instead
    assert "\n" not in text and len(text) < 1000
    assert instance.get_dynamic_partitions("orders_renditions") == ["r1"]


def test_materialize_rendition_from_the_ui_uses_the_sources_shard_count(
    home: Path, resources: dict[str, object], instance: dg.DagsterInstance
) -> None:
    """Defect 5: Materialize in the UI runs ``__ASSET_JOB`` with an empty config."""
    assert ORDERS.num_shards == 4  # ingestion's; renditions are rebuilt with 8 (rendition_shards)
    write_orders_file(home / "landing" / "orders", 0, 120)
    ingest(resources, instance)
    defs = build_defs(**resources)
    job = defs.resolve_implicit_global_asset_job_def()
    schema = job.run_config_schema.config_type.fields["ops"].config_type.fields  # type: ignore[attr-defined]
    field = schema["orders_rendition"].config_type.fields["config"].config_type.fields["num_shards"]
    assert field.default_value == 8  # the launchpad shows what will be built
    instance.add_dynamic_partitions("orders_renditions", ["r1"])
    res = job.execute_in_process(
        instance=instance, partition_key="r1", asset_selection=[RENDITION]
    )
    assert res.success
    d = describe(home, "orders")
    assert d["active_rendition"] == "r1" and d["renditions"]["r1"]["num_shards"] == 8
    assert latest(instance, RENDITION, "r1")["num_shards"] == 8
    assert job.executor_def.name == "in_process"  # one process (one Spark session) per run


def test_shard_partitions_say_what_each_shard_is(
    home: Path, resources: dict[str, object], instance: dg.DagsterInstance
) -> None:
    """Defect 6 (and the Dagster side of defect 1)."""
    write_orders_file(home / "landing" / "orders", 0, 120)
    ingest(resources, instance)
    persist = resources["persist"]
    assert isinstance(persist, PersistResource)
    d0 = describe(home, "orders")
    r0 = d0["renditions"]["r0"]["shards"]
    assert set(instance.get_dynamic_partitions("persist_shards")) == {*r0, d0["metadata_shard"]}
    for i, s in enumerate(r0):
        meta = latest(instance, "persist_shard", s)  # registered: not "Missing"
        assert meta["shard_of"] == f"orders / r0 / shard {i} of 4", meta
        assert meta["collection"] == "orders" and meta["rendition"] == "r0"
        assert meta["shard_index"] == i
    assert latest(instance, "persist_shard", d0["metadata_shard"])["shard_of"] == (
        "orders / rendition metadata shard"
    )

    assert backfill(resources, instance, "r1").success
    d1 = describe(home, "orders")
    r1 = d1["renditions"]["r1"]["shards"]
    parts = set(instance.get_dynamic_partitions("persist_shards"))
    assert not parts & set(r0), "finalized shards of the dropped rendition are not partitions"
    assert set(r1) <= parts
    assert latest(instance, "persist_shard", r1[1])["shard_of"] == "orders / r1 / shard 1 of 2"

    # The compaction sensor registers every other live shard, each with what it is, and
    # (like every read-only path) leaves no reader or writer behind.
    before = registrations(persist)
    sensor = build_compaction_debt_sensor(threshold=1 << 40, name="quiet")
    with dg.build_sensor_context(instance=instance, resources=resources) as ctx:
        result = sensor(ctx)
    assert isinstance(result, dg.SensorResult) and not result.run_requests
    assert registrations(persist) == before
    (add,) = result.dynamic_partitions_requests or []
    assert isinstance(add, dg.AddDynamicPartitionsRequest)
    labels = {
        ev.partition: ev.metadata["shard_of"].value for ev in result.asset_events or []
    }
    assert set(labels) == set(add.partition_keys)
    assert "STORAGE catalog" in labels.values()
    assert "orders / ingestion remap shard" in labels.values()
    assert "orders.raw / r0 / shard 0 of 4" in labels.values()
    assert "orders.state / r1 / shard 1 of 2" in labels.values()

    # A compaction run records what its shard is too.
    res = dg.materialize(
        [persist_shard],
        resources=resources,
        instance=instance,
        partition_key=r1[0],
    )
    assert res.success
    assert latest(instance, "persist_shard", r1[0])["shard_of"] == "orders / r1 / shard 0 of 2"


def test_frontiers_are_timestamps_only_when_they_are_epoch_ms() -> None:
    """Issue 17 (In the UI): upper/since stay ints (the UI plots them) and, when they
    are times in ms since the epoch, are also Dagster timestamp metadata (seconds);
    logical times (small integers) get no timestamp."""
    from dagster_project.metadata import frontier_metadata, shard_metadata

    t = 1767225600123
    m = frontier_metadata("upper", [t])
    assert m["upper"] == dg.MetadataValue.int(t)
    assert m["upper_time"] == dg.MetadataValue.timestamp(t / 1000)
    assert frontier_metadata("since", [5]) == {"since": dg.MetadataValue.int(5)}
    assert set(frontier_metadata("upper", [])) == {"upper"}  # closed: text, no time
    state = {
        "shard": "s1", "upper": [t], "since": [3], "seqno": 4, "num_batches": 0,
        "num_updates": 0, "bytes": 0, "batches": [], "spine": [],
    }
    meta = shard_metadata(state)
    assert isinstance(meta["upper_time"], dg.TimestampMetadataValue) and "since_time" not in meta


@pytest.mark.parametrize("num_shards", [-3, 2000, "eight"])
def test_a_bad_shard_count_is_refused_before_the_run_starts(
    home: Path, resources: dict[str, object], instance: dg.DagsterInstance, num_shards: object
) -> None:
    """Issue 30 item 4: the run config is validated when the run is created (Dagster's
    config schema), so nothing is built and no run is recorded."""
    instance.add_dynamic_partitions("orders_renditions", ["r1"])
    with pytest.raises(dg.DagsterInvalidConfigError, match="num_shards") as err:
        dg.materialize(
            [ORDERS_ASSETS.rendition],
            resources=resources,
            instance=instance,
            partition_key="r1",
            run_config={"ops": {"orders_rendition": {"config": {"num_shards": num_shards}}}},
        )
    if num_shards != "eight":
        assert f"from 1 to 1024 (0 = the source's default), got {num_shards}" in str(err.value)
    assert instance.get_runs() == []
    assert not (home / "consensus.db").exists()  # nothing touched the location


def test_every_view_uses_one_status_word_per_rendition(
    home: Path, resources: dict[str, object], instance: dg.DagsterInstance
) -> None:
    """Issue 30 item 5: the active rendition was ``ready`` in the renditions table and in
    ``describe --json`` (next to ``active: true``), and shard partitions kept the
    ``rendition_status`` of their registration after a handover."""
    import json
    import os
    import re
    import subprocess
    import sys

    from persist_lib.storage.status import RENDITION_STATUSES

    write_orders_file(home / "landing" / "orders", 0, 120)
    ingest(resources, instance)
    r0 = describe(home, "orders")["renditions"]["r0"]["shards"]
    for s in r0:
        assert latest(instance, "persist_shard", s)["rendition_status"] == "active"
    # a reader still before the handover keeps r0 (retired, not yet collected)
    holder = PersistResource(home=str(home))
    reader = holder.controller().acquire_read_handle("orders")
    try:
        assert backfill(resources, instance, "r1").success
        d = describe(home, "orders")
        assert {r: i["status"] for r, i in d["renditions"].items()} == {"r0": "retired", "r1": "active"}
        for info in d["renditions"].values():
            assert info["status"] in RENDITION_STATUSES
            assert info["active"] == (info["status"] == "active")
        # the Dagster metadata: the renditions table and the shard partitions
        table = {row[0]: row[1] for row in md_rows(latest(instance, RENDITION, "r1")["renditions"])}
        assert table == {"r0": "retired", "r1": "active"}
        assert latest(instance, RENDITION, "r1")["status"] == "active"
        for s in d["renditions"]["r1"]["shards"]:
            assert latest(instance, "persist_shard", s)["rendition_status"] == "active"
        for s in r0:
            meta = latest(instance, "persist_shard", s)
            assert meta["rendition_status"] == "retired", meta
        # the command line, in a subprocess, says the same
        env = {k: v for k, v in os.environ.items() if not k.startswith("PERSIST_")}
        env.update(PERSIST_HOME=str(home), PYTHONPATH=str(Path(__file__).resolve().parents[1]))

        def cli(*args: str) -> str:
            out = subprocess.run(
                [sys.executable, "-m", "persist_lib.cli.main", *args],
                env=env, capture_output=True, text=True, timeout=120,
            )
            assert out.returncode == 0, out.stderr
            return out.stdout

        doc = json.loads(cli("describe", "orders", "--json"))
        assert {r: i["status"] for r, i in doc["renditions"].items()} == {"r0": "retired", "r1": "active"}
        text = cli("describe", "orders")
        assert re.search(r"^\s*r0\s+retired\s+4\s", text, re.M), text
        assert re.search(r"^\s*r1\s+active\s+2\s", text, re.M), text
        assert "ready" not in text
        assert "r0 retired, r1 active" in cli("collections")
        shards = cli("shards")
        assert "orders / r1 / shard 0 of 2 (active)" in shards
        assert "orders / r0 / shard 0 of 4 (retired)" in shards
    finally:
        reader.expire()
        holder.close()


# ----- issue 30 items 1 and 2: the check before the handover; the since a reader gets -----
# Issue 30 item 1: a rendition backfill runs the blocking Great Expectations check on the
# rebuilt rendition before the handover.
#
# - a passing check: the backfilled partition's ``orders_rendition/ge_contents`` passed
#   on the new rendition at the handover time, and ``orders/ge_contents`` is evaluated (in
#   the backfill run) on what ``orders`` reads since the handover; the summary sensor
#   launches a run for the handover;
# - a failing check (a decoding change that breaks the rules) stops the handover: the old
#   rendition stays active, the new one stays ``ready``, the failed check and the refused
#   handover are on the asset, the run fails with the reason, and nothing downstream runs;
# - the summary sensor ignores a materialization whose run did not evaluate the blocking
#   check.

SA = SOURCE_ASSETS["orders"]
ORDERS_CHECK = dg.AssetCheckKey(dg.AssetKey("orders"), "ge_contents")
RENDITION_CHECK = dg.AssetCheckKey(RENDITION, "ge_contents")


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


def backfill_with(assets: Any, resources: dict[str, object], instance: dg.DagsterInstance, r: str) -> dg.ExecuteInProcessResult:
    instance.add_dynamic_partitions("orders_renditions", [r])
    return dg.materialize(
        [assets.rendition],
        resources=resources,
        instance=instance,
        partition_key=r,
        run_config={"ops": {"orders_rendition": {"config": {"num_shards": 2}}}},
        raise_on_error=False,
    )


def describe_orders(home: Path) -> dict[str, Any]:
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
    res = backfill_with(SA, resources, instance, "r1")
    assert res.success
    d = describe_orders(home)
    assert d["active_rendition"] == "r1"
    (handover,) = [h for h in d["timeline"] if h["to"] == "r1"]
    ev = evaluations(res)
    on_rendition = ev[RENDITION_CHECK]
    assert on_rendition.passed and on_rendition.blocking
    assert on_rendition.metadata["rendition"].value == "r1"
    # what readers see from then, as a wall-clock time (no raw integer on the check's plot)
    assert on_rendition.metadata["as_of"].value == handover["at"] / 1000.0
    assert on_rendition.metadata["as_of_time"].value == f"{handover['at']} ({iso_utc(handover['at'])})"
    assert on_rendition.metadata["rows"].value == rows > 0  # the same contents, rebuilt
    on_orders = ev[ORDERS_CHECK]  # the collection's own check: evaluated, not "Not Evaluated"
    assert on_orders.passed and on_orders.metadata["rendition"].value == "r1"
    assert f"before the handover at {handover['at']} ({iso_utc(handover['at'])})" in (on_orders.description or "")
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
    res = backfill_with(broken, resources, instance, "r1")
    assert not res.success
    d = describe_orders(home)
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
    assert backfill_with(SA, resources, instance, "r1").success
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
    assert iso_utc(since) in row, table  # (a narrow table: the timestamp alone)
    ok = cli("sql", "--json", f"SELECT count(*) AS n FROM orders AS OF {since}")  # noqa: S608
    assert ok.returncode == 0 and json.loads(ok.stdout)[0]["n"] > 0, ok.stderr
    bad = cli("sql", "--json", f"SELECT count(*) AS n FROM orders AS OF {since - 1}")  # noqa: S608
    assert bad.returncode != 0 and "Traceback" not in bad.stderr
    assert "readable" in bad.stderr and str(since) in bad.stderr, bad.stderr
    text = cli("describe", "orders").stdout
    assert re.search(rf"readable since\s+{since}\b", text), text
    assert "earlier times were read through r0, dropped after the handover" in text, text
    # the UI: the orders asset's since (recorded by the next ingestion) is that one too
    write_orders_file(home / "landing" / "orders", 1, 5)
    assert dg.materialize([SA.ingest, *SA.checks], resources=resources, instance=instance).success
    now = json.loads(cli("describe", "orders", "--json").stdout)["readable_since"]
    recs = instance.fetch_materializations(dg.AssetKey("orders"), limit=1, ascending=False).records
    meta = recs[0].asset_materialization.metadata  # type: ignore[union-attr]
    assert meta["since"].value == now == meta["readable_since"].value
    assert now >= since > d["renditions"]["r1"]["since"][0]


# ----- issue 30 items 6-8 -----------------------------------------------------------------------
#
# - the backfill's log lines and the collection's renditions table show wall-clock times, no
#   Python list/dict reprs;
# - a local landing zone has no "S3" badge;
# - runs executed in-process by the demo carry the workspace's origin (the Overview timeline
#   draws only those);
# - `dagster dev` started in the background by a shell ignores SIGTERM because Dagster maps
#   SIGTERM to SIGINT's handler, which that shell set to "ignore"; started as docs/dagster.md
#   says, SIGTERM stops it.

ROOT = Path(__file__).resolve().parents[1]


def test_backfill_logs_and_metadata_show_wall_clock_times(
    home: Path, resources: dict[str, object], instance: dg.DagsterInstance
) -> None:
    write_orders_file(home / "landing" / "orders", 0, 40)
    ingest(resources, instance)
    res = backfill(resources, instance, "r1")
    assert res.success
    d = describe_orders(home)
    at = d["timeline"][-1]["at"]
    logs = [e.user_message for e in instance.all_logs(res.run_id) if e.user_message]
    caught = [m for m in logs if "caught r1 up to" in m]
    assert caught and all(re.search(r"up to \d+ \(\d{4}-\d\d-\d\dT[\d:.]+Z\)", m) for m in caught), caught
    (handed,) = [m for m in logs if "handed over to r1" in m]
    assert f"orders at {at} ({iso_utc(at)})" in handed and "{" not in handed, handed
    # the renditions table: the retired rendition's "retired at" as a wall-clock time
    meta = latest(instance, "orders")
    table = str(meta["renditions"])
    (r0,) = [line for line in table.splitlines() if line.startswith("| r0 ")]
    assert r0.rstrip(" |").endswith(f"{at} ({iso_utc(at)})"), table


def test_decode_errors_sample_shows_each_record_as_text(
    home: Path, resources: dict[str, object], instance: dg.DagsterInstance
) -> None:
    write_orders_file(home / "landing" / "orders", 0, 20, bad_rows=2)
    res = dg.materialize([ORDERS_ASSETS.ingest, *ORDERS_ASSETS.checks], resources=resources, instance=instance)
    assert res.success
    ev = {e.asset_check_key.name: e for e in res.get_asset_check_evaluations()}
    sample = ev["no_decode_errors"].metadata["sample"].value
    assert isinstance(sample, list) and len(sample) == 2
    assert all(s["raw"] == '{"order_id": "not-a-number", "amount": 1}' for s in sample), sample


def test_a_local_landing_zone_is_no_s3_badge(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("PERSIST_LANDING_URI", raising=False)
    assert build_source_assets(ORDERS).landing.kinds == {"file"}
    monkeypatch.setenv("PERSIST_LANDING_URI", str(tmp_path / "landing"))
    assert build_source_assets(ORDERS).landing.kinds == {"file"}
    monkeypatch.setenv("PERSIST_LANDING_URI", "s3://bucket/landing?endpoint=http://127.0.0.1:9000")
    assert build_source_assets(ORDERS).landing.kinds == {"s3"}


def test_in_process_runs_are_recorded_in_the_workspaces_code_location(
    home: Path, resources: dict[str, object], instance: dg.DagsterInstance
) -> None:
    from dagster_project.run_origin import recorded_in_workspace

    job = build_defs(**resources).resolve_job_def("lease_expiry_job")
    with recorded_in_workspace(instance, ROOT / "workspace.yaml"):
        inside = job.execute_in_process(instance=instance, raise_on_error=False)
    outside = job.execute_in_process(instance=instance, raise_on_error=False)
    origin = instance.get_run_by_id(inside.run_id).remote_job_origin  # type: ignore[union-attr]
    assert origin is not None and origin.job_name == "lease_expiry_job"
    assert origin.repository_origin.repository_name == "__repository__"
    assert origin.repository_origin.code_location_origin.location_name == "persist_platform"
    assert instance.get_run_by_id(outside.run_id).remote_job_origin is None  # type: ignore[union-attr]


SIGNALS = (
    "import signal; from dagster._utils.interrupts import setup_interrupt_handlers; "
    "setup_interrupt_handlers(); print(signal.getsignal(signal.SIGTERM) is signal.SIG_IGN)"
)


def test_dagster_dev_in_the_background_ignores_sigterm_unless_started_as_documented() -> None:
    import subprocess
    import sys

    def ignoring_sigint() -> None:  # what a non-interactive shell does to a `cmd &`
        import signal

        signal.signal(signal.SIGINT, signal.SIG_IGN)

    def sigterm_ignored(prefix: list[str]) -> bool:
        out = subprocess.run(
            [*prefix, sys.executable, "-c", SIGNALS],
            preexec_fn=ignoring_sigint, capture_output=True, text=True, timeout=60,  # noqa: PLW1509
        )
        assert out.returncode == 0, out.stderr
        return out.stdout.strip() == "True"

    assert sigterm_ignored([])  # the cause: Dagster's SIGTERM handler is SIGINT's (ignored)
    assert not sigterm_ignored(["env", "--default-signal=INT"])  # docs/dagster.md's way
