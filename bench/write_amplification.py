"""9. Write amplification under a mixed stream of small and bulk appends.

The stream, identical on both sides: 200 appends of 1,000 rows (full: 1,000) with a
bulk append of 250,000 rows (full: 1M) after every 50th. Write amplification = bytes
written to storage in total / bytes the appends themselves wrote.
- persist: background compaction on (the default), so merges run while the stream goes
  on; bytes = the client's blob bytes written (``persist_lib.shard.metrics``: parts and
  rollups), after the compactor went idle; the appends' own bytes = the Parquet bytes of
  the parts of the batches the writer committed, inline ones included (a small append's
  part lives in state until a merge moves its rows to blob; the merge's bytes count).
- delta-rs: never compacts by itself; the anchor runs ``optimize.compact()`` after
  every 50 commits (a maintenance schedule) and once at the end; bytes = sizes of
  every data file ever added (``add`` actions of the log), appends' own = files of the
  append commits.
Lower is better; the row's ratio is persist / delta-rs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.common import (
    KEY_SCHEMA,
    VAL_SCHEMA,
    Ctx,
    compaction_available,
    persist_file_client,
    row,
    update_batch,
    wait_compaction_idle,
)

NAME = "write_amplification"


def _stream(ctx: Ctx) -> list[Any]:
    small, bulk, every = ctx.pick((200, 250_000, 50), (1_000, 1_000_000, 50))
    out = []
    for i in range(small):
        out.append(update_batch(1000, len(out), 10_000 + i))
        if (i + 1) % every == 0:
            out.append(update_batch(bulk, len(out), 20_000 + i))
    return out


def _persist(ctx: Ctx, stream: list[Any]) -> dict[str, Any]:
    from persist_lib.ids import ShardId

    d = ctx.dir("persist_wamp")
    client = persist_file_client(d, compaction_enabled=compaction_available())
    shard = ShardId.new()
    w = client.open_writer(shard, KEY_SCHEMA, VAL_SCHEMA)
    own = 0
    for t, b in enumerate(stream):
        # (what compare_and_append does, spelled out to see the batch the append wrote)
        builder = w.builder(t)
        builder.add(w.normalize(b))
        hb = builder.finish(t + 1)
        own += sum(p.size for p in hb.parts)
        w.compare_and_append_batch(hb, t, t + 1)
    idle_s = wait_compaction_idle(client)
    assert client.metrics is not None
    m = client.metrics.by_shard()[str(shard)]
    info = client.inspect(shard)
    client.close()
    return {
        "appends_bytes": own,
        "blob_bytes_written": m.bytes_written,
        "parts_written": m.parts_written,
        "amplification": round(m.bytes_written / own, 2) if own else None,
        "batches_after": info["num_batches"],
        "bytes_after": info["bytes"],
        "compaction_wait_s": round(idle_s, 2),
    }


def _delta(ctx: Ctx, stream: list[Any]) -> dict[str, Any]:
    from deltalake import DeltaTable, write_deltalake

    p = ctx.dir("delta_wamp")
    DeltaTable.create(str(p), schema=stream[0].schema)
    dt = DeltaTable(str(p))
    compactions = 0
    for i, b in enumerate(stream, 1):
        write_deltalake(dt, b, mode="append")
        if i % 50 == 0:
            dt.optimize.compact()
            compactions += 1
    dt.optimize.compact()
    compactions += 1
    own = total = 0
    for f in sorted((Path(p) / "_delta_log").glob("*.json")):
        lines = [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
        op = next((x["commitInfo"].get("operation") for x in lines if "commitInfo" in x), "")
        sizes = sum(int(x["add"]["size"]) for x in lines if "add" in x)
        total += sizes
        if op == "WRITE":
            own += sizes
    return {
        "appends_bytes": own,
        "bytes_written": total,
        "amplification": round(total / own, 2) if own else None,
        "compactions": compactions,
    }


def run(ctx: Ctx) -> dict[str, Any]:
    stream = _stream(ctx)
    det: dict[str, Any] = {"appends": len(stream), "rows": sum(b.num_rows for b in stream)}
    det["persist"] = _persist(ctx, stream)
    det["delta"] = _delta(ctx, stream)
    p, dl = det["persist"], det["delta"]
    rows = [
        row(
            NAME,
            f"bytes written / bytes appended ({len(stream)} appends, small and bulk)",
            p["amplification"],
            "x",
            "delta-rs, optimize.compact() every 50 commits",
            dl["amplification"],
            note=f"persist {p['batches_after']} batches after, compaction on",
        )
    ]
    return {"rows": rows, "detail": det}
