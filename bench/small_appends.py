"""1. Small appends: N commits of 1,000 rows each, back to back.

persist: file blob + SQLite consensus (the embedded default, durable: fsync'd blobs,
``synchronous=FULL``), one long-lived write handle, ``compare_and_append(batch, t,
t + 1)``, in-process background compaction on (when the library has it).
Anchors, same data, same disk, right after:
- delta-rs with one reused ``DeltaTable`` handle (``write_deltalake(dt, ...)``) — the goal's anchor;
- delta-rs by path (re-opens the table at every write, like a fresh process);
- pyiceberg with a SQLite catalog (fewer commits: it is slow and O(n) per commit);
- persist without fsync (blob ``fsync=False``, SQLite ``synchronous=NORMAL``): the
  durability delta-rs has on a local disk — it never fsyncs (checked with strace);
- the durable-commit floor of this disk: a raw loop writing the same part bytes to a
  temp file + fsync + rename + directory fsync, then one ``synchronous=FULL`` SQLite
  insert — the I/O a durable commit can't avoid in this design.
"""

from __future__ import annotations

import io
import os
import sqlite3
import time
from typing import Any

import pyarrow.parquet as pq

from bench.common import (
    KEY_SCHEMA,
    VAL_SCHEMA,
    Ctx,
    compaction_available,
    compactor_stats,
    lat_summary,
    persist_file_client,
    row,
    update_batch,
    wait_compaction_idle,
)

NAME = "small_appends"
ROWS = 1000


def _persist(ctx: Ctx, data: list, *, fsync: bool, name: str) -> dict[str, Any]:
    from persist_lib.ids import ShardId

    d = ctx.dir(name)
    compaction = compaction_available()
    client = persist_file_client(d, fsync=fsync, compaction_enabled=compaction)
    shard = ShardId.new()
    w, r = client.open(shard, KEY_SCHEMA, VAL_SCHEMA)
    lat: list[float] = []
    cpu0 = time.thread_time()  # this thread is the writer: its CPU alone, not the merges'
    with ctx.profile(name):
        for i, b in enumerate(data):
            t0 = time.perf_counter()
            w.compare_and_append(b, i, i + 1)
            lat.append(time.perf_counter() - t0)
    writer_cpu = time.thread_time() - cpu0
    out = lat_summary(lat)
    out["writer_cpu_ms_per_commit"] = round(writer_cpu / len(data) * 1e3, 3)
    out["compaction_enabled"] = compaction
    out["compaction_catch_up_s"] = round(wait_compaction_idle(client), 3)
    out["compactor"] = compactor_stats(client)
    info = client.inspect(shard)
    out["batches_at_end"] = info["num_batches"]
    out["seqno_at_end"] = info["seqno"]
    out["rollups_written"] = client.machine(shard).metrics.rollups_written
    out["cas_mismatches"] = client.machine(shard).metrics.cas_mismatches
    # consensus writes by transition: the burst's merges (apply_merge_res) and their
    # part-writer registrations (one per shard and kind since s17-small2, was one per merge)
    out["consensus_writes_by"] = dict(client.machine(shard).metrics.committed_by)
    out["first10_last10_mean_ms"] = [
        round(sum(lat[:10]) / 10 * 1e3, 2),
        round(sum(lat[-10:]) / 10 * 1e3, 2),
    ]
    client.close()
    out["dir"] = str(d)
    out["shard"] = str(shard)
    out["reader_id"] = r.reader_id
    return out


def _delta(ctx: Ctx, data: list, *, reuse: bool) -> dict[str, Any]:
    from deltalake import DeltaTable, write_deltalake

    p = str(ctx.dir("delta_handle" if reuse else "delta_path"))
    DeltaTable.create(p, schema=data[0].schema)
    target: Any = DeltaTable(p) if reuse else p
    lat: list[float] = []
    for b in data:
        t0 = time.perf_counter()
        write_deltalake(target, b, mode="append")
        lat.append(time.perf_counter() - t0)
    out = lat_summary(lat)
    log = os.listdir(os.path.join(p, "_delta_log"))
    out["checkpoints"] = sorted(f for f in log if "checkpoint" in f and f.endswith(".parquet"))
    out["path"] = p
    return out


def _iceberg(ctx: Ctx, data: list) -> dict[str, Any]:
    from pyiceberg.catalog.sql import SqlCatalog

    wh = ctx.dir("iceberg_wh")
    cat = SqlCatalog("bench", uri=f"sqlite:///{wh}/catalog.db", warehouse=f"file://{wh}")
    cat.create_namespace("b")
    tbl = cat.create_table("b.t", schema=data[0].schema)
    lat: list[float] = []
    for b in data:
        t0 = time.perf_counter()
        tbl.append(b)
        lat.append(time.perf_counter() - t0)
    out = lat_summary(lat)
    out["metadata_json_bytes"] = os.path.getsize(tbl.metadata_location.replace("file://", ""))
    return out


def durable_floor(ctx: Ctx, part_bytes: bytes, n: int, state_bytes: int = 600) -> dict[str, Any]:
    """The I/O of one durable commit, nothing else: temp file + fsync + rename + dir fsync
    of ``part_bytes``, then an autocommit INSERT of ``state_bytes`` into a WAL-mode,
    ``synchronous=FULL`` SQLite file (the consensus settings)."""
    d = ctx.dir("durable_floor")
    blobdir = d / "blob"
    blobdir.mkdir()
    conn = sqlite3.connect(str(d / "c.db"), isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    conn.execute(
        "CREATE TABLE c (shard TEXT, seqno INTEGER, data BLOB, PRIMARY KEY (shard, seqno))"
    )
    payload = os.urandom(state_bytes)
    lat: list[float] = []
    dfd = os.open(blobdir, os.O_RDONLY)
    try:
        for i in range(n):
            t0 = time.perf_counter()
            tmp = blobdir / f".tmp-{i}"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                os.write(fd, part_bytes)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, blobdir / f"part-{i}")
            os.fsync(dfd)
            conn.execute("INSERT INTO c VALUES (?, ?, ?)", ("s", i, payload))
            lat.append(time.perf_counter() - t0)
    finally:
        os.close(dfd)
        conn.close()
    return lat_summary(lat)


def run(ctx: Ctx) -> dict[str, Any]:
    n = ctx.pick(200, 2000)
    n_ice = ctx.pick(50, 300)
    data = [update_batch(ROWS, i, i) for i in range(n)]
    det: dict[str, Any] = {"rows_per_commit": ROWS, "commits": n, "iceberg_commits": n_ice}

    det["persist"] = _persist(ctx, data, fsync=True, name="persist_small")
    det["delta_handle"] = _delta(ctx, data, reuse=True)
    det["delta_path"] = _delta(ctx, data, reuse=False)
    det["persist_nofsync"] = _persist(ctx, data, fsync=False, name="persist_small_nofsync")
    buf = io.BytesIO()
    pq.write_table(data[0], buf, compression="zstd")
    det["durable_floor"] = durable_floor(ctx, buf.getvalue(), n)
    try:
        det["iceberg"] = _iceberg(ctx, data[:n_ice])
    except Exception as e:  # noqa: BLE001 - an anchor failing must not sink the run
        det["iceberg"] = {"error": f"{type(e).__name__}: {e}"}

    ctx.shared[NAME] = {
        "persist_dir": det["persist"]["dir"],
        "shard": det["persist"]["shard"],
        "delta_path": det["delta_handle"]["path"],
        "commits": n,
    }

    p, dh, dp, nf, fl, ice = (
        det[k]
        for k in (
            "persist",
            "delta_handle",
            "delta_path",
            "persist_nofsync",
            "durable_floor",
            "iceberg",
        )
    )
    comp = "bg compaction on" if p["compaction_enabled"] else "NO compaction: state grows linearly"
    rows = [
        row(
            NAME,
            f"commits/s ({n} x {ROWS} rows; {comp})",
            p["ops_per_s"],
            "commits/s",
            "delta-rs reused handle",
            dh["ops_per_s"],
            goal_ratio=(">=", 3.0),
        ),
        row(
            NAME,
            "p95 commit latency",
            p["p95_ms"],
            "ms",
            "delta-rs reused handle",
            dh["p95_ms"],
            goal_ratio=("<=", 0.4),
        ),
        row(NAME, "p50 commit latency", p["p50_ms"], "ms", "delta-rs reused handle", dh["p50_ms"]),
        row(
            NAME,
            "drift: p95 last 10% / p95 first 10%",
            p["drift_p95"],
            "x",
            "delta-rs reused handle",
            dh["drift_p95"],
            goal_value=("<=", 1.2),
        ),
        row(NAME, "commits/s", p["ops_per_s"], "commits/s", "delta-rs by path", dp["ops_per_s"]),
        row(
            NAME,
            "commits/s, persist without fsync (delta-rs's durability)",
            nf["ops_per_s"],
            "commits/s",
            "delta-rs reused handle",
            dh["ops_per_s"],
        ),
        row(
            NAME,
            "p95, persist without fsync",
            nf["p95_ms"],
            "ms",
            "delta-rs reused handle",
            dh["p95_ms"],
        ),
        row(
            NAME,
            "commits/s vs the durable-commit floor (fsync'd file + FULL SQLite insert)",
            p["ops_per_s"],
            "commits/s",
            "raw durable floor",
            fl["ops_per_s"],
            goal_ratio=(">=", 0.3),
        ),
        row(
            NAME,
            "writer-thread CPU per commit (vs the floor's whole commit, wall)",
            p["writer_cpu_ms_per_commit"],
            "ms",
            "raw durable floor, mean",
            fl["mean_ms"],
            note="the floor ratio above needs writer CPU under ~3.3x the floor's commit",
        ),
    ]
    if "ops_per_s" in ice:
        rows.append(
            row(
                NAME,
                f"commits/s (iceberg: first {n_ice} commits only)",
                p["ops_per_s"],
                "commits/s",
                "pyiceberg SQLite catalog",
                ice["ops_per_s"],
            )
        )
    return {"rows": rows, "detail": det}
