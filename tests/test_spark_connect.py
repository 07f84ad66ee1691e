"""persist_lib.spark through Spark Connect (``sc://``): writes, reads, compaction and
ingestion run unchanged on a Connect session, against a real Spark Connect server
(``SparkConnectServer``, started once for the module on ``local[2]``).

The Connect client is built with the Connect builder (``SparkConnectServer.session()``),
not ``pyspark.sql.SparkSession.builder.remote(url)``: that one refuses to start while the
classic ``spark`` fixture's SparkContext lives in the process and, in a process without
one, sets pyspark's process-wide Connect switch that breaks classic sessions created
later. Built this way, both kinds of session live side by side whatever the test order
(``test_classic_and_connect_sessions_share_the_process``).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from persist_lib import PersistClient, PersistConfig
from persist_lib.shard.codec import Schemas
from persist_lib.shard.spine import compaction_requests
from tests.test_ingest_support import DELETE, compare_locations, make_zone
from tests.test_ingest_support import KEY as ING_KEY
from tests.test_ingest_support import VAL as ING_VAL
from tests.test_spark_compact import KEY as CMP_KEY
from tests.test_spark_compact import VAL as CMP_VAL
from tests.test_spark_compact import _fill, _whole_merge
from tests.test_spark_support import df_counter, file_location, open_client, table_counter

pytest_plugins = ["tests.spark_fixtures"]
pytestmark = pytest.mark.spark

KEY = pa.schema([("id", pa.int64())])
VAL = pa.schema([("name", pa.string()), ("amount", pa.float64())])
SHARD = "s00000000-0000-4000-8000-0000000000d1"


@pytest.fixture(scope="module")
def connect_server() -> Iterator[Any]:
    pytest.importorskip("pyspark")
    pytest.importorskip("grpc")  # pyspark[connect]
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        pytest.skip("no Java for the Spark Connect server")
    from persist_lib.spark.connect_server import SparkConnectServer
    from tests.spark_fixtures import SPARK_TEST_CONF  # after pytest_plugins loaded it

    conf = {k: v for k, v in SPARK_TEST_CONF.items() if k != "spark.executor.memory"}
    with SparkConnectServer(master="local[2]", conf=conf) as server:
        yield server


@pytest.fixture(scope="module")
def remote(connect_server: Any) -> Iterator[Any]:
    session = connect_server.session()
    try:
        yield session
    finally:
        session.stop()


def _input(remote: Any, n: int, *, parts: int = 2, times: int = 3, t0: int = 0) -> Any:
    """``n`` rows built on the server (Connect columns: ``sql_functions(remote)``)."""
    from persist_lib.spark._common import sql_functions

    F = sql_functions(remote)
    return remote.range(n, numPartitions=parts).select(
        F.col("id"),
        F.concat(F.lit("n"), (F.col("id") % 97).cast("string")).alias("name"),
        (F.col("id") * 0.5).alias("amount"),
        (F.col("id") % times + t0).alias("ts"),
        F.lit(1).cast("long").alias("diff"),
    )


def _truth(n: int, as_of: int) -> Any:
    """What ``_input(n)`` reads back as at ``as_of`` (times forwarded), as a Counter."""
    ids = np.arange(n, dtype=np.int64)
    return table_counter(
        pa.table(
            {
                "id": ids,
                "name": pa.array([f"n{i % 97}" for i in range(n)]),
                "amount": ids * 0.5,
                "ts": np.full(n, as_of, dtype=np.int64),
                "diff": np.ones(n, dtype=np.int64),
            }
        )
    )


def test_server_command_and_a_failed_start() -> None:
    """The command binds to 127.0.0.1 on the chosen port; a server that can't start
    fails with its log's tail (here: no Java) and leaves no temp dir."""
    pytest.importorskip("pyspark")
    from persist_lib.spark.connect_server import (
        SERVER_CLASS,
        SparkConnectServer,
        SparkConnectServerError,
    )

    server = SparkConnectServer(master="local[1]", port=12345, env={"JAVA_HOME": "/nonexistent-java"})
    server.workdir = Path("/tmp/unused")
    cmd = server.command()
    assert cmd[cmd.index("--class") + 1] == SERVER_CLASS and cmd[cmd.index("--master") + 1] == "local[1]"
    assert "spark.connect.grpc.binding.port=12345" in cmd and "spark.connect.grpc.binding.address=127.0.0.1" in cmd
    assert cmd[-1].endswith(".jar") and "spark-connect_" in cmd[-1]
    assert server.url == "sc://127.0.0.1:12345"
    server.workdir = None
    with pytest.raises(SparkConnectServerError, match="nonexistent-java") as ei:
        server.start()
    assert "exited with code" in str(ei.value)
    assert server.workdir is None and server.pid is None


def test_connect_session_kind_and_parallelism(remote: Any) -> None:
    from pyspark.sql.utils import is_remote

    from persist_lib.spark import compact_shard
    from persist_lib.spark._common import (
        UnsupportedSparkSession,
        check_session,
        default_parallelism,
        is_connect,
    )

    assert is_connect(remote) and is_connect(remote.range(1))
    assert not is_remote(), "the process-wide Connect switch must stay off (classic sessions share the process)"
    check_session(remote, "test")
    assert default_parallelism(remote) == 2  # the server's spark.default.parallelism
    assert default_parallelism(remote, 5) == 5
    with pytest.raises(UnsupportedSparkSession, match="SparkSession"):
        compact_shard(object(), None, SHARD)  # type: ignore[arg-type]


@pytest.mark.slow  # (the default suite's budget: the same paths run on local[2] in the default suite)
def test_bucket_partition_keys_match_sparks_hash_partitioning(remote: Any) -> None:
    """``partition_keys(n)[b]`` lands in partition ``b`` of ``repartition(n, key)``: each
    compaction bucket gets its own merge task."""
    from persist_lib.spark.compact import partition_keys

    ns = (1, 2, 3, 7, 16, 61)
    rows = [(n, b, k) for n in ns for b, k in enumerate(partition_keys(n))]
    got = (
        remote.createDataFrame(rows, "n int, b int, k int")
        .selectExpr("n", "b", "pmod(hash(k), n) AS p")
        .toArrow()
        .to_pylist()
    )
    assert all(r["p"] == r["b"] for r in got) and len(got) == sum(ns)
    keys = partition_keys(7)
    parts = (
        remote.createDataFrame([(b, k) for b, k in enumerate(keys)], "b int, pkey int")
        .repartition(7, "pkey")
        .selectExpr("b", "spark_partition_id() AS p")
        .toArrow()
        .to_pylist()
    )
    assert sorted((r["b"], r["p"]) for r in parts) == [(b, b) for b in range(7)]


def test_write_batch_and_read_back_through_connect(remote: Any, tmp_path: Path) -> None:
    from persist_lib.spark import read_snapshot, read_updates, write_batch

    client = open_client(file_location(tmp_path), blob_target_size=64 << 10)
    w, r = client.open(SHARD, KEY, VAL)
    n = 20_000
    before = client.inspect(SHARD)["seqno"]
    res = write_batch(_input(remote, n), w, 0, 3)
    info = client.inspect(SHARD)
    assert info["seqno"] == before + 2, "register the job's part writer + one commit"
    assert info["num_batches"] == 1 and res.rows_in == res.updates == n and res.parts > 1
    assert res.part_writer not in info["writers"]
    # Read back through Connect: equal to the ground truth and to the in-process read.
    got = read_snapshot(remote, r, 2, num_splits=3)
    assert df_counter(got) == _truth(n, 2) == table_counter(r.snapshot(2))
    # Without ts/diff (the driver adds them: Connect columns), then a (from, to] range.
    res2 = write_batch(_input(remote, 500).drop("ts", "diff"), w, 3, 5, time=4)
    assert res2.updates == 500
    upd = read_updates(remote, r, 2, 4)
    assert df_counter(upd) == table_counter(r.updates_between(3, 5))
    assert set(upd.toArrow().column("ts").to_pylist()) == {4}
    assert client.unreferenced_blobs(SHARD, older_than_ms=0) == []
    client.close()


@pytest.mark.slow  # (the default suite's budget: the same paths run on local[2] in the default suite)
def test_compact_shard_through_connect_keeps_every_snapshot(remote: Any, tmp_path: Path) -> None:
    from persist_lib.spark import compact_shard

    client = open_client(file_location(tmp_path), blob_target_size=64 << 10)
    a = "s00000000-0000-4000-8000-0000000000d2"
    b = "s00000000-0000-4000-8000-0000000000d3"
    wa, ra = client.open(a, CMP_KEY, CMP_VAL)
    wb, rb = client.open(b, CMP_KEY, CMP_VAL)
    for w in (wa, wb):
        _fill(w, 6, 3000, seed=4)
    ra.downgrade_since(7)
    rb.downgrade_since(7)
    before = {t: table_counter(ra.snapshot(t)) for t in (7, 9, 11)}
    threshold = max(req.num_bytes for req in compaction_requests(client.machine(a).fetch_latest()))
    sa = compact_shard(remote, client, a, min_bytes=threshold, num_buckets=3)
    sb = client.compact(b)  # the in-process twin
    assert sa["batches_after"] == sb["batches_after"]
    assert sa["spark_merges_applied"] >= 1 and sa["failed"] == []
    assert all(m["stats"]["buckets"] == 3 and m["stats"]["shared_merge_tasks"] == 0 for m in sa["spark_merges"])
    assert {t: table_counter(ra.snapshot(t)) for t in (7, 9, 11)} == before
    da, db = client.inspect(a)["batches"], client.inspect(b)["batches"]
    assert [(x["lower"], x["upper"], x["since"], x["len"]) for x in da] == [
        (x["lower"], x["upper"], x["since"], x["len"]) for x in db
    ]
    assert compaction_requests(client.machine(a).fetch_latest()) == []
    assert client.unreferenced_blobs(a, older_than_ms=0) == []
    client.close()


def test_failed_merge_through_connect_applies_and_leaves_nothing(remote: Any, tmp_path: Path) -> None:
    from persist_lib.spark import spark_merge

    # Appends' parts in blob (not inlined), so that one of them can go missing.
    client = open_client(file_location(tmp_path), blob_target_size=64 << 10, inline_append_threshold=4096)
    shard = "s00000000-0000-4000-8000-0000000000d4"
    w, _ = client.open(shard, CMP_KEY, CMP_VAL)
    _fill(w, 3, 1500, seed=5)
    s = client.machine(shard).fetch_latest()
    req = _whole_merge(s)
    victim = req.inputs[-1].parts[0]
    assert victim.key is not None
    client.blob.delete(victim.key)
    with pytest.raises(Exception, match="missing"):  # the executor's error, through gRPC
        spark_merge(remote, client, Schemas.from_json(s.schemas), req, shard_id=shard, num_buckets=2)
    after = client.machine(shard).fetch_latest()
    assert after.batches == s.batches and after.writers.keys() == s.writers.keys()
    assert client.unreferenced_blobs(shard, older_than_ms=0) == []
    client.close()


@pytest.mark.slow  # (the default suite's budget: the same paths run on local[2] in the default suite)
def test_ingest_landing_zone_through_connect(remote: Any, tmp_path: Path) -> None:
    from persist_lib.ingest import IngestConfig, Ingestion, LandingZoneSource
    from persist_lib.spark import SparkIngestion, ingest_landing_zone

    zone = make_zone(tmp_path / "zone", seed=8, files=6, rows=40)
    a, b = file_location(tmp_path, "inproc"), file_location(tmp_path, "connect")
    cfg = IngestConfig(max_records_per_binding=30, max_append_records=70, keep_raw=True)
    kw: dict[str, Any] = {"envelope": "upsert", "delete_field": DELETE, "config": cfg, "clock": lambda: 1}
    ca = PersistClient.open(*a, PersistConfig.for_tests())
    cb = PersistClient.open(*b, PersistConfig.for_tests())
    with Ingestion(ca, "ing", LandingZoneSource(str(zone.path)), ING_KEY, ING_VAL, **kw) as ing:
        sa = ing.run_once()
    with SparkIngestion(
        remote, cb, "ing", LandingZoneSource(str(zone.path)), ING_KEY, ING_VAL,
        records_per_job=100, min_piece_records=9, **kw,
    ) as ing:
        sb = ing.run_once()
    for k in ("upper", "records", "errors", "updates", "bindings_minted"):
        assert sa[k] == sb[k], k
    assert sb["spark"]["records_on_executors"] > 0 and sb["spark"]["jobs"] >= 2
    assert sb["errors"] == zone.bad
    compare_locations(a, b, "ing", ["data", "errors", "remap", "state", "raw"])
    again = ingest_landing_zone(remote, cb, "ing", LandingZoneSource(str(zone.path)), ING_KEY, ING_VAL, **kw)
    assert again["records"] == 0 and again["upper"] == sb["upper"]
    ca.close()
    cb.close()


def test_classic_and_connect_sessions_share_the_process(spark: Any, remote: Any, tmp_path: Path) -> None:
    """The classic ``spark`` fixture and the Connect session work in one process, on the
    same shard: written by one, read by the other."""
    from persist_lib.spark import read_snapshot, write_batch

    client = open_client(file_location(tmp_path))
    w, r = client.open(SHARD, KEY, VAL)
    classic_df = spark.range(1000, numPartitions=2).selectExpr(
        "id", "concat('n', CAST(id % 97 AS STRING)) AS name", "id * 0.5 AS amount",
        "id % 3 AS ts", "CAST(1 AS BIGINT) AS diff",
    )
    write_batch(classic_df, w, 0, 3)
    write_batch(_input(remote, 1000, t0=3), w, 3, 6)
    for session in (spark, remote):
        got = read_snapshot(session, r, 5)
        assert df_counter(got) == table_counter(r.snapshot(5)), type(session).__module__
    client.close()
