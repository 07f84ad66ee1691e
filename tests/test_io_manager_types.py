"""PersistIOManager's type handlers round-trip exactly: pandas, polars DataFrame and
LazyFrame, PySpark (pyarrow is covered in test_io_manager.py). Each type is written by
one asset and read back, as the same type, by a downstream asset of the same run."""

import datetime as dt
from typing import Any

import dagster as dg
import pandas as pd
import polars as pl
import pyarrow as pa
import pytest

from dagster_project.io_manager import PersistIOManager
from dagster_project.resources import PersistResource

pytestmark = pytest.mark.dagster
pytest_plugins = ["tests.spark_fixtures", "tests.io_manager_fixtures"]


def _pair(name: str, typ: Any, value: Any, got: dict[str, Any], **md: Any) -> list[dg.AssetsDefinition]:
    @dg.asset(name=f"{name}_out", key_prefix=["types"], metadata={"persist/key": ["id"], **md})
    def out() -> typ:  # type: ignore[valid-type]
        return value

    @dg.asset(name=f"{name}_in", key_prefix=["types"], ins={"v": dg.AssetIn(key=["types", f"{name}_out"])}, io_manager_key="mem")
    def back(v: typ) -> None:  # type: ignore[valid-type]
        got[name] = v

    return [out, back]


def test_pandas_and_polars_round_trip_exactly(persist: PersistResource) -> None:
    pdf = pd.DataFrame(
        {
            "id": pd.Series([1, 2, 3], dtype="int64"),
            "name": ["a", None, "c"],
            "amount": [1.5, float("nan"), -2.0],
            "at": pd.to_datetime(["2026-01-01T00:00:00", "2026-01-02T12:00:00", "2026-01-03T00:00:00"], utc=True),
        }
    )
    pldf = pl.DataFrame(
        {"id": [1, 2, 3], "name": ["a", None, "c"], "day": [dt.date(2026, 1, d) for d in (1, 2, 3)], "n": [1.0, 2.5, None]}
    )
    got: dict[str, Any] = {}
    assets = (
        _pair("pandas", pd.DataFrame, pdf, got)
        + _pair("polars", pl.DataFrame, pldf, got)
        + _pair("lazy", pl.LazyFrame, pldf.lazy(), got)
    )
    with dg.instance_for_test() as instance:
        res = dg.materialize(
            assets, resources={"io_manager": PersistIOManager(persist=persist), "mem": dg.InMemoryIOManager()}, instance=instance
        )
    assert res.success
    pd.testing.assert_frame_equal(got["pandas"].sort_values("id").reset_index(drop=True), pdf)
    assert isinstance(got["polars"], pl.DataFrame) and got["polars"].sort("id").equals(pldf)
    assert got["polars"].schema == pldf.schema
    assert isinstance(got["lazy"], pl.LazyFrame) and got["lazy"].collect().sort("id").equals(pldf)
    # the stored types are the Arrow types of the output
    with persist.controller().acquire_read_handle("types.pandas_out") as r:
        assert r.schemas.key_names == ["id"] and r.schemas.val_names == ["name", "amount", "at"]


@pytest.mark.spark
def test_pyspark_round_trips_exactly(persist: PersistResource, spark: Any) -> None:
    sdf = spark.createDataFrame(
        pa.table({"id": pa.array([1, 2, 3], pa.int64()), "s": ["x", None, "z"], "f": [0.5, 1.5, None]}).to_pandas()
    )
    got: dict[str, Any] = {}
    from pyspark.sql import DataFrame

    with dg.instance_for_test() as instance:
        res = dg.materialize(
            _pair("spark", DataFrame, sdf, got),
            resources={"io_manager": PersistIOManager(persist=persist), "mem": dg.InMemoryIOManager()}, instance=instance,
        )
    assert res.success
    back = got["spark"]
    assert isinstance(back, DataFrame)
    assert back.schema == sdf.schema
    assert sorted(back.collect()) == sorted(sdf.collect())
