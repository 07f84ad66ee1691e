"""The I/O manager follows an output whose columns changed (io_manager/schema_follow.py).

A new column evolves the collection in place (history before it reads null there, a
downstream reading as of an old materialization gets the old rows), a wider type widens
it, a narrower one is cast up, a missing nullable column is written as nulls, column
order does not matter; ``persist/schema_change: fail`` refuses any change; a change of
kind is refused with nothing written.
"""

from __future__ import annotations

from typing import Any

import dagster as dg
import pyarrow as pa
import pytest

from dagster_project.io_manager import OutputSchemaMismatch, PersistIOManager
from dagster_project.resources import PersistResource
from tests.io_manager_fixtures import root_error

pytestmark = pytest.mark.dagster
pytest_plugins = ["tests.io_manager_fixtures"]

holder: dict[str, pa.Table] = {}


def _asset(name: str, **md: Any) -> dg.AssetsDefinition:
    @dg.asset(name=name, key_prefix=["evo"], metadata={"persist/key": ["id"], **md})
    def a() -> pa.Table:
        return holder["v"]

    return a


def _write(persist: PersistResource, instance: dg.DagsterInstance, asset: dg.AssetsDefinition, t: pa.Table) -> dict[str, Any]:
    holder["v"] = t
    res = dg.materialize([asset], resources={"io_manager": PersistIOManager(persist=persist)}, instance=instance)
    assert res.success
    (ev,) = res.get_asset_materialization_events()
    return {k: v.value for k, v in ev.materialization.metadata.items()}


def _at(persist: PersistResource, name: str, t: int) -> pa.Table:
    with persist.controller().acquire_read_handle(name) as r:
        snap = r.snapshot(t)
    assert set(snap["diff"].to_pylist()) <= {1}
    return snap.drop(["ts", "diff"]).sort_by("id")


def test_outputs_that_grow_columns_and_widen_types_evolve_the_collection(
    persist: PersistResource, instance: dg.DagsterInstance
) -> None:
    a = _asset("grow")
    v1 = pa.table({"id": pa.array([1, 2], pa.int64()), "qty": pa.array([1, 2], pa.int32())})
    m1 = _write(persist, instance, a, v1)
    assert "persist/schema_version" not in m1
    # a new column, qty widened to int64, and the value columns in another order
    v2 = pa.table({
        "id": pa.array([1, 2, 3], pa.int64()), "note": ["x", None, "z"],
        "qty": pa.array([10, 2, 1 << 40], pa.int64()),
    })
    m2 = _write(persist, instance, a, v2)
    assert m2["persist/schema_version"] == 1
    info = persist.controller().schema("evo.grow")
    assert info["version"] == 1 and "note" in info["schemas"] and "qty: int64" in info["schemas"]
    got2 = _at(persist, "evo.grow", m2["persist/time"])
    assert got2.column_names == ["id", "qty", "note"]
    assert got2.to_pylist() == [
        {"id": 1, "qty": 10, "note": "x"}, {"id": 2, "qty": 2, "note": None}, {"id": 3, "qty": 1 << 40, "note": "z"},
    ]
    # the first materialization reads back as it was, in the evolved schemas
    assert _at(persist, "evo.grow", m1["persist/time"]).to_pylist() == [
        {"id": 1, "qty": 1, "note": None}, {"id": 2, "qty": 2, "note": None},
    ]
    # an output without the nullable column, with qty narrower again: nulls, cast up
    v3 = pa.table({"id": pa.array([5], pa.int64()), "qty": pa.array([7], pa.int16())})
    m3 = _write(persist, instance, a, v3)
    assert "persist/schema_version" not in m3
    assert _at(persist, "evo.grow", m3["persist/time"]).to_pylist() == [{"id": 5, "qty": 7, "note": None}]


def test_refused_changes_write_nothing(persist: PersistResource, instance: dg.DagsterInstance) -> None:
    strict = _asset("strict", **{"persist/schema_change": "fail"})
    m = _write(persist, instance, strict, pa.table({"id": [1], "x": ["a"]}))
    name = "evo.strict"
    before = persist.controller().describe(name)

    def refused(asset: dg.AssetsDefinition, t: pa.Table) -> BaseException:
        holder["v"] = t
        with pytest.raises(Exception) as ei:
            dg.materialize([asset], resources={"io_manager": PersistIOManager(persist=persist)}, instance=instance)
        err = root_error(ei.value)
        assert isinstance(err, OutputSchemaMismatch) and "\n" not in str(err), err
        return err

    e = refused(strict, pa.table({"id": [1], "x": ["a"], "y": [1.0]}))
    assert "persist/schema_change is 'fail'" in str(e)
    loose = _asset("strict")  # same collection, default policy
    e = refused(loose, pa.table({"id": [1], "x": [1.5]}))  # string -> double: a change of kind
    assert "column 'x' is double in the output, string in the collection" in str(e)
    e = refused(loose, pa.table({"id": ["1"], "x": ["a"]}))  # a key column changed
    assert "key columns can't change" in str(e)
    after = persist.controller().describe(name)
    assert after["schemas"] == before["schemas"] and after["metadata_upper"] == before["metadata_upper"]
    assert _at(persist, name, m["persist/time"]).to_pylist() == [{"id": 1, "x": "a"}]
    with pytest.raises(Exception, match="persist/schema_change must be one of evolve, fail"):
        _write(persist, instance, _asset("strict", **{"persist/schema_change": "merge"}), pa.table({"id": [1], "x": ["a"]}))
