"""PySpark outputs are written by the Spark executors (``dagster_project/io_manager/spark_write.py``),
on Spark local[2]: the DataFrame is never converted to Arrow on the driver (``toArrow``
is patched to raise), and each mode stores exactly what the same data stores through
the pyarrow path, history included; a retried step writes nothing twice; a write that
lost the race between computing and committing recomputes and lands."""


import datetime as dt
from collections.abc import Iterator
from typing import Any

import dagster as dg
import pyarrow as pa
import pytest

from dagster_project.io_manager import PartitionMismatch, PersistIOManager
from dagster_project.resources import PersistResource
from tests.io_manager_fixtures import interleaving, root_error

pytestmark = [pytest.mark.dagster, pytest.mark.spark]
pytest_plugins = ["tests.spark_fixtures", "tests.io_manager_fixtures"]


@pytest.fixture
def no_driver_arrow(spark: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """``toArrow`` (the driver collect the old path used) raises on every DataFrame class."""
    calls: list[int] = []

    def refuse(self: Any) -> Any:
        calls.append(1)
        raise AssertionError("toArrow called: the output went through the driver")

    for cls in {type(spark.range(1)), *type(spark.range(1)).__mro__[:-1]}:
        if "toArrow" in vars(cls):
            monkeypatch.setattr(cls, "toArrow", refuse)
    yield calls


def _table(ids: range, tag: str, deleted: set[int] | None = None) -> pa.Table:
    cols: dict[str, Any] = {
        "id": pa.array(list(ids), pa.int64()),
        "s": [f"{tag}{i % 3}" for i in ids],  # some rows equal across versions: no update
        "f": [None if i % 5 == 0 else i * 0.5 for i in ids],
    }
    if deleted is not None:
        cols["gone"] = [i in deleted for i in ids]
    return pa.table(cols)


def _contents(persist: PersistResource, name: str, as_of: int) -> list[tuple[Any, ...]]:
    with persist.controller().acquire_read_handle(name) as r:
        snap = r.snapshot(as_of)
    cols = [c for c in snap.column_names if c not in ("ts", "diff")]
    return sorted(tuple(repr(row[c]) for c in cols) for row in snap.to_pylist() for _ in range(row["diff"]))


def _times(res: Any) -> dict[str, dict[str, Any]]:
    return {
        e.asset_key.to_user_string(): {k: v.value for k, v in e.materialization.metadata.items()}
        for e in res.get_asset_materialization_events()
    }


@pytest.mark.slow  # six Spark writes and their reads (~50 s on a loaded 2-core machine)
def test_pyspark_outputs_store_what_pyarrow_stores_in_every_mode(
    persist: PersistResource, instance: dg.DagsterInstance, spark: Any, no_driver_arrow: list[int]
) -> None:
    rounds = [
        {"append": _table(range(0, 8), "a"), "overwrite": _table(range(0, 8), "a"), "upsert": _table(range(0, 8), "a", set())},
        {"append": _table(range(4, 12), "a"), "overwrite": _table(range(4, 12), "b"), "upsert": _table(range(4, 12), "b", {5, 9})},
    ]
    state = {"i": 0}

    def pair(mode: str) -> list[dg.AssetsDefinition]:
        md = {"persist/key": ["id"], "persist/mode": mode, "persist/num_shards": 2,
              **({"persist/delete_column": "gone"} if mode == "upsert" else {})}

        @dg.asset(name=f"spk_{mode}", key_prefix=["sw"], metadata=md)
        def spk() -> Any:
            return spark.createDataFrame(rounds[state["i"]][mode].to_pandas())

        @dg.asset(name=f"arw_{mode}", key_prefix=["sw"], metadata=md)
        def arw() -> pa.Table:
            return rounds[state["i"]][mode]

        return [spk, arw]

    modes = ["append", "overwrite", "upsert"]
    assets = [a for m in modes for a in pair(m)]
    io = {"io_manager": PersistIOManager(persist=persist)}
    runs = []
    for i in range(2):
        state["i"] = i
        res = dg.materialize(assets, resources=io, instance=instance)
        assert res.success
        runs.append(_times(res))
    assert no_driver_arrow == []
    for run in runs:
        for m in modes:
            spk, arw = run[f"sw/spk_{m}"], run[f"sw/arw_{m}"]
            assert spk["persist/type"] == "pyspark" and arw["persist/type"] == "pyarrow"
            assert (spk["persist/inserted"], spk["persist/retracted"]) == (arw["persist/inserted"], arw["persist/retracted"]), m
            got = _contents(persist, f"sw.spk_{m}", spk["persist/time"])
            assert got == _contents(persist, f"sw.arw_{m}", arw["persist/time"]), m
            assert got, m
    # the history is the same too: the first write's contents stay readable
    assert runs[1]["sw/spk_overwrite"]["persist/retracted"] > 0


DAYS = ["2026-04-01", "2026-04-02"]
daily = dg.DailyPartitionsDefinition(start_date=DAYS[0], end_date="2026-04-03")


def _day(day: str, tag: str) -> pa.Table:
    t = _table(range(6), tag)
    return t.append_column("day", pa.array([dt.date.fromisoformat(day)] * t.num_rows, pa.date32()))


@pytest.mark.slow  # three partition materializations (~25 s)
def test_a_partition_overwrite_replaces_exactly_that_partition(
    persist: PersistResource, instance: dg.DagsterInstance, spark: Any, no_driver_arrow: list[int]
) -> None:
    tag = {"v": "a"}

    @dg.asset(key_prefix=["sw"], partitions_def=daily,
              metadata={"persist/key": ["day", "id"], "persist/partition_column": "day"})
    def spk_daily(context: dg.AssetExecutionContext) -> Any:
        return spark.createDataFrame(_day(context.partition_key, tag["v"]).to_pandas())

    io = {"io_manager": PersistIOManager(persist=persist)}
    for day in DAYS:
        assert dg.materialize([spk_daily], partition_key=day, resources=io, instance=instance).success
    tag["v"] = "b"
    res = dg.materialize([spk_daily], partition_key=DAYS[0], resources=io, instance=instance)
    assert res.success and no_driver_arrow == []
    md = _times(res)["sw/spk_daily"]
    want = pa.concat_tables([_day(DAYS[0], "b"), _day(DAYS[1], "a")])
    with persist.controller().acquire_read_handle("sw.spk_daily") as r:
        snap = r.snapshot(md["persist/time"])
    assert all(d == 1 for d in snap.column("diff").to_pylist())
    assert sorted(map(repr, snap.select(want.column_names).to_pylist())) == sorted(map(repr, want.to_pylist()))
    # rows outside the partition are refused on the executors' check; nothing written
    tag["v"] = "c"
    wrong = {"day": DAYS[1]}

    @dg.asset(key_prefix=["sw"], name="spk_daily", partitions_def=daily,
              metadata={"persist/key": ["day", "id"], "persist/partition_column": "day"})
    def spk_wrong() -> Any:
        return spark.createDataFrame(_day(wrong["day"], "c").to_pandas())

    with pytest.raises(Exception) as ei:
        dg.materialize([spk_wrong], partition_key=DAYS[0], resources=io, instance=instance)
    err = root_error(ei.value)
    assert isinstance(err, PartitionMismatch) and "6 output row(s) lie outside partition 2026-04-01" in str(err)
    with persist.controller().acquire_read_handle("sw.spk_daily") as r:
        assert r.upper.time == md["persist/time"] + 1


def test_a_retried_step_writes_nothing_twice(
    persist: PersistResource, instance: dg.DagsterInstance, spark: Any, no_driver_arrow: list[int]
) -> None:
    attempts: list[int] = []

    @dg.multi_asset(
        outs={"first": dg.AssetOut(key=["sw_retry", "first"], metadata={"persist/key": ["id"], "persist/mode": "append"})},
        retry_policy=dg.RetryPolicy(max_retries=1),
    )
    def first() -> Iterator[dg.Output[Any]]:
        attempts.append(1)
        yield dg.Output(spark.createDataFrame(_table(range(5), "r").to_pandas()), "first")
        if len(attempts) == 1:
            raise RuntimeError("fails after the output was stored")

    res = dg.materialize([first], resources={"io_manager": PersistIOManager(persist=persist)}, instance=instance)
    assert res.success and len(attempts) == 2
    evs = [{k: v.value for k, v in e.materialization.metadata.items()} for e in res.get_asset_materialization_events()]
    assert [e["persist/replayed"] for e in evs] == [False, True]
    (t,) = {e["persist/time"] for e in evs}
    assert len(_contents(persist, "sw_retry.first", t)) == 5  # each row once


def test_a_write_that_lost_the_race_recomputes(
    persist: PersistResource, instance: dg.DagsterInstance, spark: Any, no_driver_arrow: list[int]
) -> None:
    """Between computing its difference and committing it, an overwrite sees another
    run overwrite the collection: its commit loses, it recomputes against the new
    contents and lands exactly its own output."""
    src = {"v": _table(range(2, 7), "y"), "other": _table(range(6), "x")}

    @dg.asset(key_prefix=["sw"], metadata={"persist/key": ["id"]})
    def raced() -> Any:
        return spark.createDataFrame(src["v"].to_pandas())

    @dg.asset(key_prefix=["sw"], name="raced", metadata={"persist/key": ["id"]})
    def raced_arrow() -> pa.Table:
        return src["other"]

    plain = PersistIOManager(persist=persist)
    assert dg.materialize([raced_arrow], resources={"io_manager": plain}, instance=instance).success  # the old contents

    def concurrent_write() -> None:
        src["other"] = _table(range(3, 9), "other")
        assert dg.materialize([raced_arrow], resources={"io_manager": plain}, instance=instance).success

    res = dg.materialize([raced], resources={"io_manager": interleaving(persist, concurrent_write)}, instance=instance)
    assert res.success and no_driver_arrow == []
    md = _times(res)["sw/raced"]
    assert md["persist/attempts"] == 2
    want = sorted(tuple(repr(r[c]) for c in ("id", "s", "f")) for r in src["v"].to_pylist())
    assert _contents(persist, "sw.raced", md["persist/time"]) == want


@pytest.mark.slow  # three materializations (~25 s on a loaded machine)
def test_schema_following_is_done_with_spark_columns(
    persist: PersistResource, instance: dg.DagsterInstance, spark: Any, no_driver_arrow: list[int]
) -> None:
    """A PySpark output follows its collection's schema like an Arrow one: a narrower
    column is cast up, a missing nullable one written as nulls, a new one added (the
    collection evolves); a changed key column is refused and nothing is written."""
    from pyspark.sql import functions as F

    from dagster_project.io_manager import OutputSchemaMismatch

    first = pa.table({"id": pa.array([0, 1], pa.int64()), "n": pa.array([10, 11], pa.int64()), "s": ["a", "b"]})
    out: dict[str, Any] = {"v": first}
    md = {"persist/key": ["id"], "persist/mode": "append"}

    @dg.asset(key_prefix=["sw"], metadata=md)
    def follows() -> Any:
        return out["v"]

    io = {"io_manager": PersistIOManager(persist=persist)}
    assert dg.materialize([follows], resources=io, instance=instance).success
    out["v"] = spark.range(2, 4).select(
        F.col("id"), F.col("id").cast("int").alias("n"), F.concat(F.lit("x"), F.col("id").cast("string")).alias("x")
    )
    res = dg.materialize([follows], resources=io, instance=instance)
    assert res.success and no_driver_arrow == []
    md_out = _times(res)["sw/follows"]
    assert md_out["persist/type"] == "pyspark" and md_out["persist/schema_version"] >= 1
    with persist.controller().acquire_read_handle("sw.follows") as r:
        assert [f.type for f in r.schemas.val] == [pa.int64(), pa.string(), pa.string()]
        got = sorted((x["id"], x["n"], x["s"], x["x"]) for x in r.snapshot(md_out["persist/time"]).to_pylist())
    assert got == [(0, 10, "a", None), (1, 11, "b", None), (2, 2, None, "x2"), (3, 3, None, "x3")]
    out["v"] = spark.range(4, 5).select(F.col("id").cast("string").alias("id"), F.col("id").alias("n"))
    with pytest.raises(Exception) as ei:
        dg.materialize([follows], resources=io, instance=instance)
    err = root_error(ei.value)
    assert isinstance(err, OutputSchemaMismatch) and "key columns" in str(err) and "\n" not in str(err)
    with persist.controller().acquire_read_handle("sw.follows") as r:
        assert r.upper.time == md_out["persist/time"] + 1  # nothing written


def test_a_non_transactional_collection_takes_the_arrow_path(
    persist: PersistResource, instance: dg.DagsterInstance, spark: Any
) -> None:
    """A collection created non-transactional (before the I/O manager made them
    transactional) can't take the data and the ledger entry in one Spark transaction:
    the PySpark output goes through the driver (Arrow) instead, and lands."""
    v1 = _table(range(4), "l")
    persist.controller().create_collection("sw.legacy", v1.schema.remove(2).remove(1), v1.schema.remove(0))

    @dg.asset(key_prefix=["sw"], metadata={"persist/key": ["id"]})
    def legacy() -> Any:
        return spark.createDataFrame(v1.to_pandas())

    res = dg.materialize([legacy], resources={"io_manager": PersistIOManager(persist=persist)}, instance=instance)
    assert res.success
    md = _times(res)["sw/legacy"]
    assert md["persist/type"] == "pyspark" and not persist.controller().is_transactional("sw.legacy")
    assert _contents(persist, "sw.legacy", md["persist/time"]) == sorted(
        tuple(repr(r[c]) for c in ("id", "s", "f")) for r in v1.to_pylist()
    )
    logs = [e for e in instance.all_logs(res.run_id) if "is not transactional" in (e.user_message or "")]
    assert logs, "the fallback's reason was not logged"
