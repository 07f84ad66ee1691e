"""persist_lib.spark on a real standalone cluster: a master and two 1-core workers, each
a separate JVM with its own executor and Python workers (``persist_lib.spark.standalone``).

What ``local[2]`` can't show: executors that don't share the driver's process tree (and
maybe not its Python), and workers that die mid-job. Covered here: write / snapshot
read / compaction / landing-zone ingestion on ``spark://``; workers with the project
installed (nothing shipped) and without it (the driver ships its persist_lib, or says
exactly what is missing); a worker killed (kill -9 of its process group) and a Python
worker killed mid-write, and speculative execution: every row committed exactly once
by the driver's single CAS, the lost attempts' parts left unlinked for the sweeper.

The default suite runs the data plane, both kill tests on writes and the shipping test
(about a minute); the compaction kill, speculation, missing-dependency and Dagster tests
are in the slow tier (``make test-long``).

A process has one SparkContext: the module stops the local test session, runs its own
sessions against the cluster and stops them; the ``spark`` fixture of later modules
builds a new local one.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from tests.test_spark_support import df_counter, file_location, open_client, table_counter

# The standalone-cluster tests run in the slow tier (`make test-long`): the default suite's
# 10-minute budget; local[2] runs the same data plane, kills and exactly-once checks in
# tests/test_spark_write.py, test_spark_compact.py, test_spark_ingest.py, test_spark_kafka.py.
pytestmark = [pytest.mark.spark, pytest.mark.slow]

KEY = pa.schema([("id", pa.int64())])
VAL = pa.schema([("name", pa.string()), ("amount", pa.float64())])
SHARD = "s00000000-0000-4000-8000-0000000000c1"

CLUSTER_CONF = {
    "spark.executor.memory": "512m",
    "spark.executor.cores": "1",
    "spark.cores.max": "2",
    "spark.sql.shuffle.partitions": "2",
    "spark.default.parallelism": "2",
    # Task attempts may fail (a killed Python worker counts as one); lost executors don't.
    "spark.task.maxFailures": "4",
    "spark.sql.adaptive.enabled": "false",
}


def _pickle_by_value() -> None:
    # Hooks defined here run on executors whose cwd is a worker dir: ship them by value
    # (``tests`` is not importable there).
    from pyspark import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])


class Sessions:
    """The module's cluster and the one SparkSession on it (rebuilt for another executor Python)."""

    def __init__(self, cluster: Any) -> None:
        self.cluster = cluster
        self.session: Any = None
        self.python: str | None = None

    def get(self, python: str = sys.executable, **conf: str) -> Any:
        from pyspark.sql import SparkSession

        from persist_lib.spark.session import local_session

        if self.session is not None and self.python == python and not conf:
            if self.session.sparkContext._jsc is not None:
                return self.session
        active = SparkSession.getActiveSession()
        if active is not None:
            active.stop()
        old = os.environ.get("PYSPARK_PYTHON")
        os.environ["PYSPARK_PYTHON"] = python  # what the executors run (SparkContext reads it)
        try:
            settings = {**CLUSTER_CONF, **conf}
            self.session = local_session(self.cluster.url, "persist-cluster-tests", settings)
        finally:
            if old is None:
                os.environ.pop("PYSPARK_PYTHON", None)
            else:
                os.environ["PYSPARK_PYTHON"] = old
        self.session.sparkContext.setLogLevel(os.environ.get("SPARK_TEST_LOG", "ERROR"))
        self.python = python if not conf else None
        _pickle_by_value()
        return self.session

    def stop(self) -> None:
        if self.session is not None:
            self.session.stop()
            self.session = None


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    pytest.importorskip("pyspark")
    from persist_lib.spark.standalone import StandaloneCluster

    # Workers don't inherit a developer's PYTHONPATH: executors import what their
    # Python has installed (or what the driver ships).
    with StandaloneCluster(workers=2, cores=1, memory="1g", env={"PYTHONPATH": ""}) as c:
        yield c


@pytest.fixture(scope="module")
def sessions(cluster: Any) -> Iterator[Sessions]:
    s = Sessions(cluster)
    try:
        yield s
    finally:
        s.stop()


def _input(spark: Any, n: int, *, parts: int = 4, times: int = 3, t0: int = 0) -> Any:
    from pyspark.sql import functions as F

    return spark.range(n, numPartitions=parts).select(
        F.col("id"),
        F.concat(F.lit("n"), (F.col("id") % 997).cast("string")).alias("name"),
        (F.col("id") * 0.5).alias("amount"),
        (F.col("id") % times + t0).alias("ts"),
        F.lit(1).cast("long").alias("diff"),
    )


def _expected(n: int, times: int = 3, t0: int = 0) -> Any:
    ids = list(range(n))
    return table_counter(
        pa.table(
            {
                "id": ids,
                "name": [f"n{i % 997}" for i in ids],
                "amount": [i * 0.5 for i in ids],
                "ts": [i % times + t0 for i in ids],
                "diff": [1] * n,
            }
        )
    )


def _at(counter: Any, as_of: int) -> Any:
    """``counter`` as a snapshot at ``as_of`` reports it (every time forwarded to it)."""
    from collections import Counter

    out: Counter[tuple[Any, ...]] = Counter()
    for k, d in counter.items():
        out[(*k[:-1], as_of)] += d
    return Counter({k: d for k, d in out.items() if d})


def _blob_keys(client: Any, shard: str) -> set[str]:
    return {m.key for m in client.blob.list_keys_and_metadata(f"{shard}/")}


def _linked(client: Any, shard: str) -> list[str]:
    """Blob keys of the parts the shard's state references (with repeats, if any)."""
    state = client.machine(shard).fetch_latest()
    return [p.key for b in state.batches.values() for p in b.parts if p.key is not None]


def _venv_imports_this_checkout() -> bool:
    """Whether the project's Python, outside this directory, imports this persist_lib."""
    from persist_lib.spark.executors import package_dir

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(
        [sys.executable, "-c", "import importlib.util as u; print(u.find_spec('persist_lib').origin)"],
        capture_output=True, text=True, cwd="/", env=env, check=False,
    ).stdout.strip()
    return bool(out) and Path(out).parent.resolve() == package_dir().resolve()


# -- the data plane on spark:// --------------------------------------------------------


def test_write_read_and_compact_on_the_cluster(sessions: Sessions, tmp_path: Path) -> None:
    from persist_lib.spark import compact_shard, read_snapshot, write_batch
    from persist_lib.spark.executors import prepare_executors

    spark = sessions.get()
    client = open_client(file_location(tmp_path))
    w, r = client.open(SHARD, KEY, VAL)
    res = write_batch(_input(spark, 30_000), w, 0, 3)
    assert res.parts >= 2 and client.inspect(SHARD)["num_batches"] == 1
    check = prepare_executors(spark)
    assert not check.skipped and len(check.probes) >= 2
    # The executors are other processes than the driver, on both workers.
    assert check.shipped is None or not _venv_imports_this_checkout()
    for t0 in (3, 6):  # more batches, so there is something to compact
        write_batch(_input(spark, 5_000, parts=2, t0=t0), w, t0, t0 + 3)
    want = _at(_expected(30_000) + _expected(5_000, t0=3) + _expected(5_000, t0=6), 8)
    assert table_counter(r.snapshot(8)) == want
    assert df_counter(read_snapshot(spark, r, 8)) == want
    summary = compact_shard(spark, client, SHARD, min_bytes=0)
    assert summary["rounds"] >= 1, summary
    assert client.inspect(SHARD)["num_batches"] < 3
    assert df_counter(read_snapshot(spark, r, 8)) == want
    client.close()


def test_landing_zone_ingestion_on_the_cluster(sessions: Sessions, tmp_path: Path) -> None:
    from persist_lib import PersistClient, PersistConfig
    from persist_lib.ingest import IngestConfig, Ingestion, LandingZoneSource
    from persist_lib.spark import SparkIngestion
    from tests.test_ingest_support import KEY as IKEY
    from tests.test_ingest_support import VAL as IVAL
    from tests.test_ingest_support import compare_locations, make_zone

    spark = sessions.get()
    zone = make_zone(tmp_path / "zone", seed=7, files=6, rows=40)
    a, b = file_location(tmp_path, "inproc"), file_location(tmp_path, "cluster")
    kw: dict[str, Any] = {"config": IngestConfig(max_records_per_binding=50), "clock": lambda: 1}
    ca = PersistClient.open(*a, PersistConfig.for_tests())
    cb = PersistClient.open(*b, PersistConfig.for_tests())
    with Ingestion(ca, "ing", LandingZoneSource(str(zone.path)), IKEY, IVAL, **kw) as ing:
        sa = ing.run_once()
    with SparkIngestion(
        spark, cb, "ing", LandingZoneSource(str(zone.path)), IKEY, IVAL,
        records_per_job=120, min_piece_records=10, **kw,
    ) as ing:
        sb = ing.run_once()
    assert sb["spark"]["records_on_executors"] > 0
    for k in ("upper", "records", "errors", "updates"):
        assert sa[k] == sb[k], k
    compare_locations(a, b, "ing", ["data", "errors", "remap"])
    ca.close()
    cb.close()


@pytest.mark.kafka
def test_a_kafka_backlog_on_the_cluster_with_killed_python_workers(
    sessions: Sessions, tmp_path: Path, kafka_broker: Any
) -> None:
    """A Kafka backlog decoded by the cluster's executors, one task per (partition, offset
    range) piece; the first attempt of two pieces is killed (SIGKILL of its Python worker)
    after it read its range. Spark retries them; the collection is exactly the produced
    messages at every bound time and the group offsets are the durable frontier."""
    import random

    from persist_lib import PersistClient, PersistConfig
    from persist_lib.ingest import IngestConfig
    from persist_lib.spark import SparkIngestion
    from tests.test_ingest_kafka import (
        AKEY,
        AVAL,
        _append_batch,
        _check_exactly_once,
        _source,
        _topic,
    )

    spark = sessions.get()
    marks = tmp_path / "marks"
    marks.mkdir()

    def kill_first_attempt(partition: int, start: int, end: int) -> None:
        from pyspark import TaskContext

        if partition in (0, 2) and start == 0 and TaskContext.get().attemptNumber() == 0:
            (marks / f"p{partition}-{os.getpid()}").touch()
            os.kill(os.getpid(), signal.SIGKILL)

    topic = _topic(kafka_broker, 3)
    batch = _append_batch(random.Random(17), 3, 3000, 0)
    kafka_broker.produce(topic, batch[:-20])
    kafka_broker.produce(topic, batch[-20:])
    client = PersistClient.open(*file_location(tmp_path), PersistConfig.for_tests())
    with SparkIngestion(
        spark, client, "kc", _source(kafka_broker, topic, "append_only"), AKEY, AVAL,
        config=IngestConfig(max_records_per_binding=800), min_piece_records=200, after_read=kill_first_attempt,
    ) as ing:
        s = ing.run_once()
    assert len(list(marks.iterdir())) == 2, "two first attempts were killed"
    assert s["records"] == 3000 and s["spark"]["records_on_executors"] >= 2980, s
    truth = kafka_broker.consume_all(topic, 3)
    assert _check_exactly_once(client, "kc", truth, "append_only") >= 4
    assert kafka_broker.group_offsets("persist_kc", topic, 3) == {p: len(v) for p, v in truth.items()}
    client.close()


# -- faults: executors that die ----------------------------------------------------------


def _kill_run(
    sessions: Sessions, tmp_path: Path, hook: Any, watch: Any = None, n: int = 20_000, **conf: str
) -> dict[str, Any]:
    """Writes ``n`` rows with ``hook`` after each partition's upload (``watch`` runs
    beside the job on the driver); checks exactly once and the sweep; the tallies."""
    from persist_lib.spark import write_batch

    spark = sessions.get(**conf)
    client = open_client(file_location(tmp_path))
    w, r = client.open(SHARD, KEY, VAL)
    stop = threading.Event()
    watcher = threading.Thread(target=watch, args=(stop,), daemon=True) if watch else None
    if watcher:
        watcher.start()
    try:
        res = write_batch(_input(spark, n, parts=4), w, 0, 3, after_upload=hook)
    finally:
        stop.set()
        if watcher:
            watcher.join(30)
    linked = _linked(client, SHARD)
    assert len(linked) == len(set(linked)) == res.parts, "each part linked exactly once"
    assert table_counter(r.snapshot(2)) == _at(_expected(n), 2), "every row exactly once"
    assert res.part_writer not in client.inspect(SHARD)["writers"]
    leaked = _blob_keys(client, SHARD) - set(linked)
    assert all(k.split("/")[1] == res.part_writer for k in leaked)
    # Lost attempts' parts: not linked, sweepable (their writer is released).
    swept = client.unreferenced_blobs(SHARD, older_than_ms=0, delete=True)
    assert {s["key"] for s in swept if s["deleted"]} == leaked
    assert _blob_keys(client, SHARD) == set(linked)
    assert table_counter(r.snapshot(2)) == _at(_expected(n), 2)
    client.close()
    return {"parts_linked": len(linked), "leaked_parts_swept": len(leaked)}


def test_a_killed_python_worker_is_retried_and_commits_exactly_once(
    sessions: Sessions, tmp_path: Path
) -> None:
    marks = tmp_path / "marks"
    marks.mkdir()

    def kill_first_attempt(pid: int, batches: list[Any]) -> None:
        from pyspark import TaskContext

        if pid in (0, 2) and TaskContext.get().attemptNumber() == 0:
            (marks / f"p{pid}-{os.getpid()}").touch()
            os.kill(os.getpid(), signal.SIGKILL)  # after its parts were uploaded

    tally = _kill_run(sessions, tmp_path, kill_first_attempt)
    killed = len(list(marks.iterdir()))
    assert killed == 2
    assert tally["leaked_parts_swept"] >= killed  # each killed attempt had uploaded parts
    print(f"\npython worker kill: attempts killed {killed}, {tally}")


def test_a_killed_worker_is_retried_elsewhere_and_commits_exactly_once(
    sessions: Sessions, cluster: Any, tmp_path: Path
) -> None:
    marks = tmp_path / "marks"
    marks.mkdir()

    def stall_first_attempt(pid: int, batches: list[Any]) -> None:
        from pyspark import TaskContext

        if pid == 1 and TaskContext.get().attemptNumber() == 0:
            (marks / str(os.getpid())).touch()
            time.sleep(90)  # until its worker is killed

    killed: list[int] = []

    def kill_its_worker(stop: threading.Event) -> None:
        while not stop.is_set():
            for m in marks.iterdir():
                i = cluster.worker_of_pid(int(m.name))
                if i is not None and not killed:
                    killed.append(i)
                    cluster.kill_worker(i)  # the worker, its executor, their Python workers
                    return
            time.sleep(0.1)

    try:
        tally = _kill_run(sessions, tmp_path, stall_first_attempt, kill_its_worker)
        assert len(killed) == 1
        assert tally["leaked_parts_swept"] >= 1
        print(f"\nworker kill: workers killed {len(killed)}, attempts lost >= 1, {tally}")
    finally:
        if killed:  # back to two workers for the rest of the module
            cluster.add_worker()


def test_a_killed_python_worker_mid_compaction_is_retried_and_applied_once(
    sessions: Sessions, tmp_path: Path
) -> None:
    """The merge task of bucket 0 kills its own Python worker after uploading its parts
    (first attempt only): Spark retries the task, the driver applies one output batch."""
    from persist_lib.shard.codec import Schemas
    from persist_lib.shard.maintenance_transitions import MergeOutcome
    from persist_lib.spark import apply_merge, spark_merge
    from tests.test_spark_compact import KEY as CKEY
    from tests.test_spark_compact import VAL as CVAL
    from tests.test_spark_compact import _fill, _whole_merge

    spark = sessions.get()
    client = open_client(file_location(tmp_path), blob_target_size=64 << 10)
    shard = "s00000000-0000-4000-8000-0000000000c3"
    w, r = client.open(shard, CKEY, CVAL)
    _fill(w, 4, 3000, seed=5)
    m = client.machine(shard)
    s = m.fetch_latest()
    req = _whole_merge(s)
    before = table_counter(r.snapshot(7))
    marks = tmp_path / "marks"
    marks.mkdir()

    def kill_bucket_0(bucket: int, parts: int) -> None:
        if bucket == 0 and parts > 0 and not any(marks.iterdir()):
            (marks / str(os.getpid())).touch()
            os.kill(os.getpid(), signal.SIGKILL)

    out = spark_merge(
        spark, client, Schemas.from_json(s.schemas), req, shard_id=shard, num_buckets=2,
        after_upload=kill_bucket_0,
    )
    assert len(list(marks.iterdir())) == 1
    assert apply_merge(client, m, req, out).outcome is MergeOutcome.APPLIED
    linked = _linked(client, shard)
    assert len(linked) == len(set(linked))
    assert table_counter(r.snapshot(7)) == before
    lost = {k for k in _blob_keys(client, shard) - set(linked) if k.split("/")[1] == out.writer}
    assert lost, "the killed attempt had uploaded parts"
    swept = client.unreferenced_blobs(shard, older_than_ms=0, delete=True)
    assert lost <= {x["key"] for x in swept if x["deleted"]}
    assert table_counter(r.snapshot(7)) == before
    print(f"\ncompaction python worker kill: attempts killed 1, parts linked {len(out.batch.parts)}, "
          f"lost-attempt parts swept {len(lost)}")
    client.close()


@pytest.mark.slow
def test_a_worker_killed_mid_compaction_links_each_output_part_once(
    sessions: Sessions, cluster: Any, tmp_path: Path
) -> None:
    """The merge stage's task for bucket 1 uploads its parts and stalls; its worker is
    killed (shuffle outputs on it are lost too): Spark recomputes what it must, the
    driver applies one output batch, the lost attempt's parts stay unlinked and sweepable."""
    from persist_lib.shard.codec import Schemas
    from persist_lib.shard.maintenance_transitions import MergeOutcome
    from persist_lib.spark import apply_merge, spark_merge
    from tests.test_spark_compact import KEY as CKEY
    from tests.test_spark_compact import VAL as CVAL
    from tests.test_spark_compact import _fill, _whole_merge

    spark = sessions.get()
    client = open_client(file_location(tmp_path), blob_target_size=64 << 10)
    shard = "s00000000-0000-4000-8000-0000000000c2"
    w, r = client.open(shard, CKEY, CVAL)
    _fill(w, 6, 4000, seed=3)
    m = client.machine(shard)
    s = m.fetch_latest()
    req = _whole_merge(s)
    before = table_counter(r.snapshot(11))
    committed = _blob_keys(client, shard)
    marks = tmp_path / "marks"
    marks.mkdir()

    def stall_bucket_1(bucket: int, parts: int) -> None:
        # Only the first attempt ever (a resubmitted stage numbers its attempts from 0).
        if bucket == 1 and parts > 0 and not any(marks.iterdir()):
            (marks / str(os.getpid())).touch()
            time.sleep(90)  # until its worker is killed

    killed: list[int] = []

    def kill_its_worker(stop: threading.Event) -> None:
        while not stop.is_set() and not killed:
            for mk in marks.iterdir():
                i = cluster.worker_of_pid(int(mk.name))
                if i is not None:
                    killed.append(i)
                    cluster.kill_worker(i)
                    print(f"\nkilled worker {i} at {time.monotonic() - t0:.1f} s")
                    return
            time.sleep(0.1)

    stop = threading.Event()
    watcher = threading.Thread(target=kill_its_worker, args=(stop,), daemon=True)
    t0 = time.monotonic()
    watcher.start()
    try:
        out = spark_merge(
            spark, client, Schemas.from_json(s.schemas), req, shard_id=shard, num_buckets=3,
            after_upload=stall_bucket_1,
        )
        stop.set()
        watcher.join(30)
        print(f"merge done at {time.monotonic() - t0:.1f} s")
        assert len(killed) == 1
        res = apply_merge(client, m, req, out)
        assert res.outcome is MergeOutcome.APPLIED
        linked = _linked(client, shard)
        assert len(linked) == len(set(linked)) and set(linked) >= {p.key for p in out.batch.parts if p.key}
        assert table_counter(r.snapshot(11)) == before, "the merge changed nothing but the layout"
        leaked = _blob_keys(client, shard) - set(linked)
        # The killed attempt's parts (and the merged-away inputs, once GC runs) are the
        # only unreferenced blobs; the lost attempt's are under the merge's writer id.
        lost = {k for k in leaked if k.split("/")[1] == out.writer}
        assert lost, "the killed attempt had uploaded parts"
        assert leaked - lost <= committed
        swept = client.unreferenced_blobs(shard, older_than_ms=0, delete=True)
        assert lost <= {x["key"] for x in swept if x["deleted"]}
        assert table_counter(r.snapshot(11)) == before
        print(f"\ncompaction worker kill: workers killed 1, parts linked {len(out.batch.parts)}, "
              f"lost-attempt parts swept {len(lost)}")
    finally:
        stop.set()
        client.close()
        if killed:
            cluster.add_worker()


@pytest.mark.slow
def test_speculative_attempts_commit_exactly_once(sessions: Sessions, tmp_path: Path) -> None:
    marks = tmp_path / "marks"
    marks.mkdir()

    def slow_first_attempt(pid: int, batches: list[Any]) -> None:
        from pyspark import TaskContext

        ctx = TaskContext.get()
        (marks / f"p{pid}-a{ctx.attemptNumber()}").touch()
        if pid == 3 and ctx.attemptNumber() == 0:
            time.sleep(8)  # a straggler: the speculative copy finishes first

    tally = _kill_run(
        sessions,
        tmp_path,
        slow_first_attempt,
        **{
            "spark.speculation": "true",
            "spark.speculation.interval": "100ms",
            "spark.speculation.multiplier": "1.5",
            "spark.speculation.quantile": "0.5",
            "spark.speculation.minTaskRuntime": "500ms",
        },
    )
    attempts = sorted(m.name for m in marks.iterdir())
    assert "p3-a1" in attempts, attempts  # a speculative copy of the straggler ran
    assert tally["leaked_parts_swept"] >= 1  # the straggler's parts were not linked
    print(f"\nspeculation: attempts {attempts}, {tally}")


# -- executors that lack the project ------------------------------------------------------


@pytest.fixture(scope="module")
def bare_pythons(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Two interpreters a worker might have: ``deps`` has pyspark, pyarrow, numpy (this
    venv's site-packages on its path) but not persist_lib; ``empty`` has nothing."""
    import site
    import venv

    root = tmp_path_factory.mktemp("pythons")
    out: dict[str, str] = {}
    for name in ("deps", "empty"):
        venv.EnvBuilder(with_pip=False, symlinks=True).create(root / name)
        py = root / name / "bin" / "python"
        out[name] = str(py)
    # A .pth line adds a directory to sys.path without running that directory's own .pth
    # files: the editable install's finder (persist_lib) stays out.
    sp = subprocess.run(
        [out["deps"], "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()
    (Path(sp) / "project-deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    check = subprocess.run(
        [out["deps"], "-c", "import pyarrow, pyspark, importlib.util as u; print(u.find_spec('persist_lib'))"],
        capture_output=True, text=True, cwd="/", env={"PATH": os.environ.get("PATH", "")}, check=True,
    )
    assert check.stdout.strip() == "None", check.stdout
    return out


def test_workers_without_the_project_get_the_drivers_copy(
    sessions: Sessions, bare_pythons: dict[str, str], tmp_path: Path
) -> None:
    from persist_lib.spark import read_snapshot, write_batch
    from persist_lib.spark.executors import ExecutorEnvironmentError, prepare_executors

    spark = sessions.get(bare_pythons["deps"])
    with pytest.raises(ExecutorEnvironmentError, match="can't import persist_lib.*ship='auto'"):
        prepare_executors(spark, ship="never")
    check = prepare_executors(spark, force=True)
    assert check.shipped and os.path.basename(check.shipped).startswith("persist_lib-")
    assert {p.executable for p in check.probes} == {bare_pythons["deps"]}
    assert all(str(p.fingerprint).startswith("zip:") for p in check.probes)
    client = open_client(file_location(tmp_path))
    w, r = client.open(SHARD, KEY, VAL)
    write_batch(_input(spark, 10_000), w, 0, 3)
    assert df_counter(read_snapshot(spark, r, 2)) == _at(_expected(10_000), 2)
    client.close()


@pytest.mark.slow
def test_workers_without_the_dependencies_fail_early_with_what_is_missing(
    sessions: Sessions, bare_pythons: dict[str, str], tmp_path: Path
) -> None:
    from persist_lib.spark import write_batch
    from persist_lib.spark.executors import ExecutorEnvironmentError

    spark = sessions.get(bare_pythons["empty"])
    client = open_client(file_location(tmp_path))
    w, _ = client.open(SHARD, KEY, VAL)
    seqno = client.inspect(SHARD)["seqno"]
    with pytest.raises(ExecutorEnvironmentError, match="module '(pyspark|pyarrow)' is missing") as ei:
        write_batch(_input(spark, 100), w, 0, 3)
    assert "PYSPARK_PYTHON" in str(ei.value)
    # Nothing happened to the shard: no batch, no part writer was even registered.
    state = client.inspect(SHARD)
    assert state["num_batches"] == 0 and state["seqno"] == seqno
    assert all(v["purpose"] != "spark-write" for v in state["writers"].values())
    client.close()


# -- Dagster: a run with SPARK_MASTER_URL=spark://... --------------------------------------


@pytest.mark.slow
@pytest.mark.dagster
def test_a_dagster_run_ingests_and_compacts_on_the_cluster(
    sessions: Sessions, cluster: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The code location's own resources, built from the environment the way docker/
    sets it (``SPARK_MASTER_URL``, ``PYSPARK_PYTHON`` of the shared image)."""
    dg = pytest.importorskip("dagster")
    from dagster_project.assets import SOURCE_ASSETS, persist_shard
    from dagster_project.definitions import build_resources
    from dagster_project.resources import PersistResource, SparkResource, spark_config_from_env
    from dagster_project.sample import write_orders_file

    sessions.stop()  # the run's SparkResource builds (and stops) its own session
    home = tmp_path / "persist"
    for var in ("PERSIST_BLOB_URI", "PERSIST_CONSENSUS_URI", "PERSIST_LANDING_URI"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PERSIST_HOME", str(home))
    monkeypatch.setenv("SPARK_MASTER_URL", cluster.url)
    monkeypatch.setenv("PYSPARK_PYTHON", sys.executable)
    conf = spark_config_from_env()
    assert conf["spark.master"] == cluster.url
    # One Spark application for the three runs (each would start its own otherwise).
    resources = build_resources(spark=SparkResource(spark_config=conf, stop_session=False))
    orders = SOURCE_ASSETS["orders"]
    landing = home / "landing" / "orders"
    for b in range(3):
        write_orders_file(landing, b, 150, id_space=200)
    (tmp_path / "dagster").mkdir()
    with dg.instance_for_test(temp_dir=str(tmp_path / "dagster")) as instance:
        res = dg.materialize([orders.ingest], resources=resources, instance=instance)
        assert res.success
        mats = {m.asset_key.to_user_string(): m for m in res.get_asset_materialization_events()}
        meta = mats["orders"].materialization.metadata
        assert meta["engine"].value == "spark" and meta["records_appended"].value == 450
        write_orders_file(landing, 3, 50, id_space=200)
        assert dg.materialize([orders.ingest], resources=resources, instance=instance).success
        desc = PersistResource(home=str(home)).controller().describe("orders")
        shard_id = desc["renditions"][desc["active_rendition"]]["shards"][0]
        instance.add_dynamic_partitions("persist_shards", [shard_id])
        res = dg.materialize(
            [persist_shard],
            resources=resources,
            instance=instance,
            partition_key=shard_id,
            run_config={
                "ops": {"persist_shard": {"config": {"debt_threshold": -1, "spark_min_bytes": 0}}}
            },
        )
        assert res.success
        meta = res.get_asset_materialization_events()[0].materialization.metadata
        assert meta["compaction_engine"].value == "spark"
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    assert active is not None and active.sparkContext.master == cluster.url
    active.stop()
    # The work ran on the cluster: the master saw the runs' applications.
    apps = cluster.status().get("completedapps", []) + cluster.status().get("activeapps", [])
    assert any(a.get("name") == "persist-platform" for a in apps), apps
