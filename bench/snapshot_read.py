"""8. Snapshot read: MB/s of Arrow a full read of a table returns (median of 3).

The same 1M updates (full: 5M), written once by each side:
- persist: one ``compare_and_append`` (bulk parts as the writer stored them: sorted parts
  of disjoint key ranges since issue 28's session 14, unsorted parts before), read with
  ``ReadHandle.snapshot(as_of)`` — every part fetched, its SHA-256 verified, decoded, and
  consolidated (key-range parts chain into one run: a linear neighbour check; unsorted
  parts: one sort); then the same after ``client.compact`` (one sorted, consolidated run);
- delta-rs: ``write_deltalake`` then ``DeltaTable(path).to_pyarrow_table()``;
- raw: ``pq.write_table`` (zstd) then ``pq.read_table`` of that one file (the limit:
  decoding alone, no checksum, no consolidation).
MB/s = Arrow bytes of the result / wall time of the read call, on a warm page cache.
"""

from __future__ import annotations

import gc
from typing import Any

import pyarrow.parquet as pq

from bench.common import (
    KEY_SCHEMA,
    VAL_SCHEMA,
    Ctx,
    median_time,
    persist_file_client,
    row,
    update_batch,
)

NAME = "snapshot_read"
REPS = 3


def run(ctx: Ctx) -> dict[str, Any]:
    from deltalake import DeltaTable, write_deltalake

    from persist_lib.ids import ShardId

    n = ctx.pick(1_000_000, 5_000_000)
    table = update_batch(n, 0, 777)
    det: dict[str, Any] = {"rows": n, "arrow_MB": round(table.nbytes / 1e6, 1)}

    d = ctx.dir("persist_read")
    client = persist_file_client(d, compaction_enabled=False)
    shard = ShardId.new()
    w, r = client.open(shard, KEY_SCHEMA, VAL_SCHEMA)
    w.compare_and_append(table, 0, 1)
    state = client.machine(shard).fetch_latest()
    parts = [p for b in state.batches.values() for p in b.parts]
    gc.collect()
    with ctx.profile("persist_snapshot_read"):
        s_bulk, out = median_time(lambda: r.snapshot(0), REPS)
    det["persist_as_written"] = {
        "ms": round(s_bulk * 1e3, 1),
        "rows": out.num_rows,
        "MB_per_s": round(out.nbytes / 1e6 / s_bulk, 1),
        "parts": len(parts),
        "unsorted_parts": sum(1 for p in parts if not p.sorted),
    }
    del out
    client.compact(shard)
    gc.collect()
    s_comp, out = median_time(lambda: r.snapshot(0), REPS)
    det["persist_compacted"] = {
        "ms": round(s_comp * 1e3, 1),
        "rows": out.num_rows,
        "MB_per_s": round(out.nbytes / 1e6 / s_comp, 1),
    }
    persist_mb = out.nbytes / 1e6
    del out
    w.expire()
    r.expire()
    client.close()

    p = str(ctx.dir("delta_read"))
    write_deltalake(p, table, mode="append")
    gc.collect()
    s_delta, dout = median_time(lambda: DeltaTable(p).to_pyarrow_table(), REPS)
    det["delta"] = {"ms": round(s_delta * 1e3, 1), "rows": dout.num_rows,
                    "MB_per_s": round(dout.nbytes / 1e6 / s_delta, 1)}
    delta_mb = dout.nbytes / 1e6
    del dout

    f = ctx.dir("raw_read") / "t.parquet"
    pq.write_table(table, f, compression="zstd")
    gc.collect()
    s_raw, rout = median_time(lambda: pq.read_table(f), REPS)
    det["raw"] = {"ms": round(s_raw * 1e3, 1), "MB_per_s": round(rout.nbytes / 1e6 / s_raw, 1)}
    del rout

    a, c = det["persist_as_written"], det["persist_compacted"]
    label = f"{n / 1e6:g}M rows"
    note = f"{a['parts']} parts, {a['unsorted_parts']} unsorted"
    rows = [
        row(NAME, f"MB/s of Arrow, snapshot of a bulk-written shard ({label})", a["MB_per_s"], "MB/s",
            "delta-rs to_pyarrow_table", det["delta"]["MB_per_s"], note=note),
        row(NAME, "MB/s of Arrow, snapshot of a bulk-written shard", a["MB_per_s"], "MB/s",
            "raw pq.read_table", det["raw"]["MB_per_s"]),
        row(NAME, "MB/s of Arrow, snapshot after compaction", c["MB_per_s"], "MB/s",
            "delta-rs to_pyarrow_table", det["delta"]["MB_per_s"]),
        row(NAME, "MB/s of Arrow, snapshot after compaction", c["MB_per_s"], "MB/s",
            "raw pq.read_table", det["raw"]["MB_per_s"]),
    ]
    det["result_MB"] = {"persist": round(persist_mb, 1), "delta": round(delta_mb, 1)}
    return {"rows": rows, "detail": det}
