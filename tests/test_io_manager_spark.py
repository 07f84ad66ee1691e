"""PySpark DataFrame inputs load through ``persist_lib.spark``'s distributed read (Spark
``local[2]``): the executors (Python worker processes) fetch and decode the parts, so the
driver's process reads none of them (its clients' blob counters stay put), and the rows
are exact: as of a recorded materialization, with their multiplicity, projected to
``columns`` and cut to a partition, over a 2-shard collection."""

import datetime as dt
from typing import Any

import dagster as dg
import pyarrow as pa
import pytest

from dagster_project.io_manager import PersistIOManager
from dagster_project.resources import PersistResource
from persist_lib.shard.metrics import process_counters

DataFrame = pytest.importorskip("pyspark.sql").DataFrame

pytestmark = [pytest.mark.dagster, pytest.mark.spark]
pytest_plugins = ["tests.spark_fixtures", "tests.io_manager_fixtures"]

N = 3000  # well above the inline threshold: each write is blob parts


def _rows(n: int, tag: str) -> pa.Table:
    return pa.table({"id": pa.array(range(n), pa.int64()), "s": [f"{tag}{i}" for i in range(n)], "f": [i * 0.5 for i in range(n)]})


def _parts_read(persist: PersistResource, name: str) -> int:
    """Parts every client of this (the driver's) process read from blob for ``name``'s shards."""
    shards = persist.controller().describe(name)["renditions"]["r0"]["shards"]
    c = process_counters()
    return sum(c[s].parts_read for s in shards if s in c)


def test_spark_input_is_read_on_the_executors_exactly(
    persist: PersistResource, instance: dg.DagsterInstance, spark: Any
) -> None:
    state: dict[str, Any] = {"v": _rows(N, "a")}

    @dg.asset(key_prefix=["spk"], metadata={"persist/key": ["id"], "persist/mode": "append", "persist/num_shards": 2})
    def up() -> pa.Table:
        return state["v"]

    got: dict[str, DataFrame] = {}

    def reader(name: str, **md: Any) -> dg.AssetsDefinition:
        @dg.asset(name=name, io_manager_key="mem", ins={"u": dg.AssetIn(key=up.key, metadata=md)})
        def r(u: DataFrame) -> None:
            got[name] = u

        return r

    io = {"io_manager": PersistIOManager(persist=persist), "mem": dg.InMemoryIOManager()}
    first = dg.materialize([up], resources=io, instance=instance)
    assert first.success
    state["v"] = _rows(N, "a")  # the same rows again: each is held twice now
    assert dg.materialize([up], resources=io, instance=instance).success
    before = _parts_read(persist, "spk.up")
    readers = [reader("twice"), reader("once", **{"persist/as_of": first.run_id}), reader("cols", columns=["s"])]
    res = dg.materialize([up, *readers], selection=[r.key for r in readers], resources=io, instance=instance)
    assert res.success
    assert _parts_read(persist, "spk.up") == before, "the driver fetched parts: the read was not distributed"
    want = sorted(tuple(r.values()) for r in _rows(N, "a").to_pylist())
    assert all(isinstance(v, DataFrame) for v in got.values())
    assert got["twice"].columns == ["id", "s", "f"]
    assert sorted(tuple(r) for r in got["twice"].collect()) == sorted(want * 2)
    assert sorted(tuple(r) for r in got["once"].collect()) == want
    assert sorted(r[0] for r in got["cols"].collect()) == sorted([w[1] for w in want] * 2)
    assert got["cols"].columns == ["s"]


DAYS = ["2026-03-01", "2026-03-02", "2026-03-03"]
daily = dg.DailyPartitionsDefinition(start_date=DAYS[0], end_date="2026-03-04")


def _day(day: str) -> pa.Table:
    d = dt.date.fromisoformat(day)
    t = _rows(N, day)
    return t.append_column("day", pa.array([d] * N, pa.date32()))


@pytest.mark.slow
def test_spark_partition_load_gets_just_its_rows(
    persist: PersistResource, instance: dg.DagsterInstance, spark: Any
) -> None:
    @dg.asset(key_prefix=["spk"], partitions_def=daily, metadata={
        "persist/key": ["day", "id"], "persist/partition_column": "day"})
    def daily_up(context: dg.AssetExecutionContext) -> pa.Table:
        return _day(context.partition_key)

    got: dict[str, DataFrame] = {}

    @dg.asset(key_prefix=["spk"], partitions_def=daily, io_manager_key="mem",
              ins={"u": dg.AssetIn(key=daily_up.key, metadata={"columns": ["id", "s"]})})
    def one_day(u: DataFrame) -> None:
        got["day"] = u

    io = {"io_manager": PersistIOManager(persist=persist), "mem": dg.InMemoryIOManager()}
    for day in DAYS:
        assert dg.materialize([daily_up], partition_key=day, resources=io, instance=instance).success
    res = dg.materialize([daily_up, one_day], selection=[one_day.key], partition_key=DAYS[1], resources=io, instance=instance)
    assert res.success
    assert got["day"].columns == ["id", "s"]
    assert sorted(tuple(r) for r in got["day"].collect()) == sorted(
        (r["id"], r["s"]) for r in _day(DAYS[1]).to_pylist()
    )


def test_spark_cut_to_several_multi_partitions_is_exact(spark: Any) -> None:
    """Loading partitions a|x and b|y of a two-dimensional asset, the pushed-down filter
    (each dimension IN its keys) also holds a|y and b|x: the executors cut those out."""
    from dagster_project.io_manager.partitions import PartitionSelection
    from dagster_project.io_manager.spark_read import _exact_partitions

    rows = pa.table({"d1": ["a", "a", "b", "b", "c"], "d2": ["x", "y", "x", "y", "x"], "n": [1, 2, 3, 4, 5]})
    sel = PartitionSelection({"one": "d1", "two": "d2"}, [{"one": "a", "two": "x"}, {"one": "b", "two": "y"}])
    df = spark.createDataFrame(rows.to_pandas())
    got = _exact_partitions(df, sel, "test")
    assert sorted(tuple(r) for r in got.collect()) == [("a", "x", 1), ("b", "y", 4)]
