"""``insert_job``: rows into transactional collections as one transaction from Dagster
(a real temporary instance, in-process run, a temp PERSIST_HOME)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import dagster as dg
import pyarrow as pa
import pytest

from dagster_project.resources import PersistResource
from jobs.insert import insert_job
from persist_lib import PersistClient
from persist_lib.config import PersistConfig
from persist_lib.storage import StorageController

pytestmark = pytest.mark.dagster

K = pa.schema([("k", pa.int64())])
V = pa.schema([("v", pa.string())])


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for var in ("PERSIST_BLOB_URI", "PERSIST_CONSENSUS_URI"):
        monkeypatch.delenv(var, raising=False)
    h = tmp_path / "persist"
    monkeypatch.setenv("PERSIST_HOME", str(h))
    return h


@pytest.fixture
def instance(tmp_path: Path) -> Iterator[dg.DagsterInstance]:
    (tmp_path / "dagster").mkdir()
    with dg.instance_for_test(temp_dir=str(tmp_path / "dagster")) as inst:
        yield inst


def _run(home: Path, instance: dg.DagsterInstance, rows: dict) -> dg.ExecuteInJobResult:
    return insert_job.execute_in_process(
        resources={"persist": PersistResource(home=str(home))}, instance=instance,
        run_config={"ops": {"insert_rows_op": {"config": {"rows": rows}}}}, raise_on_error=False,
    )


def test_insert_job_writes_two_collections_at_one_time(home: Path, instance: dg.DagsterInstance) -> None:
    with StorageController(PersistClient.default(home, PersistConfig.for_tests())) as ctl:
        ctl.create_collection("a", K, V, num_shards=3)
        ctl.create_collection("b", K, V, num_shards=2)
        ctl.create_collection("plain", K, V)  # one shard: not transactional
    res = _run(home, instance, {"a": [{"k": i, "v": f"a{i}"} for i in range(5)], "b": [{"k": 1, "v": "b"}]})
    assert res.success
    out = res.output_for_node("insert_rows_op")
    assert out["rows"] == {"a": 5, "b": 1}
    t = out["time"]
    bad = _run(home, instance, {"a": [{"k": 9, "v": "x"}], "plain": [{"k": 1, "v": "y"}]})
    assert not bad.success  # a non-transactional collection in the set: nothing written
    err = bad.get_step_failure_events()[0].step_failure_data.error
    assert err is not None and err.cause is not None and "not transactional" in err.cause.message
    with StorageController(PersistClient.default(home, PersistConfig.for_tests())) as ctl:
        for name, want in (("a", {(i, f"a{i}") for i in range(5)}), ("b", {(1, "b")})):
            r = ctl.acquire_read_handle(name)
            assert {(x["k"], x["v"]) for x in r.snapshot(t).to_pylist() if x["diff"] == 1} == want
            r.expire()
        assert ctl.open_writer("a").upper.time == t + 1  # the refused run wrote nothing
