"""2. Bulk append: one table of 5M updates (quick: 1M), MB/s of Arrow data.

persist: one ``compare_and_append`` with the default 128 MiB target parts (the batch
builder cuts the chunk at sampled key quantiles into ranges, sorts and consolidates each
range on its own upload thread, encodes Parquet/zstd, SHA-256s and fsyncs it),
and the same through ``WriteHandle.builder`` fed in 1M-row chunks; and a
``compare_and_append`` of the same table already sorted by (key, value, ts) against raw
Parquet of that sorted table (the writer recognises sorted input and skips its sort).
Anchors: delta-rs ``write_deltalake`` of the same table into a new table, and raw
``pyarrow.parquet.write_table(table, path, compression="zstd")`` (the limit: Parquet
encoding alone, no sort, no checksum, no fsync), and the same after Arrow's
``sort_by(key, value, ts)`` (the floor of a design that stores sorted runs).
"""

from __future__ import annotations

import gc
import time
from typing import Any

import pyarrow.parquet as pq

from bench.common import KEY_SCHEMA, VAL_SCHEMA, Ctx, du, persist_file_client, row, update_batch

NAME = "bulk_append"


def _persist(ctx: Ctx, table: Any, *, builder: bool, name: str | None = None) -> dict[str, Any]:
    from persist_lib.ids import ShardId
    from persist_lib.shard.kernels import polars

    # The kernels' engine is imported outside the timer, as ``deltalake`` is for delta-rs
    # (a first import costs 0.2-0.7 s: more than the append of 1M rows).
    polars()
    name = name or ("persist_bulk_builder" if builder else "persist_bulk")
    d = ctx.dir(name)
    client = persist_file_client(d)
    shard = ShardId.new()
    w = client.open_writer(shard, KEY_SCHEMA, VAL_SCHEMA)
    gc.collect()
    with ctx.profile(name):
        t0 = time.perf_counter()
        if builder:
            b = w.builder(0)
            step = 1_000_000
            for off in range(0, table.num_rows, step):
                b.add(w.normalize(table.slice(off, step)))
            w.compare_and_append_batch(b.finish(1), 0, 1)
        else:
            w.compare_and_append(table, 0, 1)
        el = time.perf_counter() - t0
    info = client.inspect(shard)
    client.close()
    return {
        "seconds": round(el, 3),
        "arrow_MB_per_s": round(table.nbytes / 1e6 / el, 1),
        "rows_per_s": int(table.num_rows / el),
        "parts": sum(len(b["parts"]) for b in info["batches"]),
        "parquet_MB": round(info["bytes"] / 1e6, 1),
        "updates_stored": info["num_updates"],
    }


def _delta(ctx: Ctx, table: Any) -> dict[str, Any]:
    from deltalake import write_deltalake

    p = ctx.dir("delta_bulk")
    gc.collect()
    t0 = time.perf_counter()
    write_deltalake(str(p), table, mode="append")
    el = time.perf_counter() - t0
    return {
        "seconds": round(el, 3),
        "arrow_MB_per_s": round(table.nbytes / 1e6 / el, 1),
        "rows_per_s": int(table.num_rows / el),
        "parquet_MB": round(du(p) / 1e6, 1),
    }


def _raw(ctx: Ctx, table: Any, name: str = "raw_parquet") -> dict[str, Any]:
    p = ctx.dir(name) / "t.parquet"
    gc.collect()
    t0 = time.perf_counter()
    pq.write_table(table, p, compression="zstd")
    el = time.perf_counter() - t0
    return {
        "seconds": round(el, 3),
        "arrow_MB_per_s": round(table.nbytes / 1e6 / el, 1),
        "rows_per_s": int(table.num_rows / el),
        "parquet_MB": round(p.stat().st_size / 1e6, 1),
    }


def _raw_sorted(ctx: Ctx, table: Any) -> dict[str, Any]:
    """persist's design floor: the same table sorted by (key, value, ts) with Arrow's
    ``sort_by``, then ``write_table`` zstd (no consolidation, checksum or fsync)."""
    p = ctx.dir("raw_sorted_parquet") / "t.parquet"
    gc.collect()
    t0 = time.perf_counter()
    srt = table.sort_by([("key", "ascending"), ("value", "ascending"), ("ts", "ascending")])
    pq.write_table(srt, p, compression="zstd")
    el = time.perf_counter() - t0
    return {
        "seconds": round(el, 3),
        "arrow_MB_per_s": round(table.nbytes / 1e6 / el, 1),
        "rows_per_s": int(table.num_rows / el),
        "parquet_MB": round(p.stat().st_size / 1e6, 1),
    }


def run(ctx: Ctx) -> dict[str, Any]:
    n = ctx.pick(1_000_000, 5_000_000)
    table = update_batch(n, 0, 12345)
    det: dict[str, Any] = {"rows": n, "arrow_MB": round(table.nbytes / 1e6, 1)}
    det["persist"] = _persist(ctx, table, builder=False)
    det["delta"] = _delta(ctx, table)
    det["raw_parquet_zstd"] = _raw(ctx, table)
    det["raw_sorted_parquet_zstd"] = _raw_sorted(ctx, table)
    det["persist_builder"] = _persist(ctx, table, builder=True)
    # Input already sorted by (key, value, ts): the writer cuts it where it lies
    # (``shard.presorted``), no sort; against raw Parquet of the same sorted table.
    srt = table.sort_by([("key", "ascending"), ("value", "ascending"), ("ts", "ascending")])
    det["persist_sorted_input"] = _persist(ctx, srt, builder=False, name="persist_bulk_sorted_input")
    det["raw_sorted_input"] = _raw(ctx, srt, name="raw_sorted_input")
    p, dl, raw, pb = det["persist"], det["delta"], det["raw_parquet_zstd"], det["persist_builder"]
    rs = det["raw_sorted_parquet_zstd"]
    label = f"{n / 1e6:g}M rows, {det['arrow_MB']} MB Arrow"
    rows = [
        row(
            NAME,
            f"MB/s of Arrow, one compare_and_append ({label})",
            p["arrow_MB_per_s"],
            "MB/s",
            "delta-rs write_deltalake",
            dl["arrow_MB_per_s"],
            goal_ratio=(">=", 1.2),
        ),
        row(
            NAME,
            "MB/s of Arrow, one compare_and_append",
            p["arrow_MB_per_s"],
            "MB/s",
            "raw pq.write_table zstd",
            raw["arrow_MB_per_s"],
            goal_ratio=(">=", 0.9),
        ),
        row(
            NAME,
            "MB/s of Arrow, one compare_and_append",
            p["arrow_MB_per_s"],
            "MB/s",
            "Arrow sort_by(key, value, ts) + write_table zstd",
            rs["arrow_MB_per_s"],
        ),
        row(
            NAME,
            "MB/s of Arrow, builder fed 1M-row chunks",
            pb["arrow_MB_per_s"],
            "MB/s",
            "delta-rs write_deltalake",
            dl["arrow_MB_per_s"],
        ),
        row(
            NAME,
            "MB/s of Arrow, one compare_and_append of input sorted by (key, value, ts)",
            det["persist_sorted_input"]["arrow_MB_per_s"],
            "MB/s",
            "raw pq.write_table zstd of the same sorted table",
            det["raw_sorted_input"]["arrow_MB_per_s"],
        ),
    ]
    return {"rows": rows, "detail": det}
