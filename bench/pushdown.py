"""Filter pushdown: a 1%-selective snapshot against the full one and delta-rs (issue 28).

The same 1M updates (full: 5M; random int64 keys in [0, 1e7)), written once by each side:
- persist: four ``compare_and_append`` with 1 MiB parts, then ``client.compact`` (key-
  sorted parts, each with its statistics); read with ``snapshot(3)`` (every part)
  and with ``snapshot(3, filter=[("key", ">=", lo), ("key", "<", hi)])`` for 1% of
  the key range (parts whose statistics rule it out are not fetched). Bytes fetched
  from blob come from the client's metrics (``persist_blob_bytes_read``);
- delta-rs: the rows sorted by key, written with a file size like persist's parts;
  ``DeltaTable(path).to_pyarrow_table(filters=...)`` with the same bounds (file
  statistics skip the other files).
Median of 3, warm page cache; both read the whole of each file they don't skip.
"""

from __future__ import annotations

import gc
from typing import Any

import pyarrow as pa

from bench.common import (
    KEY_SCHEMA,
    VAL_SCHEMA,
    Ctx,
    du,
    median_time,
    persist_file_client,
    row,
    update_batch,
)

NAME = "pushdown"
REPS = 3
PART_BYTES = 1 << 20


def run(ctx: Ctx) -> dict[str, Any]:
    from deltalake import DeltaTable, write_deltalake

    from persist_lib.ids import ShardId

    n = ctx.pick(1_000_000, 5_000_000)
    table = update_batch(n, 0, 4242)
    as_of = 3
    lo, hi = 5_000_000, 5_100_000  # 1% of the key range
    det: dict[str, Any] = {"rows": n, "filter": f"{lo} <= key < {hi}"}

    d = ctx.dir("persist_pushdown")
    client = persist_file_client(d, compaction_enabled=False, metrics=True, blob_target_size=PART_BYTES)
    shard = ShardId.new()
    w, r = client.open(shard, KEY_SCHEMA, VAL_SCHEMA)
    commits = 4  # compaction merges them into key-sorted parts
    step = -(-n // commits)
    for i in range(commits):
        chunk = table.slice(i * step, step)
        chunk = chunk.set_column(chunk.schema.get_field_index("ts"), "ts", pa.array([i] * chunk.num_rows, pa.int64()))
        w.compare_and_append(chunk, i, i + 1)
    client.compact(shard)
    state = client.machine(shard).fetch_latest()
    parts = [p for _, b in state.trace_batches() for p in b.parts]
    sm = client.metrics.shard(str(shard))
    spec = [("key", ">=", lo), ("key", "<", hi)]

    def measured(fn: Any) -> tuple[float, Any, int]:
        before = sm.bytes_read
        s, out = median_time(fn, REPS)
        return s, out, (sm.bytes_read - before) // REPS

    gc.collect()
    s_full, full, b_full = measured(lambda: r.snapshot(as_of))
    full_rows = full.num_rows
    del full
    gc.collect()
    with ctx.profile("persist_selective_snapshot"):
        s_sel, sel, b_sel = measured(lambda: r.snapshot(as_of, filter=spec))
    det["persist"] = {
        "parts": len(parts),
        "parts_with_stats": sum(1 for p in parts if p.stats is not None),
        "full_ms": round(s_full * 1e3, 1),
        "full_rows": full_rows,
        "full_bytes_fetched": b_full,
        "selective_ms": round(s_sel * 1e3, 2),
        "selective_rows": sel.num_rows,
        "selective_bytes_fetched": b_sel,
        "bytes_fraction": round(b_sel / max(1, b_full), 4),
    }
    w.expire()
    r.expire()
    client.close()

    p = str(ctx.dir("delta_pushdown"))
    avg_part = max(1, sum(x.size for x in parts) // max(1, len(parts)))
    write_deltalake(p, table.sort_by("key"), mode="append", target_file_size=avg_part)
    dt_files = len(DeltaTable(p).file_uris())
    gc.collect()
    filt = [("key", ">=", lo), ("key", "<", hi)]
    s_delta, dout = median_time(lambda: DeltaTable(p).to_pyarrow_table(filters=filt), REPS)
    det["delta"] = {"files": dt_files, "ms": round(s_delta * 1e3, 2), "rows": dout.num_rows,
                    "table_bytes": du(p)}
    pp = det["persist"]
    note = (
        f"{pp['selective_rows']:,} of {full_rows:,} rows; persist fetched {pp['bytes_fraction']:.1%} of "
        f"the full read's bytes ({pp['parts']} parts); delta-rs {dt_files} files"
    )
    rows = [
        row(NAME, f"1%-selective snapshot ({n / 1e6:g}M rows), ms", pp["selective_ms"], "ms",
            "delta-rs to_pyarrow_table(filters)", det["delta"]["ms"], note=note),
        row(NAME, "1%-selective snapshot vs full snapshot, ms", pp["selective_ms"], "ms",
            "persist full snapshot", pp["full_ms"]),
        row(NAME, "bytes fetched, 1%-selective / full snapshot", pp["bytes_fraction"], "fraction",
            goal_value=("<=", 0.1)),
    ]
    return {"rows": rows, "detail": det}
