"""Scaling: the data-plane figures at 1M and 4M rows (16M with ``PERSIST_BENCH_16M=1``),
persist and delta-rs side by side in one run.

For each size n, the same n updates (``update_batch``) are written by each side in 4
commits of n/4 rows at times 0..3 (delta: versions 0..3), then, per side:
- bulk append: MB/s of Arrow over the 4 commits (persist: file blob + SQLite, durable);
- snapshot of the as-written table: MB/s of Arrow of ``snapshot(3)`` against
  ``DeltaTable(path).to_pyarrow_table()`` (median of 3);
- compaction: rows/s of ``client.compact`` against ``optimize.compact()``;
- snapshot after compaction, as above;
- cold time travel: a new client and reader reading as of time 1 (half the rows)
  against ``DeltaTable(path, version=1).to_pyarrow_table()`` (median of 3).
Run alone: ``python -m bench --only scaling`` (not part of ``make bench``). The issue
28 goal: the persist/delta-rs ratio falls by at most 20% from the smallest size to the
largest on every row.
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
)

NAME = "scaling"
COMMITS = 4
REPS = 3


def _sizes() -> list[int]:
    sizes = [1_000_000, 4_000_000]
    if os.environ.get("PERSIST_BENCH_16M") == "1":
        sizes.append(16_000_000)
    return sizes


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
    t0 = time.perf_counter()
    client.compact(shard)
    out["compact_rows_per_s"] = rows / (time.perf_counter() - t0)
    gc.collect()
    out["snap_c_s"], snap = median_time(lambda: r.snapshot(COMMITS - 1), REPS)
    out["snap_c_mb"] = snap.nbytes / 1e6
    del snap
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
    t0 = time.perf_counter()
    DeltaTable(p).optimize.compact()
    out["compact_rows_per_s"] = rows / (time.perf_counter() - t0)
    gc.collect()
    out["snap_c_s"], snap = median_time(lambda: DeltaTable(p).to_pyarrow_table(), REPS)
    out["snap_c_mb"] = snap.nbytes / 1e6
    del snap
    out["tt_s"], out["tt_rows"] = median_time(
        lambda: DeltaTable(p, version=1).to_pyarrow_table().num_rows, REPS
    )
    return out


def run(ctx: Ctx) -> dict[str, Any]:
    det: dict[str, Any] = {}
    rows: list[dict[str, Any]] = []
    for n in _sizes():
        label = f"{n // 1_000_000}M"
        per = n // COMMITS
        chunks = [update_batch(per, i, 1000 + i) for i in range(COMMITS)]
        arrow_mb = sum(c.nbytes for c in chunks) / 1e6
        p = _persist(ctx, chunks, label)
        gc.collect()
        dl = _delta(ctx, chunks, label)
        del chunks
        gc.collect()
        det[label] = {"arrow_MB": round(arrow_mb, 1), "persist": p, "delta": dl}
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
        ]
    return {"rows": rows, "detail": det}
