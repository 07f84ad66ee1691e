"""PersistIOManager on both kinds of DagsterInstance: ``DagsterInstance.ephemeral()`` (in
memory, what ``materialize()`` uses by default) and an on-disk one (SQLite under a temp
DAGSTER_HOME), through Dagster's own ``materialize()``.

Each test runs on both: the round trip and its lineage, history kept by overwrites, a
retried step that writes nothing twice, and reads ``as_of`` a given run (input metadata
``persist/as_of: <run id>``: the upstream as of the time that run's materialization
recorded, looked up in the instance's event log), with its typed one-line errors.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import dagster as dg
import pyarrow as pa
import pytest

from dagster_project.io_manager import (
    IOManagerConfigError,
    PersistIOManager,
    RunDidNotMaterialize,
    UnknownAsOfRun,
)
from dagster_project.resources import PersistResource
from tests.io_manager_fixtures import root_error

pytestmark = pytest.mark.dagster
pytest_plugins = ["tests.io_manager_fixtures"]

V1 = pa.table({"id": [1, 2, 3], "x": ["a", "b", "c"]})
V2 = pa.table({"id": [1, 2, 4], "x": ["a", "B", "d"]})


@pytest.fixture(params=["ephemeral", "on_disk"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def dagster_instance(kind: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dg.DagsterInstance]:
    if kind == "ephemeral":
        with dg.DagsterInstance.ephemeral() as inst:
            assert not inst.is_persistent
            yield inst
    else:
        with dg.instance_for_test(temp_dir=str(tmp_path_factory.mktemp("dagster"))) as inst:
            assert inst.is_persistent
            yield inst


def _rows(t: pa.Table) -> list[tuple[Any, ...]]:
    return sorted(tuple(r.values()) for r in t.select(sorted(t.column_names)).to_pylist())


def _mat(result: dg.ExecuteInJobResult, key: dg.AssetKey) -> dict[str, Any]:
    (ev,) = [e for e in result.get_asset_materialization_events() if e.asset_key == key]
    m = ev.materialization
    return {**{k: v.value for k, v in m.metadata.items()}, "_tags": dict(m.tags or {})}


def _snapshot(persist: PersistResource, name: str, as_of: int) -> list[tuple[Any, ...]]:
    with persist.controller().acquire_read_handle(name) as r:
        snap = r.snapshot(as_of)
    assert set(snap.column("diff").to_pylist()) <= {1}
    return _rows(snap.drop_columns(["ts", "diff"]))


class Upstream:
    """An asset whose output the test sets before each materialization."""

    def __init__(self, prefix: str) -> None:
        self.value = V1

        @dg.asset(key_prefix=[prefix], metadata={"persist/key": ["id"]})
        def up() -> pa.Table:
            return self.value

        self.asset = up

    def materialize(self, persist: PersistResource, instance: dg.DagsterInstance, value: pa.Table) -> tuple[str, int]:
        self.value = value
        res = dg.materialize([self.asset], resources={"io_manager": PersistIOManager(persist=persist)}, instance=instance)
        assert res.success
        return res.run_id, _mat(res, self.asset.key)["persist/time"]


def _reader(name: str, up: dg.AssetsDefinition, as_of: object) -> dg.AssetsDefinition:
    @dg.asset(name=name, ins={"u": dg.AssetIn(key=up.key, metadata={"persist/as_of": as_of})}, io_manager_key="mem")
    def r(u: pa.Table) -> pa.Table:
        return u

    return r


def _read(persist: PersistResource, instance: dg.DagsterInstance, up: dg.AssetsDefinition, **as_ofs: object) -> dg.ExecuteInJobResult:
    readers = [_reader(n, up, a) for n, a in as_ofs.items()]
    return dg.materialize(
        [up, *readers], selection=[r.key for r in readers], instance=instance,
        resources={"io_manager": PersistIOManager(persist=persist), "mem": dg.InMemoryIOManager()},
    )


def test_round_trip_history_and_lineage(persist: PersistResource, dagster_instance: dg.DagsterInstance, kind: str) -> None:
    """An upstream written twice (an overwrite) and a downstream in the second run: the
    downstream reads exactly the second output, records the time it read, and the first
    output stays readable at its time."""
    up = Upstream(f"{kind}_rt")
    _, t1 = up.materialize(persist, dagster_instance, V1)

    @dg.asset(key_prefix=[f"{kind}_rt"], metadata={"persist/key": ["id"]}, ins={"u": dg.AssetIn(key=up.asset.key)})
    def copy(u: pa.Table) -> pa.Table:
        return u

    up.value = V2
    res = dg.materialize([up.asset, copy], resources={"io_manager": PersistIOManager(persist=persist)}, instance=dagster_instance)
    assert res.success
    t2 = _mat(res, up.asset.key)["persist/time"]
    down = _mat(res, copy.key)
    assert t1 < t2
    assert _snapshot(persist, f"{kind}_rt.up", t1) == _rows(V1)
    assert _snapshot(persist, f"{kind}_rt.up", t2) == _rows(V2)
    assert _rows(res.output_for_node(copy.node_def.name)) == _rows(V2)
    assert down[f"persist/read/{kind}_rt.up"] == t2
    assert down["_tags"][f"dagster/input_data_version/{kind}_rt/up"] == f"persist@{t2}"


def test_as_of_a_run_reads_that_runs_materialization(
    persist: PersistResource, dagster_instance: dg.DagsterInstance, kind: str
) -> None:
    """Run A writes V1, run B writes V2: a downstream reading ``as_of`` run A gets V1
    exactly (after the upstream was materialized again), ``as_of`` run B gets V2, and the
    time it read is the one run A recorded."""
    up = Upstream(f"{kind}_asof")
    run_a, t1 = up.materialize(persist, dagster_instance, V1)
    run_b, t2 = up.materialize(persist, dagster_instance, V2)
    assert t1 < t2
    res = _read(persist, dagster_instance, up.asset, at_a=run_a, at_b=run_b, rec="recorded")
    assert res.success
    assert _rows(res.output_for_node("at_a")) == _rows(V1)
    assert _rows(res.output_for_node("at_b")) == _rows(V2)
    assert _rows(res.output_for_node("rec")) == _rows(V2)  # the latest recorded materialization
    loaded = {
        e.step_key: e.event_specific_data.metadata["persist/as_of"].value  # type: ignore[union-attr]
        for e in res.all_events if e.event_type == dg.DagsterEventType.LOADED_INPUT
    }
    assert loaded == {"at_a": t1, "at_b": t2, "rec": t2}


def test_as_of_an_unknown_run_or_one_that_did_not_materialize_fails_with_one_line(
    persist: PersistResource, dagster_instance: dg.DagsterInstance, kind: str
) -> None:
    up = Upstream(f"{kind}_bad")
    up.materialize(persist, dagster_instance, V1)
    other = Upstream(f"{kind}_other")
    run_other, _ = other.materialize(persist, dagster_instance, V2)
    cases: list[tuple[object, type[Exception], str]] = [
        ("0d4c5b1e-0000-4000-8000-000000000000", UnknownAsOfRun, "which this Dagster instance does not know"),
        (run_other, RunDidNotMaterialize, f"recorded no persist time for {kind}_bad/up"),
        ("  ", IOManagerConfigError, "persist/as_of must be 'recorded', 'latest', a persist time (an int >= 0) or a run id"),
    ]
    for as_of, typ, message in cases:
        with pytest.raises(Exception) as ei:
            _read(persist, dagster_instance, up.asset, r=as_of)
        err = root_error(ei.value)
        assert isinstance(err, typ) and message in str(err) and "\n" not in str(err), (as_of, err)


def test_retried_step_writes_nothing_twice(persist: PersistResource, dagster_instance: dg.DagsterInstance, kind: str) -> None:
    """A multi-asset stores an append-mode output, then fails; Dagster retries the step
    in the same run: the output is not appended again (its ledger entry is found)."""
    attempts: list[int] = []

    @dg.multi_asset(
        outs={
            "first": dg.AssetOut(key=[f"{kind}_retry", "first"], metadata={"persist/key": ["id"], "persist/mode": "append"}),
            "second": dg.AssetOut(key=[f"{kind}_retry", "second"], metadata={"persist/key": ["id"]}),
        },
        retry_policy=dg.RetryPolicy(max_retries=1),
    )
    def both() -> Iterator[dg.Output[pa.Table]]:
        attempts.append(1)
        yield dg.Output(V1, "first")
        if len(attempts) == 1:
            raise RuntimeError("fails after the first output was stored")
        yield dg.Output(V2, "second")

    res = dg.materialize([both], resources={"io_manager": PersistIOManager(persist=persist)}, instance=dagster_instance)
    assert res.success and len(attempts) == 2
    first = [e for e in res.get_asset_materialization_events() if e.asset_key == dg.AssetKey([f"{kind}_retry", "first"])]
    assert [e.materialization.metadata["persist/replayed"].value for e in first] == [False, True]
    (t,) = {e.materialization.metadata["persist/time"].value for e in first}
    assert _snapshot(persist, f"{kind}_retry.first", t) == _rows(V1)  # each row once
