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
Median of 3, warm page cache. Run twice: with 1 MiB parts (part statistics skip
parts), and with the default part target (one big compacted part: only the row-group
index of ``shard.part_index`` can skip anything; delta-rs then writes its default file).
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
AS_OF = 3
LO, HI = 5_000_000, 5_100_000  # 1% of the key range


def _persist(ctx: Ctx, table: pa.Table, part_bytes: int | None, label: str) -> dict[str, Any]:
    """Writes ``table`` in four commits (``part_bytes`` parts; None: the default target),
    compacts, and measures the full and the 1%-selective snapshot as of 3."""
    from persist_lib.ids import ShardId

    d = ctx.dir(f"persist_pushdown_{label}")
    cfg: dict[str, Any] = {"compaction_enabled": False, "metrics": True}
    if part_bytes is not None:
        cfg["blob_target_size"] = part_bytes
    client = persist_file_client(d, **cfg)
    shard = ShardId.new()
    w, r = client.open(shard, KEY_SCHEMA, VAL_SCHEMA)
    n = table.num_rows
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
    spec = [("key", ">=", LO), ("key", "<", HI)]

    def measured(fn: Any) -> tuple[float, Any, int]:
        before = sm.bytes_read
        s, out = median_time(fn, REPS)
        return s, out, (sm.bytes_read - before) // REPS

    gc.collect()
    s_full, full, b_full = measured(lambda: r.snapshot(AS_OF))
    full_rows = full.num_rows
    del full
    gc.collect()
    with ctx.profile(f"persist_selective_snapshot_{label}"):
        s_sel, sel, b_sel = measured(lambda: r.snapshot(AS_OF, filter=spec))
    out = {
        "parts": len(parts),
        "parts_with_stats": sum(1 for p in parts if p.stats is not None),
        "parts_indexed": sum(1 for p in parts if getattr(p, "footer", None) is not None),
        "avg_part_bytes": max(1, sum(x.size for x in parts) // max(1, len(parts))),
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
    return out


def _delta(ctx: Ctx, table: pa.Table, file_bytes: int | None, label: str) -> dict[str, Any]:
    from deltalake import DeltaTable, write_deltalake

    p = str(ctx.dir(f"delta_pushdown_{label}"))
    kw: dict[str, Any] = {} if file_bytes is None else {"target_file_size": file_bytes}
    write_deltalake(p, table.sort_by("key"), mode="append", **kw)
    dt_files = len(DeltaTable(p).file_uris())
    gc.collect()
    filt = [("key", ">=", LO), ("key", "<", HI)]
    s_delta, dout = median_time(lambda: DeltaTable(p).to_pyarrow_table(filters=filt), REPS)
    return {"files": dt_files, "ms": round(s_delta * 1e3, 2), "rows": dout.num_rows, "table_bytes": du(p)}


def run(ctx: Ctx) -> dict[str, Any]:
    n = ctx.pick(1_000_000, 5_000_000)
    table = update_batch(n, 0, 4242)
    det: dict[str, Any] = {"rows": n, "filter": f"{LO} <= key < {HI}"}
    rows = []
    # Small parts (the part statistics prune), then the default part size: one big part
    # per ~128 MiB, where only the row-group index can prune (issue 28).
    for label, part_bytes, what in (("1mib", PART_BYTES, "1 MiB parts"), ("default", None, "default parts")):
        pp = _persist(ctx, table, part_bytes, label)
        dd = _delta(ctx, table, pp["avg_part_bytes"] if part_bytes is not None else None, label)
        det[f"persist_{label}"], det[f"delta_{label}"] = pp, dd
        note = (
            f"{pp['selective_rows']:,} of {pp['full_rows']:,} rows; persist fetched {pp['bytes_fraction']:.1%} of "
            f"the full read's bytes ({pp['parts']} parts, {pp['parts_indexed']} indexed); delta-rs {dd['files']} files"
        )
        rows += [
            row(NAME, f"1%-selective snapshot ({n / 1e6:g}M rows, {what}), ms", pp["selective_ms"], "ms",
                "delta-rs to_pyarrow_table(filters)", dd["ms"], note=note),
            row(NAME, f"1%-selective snapshot vs full snapshot ({what}), ms", pp["selective_ms"], "ms",
                "persist full snapshot", pp["full_ms"]),
            row(NAME, f"bytes fetched, 1%-selective / full snapshot ({what})", pp["bytes_fraction"], "fraction",
                goal_value=("<=", 0.1 if part_bytes is not None else 0.05)),
        ]
    return {"rows": rows, "detail": det}
