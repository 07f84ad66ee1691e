"""Spark scaling: the same write and compaction in-process, on ``local[1]``, ``local[2]``
and on a standalone cluster of one and of two 1-core workers, in one run.

Run: ``.venv/bin/python -m bench.spark_scaling [--rows 2000000] [--merge-rows 1000000]
[--repeat 3] [--out FILE]`` (``make bench-spark``).

- **write**: ``write_batch`` of ``--rows`` generated rows as one batch, one CAS
  (``bench.spark_write.bench_session``; in-process: ``compare_and_append`` of the same
  rows as an Arrow table).
- **merge**: ``spark_merge`` of a shard of 8 overlapping batches (``--merge-rows``
  updates) into 4 buckets, not applied, so every repeat merges the same inputs
  (``bench.spark_maintenance.bench_merge``; in-process: ``compactor.merge_batches``).

The cluster is ``persist_lib.spark.standalone.StandaloneCluster`` on loopback: master and
workers are separate JVMs, each worker's executor has its own Python workers, parts go
through the ``file://`` blob exactly as on a shared filesystem. On this 2-core machine
two 1-core workers compete with the driver (whose single CAS is the serial part) and with
each other for the same two cores, so the figures show the overhead of going distributed
and what a second core buys, not what a second machine would; see docs/spark.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

MiB = 1 << 20


def _register_by_value() -> None:
    """Bench functions run on executors whose cwd is a worker dir: ship them by value."""
    from pyspark import cloudpickle

    for name in ("bench.spark_write", "bench.spark_maintenance"):
        __import__(name)
        cloudpickle.register_pickle_by_value(sys.modules[name])


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def _session(master: str, cores: int) -> Any:
    from persist_lib.spark import local_session

    conf = {
        "spark.sql.shuffle.partitions": str(2 * cores),
        "spark.default.parallelism": str(cores),
        "spark.executor.memory": "1500m",
        "spark.executor.cores": "1",
    }
    s = local_session(master, "bench-spark-scaling", conf)
    s.sparkContext.setLogLevel("ERROR")
    _register_by_value()
    return s


def _measure(root: Path, spark: Any, tag: str, cores: int, args: argparse.Namespace) -> dict[str, Any]:
    from bench.spark_maintenance import bench_merge
    from bench.spark_write import bench_session

    w = bench_session(root, spark, tag, args.rows, args.repeat, args.part_mb, 2 * cores)
    m = bench_merge(spark, root / f"merge-{tag.replace('[', '').replace(']', '')}", args.merge_rows, args.repeat)
    return {"write_seconds": w["seconds"], "floor_seconds": w["floor_seconds"], "merge": m}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from bench.spark_write import _client, arrow_input, bench_in_process
    from persist_lib.spark.standalone import StandaloneCluster

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    root = Path(tempfile.mkdtemp(prefix="bench-spark-scaling-"))
    rows: list[dict[str, Any]] = []
    try:
        table = arrow_input(args.rows)
        nbytes = table.nbytes
        inproc = bench_in_process(root, table, args.repeat, args.part_mb)
        del table
        _ = _client  # (the in-process writer opens its own client)
        modes: list[tuple[str, str | int, int]] = [
            ("local[1]", "local[1]", 1),
            ("local[2]", "local[2]", 2),
            ("cluster, 1 worker", 1, 1),
            ("cluster, 2 workers", 2, 2),
        ]
        merge_anchor: float | None = None
        for label, master, cores in modes:
            if isinstance(master, int):
                with StandaloneCluster(workers=master, cores=1, memory="2g") as cluster:
                    spark = _session(cluster.url, cores)
                    try:
                        r = _measure(root, spark, label, cores, args)
                    finally:
                        spark.stop()
            else:
                spark = _session(master, cores)
                try:
                    r = _measure(root, spark, label, cores, args)
                finally:
                    spark.stop()
            m = r["merge"]
            if merge_anchor is None:  # the in-process merge of the same request, first mode's run
                merge_anchor = m["rows_in"] / _median(m["in_process_seconds"])
            rows.append({"mode": label, **r})
    finally:
        shutil.rmtree(root, ignore_errors=True)
    w_in = _median(inproc["seconds"])
    out_rows = [
        {
            "mode": "in-process",
            "write_rows_per_s": round(args.rows / w_in),
            "write_mb_per_s": round(nbytes / MiB / w_in, 1),
            "spark_floor_s": None,
            "merge_rows_per_s": round(merge_anchor or 0),
        }
    ]
    for r in rows:
        ws = _median(r["write_seconds"])
        out_rows.append(
            {
                "mode": r["mode"],
                "write_rows_per_s": round(args.rows / ws),
                "write_mb_per_s": round(nbytes / MiB / ws, 1),
                "spark_floor_s": round(_median(r["floor_seconds"]), 3),
                "merge_rows_per_s": round(r["merge"]["rows_in"] / _median(r["merge"]["seconds"])),
            }
        )
    return {
        "benchmark": "spark_scaling",
        "rows": args.rows,
        "merge_rows": args.merge_rows,
        "input_mb": round(nbytes / MiB, 1),
        "repeat": args.repeat,
        "cpus": os.cpu_count(),
        "load_after": round(os.getloadavg()[0], 2),
        "python": platform.python_version(),
        "results": out_rows,
    }


def render(out: dict[str, Any]) -> str:
    base = out["results"][0]
    lines = [
        f"Spark scaling: write {out['rows']:,} rows ({out['input_mb']} MB Arrow), merge "
        f"{out['merge_rows']:,} updates; median of {out['repeat']} (machine: {out['cpus']} CPUs, "
        f"load {out['load_after']} at the end)",
        "",
        "| mode | write rows/s | write MB/s | vs in-process | Spark floor s | merge rows/s | vs in-process |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in out["results"]:
        lines.append(
            f"| {r['mode']} | {r['write_rows_per_s']:,} | {r['write_mb_per_s']} | "
            f"{r['write_rows_per_s'] / base['write_rows_per_s']:.2f}x | "
            f"{r['spark_floor_s'] if r['spark_floor_s'] is not None else '-'} | "
            f"{r['merge_rows_per_s']:,} | {r['merge_rows_per_s'] / max(1, base['merge_rows_per_s']):.2f}x |"
        )
    by = {r["mode"]: r for r in out["results"]}
    if "cluster, 1 worker" in by and "cluster, 2 workers" in by:
        one, two = by["cluster, 1 worker"], by["cluster, 2 workers"]
        lines += [
            "",
            f"Second worker: write {two['write_rows_per_s'] / one['write_rows_per_s']:.2f}x, "
            f"merge {two['merge_rows_per_s'] / max(1, one['merge_rows_per_s']):.2f}x "
            f"(local[2]/local[1]: write {by['local[2]']['write_rows_per_s'] / by['local[1]']['write_rows_per_s']:.2f}x, "
            f"merge {by['local[2]']['merge_rows_per_s'] / max(1, by['local[1]']['merge_rows_per_s']):.2f}x)",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--merge-rows", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--part-mb", type=int, default=128)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    out = run(args)
    print(render(out))
    print()
    print(json.dumps(out, indent=2))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
