"""5. Time-travel read of an old time / version, median of 5.

On the tables the small-appends benchmark left (200 commits of 1,000 rows, full: 2,000;
quick and full alike it reads time 5 = the first 6 commits, 6,000 rows), or on as many
fresh commits when run alone:
- persist, cold: ``clear_state_cache()``, a new client, ``client.snapshot(shard, ...,
  as_of=5)`` (a one-shot read: state load + part fetches, nothing written), then
  ``client.close()``;
- persist, cold with a leased reader: the same through ``open_leased_reader``,
  ``snapshot(as_of=5)``, ``expire()`` (two consensus writes more: registration, expiry);
- persist, warm: ``snapshot(as_of=5)`` again on that open reader;
- delta-rs: ``DeltaTable(path, version=6).to_pyarrow_table()`` (version 0 is the create).
persist reads the parts with ``tmin <= 5`` of every batch whose ``lower <= 5``: after
compaction the old commits live in merged batches, whose retained history the compactor
keeps in time layers (``shard.time_layers``): the parts of the layers after time 5 are
not fetched.
A last row reads a second table whose keys grow with time (50 commits; full: 500): its
compacted parts are key-sorted and so time-clustered, and an indexed part's row groups
after the as-of are not fetched (``shard.part_index``); with random keys every row
group holds every time and nothing can be skipped.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from bench.common import (
    KEY_SCHEMA,
    VAL_SCHEMA,
    Ctx,
    compaction_available,
    median_time,
    persist_file_client,
    row,
    update_batch,
    wait_compaction_idle,
)

NAME = "time_travel"
AS_OF = 5
REPS = 5


def _growing_keys(n: int, t: int) -> pa.Table:
    """``n`` updates at time ``t`` whose keys grow with time (``t * n + i``): an
    append-only table keyed by an increasing id (offsets, LSNs, sequence ids)."""
    keys = pa.array(np.arange(t * n, (t + 1) * n, dtype=np.int64))
    vals = pc.binary_join_element_wise("val_", pc.cast(keys, pa.string()), "")
    return pa.table({"key": keys, "value": vals, "ts": pa.array(np.full(n, t, dtype=np.int64)),
                     "diff": pa.array(np.ones(n, dtype=np.int64))})


def _build(ctx: Ctx, n: int, *, growing: bool = False) -> dict[str, Any]:
    """``n`` commits of 1,000 rows on both sides (random keys: when small_appends did
    not run; ``growing``: keys that grow with time)."""
    from deltalake import DeltaTable, write_deltalake

    from persist_lib.ids import ShardId

    data = [_growing_keys(1000, i) if growing else update_batch(1000, i, i) for i in range(n)]
    tag = "_growing" if growing else ""
    d = ctx.dir(f"tt_persist{tag}")
    client = persist_file_client(d, compaction_enabled=compaction_available())
    shard = ShardId.new()
    w, _r = client.open(shard, KEY_SCHEMA, VAL_SCHEMA)
    for i, b in enumerate(data):
        w.compare_and_append(b, i, i + 1)
    wait_compaction_idle(client)
    client.close()
    p = str(ctx.dir(f"tt_delta{tag}"))
    DeltaTable.create(p, schema=data[0].schema)
    dt = DeltaTable(p)
    for b in data:
        write_deltalake(dt, b, mode="append")
    return {"persist_dir": str(d), "shard": str(shard), "delta_path": p, "commits": n}


def _cold_one_shot(d: Path, shard: Any) -> int:
    """A cold read as of ``AS_OF``: empty state cache, a new client, ``client.snapshot``."""
    from persist_lib.shard.machine import clear_state_cache

    clear_state_cache()
    c = persist_file_client(d)
    try:
        return int(c.snapshot(shard, KEY_SCHEMA, VAL_SCHEMA, AS_OF).num_rows)
    finally:
        c.close()


def _cold_growing(ctx: Ctx) -> tuple[float, float, int, dict[str, Any]]:
    """The cold one-shot read as of ``AS_OF`` of a shard whose keys grow with time, and
    delta-rs at the same version: the compacted batch holding the old times is key-
    sorted, so its early row groups hold the early times (``shard.part_index``)."""
    from deltalake import DeltaTable

    from persist_lib.ids import ShardId

    src = _build(ctx, ctx.pick(50, 500), growing=True)
    d = Path(src["persist_dir"])
    shard = ShardId.parse(src["shard"])
    cold_s, rows = median_time(lambda: _cold_one_shot(d, shard), REPS)
    c = persist_file_client(d)
    state = c.machine(shard).fetch_latest()
    parts = [p for _, b in state.trace_batches() if b.lower.less_equal(AS_OF) for p in b.parts if p.tmin <= AS_OF]
    c.close()
    delta_s, _ = median_time(lambda: DeltaTable(src["delta_path"], version=AS_OF + 1).to_pyarrow_table().num_rows, REPS)
    det = {"commits": src["commits"], "cold_ms": round(cold_s * 1e3, 2), "delta_ms": round(delta_s * 1e3, 2),
           "rows": rows, "parts_read": len(parts), "updates_in_parts_read": sum(p.count for p in parts),
           "parts_indexed": sum(1 for p in parts if getattr(p, "footer", None) is not None)}
    return cold_s, delta_s, rows, det


def run(ctx: Ctx) -> dict[str, Any]:
    from deltalake import DeltaTable

    from persist_lib.ids import ShardId
    from persist_lib.shard.machine import clear_state_cache

    src = ctx.shared.get("small_appends") or _build(ctx, ctx.pick(200, 2000))
    d = Path(src["persist_dir"])
    shard = ShardId.parse(src["shard"])
    det: dict[str, Any] = {"source": src, "as_of": AS_OF}

    def cold() -> int:
        return _cold_one_shot(d, shard)

    def cold_leased() -> int:
        clear_state_cache()
        c = persist_file_client(d)
        try:
            r = c.open_leased_reader(shard, KEY_SCHEMA, VAL_SCHEMA)
            n = r.snapshot(AS_OF).num_rows
            r.expire()
            return n
        finally:
            c.close()

    with ctx.profile("persist_time_travel_cold"):
        cold_s, cold_rows = median_time(cold, REPS)
    leased_s, _ = median_time(cold_leased, REPS)
    clear_state_cache()
    client = persist_file_client(d)
    reader = client.open_leased_reader(shard, KEY_SCHEMA, VAL_SCHEMA)
    warm_s, warm_rows = median_time(lambda: reader.snapshot(AS_OF).num_rows, REPS)
    state = client.machine(shard).fetch_latest()
    parts = [p for _, b in state.trace_batches() if b.lower.less_equal(AS_OF) for p in b.parts if p.tmin <= AS_OF]
    det["persist"] = {
        "cold_ms": round(cold_s * 1e3, 2),
        "cold_leased_ms": round(leased_s * 1e3, 2),
        "warm_ms": round(warm_s * 1e3, 2),
        "rows": warm_rows,
        "parts_read": len(parts),
        "updates_in_parts_read": sum(p.count for p in parts),
    }
    reader.expire()
    client.close()

    path = src["delta_path"]
    t0 = time.perf_counter()
    delta_s, delta_rows = median_time(
        lambda: DeltaTable(path, version=AS_OF + 1).to_pyarrow_table().num_rows, REPS
    )
    det["delta"] = {
        "ms": round(delta_s * 1e3, 2),
        "rows": delta_rows,
        "total_s": round(time.perf_counter() - t0, 3),
    }
    p = det["persist"]
    note = f"persist {warm_rows:,} rows from {p['parts_read']} parts holding {p['updates_in_parts_read']:,}"
    rows = [
        row(
            NAME,
            f"read as of time {AS_OF} (cold: new client, one-shot snapshot)",
            p["cold_ms"],
            "ms",
            f"delta-rs version={AS_OF + 1} ({delta_rows:,} rows)",
            det["delta"]["ms"],
            goal_ratio=("<=", 1.0),
            note=note,
        ),
        row(
            NAME,
            f"read as of time {AS_OF} (cold: new client + leased reader, registered and expired)",
            p["cold_leased_ms"],
            "ms",
            f"delta-rs version={AS_OF + 1}",
            det["delta"]["ms"],
        ),
        row(
            NAME,
            f"read as of time {AS_OF} (warm reader)",
            p["warm_ms"],
            "ms",
            f"delta-rs version={AS_OF + 1}",
            det["delta"]["ms"],
        ),
    ]
    g_s, g_delta_s, g_rows, det["growing_keys"] = _cold_growing(ctx)
    g = det["growing_keys"]
    rows.append(
        row(
            NAME,
            f"read as of time {AS_OF}, keys growing with time (cold, one-shot; {g['commits']} commits)",
            round(g_s * 1e3, 2),
            "ms",
            f"delta-rs version={AS_OF + 1} ({g_rows:,} rows)",
            round(g_delta_s * 1e3, 2),
            goal_ratio=("<=", 1.0),
            note=f"{g['parts_read']} parts ({g['parts_indexed']} indexed) holding {g['updates_in_parts_read']:,}",
        )
    )
    return {"rows": rows, "detail": det}
