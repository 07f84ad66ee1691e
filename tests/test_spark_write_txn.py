"""Spark ``write_collection`` on a transactional (multi-shard, by default) collection
commits the whole job as ONE transaction: every shard's batch or none, on Spark
local[2]; a failed job leaves nothing visible and nothing registered."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from persist_lib.errors import UpperMismatch
from persist_lib.frontier import Antichain
from tests.test_spark_support import df_counter, file_location, open_client, table_counter
from tests.test_spark_write import KEY, VAL, _input

pytest_plugins = ["tests.spark_fixtures"]
pytestmark = pytest.mark.spark


def _blob_keys(client: Any, shards: list[str]) -> set[str]:
    return {m.key for s in shards for m in client.blob.list_keys_and_metadata(f"{s}/")}


def test_a_job_commits_every_shard_with_one_log_cas(spark: Any, tmp_path: Path) -> None:
    from persist_lib.spark import read_collection_snapshot, write_collection
    from persist_lib.storage import StorageController

    client = open_client(file_location(tmp_path))
    ctl = StorageController(client)
    ctl.create_collection("c", KEY, VAL, num_shards=3)  # transactional by default
    w = ctl.open_writer("c")
    log = client.machine(ctl.txns.log.shard)
    before = log.fetch_latest().upper.time
    df = _input(spark, 20_000, parts=3)
    res = write_collection(df, w, 0, 3)
    assert res.updates == 20_000 and len(res.batches) == 3
    # One commit CAS and one tidy CAS on the log: the three batches landed together.
    assert log.fetch_latest().upper.time == (before or 0) + 2
    assert ctl.txns.log.read().pending == ()
    for s in w.shard_ids:
        st = client.machine(s).fetch_latest()
        assert st.upper == Antichain([3])
        assert not [x for x in st.writers.values() if x.purpose.startswith("txn ")]
    reader = ctl.acquire_read_handle("c")
    got = read_collection_snapshot(spark, reader, 2)
    assert df_counter(got) == table_counter(reader.snapshot(2)) and got.count() == 20_000
    # A retry of the committed job is a no-op; a job at a stale upper is refused.
    assert write_collection(df, w, 0, 3).skipped_shards == w.shard_ids
    with pytest.raises(UpperMismatch):
        write_collection(_input(spark, 10, parts=1, t0=1), w, 1, 4)
    reader.expire()
    client.close()


def test_a_failed_job_leaves_nothing_visible(spark: Any, tmp_path: Path) -> None:
    from persist_lib.spark import write_collection
    from persist_lib.storage import StorageController

    client = open_client(file_location(tmp_path))
    ctl = StorageController(client)
    ctl.create_collection("c", KEY, VAL, num_shards=3)
    w = ctl.open_writer("c")
    w.append(_input(spark, 3000, parts=1).toArrow(), 0, 3)
    reader = ctl.acquire_read_handle("c")
    good = table_counter(reader.snapshot(2))
    committed = _blob_keys(client, w.shard_ids)

    def crash_after_upload(pid: int, batches: list[Any]) -> None:
        assert sum(len(b.parts) for b in batches) > 0  # this partition did upload parts
        if pid == 1:
            raise RuntimeError("injected executor failure after the upload")

    with pytest.raises(Exception, match="injected executor failure"):
        write_collection(_input(spark, 20_000, parts=3, t0=3), w, 3, 6, after_upload=crash_after_upload)
    # Nothing committed on any shard, the log holds no entry, the part writers are gone,
    # and the job's uploaded parts were deleted (it knew their prefixes).
    assert ctl.txns.log.read().pending == ()
    for s in w.shard_ids:
        st = client.machine(s).fetch_latest()
        assert st.upper == Antichain([3])
        assert not [x for x in st.writers.values() if x.purpose.startswith("txn ")]
    assert _blob_keys(client, w.shard_ids) == committed
    assert w.upper == Antichain([3]) and table_counter(reader.snapshot(2)) == good
    write_collection(_input(spark, 1000, parts=2, t0=3), w, 3, 6)  # still writable at 3
    assert sum(r["diff"] for r in reader.snapshot(5).to_pylist()) == 3000 + 1000
    reader.expire()
    client.close()


def test_a_dataframe_and_an_arrow_table_at_their_own_lowers_commit_together(spark: Any, tmp_path: Path) -> None:
    """``write_collections`` with a small Arrow job (built on the driver under the same
    transaction) and per-job lowers: both collections move to the new upper in one
    commit; a job whose rows are invalid commits neither."""
    import pyarrow as pa

    from persist_lib.spark import write_collections
    from persist_lib.storage import StorageController

    client = open_client(file_location(tmp_path))
    ctl = StorageController(client)
    ctl.create_collection("data", KEY, VAL, num_shards=2)
    ctl.create_collection("book", pa.schema([("k", pa.string())]), pa.schema([("v", pa.int64())]), num_shards=1,
                          transactional=True)
    w, b = ctl.open_writer("data"), ctl.open_writer("book")
    b.compare_and_append(pa.table({"k": ["old"], "v": [0], "ts": [4], "diff": [1]}), 0, 5)  # book at 5, data at 0
    row = pa.table({"k": ["job1"], "v": pa.array([7], pa.int64())})
    bad = pa.table({"k": ["bad"], "v": pa.array([1], pa.int64()), "ts": [99], "diff": [1]})  # ts outside [5, 6)
    with pytest.raises(Exception, match="outside the batch interval"):
        write_collections([(_input(spark, 500, parts=2, times=1, t0=5), w), (bad, b)], 0, 6, lowers=[0, 5])
    assert w.upper == Antichain([0]) and b.upper == Antichain([5]) and ctl.txns.log.read().pending == ()
    res = write_collections([(_input(spark, 500, parts=2, times=1).drop("ts"), w), (row, b)], 0, 6,
                            lowers=[0, 5], time=5)
    assert [r.rows_in for r in res] == [500, 1] and [r.lower for r in res] == [Antichain([0]), Antichain([5])]
    assert w.upper == Antichain([6]) and b.upper == Antichain([6])
    with ctl.acquire_read_handle("data") as r:
        assert sum(x["diff"] for x in r.snapshot(5).to_pylist()) == 500
    with ctl.acquire_read_handle("book") as r:
        assert sorted((x["k"], x["v"]) for x in r.snapshot(5).to_pylist()) == [("job1", 7), ("old", 0)]
        assert r.snapshot(4).num_rows == 1  # the entry landed at 5, with the data
    client.close()
