"""5. Time-travel read of an old time / version, median of 5.

On the tables the small-appends benchmark left (200 commits of 1,000 rows; quick and
full alike it reads time 5 = the first 6 commits, 6,000 rows), or on 50 fresh commits
when run alone:
- persist, cold: ``clear_state_cache()``, a new client, ``client.snapshot(shard, ...,
  as_of=5)`` (a one-shot read: state load + part fetches, nothing written), then
  ``client.close()``;
- persist, cold with a leased reader: the same through ``open_leased_reader``,
  ``snapshot(as_of=5)``, ``expire()`` (two consensus writes more: registration, expiry);
- persist, warm: ``snapshot(as_of=5)`` again on that open reader;
- delta-rs: ``DeltaTable(path, version=6).to_pyarrow_table()`` (version 0 is the create).
persist reads every part of every batch whose ``lower <= 5``: after compaction the old
commits live in merged batches, so it fetches (and filters) more than delta's 6 files.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

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


def _build(ctx: Ctx) -> dict[str, Any]:
    """50 commits of 1,000 rows on both sides (when small_appends did not run)."""
    from deltalake import DeltaTable, write_deltalake

    from persist_lib.ids import ShardId

    n = 50
    data = [update_batch(1000, i, i) for i in range(n)]
    d = ctx.dir("tt_persist")
    client = persist_file_client(d, compaction_enabled=compaction_available())
    shard = ShardId.new()
    w, _r = client.open(shard, KEY_SCHEMA, VAL_SCHEMA)
    for i, b in enumerate(data):
        w.compare_and_append(b, i, i + 1)
    wait_compaction_idle(client)
    client.close()
    p = str(ctx.dir("tt_delta"))
    DeltaTable.create(p, schema=data[0].schema)
    dt = DeltaTable(p)
    for b in data:
        write_deltalake(dt, b, mode="append")
    return {"persist_dir": str(d), "shard": str(shard), "delta_path": p, "commits": n}


def run(ctx: Ctx) -> dict[str, Any]:
    from deltalake import DeltaTable

    from persist_lib.ids import ShardId
    from persist_lib.shard.machine import clear_state_cache

    src = ctx.shared.get("small_appends") or _build(ctx)
    d = Path(src["persist_dir"])
    shard = ShardId.parse(src["shard"])
    det: dict[str, Any] = {"source": src, "as_of": AS_OF}

    def cold() -> int:
        clear_state_cache()
        c = persist_file_client(d)
        try:
            return int(c.snapshot(shard, KEY_SCHEMA, VAL_SCHEMA, AS_OF).num_rows)
        finally:
            c.close()

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
    parts = [p for _, b in state.trace_batches() if b.lower.less_equal(AS_OF) for p in b.parts]
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
    return {"rows": rows, "detail": det}
