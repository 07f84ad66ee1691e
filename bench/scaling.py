"""Scaling: the data-plane figures at 1M and 4M rows (16M with ``PERSIST_BENCH_16M=1``),
persist and delta-rs side by side in one run.

For each size n, the same n updates (``update_batch``) are written by each side in 4
commits of n/4 rows at times 0..3 (delta: versions 0..3), then, per side:
- bulk append: MB/s of Arrow over the 4 commits (persist: file blob + SQLite, durable);
- snapshot of the as-written table: MB/s of Arrow of ``snapshot(3)`` against
  ``DeltaTable(path).to_pyarrow_table()`` (median of 3);
- compaction: rows/s of ``client.compact`` against ``optimize.compact()``;
- snapshot after compaction, as above;
- a 1%-selective filtered snapshot after compaction (``1% of the key range``):
  ``snapshot(3, filter=[("key", ">=", lo), ("key", "<", hi)])`` against
  ``to_pyarrow_table(filters=...)`` of the compacted delta table (median of 3);
- cold time travel: a new client and reader reading as of time 1 (half the rows)
  against ``DeltaTable(path, version=1).to_pyarrow_table()`` (median of 3);
- Spark and ``persist sql`` over the compacted shard against Spark and DuckDB reading its
  part files as plain Parquet (``bench.scaling_engines``; ``PERSIST_BENCH_ENGINES=0``
  leaves them out), then again once the since reached the as-of and the shard was
  compacted again ("no history" rows: parts that need no consolidation).
Run alone: ``python -m bench --only scaling --runs 1 --max-runs 1`` (not part of ``make
bench``); ``PERSIST_BENCH_SIZES=1,4`` picks the sizes in millions. The issue 28 goal:
the persist/delta-rs ratio falls by at most 20% from the smallest size to the largest on
every row.
"""

from __future__ import annotations

import gc
import os
import time
from typing import Any

from bench.common import (
    KEY_SCHEMA,
    VAL_SCHEMA,
    Ctx,
    median_time,
    persist_file_client,
    row,
    update_batch,
    warm_imports,
)

NAME = "scaling"
COMMITS = 4
REPS = 3


LO, HI = 5_000_000, 5_100_000  # 1% of the key range [0, 1e7)
FILTER: list[tuple[str, str, int]] = [("key", ">=", LO), ("key", "<", HI)]


def _sizes() -> list[int]:
    env = os.environ.get("PERSIST_BENCH_SIZES")
    if env:
        return [int(float(x) * 1_000_000) for x in env.split(",") if x.strip()]
    sizes = [1_000_000, 4_000_000]
    if os.environ.get("PERSIST_BENCH_16M") == "1":
        sizes.append(16_000_000)
    return sizes


def _engines() -> bool:
    return os.environ.get("PERSIST_BENCH_ENGINES", "1") != "0"


def _persist(ctx: Ctx, chunks: list[Any], label: str) -> dict[str, Any]:
    from persist_lib.ids import ShardId
    from persist_lib.shard.machine import clear_state_cache

    d = ctx.dir(f"scaling_persist_{label}")
    client = persist_file_client(d, compaction_enabled=False)
    shard = ShardId.new()
    w, r = client.open(shard, KEY_SCHEMA, VAL_SCHEMA)
    t0 = time.perf_counter()
    for i, c in enumerate(chunks):
        w.compare_and_append(c, i, i + 1)
    out: dict[str, Any] = {"append_s": time.perf_counter() - t0}
    gc.collect()
    out["snap_s"], snap = median_time(lambda: r.snapshot(COMMITS - 1), REPS)
    out["snap_mb"] = snap.nbytes / 1e6
    del snap
    rows = sum(c.num_rows for c in chunks)
    t0, c0 = time.perf_counter(), time.process_time()
    client.compact(shard)
    out["compact_rows_per_s"] = rows / (time.perf_counter() - t0)
    out["compact_cpu_s"] = round(time.process_time() - c0, 3)  # every thread of the process
    gc.collect()
    out["snap_c_s"], snap = median_time(lambda: r.snapshot(COMMITS - 1), REPS)
    out["snap_c_mb"] = snap.nbytes / 1e6
    del snap
    out["filt_s"], sel = median_time(lambda: r.snapshot(COMMITS - 1, filter=FILTER), REPS)
    out["filt_rows"] = sel.num_rows
    del sel
    out["dir"], out["shard"] = d, shard
    w.expire()
    r.expire()
    client.close()

    def cold() -> int:
        clear_state_cache()
        c = persist_file_client(d)
        try:
            rr = c.open_leased_reader(shard, KEY_SCHEMA, VAL_SCHEMA)
            n = rr.snapshot(1).num_rows
            rr.expire()
            return n
        finally:
            c.close()

    out["tt_s"], out["tt_rows"] = median_time(cold, REPS)
    return out


def _delta(ctx: Ctx, chunks: list[Any], label: str) -> dict[str, Any]:
    from deltalake import DeltaTable, write_deltalake

    p = str(ctx.dir(f"scaling_delta_{label}"))
    t0 = time.perf_counter()
    for c in chunks:
        write_deltalake(p, c, mode="append")
    out: dict[str, Any] = {"append_s": time.perf_counter() - t0}
    gc.collect()
    out["snap_s"], snap = median_time(lambda: DeltaTable(p).to_pyarrow_table(), REPS)
    out["snap_mb"] = snap.nbytes / 1e6
    del snap
    rows = sum(c.num_rows for c in chunks)
    t0, c0 = time.perf_counter(), time.process_time()
    DeltaTable(p).optimize.compact()
    out["compact_rows_per_s"] = rows / (time.perf_counter() - t0)
    out["compact_cpu_s"] = round(time.process_time() - c0, 3)
    gc.collect()
    out["snap_c_s"], snap = median_time(lambda: DeltaTable(p).to_pyarrow_table(), REPS)
    out["snap_c_mb"] = snap.nbytes / 1e6
    del snap
    out["filt_s"], sel = median_time(lambda: DeltaTable(p).to_pyarrow_table(filters=FILTER), REPS)
    out["filt_rows"] = sel.num_rows
    del sel
    out["tt_s"], out["tt_rows"] = median_time(
        lambda: DeltaTable(p, version=1).to_pyarrow_table().num_rows, REPS
    )
    return out


def run(ctx: Ctx) -> dict[str, Any]:
    warm_imports()
    det: dict[str, Any] = {}
    rows: list[dict[str, Any]] = []
    for n in _sizes():
        label = f"{n / 1e6:g}M"
        per = n // COMMITS
        chunks = [update_batch(per, i, 1000 + i) for i in range(COMMITS)]
        arrow_mb = sum(c.nbytes for c in chunks) / 1e6
        p = _persist(ctx, chunks, label)
        gc.collect()
        dl = _delta(ctx, chunks, label)
        del chunks
        gc.collect()
        eng: dict[str, Any] = {}
        if _engines():
            from bench import scaling_engines as se

            files = se.part_files_of(p["dir"], p["shard"])
            eng["spark"] = se.spark_figures(p["dir"], p["shard"], files)
            gc.collect()
            eng["sql"] = se.sql_figures(p["dir"], p["shard"], files)
            gc.collect()
            eng |= se.no_history_figures(p["dir"], p["shard"])
            gc.collect()
        p["dir"], p["shard"] = str(p["dir"]), str(p["shard"])
        det[label] = {"arrow_MB": round(arrow_mb, 1), "persist": p, "delta": dl, **eng}
        rows += [
            row(NAME, f"{label}: bulk append, MB/s of Arrow", arrow_mb / p["append_s"], "MB/s",
                "delta-rs write_deltalake", arrow_mb / dl["append_s"]),
            row(NAME, f"{label}: snapshot as written, MB/s of Arrow", p["snap_mb"] / p["snap_s"], "MB/s",
                "delta-rs to_pyarrow_table", dl["snap_mb"] / dl["snap_s"]),
            row(NAME, f"{label}: compaction, rows/s", p["compact_rows_per_s"], "rows/s",
                "delta-rs optimize.compact", dl["compact_rows_per_s"]),
            row(NAME, f"{label}: snapshot after compaction, MB/s of Arrow", p["snap_c_mb"] / p["snap_c_s"],
                "MB/s", "delta-rs to_pyarrow_table", dl["snap_c_mb"] / dl["snap_c_s"]),
            row(NAME, f"{label}: cold time travel (as of time 1 of 4), ms", p["tt_s"] * 1e3, "ms",
                f"delta-rs version=1 ({dl['tt_rows']:,} rows)", dl["tt_s"] * 1e3,
                note=f"persist {p['tt_rows']:,} rows"),
            row(NAME, f"{label}: 1%-selective filtered snapshot after compaction, ms", p["filt_s"] * 1e3,
                "ms", f"delta-rs to_pyarrow_table(filters) ({dl['filt_rows']:,} rows)", dl["filt_s"] * 1e3,
                note=f"persist {p['filt_rows']:,} rows"),
        ]
        for key, what, anchor in (
            ("spark", "Spark read_snapshot + aggregate (local[2])", "spark.read.parquet of the part files"),
            ("sql", "persist sql aggregate over the snapshot", "DuckDB read_parquet of the part files"),
            ("spark_nh", "no history: Spark read_snapshot + aggregate", "spark.read.parquet of the part files"),
            ("spark_nh_lazy", "no history: Spark read_snapshot(materialize=False) + aggregate",
             "spark.read.parquet of the part files"),
            ("sql_nh", "no history: persist sql aggregate", "DuckDB read_parquet of the part files"),
        ):
            if key in eng:
                e = eng[key]
                rows.append(
                    row(NAME, f"{label}: {what}, ms", e["persist_s"] * 1e3, "ms", anchor, e["raw_s"] * 1e3,
                        goal_ratio=("<=", 1.25),
                        note=f"{e['rows']:,} rows vs {e['raw_rows']:,} updates; "
                        f"speed {e['raw_s'] / e['persist_s']:.2f}x (goal >= 0.8x)")
                )
    _engines_done()
    return {"rows": rows, "detail": det}


def _engines_done() -> None:
    if _engines():
        from bench import scaling_engines as se

        se.stop_spark()
