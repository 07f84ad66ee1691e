"""PersistIOManager with Dagster's own ``materialize()`` and real DagsterInstances.

Round trips, the three write modes' contents and history, reproducible reads (a
downstream reads its upstream as of the recorded materialization, also in a
re-execution after the upstream was materialized again), retried steps that write
nothing twice (``test_io_manager_instances.py``, on ephemeral and on-disk instances), and
bad configuration that fails at once with one clear line.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import dagster as dg
import pyarrow as pa
import pytest

from dagster_project.io_manager import AsOfNotReadable, OutputSchemaMismatch, PersistIOManager
from dagster_project.resources import PersistResource
from persist_lib.errors import InvalidUsage
from tests.io_manager_fixtures import root_error

pytestmark = pytest.mark.dagster
pytest_plugins = ["tests.io_manager_fixtures"]


def _rows(t: pa.Table) -> list[dict[str, Any]]:
    cols = sorted(t.column_names)
    return sorted(t.select(cols).to_pylist(), key=lambda r: [repr(r[c]) for c in cols])


def _snapshot(persist: PersistResource, name: str, as_of: int) -> list[dict[str, Any]]:
    with persist.controller().acquire_read_handle(name) as r:
        snap = r.snapshot(as_of)
    out = []
    for row in snap.to_pylist():
        d = row.pop("diff")
        row.pop("ts")
        out += [row] * d
    return _rows(pa.Table.from_pylist(out)) if out else []


def _mat(result: dg.ExecuteInJobResult, key: str) -> dict[str, Any]:
    evs = [e for e in result.get_asset_materialization_events() if e.asset_key.to_user_string() == key]
    assert len(evs) == 1, evs
    m = evs[0].materialization
    return {**{k: v.value for k, v in m.metadata.items()}, "_tags": dict(m.tags or {})}


def _io(persist: PersistResource, **kw: Any) -> PersistIOManager:
    return PersistIOManager(persist=persist, **kw)


def test_pyarrow_round_trip_exact_and_lineage(persist: PersistResource, instance: dg.DagsterInstance) -> None:
    table = pa.table(
        {
            "id": pa.array([3, 1, 2], pa.int64()),
            "name": pa.array(["c", None, "a"], pa.string()),
            "amount": pa.array([1.5, 2.25, -0.0], pa.float64()),
            "day": pa.array([19000, 19001, 19002], pa.date32()),
            "at": pa.array([1, 2, 3], pa.timestamp("us", "UTC")),
        }
    )

    @dg.asset(key_prefix=["rt"], metadata={"persist/key": ["id"]})
    def src() -> pa.Table:
        return table

    @dg.asset(key_prefix=["rt"], metadata={"persist/key": ["id"]}, ins={"src": dg.AssetIn(key=["rt", "src"])})
    def copy(src: pa.Table) -> pa.Table:
        assert src.schema == table.select(src.column_names).schema
        return src

    res = dg.materialize([src, copy], resources={"io_manager": _io(persist)}, instance=instance)
    assert res.success
    up, down = _mat(res, "rt/src"), _mat(res, "rt/copy")
    # the key prefix is the namespace; the collection holds the output as of the recorded time
    assert up["persist/collection"] == "rt.src"
    assert _snapshot(persist, "rt.src", up["persist/time"]) == _rows(table)
    assert _rows(res.output_for_node("rt__copy")) == _rows(table)
    # data versions are the persist times; the downstream records the time it read
    assert up["_tags"]["dagster/data_version"] == f"persist@{up['persist/time']}"
    assert down["_tags"]["dagster/input_data_version/rt/src"] == f"persist@{up['persist/time']}"
    assert down["persist/read/rt.src"] == up["persist/time"]


def _versions(persist: PersistResource, instance: dg.DagsterInstance, asset: dg.AssetsDefinition, outputs: list[pa.Table]) -> list[int]:
    times = []
    for t in outputs:
        holder["v"] = t
        res = dg.materialize([asset], resources={"io_manager": _io(persist)}, instance=instance)
        assert res.success
        times.append(_mat(res, asset.key.to_user_string())["persist/time"])
    return times


holder: dict[str, Any] = {}


def _asset(name: str, **md: Any) -> dg.AssetsDefinition:
    @dg.asset(name=name, key_prefix=["modes"], metadata={"persist/key": ["id"], **md})
    def a() -> pa.Table:
        return holder["v"]

    return a


V1 = pa.table({"id": [1, 2, 3], "x": ["a", "b", "c"]})
V2 = pa.table({"id": [1, 2, 4], "x": ["a", "B", "d"]})


def test_overwrite_is_a_diff_and_keeps_history(persist: PersistResource, instance: dg.DagsterInstance) -> None:
    t1, t2 = _versions(persist, instance, _asset("ow"), [V1, V2])
    assert t1 < t2
    assert _snapshot(persist, "modes.ow", t1) == _rows(V1)
    assert _snapshot(persist, "modes.ow", t2) == _rows(V2)
    # written as the difference: only the changed rows are updates at t2
    with persist.controller().acquire_read_handle("modes.ow") as r:
        changes = r.updates_between_batches(t2, t2 + 1).read_all().to_pylist()
    assert sorted((c["id"], c["x"], c["diff"]) for c in changes) == [
        (2, "B", 1), (2, "b", -1), (3, "c", -1), (4, "d", 1)
    ]


def test_four_shard_asset_round_trip_and_overwrite(persist: PersistResource, instance: dg.DagsterInstance) -> None:
    """A 4-shard collection: each write (and its ledger entry) is one transaction over
    every shard; an overwrite's difference spans the shards; a downstream reads it back."""
    big1 = pa.table({"id": list(range(200)), "x": [f"a{i}" for i in range(200)]})
    big2 = pa.table({"id": list(range(10, 210)), "x": [f"b{i}" if i % 2 else f"a{i}" for i in range(10, 210)]})
    upstream = _asset("sharded", **{"persist/num_shards": 4})
    t1, t2 = _versions(persist, instance, upstream, [big1, big2])
    ctl = persist.controller()
    assert ctl.is_transactional("modes.sharded")
    shards = ctl.describe("modes.sharded")["renditions"]["r0"]["shards"]
    assert len(shards) == 4
    for s in shards:  # every shard holds some of the rows and moved to t2 + 1 with the others
        st = ctl.client.machine(s).fetch_latest()
        assert st.upper.time == t2 + 1 and sum(p.count for b in st.batches.values() for p in b.parts) > 0, s
    assert _snapshot(persist, "modes.sharded", t1) == _rows(big1)
    assert _snapshot(persist, "modes.sharded", t2) == _rows(big2)
    with ctl.acquire_read_handle("modes.sharded") as r:
        changes = r.updates_between_batches(t2, t2 + 1).read_all()
    assert changes.num_rows == 10 + 2 * 95 + 10  # ids 0-9 dropped; 95 odd ids changed (-old, +new); 200-209 added

    seen: dict[str, pa.Table] = {}

    @dg.asset(key_prefix=["modes"], metadata={"persist/key": ["id"]}, ins={"src": dg.AssetIn(key=["modes", "sharded"])})
    def sharded_copy(src: pa.Table) -> pa.Table:
        seen["src"] = src
        return src

    res = dg.materialize(
        [upstream, sharded_copy], resources={"io_manager": _io(persist)}, instance=instance,
        selection=[sharded_copy.key],
    )
    assert res.success
    assert _rows(seen["src"]) == _rows(big2)


def test_an_old_non_transactional_collection_keeps_the_two_commit_path(
    persist: PersistResource, instance: dg.DagsterInstance
) -> None:
    """A collection created before the I/O manager made them transactional is still
    written: the data, then its ledger entry (two commits)."""
    ctl = persist.controller()
    ctl.create_collection("legacy.t", V1.schema.remove(1), V1.schema.remove(0))
    (t1,) = _versions(persist, instance, _asset("t", **{"persist/mode": "append"}).with_attributes(
        asset_key_replacements={dg.AssetKey(["modes", "t"]): dg.AssetKey(["legacy", "t"])}
    ), [V1])
    ctl = persist.controller()
    assert not ctl.is_transactional("legacy.t")
    assert _snapshot(persist, "legacy.t", t1) == _rows(V1)
    with ctl.acquire_read_handle("dagster_io.writes") as r:
        entries = r.snapshot((r.upper.time or 1) - 1).to_pylist()
    assert [e["time"] for e in entries if e["collection"] == "legacy.t"] == [t1]


def test_append_adds_every_row(persist: PersistResource, instance: dg.DagsterInstance) -> None:
    t1, t2 = _versions(persist, instance, _asset("ap", **{"persist/mode": "append"}), [V1, V2])
    assert _snapshot(persist, "modes.ap", t1) == _rows(V1)
    assert _snapshot(persist, "modes.ap", t2) == _rows(pa.concat_tables([V1, V2]))


def test_upsert_replaces_and_deletes_by_key(persist: PersistResource, instance: dg.DagsterInstance) -> None:
    a = _asset("up", **{"persist/mode": "upsert", "persist/delete_column": "gone"})
    flagged = pa.table({"id": [2, 3, 5], "x": ["B", "c", "e"], "gone": [False, True, None]})
    t1, t2 = _versions(persist, instance, a, [V1.append_column("gone", pa.array([False] * 3)), flagged])
    assert _snapshot(persist, "modes.up", t1) == _rows(V1)
    assert _snapshot(persist, "modes.up", t2) == _rows(pa.table({"id": [1, 2, 5], "x": ["a", "B", "e"]}))


def _asof_job() -> dg.JobDefinition:
    """The re-execution test's job, rebuilt from the environment in any process."""
    state = Path(os.environ["IOM_ASOF_STATE"])

    @dg.asset(key_prefix=["asof"], metadata={"persist/key": ["id"]})
    def base() -> pa.Table:
        return pa.Table.from_pylist(json.loads(state.read_text())["rows"])

    @dg.asset(key_prefix=["asof"], metadata={"persist/key": ["id"]}, ins={"base": dg.AssetIn(key=["asof", "base"])})
    def derived(base: pa.Table) -> pa.Table:
        if json.loads(state.read_text())["fail"]:
            raise RuntimeError("downstream fails once")
        return base

    io = PersistIOManager(persist=PersistResource(home=os.environ["IOM_ASOF_HOME"]))
    defs = dg.Definitions(
        assets=[base, derived], jobs=[dg.define_asset_job("asof_job")],
        resources={"io_manager": io}, executor=dg.in_process_executor,
    )
    return defs.resolve_job_def("asof_job")


def _reads(instance: dg.DagsterInstance, run_id: str, key: list[str]) -> dict[str, Any]:
    recs = instance.get_records_for_run(run_id, of_type=dg.DagsterEventType.ASSET_MATERIALIZATION).records
    mats = [r.event_log_entry.asset_materialization for r in recs]
    (m,) = [m for m in mats if m is not None and m.asset_key == dg.AssetKey(key)]
    return {k: v.value for k, v in m.metadata.items()}


def test_downstream_reads_as_of_recorded_time_after_upstream_rematerialized(
    persist: PersistResource, instance: dg.DagsterInstance, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run 1: upstream v1 lands, the downstream fails. The upstream is materialized again
    (v2). Re-executing run 1 from failure, the downstream reads v1 -- the data of the
    materialization it depends on -- not the newer v2; a new run reads v2."""
    state = tmp_path / "state.json"
    monkeypatch.setenv("IOM_ASOF_STATE", str(state))
    monkeypatch.setenv("IOM_ASOF_HOME", persist.home)
    job = dg.reconstructable(_asof_job)

    def put(rows: pa.Table, fail: bool) -> None:
        state.write_text(json.dumps({"rows": rows.to_pylist(), "fail": fail}))

    put(V1, True)
    with dg.execute_job(job, instance) as run1:
        assert not run1.success
        run1_id = run1.run_id
    t1 = _reads(instance, run1_id, ["asof", "base"])["persist/time"]
    put(V2, False)
    with dg.execute_job(job, instance, asset_selection=[dg.AssetKey(["asof", "base"])]) as again:
        assert again.success
    t2 = _reads(instance, again.run_id, ["asof", "base"])["persist/time"]
    assert t2 > t1
    with dg.execute_job(
        job, instance, reexecution_options=dg.ReexecutionOptions.from_failure(run1_id, instance)
    ) as run2:
        assert run2.success
    md = _reads(instance, run2.run_id, ["asof", "derived"])
    assert md["persist/read/asof.base"] == t1
    assert _snapshot(persist, "asof.derived", md["persist/time"]) == _rows(V1)
    with dg.execute_job(job, instance, asset_selection=[dg.AssetKey(["asof", "derived"])]) as run3:
        assert run3.success
    md = _reads(instance, run3.run_id, ["asof", "derived"])
    assert md["persist/read/asof.base"] == t2
    assert _snapshot(persist, "asof.derived", md["persist/time"]) == _rows(V2)


def test_latest_and_explicit_as_of_inputs(persist: PersistResource, instance: dg.DagsterInstance) -> None:
    t1, t2 = _versions(persist, instance, _asset("hist"), [V1, V2])

    def reader(name: str, as_of: object) -> dg.AssetsDefinition:
        @dg.asset(name=name, ins={"h": dg.AssetIn(key=["modes", "hist"], metadata={"persist/as_of": as_of, "columns": ["x"]})},
                  io_manager_key="mem")
        def r(h: pa.Table) -> pa.Table:
            return h

        return r

    old, new = reader("old", t1), reader("new", "latest")
    res = dg.materialize(
        [old, new, _asset("hist")], selection=["old", "new"],
        resources={"io_manager": _io(persist), "mem": dg.InMemoryIOManager()}, instance=instance,
    )
    assert res.success
    assert _rows(res.output_for_node("old")) == _rows(V1.select(["x"]))
    assert _rows(res.output_for_node("new")) == _rows(V2.select(["x"]))


@pytest.mark.parametrize("beyond", [0, 1000])
def test_an_as_of_at_or_beyond_the_upper_fails_at_once(
    persist: PersistResource, instance: dg.DagsterInstance, beyond: int
) -> None:
    """An integer ``persist/as_of`` the collection has not reached is refused before any
    read with one typed line naming the time, the upper and the fix (not a read that
    waits for the snapshot timeout)."""
    (t,) = _versions(persist, instance, _asset("ahead"), [V1])
    asked = t + 1 + beyond  # the upper is t + 1

    @dg.asset(name="ahead_reader", ins={"h": dg.AssetIn(key=["modes", "ahead"], metadata={"persist/as_of": asked})},
              io_manager_key="mem")
    def r(h: pa.Table) -> None:
        raise AssertionError("never called")

    with pytest.raises(Exception) as ei:
        dg.materialize([r, _asset("ahead")], selection=["ahead_reader"],
                       resources={"io_manager": _io(persist), "mem": dg.InMemoryIOManager()}, instance=instance)
    err = root_error(ei.value)
    assert isinstance(err, AsOfNotReadable), repr(err)
    msg = str(err)
    assert "\n" not in msg and f"persist/as_of {asked}" in msg and f"upper is {t + 1}" in msg
    assert f"ask for a time below {t + 1}" in msg


@pytest.mark.parametrize(
    ("metadata", "config", "message"),
    [
        ({}, {}, "no key columns: add metadata {'persist/key'"),
        ({"persist/key": ["id"], "persist/mode": "merge"}, {}, "unknown write mode 'merge'"),
        ({"persist/key": ["nope"]}, {}, "columns ['nope'] (persist/key, persist/delete_column) are not in the output"),
        ({"persist/key": ["id"]}, {"default_mode": "replace"}, "PersistIOManager.default_mode (field default_mode) = 'replace'"),
    ],
)
def test_bad_configuration_fails_at_once_with_one_line(
    persist: PersistResource, instance: dg.DagsterInstance, metadata: dict[str, Any], config: dict[str, Any], message: str
) -> None:
    @dg.asset(key_prefix=["bad"], metadata=metadata)
    def bad() -> pa.Table:
        return V1

    with pytest.raises(Exception) as ei:
        dg.materialize([bad], resources={"io_manager": _io(persist, **config)}, instance=instance)
    err = root_error(ei.value)
    assert message in str(err) and "\n" not in str(err), str(err)
    assert isinstance(err, InvalidUsage)
    assert "bad.bad" not in persist.controller().list_collections()  # nothing written


def test_schema_mismatch_is_refused_and_writes_nothing(persist: PersistResource, instance: dg.DagsterInstance) -> None:
    (t1,) = _versions(persist, instance, _asset("schema"), [V1])
    holder["v"] = pa.table({"id": [1], "x": [1.5]})
    with pytest.raises(Exception) as ei:
        dg.materialize([_asset("schema")], resources={"io_manager": _io(persist)}, instance=instance)
    err = root_error(ei.value)
    assert isinstance(err, OutputSchemaMismatch), err
    assert "differ from collection 'modes.schema'" in str(err) and "\n" not in str(err)
    with persist.controller().acquire_read_handle("modes.schema") as r:
        assert r.upper.time == t1 + 1
