"""Spark writes and reads: one batch per DataFrame committed with one CAS, failed jobs
commit nothing and leave only sweepable parts, reads equal the input, collections are
routed like CollectionWriter routes."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from persist_lib.errors import InvalidUsage, UpperMismatch
from tests.test_spark_support import (
    df_counter,
    file_location,
    open_client,
    sorted_hashes,
    table_counter,
)

pytest_plugins = ["tests.spark_fixtures"]
pytestmark = pytest.mark.spark

KEY = pa.schema([("id", pa.int64())])
VAL = pa.schema([("name", pa.string()), ("amount", pa.float64())])
SHARD = "s00000000-0000-4000-8000-0000000000a1"


def _input(spark: Any, n: int, *, parts: int = 4, times: int = 3, t0: int = 0) -> Any:
    from pyspark.sql import functions as F

    return spark.range(n, numPartitions=parts).select(
        F.col("id"),
        F.concat(F.lit("n"), (F.col("id") % 997).cast("string")).alias("name"),
        (F.col("id") * 0.5).alias("amount"),
        (F.col("id") % times + t0).alias("ts"),
        F.lit(1).cast("long").alias("diff"),
    )


def _blob_keys(client: Any, shard: str) -> set[str]:
    return {m.key for m in client.blob.list_keys_and_metadata(f"{shard}/")}


def _write_and_check_one_cas(spark: Any, tmp_path: Path, n: int) -> None:
    from pyspark.sql import functions as F

    from persist_lib.spark import read_snapshot, write_batch

    client = open_client(file_location(tmp_path))
    w, r = client.open(SHARD, KEY, VAL)
    df = _input(spark, n)
    before = client.inspect(SHARD)
    res = write_batch(df, w, 0, 3)
    after = client.inspect(SHARD)
    # One CAS registers the job's part writer (before any executor uploads, so the
    # sweeper leaves its parts alone), one links the whole batch and releases it.
    assert after["seqno"] == before["seqno"] + 2, "register + one commit"
    assert res.part_writer not in after["writers"]
    assert after["num_batches"] == before["num_batches"] + 1 == 1
    assert after["upper"] == [3] and after["num_updates"] == n == res.rows_in == res.updates
    assert res.parts == len(after["batches"][0]["parts"]) > 1  # parts from several executors
    assert {p["key"].split("/")[1] for p in after["batches"][0]["parts"]} == {res.part_writer}
    # Read back through Spark: equal to the input (times forwarded to the as_of).
    got = read_snapshot(spark, r, 2)
    want = df.withColumn("ts", F.lit(2).cast("long"))
    a, b = sorted_hashes(got), sorted_hashes(want.select(*got.columns))
    assert len(a) == len(b) == n and (a == b).all()
    assert client.unreferenced_blobs(SHARD, older_than_ms=0) == []
    w.expire()
    r.expire()
    client.close()


def test_write_300k_rows_is_one_batch_one_cas_and_reads_back_equal(spark: Any, tmp_path: Path) -> None:
    _write_and_check_one_cas(spark, tmp_path, 300_000)


@pytest.mark.slow
def test_write_5m_rows_is_one_batch_one_cas_and_reads_back_equal(
    spark: Any, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if "slow" not in (request.config.getoption("-m") or "") and not os.environ.get("PERSIST_SLOW"):
        pytest.skip("5M rows: run with -m slow (or PERSIST_SLOW=1)")
    _write_and_check_one_cas(spark, tmp_path, 5_000_000)


def test_failed_job_commits_nothing_and_leaves_only_sweepable_parts(spark: Any, tmp_path: Path) -> None:
    from persist_lib.spark import write_batch

    client = open_client(file_location(tmp_path))
    w, r = client.open(SHARD, KEY, VAL)
    w.compare_and_append(_input(spark, 5000, parts=1).toArrow(), 0, 3)
    good = table_counter(r.snapshot(2))
    committed = _blob_keys(client, SHARD)
    before = client.inspect(SHARD)

    def crash_after_upload(pid: int, batches: list[Any]) -> None:
        assert sum(len(b.parts) for b in batches) > 0  # this partition did upload parts
        if pid == 1:
            raise RuntimeError("injected executor failure after the upload")

    with pytest.raises(Exception, match="injected executor failure"):
        write_batch(
            _input(spark, 20_000, parts=3, t0=3), w, 3, 6, cleanup_on_failure=False,
            after_upload=crash_after_upload,
        )
    after = client.inspect(SHARD)
    assert after["upper"] == before["upper"] and after["batches"] == before["batches"]
    assert after["writers"].keys() == before["writers"].keys()  # the job's writer released
    leaked = {b["key"] for b in client.unreferenced_blobs(SHARD, older_than_ms=0)}
    assert leaked and leaked == _blob_keys(client, SHARD) - committed
    assert len({k.split("/")[1] for k in leaked}) == 1, "all leaks are under the job's writer id"
    # The sweeper removes exactly them; the shard is intact and still writable at 3.
    assert client.unreferenced_blobs(SHARD, older_than_ms=3_600_000) == []  # grace period
    swept = client.unreferenced_blobs(SHARD, older_than_ms=0, delete=True)
    assert {b["key"] for b in swept if b["deleted"]} == leaked
    assert _blob_keys(client, SHARD) == committed
    assert table_counter(r.snapshot(2)) == good
    write_batch(_input(spark, 1000, parts=1, t0=3), w, 3, 6)
    assert pa.compute.sum(r.snapshot(5)["diff"]).as_py() == 5000 + 1000
    client.close()


def test_killed_executor_process_commits_nothing(spark: Any, tmp_path: Path) -> None:
    from persist_lib.spark import write_batch

    client = open_client(file_location(tmp_path))
    w, r = client.open(SHARD, KEY, VAL)
    before = client.inspect(SHARD)

    def kill_after_upload(pid: int, batches: list[Any]) -> None:
        if pid == 0:
            os.kill(os.getpid(), signal.SIGKILL)  # the Python worker dies mid-job

    with pytest.raises(Exception) as ei:
        write_batch(_input(spark, 10_000, parts=2), w, 0, 3, after_upload=kill_after_upload)
    assert "InvalidUsage" not in str(ei.value)
    assert client.inspect(SHARD)["upper"] == before["upper"]
    assert client.inspect(SHARD)["writers"].keys() == before["writers"].keys()
    assert client.inspect(SHARD)["num_batches"] == 0
    # Whatever the driver's cleanup missed is sweepable (nothing is referenced yet).
    client.unreferenced_blobs(SHARD, older_than_ms=0, delete=True)
    assert _blob_keys(client, SHARD) == set()
    write_batch(_input(spark, 1000, parts=2), w, 0, 3)
    assert r.snapshot(2).num_rows == 1000
    client.close()


def test_lost_cas_deletes_the_parts_and_raises_upper_mismatch(spark: Any, tmp_path: Path) -> None:
    from persist_lib.spark import write_batch

    loc = file_location(tmp_path)
    client = open_client(loc)
    w, r = client.open(SHARD, KEY, VAL)
    with pytest.raises(UpperMismatch):  # checked before any executor works
        write_batch(_input(spark, 100, parts=1), w, 5, 6)

    def race(pid: int, batches: list[Any]) -> None:
        # Another process (this executor) appends first: the driver's CAS then loses.
        from persist_lib import PersistClient, PersistConfig

        other = PersistClient.open(loc[0], loc[1], PersistConfig.for_tests())
        ow = other.open_writer(SHARD, KEY, VAL)
        ow.compare_and_append([(((7,), ("x", 1.0)), 1, 1)], 0, 3)
        ow.expire()
        other.close()

    with pytest.raises(UpperMismatch):
        write_batch(_input(spark, 5000, parts=1), w, 0, 3, after_upload=race)
    assert client.unreferenced_blobs(SHARD, older_than_ms=0) == []  # the loser cleaned up
    assert table_counter(r.snapshot(2)) == {(7, "x", 1.0, 2): 1}
    client.close()


def test_invalid_input_is_refused_and_commits_nothing(spark: Any, tmp_path: Path) -> None:
    from pyspark.sql import functions as F

    from persist_lib.spark import write_batch

    client = open_client(file_location(tmp_path))
    w, _ = client.open(SHARD, KEY, VAL)
    df = _input(spark, 100, parts=1)
    with pytest.raises(InvalidUsage, match="name"):  # wrong type: caught on the driver
        write_batch(df.withColumn("name", F.col("id")), w, 0, 3)
    with pytest.raises(InvalidUsage, match="missing"):
        write_batch(df.drop("amount"), w, 0, 3)
    with pytest.raises(Exception, match="outside the batch bounds"):  # times >= new upper
        write_batch(df, w, 0, 2)
    assert client.inspect(SHARD)["num_batches"] == 0
    assert client.unreferenced_blobs(SHARD, older_than_ms=0) == []
    # Without ts/diff: every row at `time`, diff +1.
    write_batch(df.drop("ts", "diff"), w, 0, 3, time=1)
    assert client.inspect(SHARD)["num_updates"] == 100
    client.close()


def test_reads_consolidate_across_splits_and_ranges_match_listen(spark: Any, tmp_path: Path) -> None:
    from persist_lib.spark import read_snapshot, read_updates

    client = open_client(file_location(tmp_path), blob_target_size=32 << 10)
    w, r = client.open(SHARD, KEY, VAL)
    base = _input(spark, 6000, parts=1).toArrow()
    w.compare_and_append(base, 0, 3)
    # Retract a third at time 4 and insert it again, renamed, at 5: the same keys sit in
    # parts of different batches, so splits must be consolidated with each other.
    third = base.filter(pa.compute.equal(pa.compute.bit_wise_and(base["id"], 3), 0))
    n = third.num_rows
    w.compare_and_append(third.set_column(3, "ts", pa.array([4] * n, pa.int64())).set_column(
        4, "diff", pa.array([-1] * n, pa.int64())), 3, 5)
    w.compare_and_append(third.set_column(1, "name", pa.array(["renamed"] * n)).set_column(
        3, "ts", pa.array([5] * n, pa.int64())), 5, 7)
    assert len(client.inspect(SHARD)["batches"][0]["parts"]) > 1
    for as_of in (4, 6):
        got = read_snapshot(spark, r, as_of, num_splits=4)
        assert df_counter(got) == table_counter(r.snapshot(as_of)), as_of
    # (from, to] ranges: exactly the in-process updates in [from + 1, to + 1).
    got = read_updates(spark, r, 2, 6, num_splits=3)
    assert df_counter(got) == table_counter(r.updates_between(3, 7))
    assert sorted(set(got.toArrow().column("ts").to_pylist())) == [4, 5]
    assert read_updates(spark, r, 4, 4).count() == 0
    client.close()


def test_collection_write_routes_like_collection_writer(spark: Any, tmp_path: Path) -> None:
    from persist_lib.spark import read_collection_snapshot, write_collection
    from persist_lib.storage import StorageController

    client = open_client(file_location(tmp_path))
    ctl = StorageController(client)
    ctl.create_collection("viaspark", KEY, VAL, num_shards=3)
    ctl.create_collection("inproc", KEY, VAL, num_shards=3)
    df = _input(spark, 20_000, parts=3)
    sw = ctl.open_writer("viaspark")
    res = write_collection(df, sw, 0, 3)
    assert res.updates == 20_000 and len(res.batches) == 3 and res.skipped_shards == []
    iw = ctl.open_writer("inproc")
    iw.append(df.toArrow(), 0, 3)
    for a, b in zip(sw.shard_ids, iw.shard_ids, strict=True):
        ra = client.open_leased_reader(a, KEY, VAL)
        rb = client.open_leased_reader(b, KEY, VAL)
        assert table_counter(ra.snapshot(2)) == table_counter(rb.snapshot(2))
        assert ra.snapshot(2).num_rows > 0
        ra.expire()
        rb.expire()
    # A retry after a partial commit skips the shards that are done.
    again = write_collection(df, sw, 0, 3)
    assert sorted(again.skipped_shards) == sorted(sw.shard_ids) and again.updates == 0
    reader = ctl.acquire_read_handle("viaspark")
    got = read_collection_snapshot(spark, reader, 2)
    assert df_counter(got) == table_counter(reader.snapshot(2))
    assert got.count() == 20_000
    reader.expire()
    sw.expire()
    iw.expire()
    client.close()


def test_refuses_an_in_memory_blob(spark: Any) -> None:
    from persist_lib import PersistClient, PersistConfig
    from persist_lib.spark import write_batch

    client = PersistClient.open("mem://b-spark", "mem://c-spark", PersistConfig.for_tests())
    w, _ = client.open(SHARD, KEY, VAL)
    with pytest.raises(InvalidUsage, match="executors"):
        write_batch(_input(spark, 10, parts=1), w, 0, 3)


@pytest.mark.s3
@pytest.mark.postgres
def test_write_and_read_on_s3_and_postgres(spark: Any, s3_blob_uri: str, pg_consensus_url: str) -> None:
    from persist_lib.spark import read_snapshot, write_batch

    # Executors open the blob from its URI: credentials travel in it here (moto's fakes).
    blob_uri = s3_blob_uri + "&access_key_id=testing&secret_access_key=testing"
    client = open_client((blob_uri, pg_consensus_url), blob_target_size=256 << 10)
    w, r = client.open(SHARD, KEY, VAL)
    df = _input(spark, 20_000, parts=2)
    before = client.inspect(SHARD)["seqno"]
    write_batch(df, w, 0, 3)
    assert client.inspect(SHARD)["seqno"] == before + 2  # register the part writer + one commit
    assert df_counter(read_snapshot(spark, r, 2)) == table_counter(r.snapshot(2))
    client.close()


def test_sweep_with_the_clock_ahead_during_the_job_spares_its_parts(spark: Any, tmp_path: Path) -> None:
    """Issue 13 defect 2 (Spark side): executors upload parts long before the driver's
    commit. A sweep that runs meanwhile — here on the executors themselves, right after
    every upload, with the clock two hours ahead and grace 0 — must not delete them:
    the job's part writer is registered before any task starts."""
    from persist_lib.spark import write_batch

    loc = file_location(tmp_path)
    client = open_client(loc)
    w, r = client.open(SHARD, KEY, VAL)

    blob_uri, cons_uri = loc

    def sweep_after_upload(pid: int, batches: list[Any]) -> None:
        from persist_lib import PersistClient, PersistConfig
        from persist_lib.testing.hooks import clock_skew

        c = PersistClient.open(blob_uri, cons_uri, PersistConfig.for_tests())
        try:
            with clock_skew(c.config, 2 * 3_600_000):
                c.unreferenced_blobs(SHARD, older_than_ms=0, delete=True)
        finally:
            c.close()

    res = write_batch(_input(spark, 20_000, parts=3), w, 0, 3, after_upload=sweep_after_upload)
    assert res.parts > 0
    assert r.snapshot(2).num_rows == 20_000  # every linked part is still there
    assert res.part_writer not in client.inspect(SHARD)["writers"]
    client.close()
