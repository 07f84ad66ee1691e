"""Spark compaction (``spark_merge``) and landing-zone ingestion (``SparkIngestion``) timings.

Run: ``.venv/bin/python -m bench.spark_maintenance [--master local[2]] [--remote]
[--rows 1000000] [--files 12] [--file-rows 25000] [--repeat 3] [--out FILE]``.

Written to compare the RDD-based implementation with the DataFrame (``mapInArrow``)
one that also runs through Spark Connect, on the same machine back to back:

- ``merge``: one ``spark_merge`` of a shard of 8 batches (``--rows`` updates in all,
  overlapping keys, half of them retractions of earlier rows) into ``num_buckets=4``
  buckets; the output is not applied, so every repeat merges the same inputs. The
  in-process ``compactor.merge_batches`` of the same request is the anchor.
- ``ingest``: ``SparkIngestion.run_once`` of a landing zone of ``--files`` JSON-lines
  files of ``--file-rows`` records each into a fresh location (upsert envelope).

Each is measured after one warm-up run in the same session; the median of ``--repeat``
is reported, in wall seconds and in *CPU seconds of the whole process tree* (this
process, the JVM and its Python workers, or the Connect server and its workers: utime +
stime + reaped children's, from ``/proc``), which a busy machine disturbs far less than
wall time. ``--remote`` runs the Spark side through a Spark Connect server
(``persist_lib.spark.connect_server``) on the same master. The machine is shared:
compare runs made back to back, not absolute figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

KEY = pa.schema([("id", pa.int64())])
VAL = pa.schema([("name", pa.string()), ("qty", pa.float64())])
MiB = 1 << 20
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def tree_cpu() -> float:
    """CPU seconds of this process and every process below it (Linux ``/proc``)."""
    total, todo, seen = 0.0, [os.getpid()], set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += sum(int(x) for x in fields[11:15]) / _TICK  # utime stime cutime cstime
            for t in os.listdir(f"/proc/{pid}/task"):
                todo += [int(k) for k in Path(f"/proc/{pid}/task/{t}/children").read_text().split()]
        except OSError:
            continue
    return total


def _client(root: Path, tag: str) -> Any:
    from persist_lib import PersistClient, PersistConfig

    blob = root / f"blob-{tag}"
    blob.mkdir(parents=True, exist_ok=True)
    cfg = PersistConfig(blob_target_size=8 * MiB, background_heartbeats=False, rollup_interval=10**9)
    return PersistClient.open(f"file://{blob}", f"sqlite:///{root / f'consensus-{tag}.db'}", cfg)


def _fill(w: Any, rows: int, batches: int = 8) -> None:
    rng = np.random.default_rng(7)
    per = rows // batches
    for i in range(batches):
        ids = rng.integers(0, rows // 2, per)
        w.compare_and_append(
            pa.table(
                {
                    "id": ids,
                    "name": pa.array([f"n{v % 1009}" for v in ids.tolist()]),
                    "qty": (ids % 97).astype(np.float64),
                    "ts": np.full(per, i, dtype=np.int64),
                    "diff": rng.choice(np.array([-1, 1], dtype=np.int64), per),
                }
            ),
            i,
            i + 1,
        )


def _zone(path: Path, files: int, rows: int) -> None:
    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(3)
    for f in range(files):
        ids = rng.integers(0, files * rows // 4, rows).tolist()
        lines = [json.dumps({"id": k, "name": f"n{f}-{j}", "qty": float(k % 50)}) for j, k in enumerate(ids)]
        (path / f"f{f:04d}.jsonl").write_text("\n".join(lines) + "\n")


def bench_merge(spark: Any, root: Path, rows: int, repeat: int) -> dict[str, Any]:
    from persist_lib.shard.codec import Schemas
    from persist_lib.shard.compactor import merge_batches
    from persist_lib.shard.spine import CompactionRequest
    from persist_lib.spark import spark_merge

    client = _client(root, "merge")
    shard = "s00000000-0000-4000-8000-00000000b001"
    w, r = client.open(shard, KEY, VAL)
    _fill(w, rows)
    r.downgrade_since(4)
    s = client.machine(shard).fetch_latest()
    schemas = Schemas.from_json(s.schemas)
    trace = s.trace_batches()
    req = CompactionRequest(
        tuple(i for i, _ in trace), trace[0][1].lower, trace[-1][1].upper, s.since, tuple(b for _, b in trace)
    )
    secs, cpu, local = [], [], []
    out: Any = None
    for i in range(repeat + 1):
        t0, c0 = time.perf_counter(), tree_cpu()
        out = spark_merge(spark, client, schemas, req, shard_id=shard, num_buckets=4)
        if i:
            secs.append(time.perf_counter() - t0)
            cpu.append(tree_cpu() - c0)
        if out.registration is not None:
            out.registration.release()
        t0 = time.perf_counter()
        merge_batches(
            client.blob, schemas, shard=shard, inputs=req.inputs, lower=req.lower, upper=req.upper,
            since=req.since, memory_budget=256 * MiB, target_part_bytes=8 * MiB, inline_threshold=4096,
        )
        if i:
            local.append(time.perf_counter() - t0)
    client.close()
    return {
        "rows_in": req.num_updates, "bytes_in": req.num_bytes, "rows_out": out.stats.rows_out,
        "parts_out": out.stats.parts_out, "seconds": secs, "cpu_seconds": cpu, "in_process_seconds": local,
    }


def bench_ingest(spark: Any, root: Path, files: int, file_rows: int, repeat: int) -> dict[str, Any]:
    from persist_lib.ingest import IngestConfig, LandingZoneSource
    from persist_lib.spark import ingest_landing_zone

    zone = root / "zone"
    _zone(zone, files, file_rows)
    cfg = IngestConfig(max_records_per_binding=50_000, max_append_records=250_000)
    secs: list[float] = []
    cpu: list[float] = []
    summary: dict[str, Any] = {}
    for i in range(repeat + 1):
        client = _client(root, f"ingest{i}")
        t0, c0 = time.perf_counter(), tree_cpu()
        summary = ingest_landing_zone(
            spark, client, "ing", LandingZoneSource(str(zone)), KEY, VAL, envelope="upsert", config=cfg,
            clock=lambda: 1,
        )
        if i:
            secs.append(time.perf_counter() - t0)
            cpu.append(tree_cpu() - c0)
        client.close()
    return {
        "records": summary["records"], "updates": summary["updates"], "spark": summary["spark"],
        "seconds": secs, "cpu_seconds": cpu,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--master", default="local[2]")
    ap.add_argument("--remote", action="store_true", help="through a Spark Connect server")
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--files", type=int, default=12)
    ap.add_argument("--file-rows", type=int, default=25_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--only", choices=["merge", "ingest"], default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="bench-spark-maint-"))
    server: Any = None
    try:
        if a.remote:
            from pyspark.sql import SparkSession

            from persist_lib.spark.connect_server import SparkConnectServer

            server = SparkConnectServer(master=a.master).start()
            spark = SparkSession.builder.remote(server.url).getOrCreate()
        else:
            from persist_lib.spark import local_session

            spark = local_session(a.master, "bench-maintenance")
            spark.sparkContext.setLogLevel("ERROR")
        res: dict[str, Any] = {"master": a.master, "remote": a.remote, "python": sys.version.split()[0]}
        if a.only in (None, "merge"):
            res["merge"] = bench_merge(spark, root, a.rows, a.repeat)
        if a.only in (None, "ingest"):
            res["ingest"] = bench_ingest(spark, root, a.files, a.file_rows, a.repeat)
        spark.stop()
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(root, ignore_errors=True)
    for k in ("merge", "ingest"):
        if k in res:
            r = res[k]
            extra = (
                f", in-process {statistics.median(r['in_process_seconds']):.2f} s" if "in_process_seconds" in r else ""
            )
            print(
                f"{k}: median {statistics.median(r['seconds']):.2f} s of {[round(s, 2) for s in r['seconds']]}, "
                f"CPU {statistics.median(r['cpu_seconds']):.2f} s of {[round(s, 2) for s in r['cpu_seconds']]}{extra}"
            )
    text = json.dumps(res, indent=2)
    if a.out:
        Path(a.out).write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
