"""PersistIOManager with partitioned assets: a partition's materialization replaces
exactly its rows at a new time, two runs materializing different partitions at once both
land, a downstream partition (or range) reads just its rows, multi-partitions map each
dimension to a column, and rows outside the partition are refused."""


import datetime as dt
import multiprocessing as mp
import sys
from typing import Any

import dagster as dg
import pyarrow as pa
import pytest

from dagster_project.io_manager import PartitionMismatch, PersistIOManager
from dagster_project.resources import PersistResource
from tests.io_manager_fixtures import interleaving, root_error

pytestmark = pytest.mark.dagster
pytest_plugins = ["tests.io_manager_fixtures"]


daily = dg.DailyPartitionsDefinition(start_date="2026-01-01", end_date="2026-01-05")
colors = dg.StaticPartitionsDefinition(["red", "blue"])
grid = dg.MultiPartitionsDefinition({"day": daily, "color": colors})


def _day_rows(day: str, n: int, tag: str) -> list[dict[str, Any]]:
    d = dt.date.fromisoformat(day)
    return [{"day": d, "id": i, "v": f"{tag}{i}"} for i in range(n)]


def _table(rows: list[dict[str, Any]]) -> pa.Table:
    return pa.Table.from_pylist(rows, pa.schema([("day", pa.date32()), ("id", pa.int64()), ("v", pa.string())]))


def _contents(persist: PersistResource, name: str, as_of: int | None = None) -> list[tuple]:
    with persist.controller().acquire_read_handle(name) as r:
        t = (r.upper.time or 1) - 1 if as_of is None else as_of
        snap = r.snapshot(t).to_pylist()
    return sorted((x["day"].isoformat(), x["id"], x["v"]) for x in snap for _ in range(x["diff"]))


TAG: dict[str, str] = {}


@dg.asset(
    key_prefix=["part"], partitions_def=daily,
    metadata={"persist/key": ["day", "id"], "persist/partition_column": "day"},
)
def events(context: dg.AssetExecutionContext) -> pa.Table:
    return _table(_day_rows(context.partition_key, 3, TAG.get(context.partition_key, "a")))


def _mat(persist: PersistResource, instance: dg.DagsterInstance, key: str, assets: list[Any] | None = None) -> dict[str, Any]:
    res = dg.materialize(
        assets or [events], partition_key=key, resources={"io_manager": PersistIOManager(persist=persist)},
        instance=instance,
    )
    assert res.success
    (ev,) = [e for e in res.get_asset_materialization_events() if e.asset_key == dg.AssetKey(["part", "events"])] or [None]
    return {k: v.value for k, v in ev.materialization.metadata.items()} if ev else {}


def test_partition_replaces_exactly_its_rows_at_a_new_time(persist: PersistResource, instance: dg.DagsterInstance) -> None:
    m1 = _mat(persist, instance, "2026-01-01")
    m2 = _mat(persist, instance, "2026-01-02")
    TAG["2026-01-01"] = "b"
    m3 = _mat(persist, instance, "2026-01-01")
    assert m1["persist/time"] < m2["persist/time"] < m3["persist/time"]
    assert (m3["persist/inserted"], m3["persist/retracted"]) == (3, 3)
    after = _contents(persist, "part.events", m3["persist/time"])
    assert after == sorted(
        [(r["day"].isoformat(), r["id"], r["v"]) for r in _day_rows("2026-01-01", 3, "b") + _day_rows("2026-01-02", 3, "a")]
    )
    # the partition's previous contents are still readable at its previous time
    assert ("2026-01-01", 0, "a0") in _contents(persist, "part.events", m2["persist/time"])


def test_rows_outside_the_partition_are_refused(persist: PersistResource, instance: dg.DagsterInstance) -> None:
    @dg.asset(key_prefix=["part"], name="leaky", partitions_def=daily,
              metadata={"persist/key": ["day", "id"], "persist/partition_column": "day"})
    def leaky(context: dg.AssetExecutionContext) -> pa.Table:
        return _table(_day_rows(context.partition_key, 1, "x") + _day_rows("2026-01-04", 1, "y"))

    with pytest.raises(Exception) as ei:
        dg.materialize([leaky], partition_key="2026-01-03", resources={"io_manager": PersistIOManager(persist=persist)}, instance=instance)
    e = root_error(ei.value)
    assert isinstance(e, PartitionMismatch) and "outside partition 2026-01-03" in str(e), e


@dg.asset(key_prefix=["part"], partitions_def=daily,
          metadata={"persist/key": ["day", "id"], "persist/partition_column": "day"})
def racing(context: dg.AssetExecutionContext) -> pa.Table:
    _RACE["barrier"].wait(timeout=120)  # both outputs reach the I/O manager together
    return _table(_day_rows(context.partition_key, 50, context.partition_key[-1]))


_RACE: dict[str, Any] = {}


def _race_run(home: str, instance_ref: Any, key: str, barrier: Any) -> None:
    """One run worker of the race (a process of its own, as Dagster runs are); exits 0
    iff its run succeeded."""
    _RACE["barrier"] = barrier
    with dg.DagsterInstance.from_ref(instance_ref) as inst:
        io = PersistIOManager(persist=PersistResource(home=home))
        res = dg.materialize([racing], partition_key=key, resources={"io_manager": io}, instance=inst, raise_on_error=False)
    sys.exit(0 if res.success else 1)


def test_two_partitions_materialized_at_once_both_land(home: str, persist: PersistResource, instance: dg.DagsterInstance) -> None:
    """Two runs, each in its own process, materialize different partitions of one
    collection at the same moment: both land (the loser of the compare-and-append
    recomputes its partition's difference against the new contents)."""
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(2)
    keys = ("2026-01-03", "2026-01-04")
    procs = [ctx.Process(target=_race_run, args=(home, instance.get_ref(), k, barrier)) for k in keys]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
    assert [p.exitcode for p in procs] == [0, 0]
    got = _contents(persist, "part.racing")
    want = sorted((r["day"].isoformat(), r["id"], r["v"]) for k in keys for r in _day_rows(k, 50, k[-1]))
    assert got == want


def test_downstream_partition_and_range_read_just_their_rows(persist: PersistResource, instance: dg.DagsterInstance) -> None:
    for k in ("2026-01-01", "2026-01-02", "2026-01-03"):
        _mat(persist, instance, k)

    @dg.asset(key_prefix=["part"], partitions_def=daily, ins={"events": dg.AssetIn(key=["part", "events"])}, io_manager_key="mem")
    def per_day(events: pa.Table) -> pa.Table:
        return events

    @dg.asset(key_prefix=["part"], ins={"events": dg.AssetIn(key=["part", "events"])}, io_manager_key="mem")
    def all_days(events: pa.Table) -> pa.Table:
        return events

    res = dg.materialize(
        [events, per_day], selection=[per_day], partition_key="2026-01-02",
        resources={"io_manager": PersistIOManager(persist=persist), "mem": dg.InMemoryIOManager()}, instance=instance,
    )
    assert {d.isoformat() for d in res.output_for_node("part__per_day")["day"].to_pylist()} == {"2026-01-02"}
    res = dg.materialize(
        [events, all_days], selection=[all_days],
        resources={"io_manager": PersistIOManager(persist=persist), "mem": dg.InMemoryIOManager()}, instance=instance,
    )
    assert res.output_for_node("part__all_days").num_rows == len(_contents(persist, "part.events"))


def test_multi_partitions_map_each_dimension_to_a_column(persist: PersistResource, instance: dg.DagsterInstance) -> None:
    schema = pa.schema([("day", pa.string()), ("color", pa.string()), ("n", pa.int64())])
    gen = {"n": 1}

    @dg.asset(key_prefix=["part"], partitions_def=grid,
              metadata={"persist/key": ["day", "color"], "persist/partition_column": {"day": "day", "color": "color"}})
    def cells(context: dg.AssetExecutionContext) -> pa.Table:
        k = context.partition_key.keys_by_dimension  # type: ignore[attr-defined]
        return pa.Table.from_pylist([{"day": k["day"], "color": k["color"], "n": gen["n"]}], schema)

    io = {"io_manager": PersistIOManager(persist=persist)}
    for key in ("red|2026-01-01", "blue|2026-01-01", "red|2026-01-02"):
        assert dg.materialize([cells], partition_key=key, resources=io, instance=instance).success
    gen["n"] = 2
    assert dg.materialize([cells], partition_key="red|2026-01-01", resources=io, instance=instance).success
    with persist.controller().acquire_read_handle("part.cells") as r:
        rows = r.snapshot(r.upper.time - 1).to_pylist()
    assert sorted((x["day"], x["color"], x["n"]) for x in rows) == [
        ("2026-01-01", "blue", 1), ("2026-01-01", "red", 2), ("2026-01-02", "red", 1)
    ]


def test_a_write_that_lost_the_race_recomputes_its_partition(persist: PersistResource, instance: dg.DagsterInstance) -> None:
    """Deterministic interleaving: between computing its updates and committing them, a
    write of partition 2026-01-02 sees another run commit partition 2026-01-01. Its
    compare-and-append loses; it recomputes against the new contents and lands, and
    the other partition's rows stay."""
    @dg.asset(key_prefix=["part"], name="interleaved", partitions_def=daily,
              metadata={"persist/key": ["day", "id"], "persist/partition_column": "day"})
    def interleaved(context: dg.AssetExecutionContext) -> pa.Table:
        return _table(_day_rows(context.partition_key, 4, "p"))

    other = PersistIOManager(persist=persist)
    assert dg.materialize([interleaved], partition_key="2026-01-03", resources={"io_manager": other}, instance=instance).success

    def concurrent_write() -> None:
        res = dg.materialize([interleaved], partition_key="2026-01-01", resources={"io_manager": other}, instance=instance)
        assert res.success

    res = dg.materialize([interleaved], partition_key="2026-01-02", resources={"io_manager": interleaving(persist, concurrent_write)}, instance=instance)
    assert res.success
    (ev,) = [e for e in res.get_asset_materialization_events()]
    assert ev.materialization.metadata["persist/attempts"].value == 2
    got = _contents(persist, "part.interleaved")
    assert got == sorted((r["day"].isoformat(), r["id"], r["v"]) for k in ("2026-01-01", "2026-01-02", "2026-01-03") for r in _day_rows(k, 4, "p"))


@pytest.mark.parametrize(
    ("metadata", "message"),
    [
        ({"persist/key": ["day", "id"]}, "the asset is partitioned: add metadata {'persist/partition_column'"),
        ({"persist/key": ["day", "id"], "persist/partition_column": "nope"}, "partition column 'nope' is not a column"),
        ({"persist/key": ["day", "id"], "persist/partition_column": 7}, "persist/partition_column must be a column name"),
    ],
)
def test_bad_partition_configuration_fails_with_one_line(
    persist: PersistResource, instance: dg.DagsterInstance, metadata: dict[str, Any], message: str
) -> None:
    @dg.asset(key_prefix=["badpart"], name="p", partitions_def=daily, metadata=metadata)
    def p(context: dg.AssetExecutionContext) -> pa.Table:
        return _table(_day_rows(context.partition_key, 1, "x"))

    with pytest.raises(Exception) as ei:
        dg.materialize([p], partition_key="2026-01-01", resources={"io_manager": PersistIOManager(persist=persist)}, instance=instance)
    e = root_error(ei.value)
    assert message in str(e) and "\n" not in str(e), e
