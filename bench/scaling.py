"""Scaling: the data-plane figures at 1M and 4M rows (16M with ``PERSIST_BENCH_16M=1``),
persist and delta-rs side by side in one run.

For each size n, the same n updates (``update_batch``) are written by each side in 4
commits of n/4 rows at times 0..3 (delta: versions 0..3). The two sides run interleaved
so that the machine's load swings (2-4x on a shared 2-core machine) land on both alike:
the commits alternate (persist then delta-rs, delta-rs then persist, ...), and every read
below runs ``REPS`` rounds with the order rotating, medians reported:
- bulk append: MB/s of Arrow over the 4 commits (persist: file blob + SQLite, durable),
  and the CPU seconds of every thread of the process (less load-sensitive);
- snapshot of the as-written table: the time of ``snapshot(3)`` against
  ``DeltaTable(path).to_pyarrow_table()`` (ms: both read the same four appends, but
  persist returns them consolidated, 8M of 16M rows at 16M, so each side's MB/s of its
  own output would fall with size by construction; the MB/s ratio is in the note);
- compaction: rows/s of ``client.compact`` against ``optimize.compact()``;
- snapshot after compaction, as above;
- a 1%-selective filtered snapshot after compaction (``1% of the key range``):
  ``snapshot(3, filter=[("key", ">=", lo), ("key", "<", hi)])`` against
  ``to_pyarrow_table(filters=...)`` of the compacted delta table;
- cold time travel: a new client and a leased reader reading as of time 1 (half the
  rows), and a new client's one-shot ``client.snapshot`` (no reader registration),
  against ``DeltaTable(path, version=1).to_pyarrow_table()``;
- Spark and ``persist sql`` over the compacted shard against Spark and DuckDB reading its
  part files as plain Parquet (``bench.scaling_engines``; ``PERSIST_BENCH_ENGINES=0``
  leaves them out), then again once the since reached the as-of and the shard was
  compacted again ("no history" rows: parts that need no consolidation).
Run alone: ``python -m bench --only scaling --runs 1 --max-runs 1`` (not part of ``make
 bench``); ``PERSIST_BENCH_SIZES=1,4`` picks the sizes in millions; ``PERSIST_BENCH_SCALING=sql``
runs only the ``persist sql`` rows (persist writes and compacts the shard; no delta-rs, no
Spark, none of the other rows); ``PERSIST_BENCH_SCALING_ROWS=snapshot_written,time_travel``
measures only those read rows (see ``READ_ROWS``; no Spark or SQL), plus the appends and the
compaction. The issue 28 goal:
the persist/delta-rs ratio falls by at most 20% from the smallest size to the largest on
every row.
"""

from __future__ import annotations

import gc
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import (
    KEY_SCHEMA,
    VAL_SCHEMA,
    Ctx,
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
    return os.environ.get("PERSIST_BENCH_ENGINES", "1") != "0" and _only() is None


#: The read rows ``PERSIST_BENCH_SCALING_ROWS`` may pick (comma-separated).
READ_ROWS = ("snapshot_written", "snapshot_compacted", "filtered", "time_travel")


def _only() -> set[str] | None:
    """The read rows to measure (``PERSIST_BENCH_SCALING_ROWS``, e.g.
    ``snapshot_written,time_travel``: the issue 28 read goals); None: every row. The
    appends and the compaction always run (the reads need them) and are reported;
    Spark and ``persist sql`` run only with every row."""
    env = os.environ.get("PERSIST_BENCH_SCALING_ROWS")
    if not env:
        return None
    picked = {x.strip() for x in env.split(",") if x.strip()}
    unknown = picked - set(READ_ROWS)
    if unknown:
        raise SystemExit(f"PERSIST_BENCH_SCALING_ROWS: unknown rows {sorted(unknown)}; pick from {READ_ROWS}")
    return picked


def _wanted(name: str) -> bool:
    only = _only()
    return only is None or name in only


def _sql_only() -> bool:
    """``PERSIST_BENCH_SCALING=sql``: only the ``persist sql`` rows."""
    return os.environ.get("PERSIST_BENCH_SCALING") == "sql"


def _sql_shard(ctx: Ctx, chunks: list[Any], label: str) -> dict[str, Any]:
    """The shard the SQL rows read, as ``_measure`` leaves it (the 4 commits, compacted with
    the since at 0), without the delta-rs side or any other figure."""
    from persist_lib.ids import ShardId

    d = ctx.dir(f"scaling_persist_{label}")
    client = persist_file_client(d, compaction_enabled=False)
    shard = ShardId.new()
    w, r = client.open(shard, KEY_SCHEMA, VAL_SCHEMA)
    for i, c in enumerate(chunks):
        w.compare_and_append(c, i, i + 1)
    client.compact(shard)
    w.expire()
    r.expire()
    client.close()
    return {"dir": d, "shard": shard}


def _timed(fn: Callable[[], Any]) -> tuple[float, float, Any]:
    """Wall seconds, CPU seconds (every thread of the process: delta-rs's Rust threads
    and persist's pools alike) and the result of one call of ``fn``."""
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    return time.perf_counter() - t0, time.process_time() - c0, out


def _interleaved(fns: dict[str, Callable[[], Any]], reps: int) -> dict[str, tuple[float, Any]]:
    """Each of ``fns`` ``reps`` times, the order rotating from round to round so that the
    machine's load swings land on every side alike: per name, the median wall time and
    the last result."""
    names = list(fns)
    times: dict[str, list[float]] = {k: [] for k in names}
    last: dict[str, Any] = {}
    for i in range(reps):
        for k in names[i % len(names):] + names[: i % len(names)]:
            gc.collect()
            wall, _, last[k] = _timed(fns[k])
            times[k].append(wall)
    return {k: (statistics.median(times[k]), last[k]) for k in names}


def _append_both(ctx: Ctx, chunks: list[Any], label: str) -> tuple[dict[str, Any], dict[str, Any], Any]:
    """The 4 commits written by both sides, commit by commit, alternating which side goes
    first: each side's wall and CPU seconds, its figures dicts, and persist's client and
    handles (``(client, shard, write, read)``)."""
    from deltalake import write_deltalake

    from persist_lib.ids import ShardId

    d = ctx.dir(f"scaling_persist_{label}")
    path = str(ctx.dir(f"scaling_delta_{label}"))
    client = persist_file_client(d, compaction_enabled=False)
    shard = ShardId.new()
    w, r = client.open(shard, KEY_SCHEMA, VAL_SCHEMA)
    p: dict[str, Any] = {"append_s": 0.0, "append_cpu_s": 0.0, "dir": d, "shard": shard}
    dl: dict[str, Any] = {"append_s": 0.0, "append_cpu_s": 0.0, "path": path}
    for i, c in enumerate(chunks):
        steps: list[tuple[dict[str, Any], Callable[[], Any]]] = [
            (p, lambda c=c, i=i: w.compare_and_append(c, i, i + 1)),
            (dl, lambda c=c: write_deltalake(path, c, mode="append")),
        ]
        for side, fn in steps if i % 2 == 0 else steps[::-1]:
            gc.collect()
            wall, cpu, _ = _timed(fn)
            side["append_s"] += wall
            side["append_cpu_s"] += cpu
    return p, dl, (client, shard, w, r)


def _cold_persist(d: Path, shard: Any, *, leased: bool) -> int:
    """A cold read as of time 1: empty state cache, a new client, and either a leased
    reader (registered and expired: two durable consensus writes) or a one-shot
    ``client.snapshot`` (no registration)."""
    from persist_lib.shard.machine import clear_state_cache

    clear_state_cache()
    c = persist_file_client(d)
    try:
        if not leased:
            return int(c.snapshot(shard, KEY_SCHEMA, VAL_SCHEMA, 1).num_rows)
        rr = c.open_leased_reader(shard, KEY_SCHEMA, VAL_SCHEMA)
        n = int(rr.snapshot(1).num_rows)
        rr.expire()
        return n
    finally:
        c.close()


def _as_of_share(d: Path, shard: Any, as_of: int) -> dict[str, int]:
    """What a snapshot as of ``as_of`` fetches of the shard: the parts of the batches
    that start at or before it whose smallest time is at or before it (the read's
    ``tmin`` pruning; row groups aside), their rows, and the shard's parts and rows.
    Rows fetched beyond the rows returned are what the time layout costs an old read."""
    c = persist_file_client(d)
    try:
        s = c.machine(shard).fetch_latest()
    finally:
        c.close()
    parts = [(b, p) for b in s.batches.values() for p in b.parts]
    read = [p for b, p in parts if b.lower.less_equal(as_of) and p.tmin <= as_of]
    return {
        "parts_read": len(read), "parts": len(parts),
        "rows_read": sum(p.count for p in read), "rows": sum(p.count for _, p in parts),
    }


def _measure(ctx: Ctx, chunks: list[Any], label: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every figure of one size, persist and delta-rs side by side (see the module doc)."""
    from deltalake import DeltaTable

    p, dl, (client, shard, w, r) = _append_both(ctx, chunks, label)
    path = dl["path"]
    rows = sum(c.num_rows for c in chunks)

    def read_pair(key: str, fp: Callable[[], Any], fd: Callable[[], Any]) -> None:
        got = _interleaved({"persist": fp, "delta": fd}, REPS)
        for side, name in ((p, "persist"), (dl, "delta")):
            side[f"{key}_s"], t = got[name]
            side[f"{key}_mb"], side[f"{key}_rows"] = t.nbytes / 1e6, t.num_rows

    if _wanted("snapshot_written"):
        read_pair("snap", lambda: r.snapshot(COMMITS - 1), lambda: DeltaTable(path).to_pyarrow_table())
    for side, compact in ((p, lambda: client.compact(shard)), (dl, lambda: DeltaTable(path).optimize.compact())):
        gc.collect()
        wall, cpu, _ = _timed(compact)
        side["compact_rows_per_s"], side["compact_cpu_s"] = rows / wall, round(cpu, 3)
    if _wanted("snapshot_compacted"):
        read_pair("snap_c", lambda: r.snapshot(COMMITS - 1), lambda: DeltaTable(path).to_pyarrow_table())
    if _wanted("filtered"):
        read_pair(
            "filt", lambda: r.snapshot(COMMITS - 1, filter=FILTER),
            lambda: DeltaTable(path).to_pyarrow_table(filters=FILTER),
        )
    w.expire()
    r.expire()
    client.close()
    d = p["dir"]
    if not _wanted("time_travel"):
        return p, dl
    tt = _interleaved(
        {
            "leased": lambda: _cold_persist(d, shard, leased=True),
            "one_shot": lambda: _cold_persist(d, shard, leased=False),
            "delta": lambda: DeltaTable(path, version=1).to_pyarrow_table().num_rows,
        },
        REPS,
    )
    p["tt_s"], p["tt_rows"] = tt["leased"]
    p["tt_fetched"] = _as_of_share(d, shard, 1)
    p["tt_one_shot_s"], _ = tt["one_shot"]
    dl["tt_s"], dl["tt_rows"] = tt["delta"]
    return p, dl


def run(ctx: Ctx) -> dict[str, Any]:
    warm_imports()
    det: dict[str, Any] = {}
    rows: list[dict[str, Any]] = []
    for n in _sizes():
        label = f"{n / 1e6:g}M"
        per = n // COMMITS
        chunks = [update_batch(per, i, 1000 + i) for i in range(COMMITS)]
        arrow_mb = sum(c.nbytes for c in chunks) / 1e6
        eng: dict[str, Any] = {}
        if _sql_only():
            from bench import scaling_engines as se

            p = _sql_shard(ctx, chunks, label)
            del chunks
            gc.collect()
            eng["sql"] = se.sql_figures(p["dir"], p["shard"], se.part_files_of(p["dir"], p["shard"]))
            eng |= se.no_history_figures(p["dir"], p["shard"], spark=False)
            det[label] = {"arrow_MB": round(arrow_mb, 1), **eng}
            rows += _engine_rows(label, eng)
            continue
        p, dl = _measure(ctx, chunks, label)
        del chunks
        gc.collect()
        if _engines():
            from bench import scaling_engines as se

            files = se.part_files_of(p["dir"], p["shard"])
            eng["spark"] = se.spark_figures(p["dir"], p["shard"], files, floor=True)
            gc.collect()
            eng["sql"] = se.sql_figures(p["dir"], p["shard"], files)
            gc.collect()
            eng |= se.no_history_figures(p["dir"], p["shard"])
            gc.collect()
        p["dir"], p["shard"] = str(p["dir"]), str(p["shard"])
        for side in (p, dl):
            side["append_cpu_s"] = round(side["append_cpu_s"], 3)
        det[label] = {"arrow_MB": round(arrow_mb, 1), "persist": p, "delta": dl, **eng}
        rows += [
            row(NAME, f"{label}: bulk append, MB/s of Arrow", arrow_mb / p["append_s"], "MB/s",
                "delta-rs write_deltalake", arrow_mb / dl["append_s"]),
            row(NAME, f"{label}: bulk append, CPU s (every thread)", p["append_cpu_s"], "CPU s",
                "delta-rs write_deltalake", dl["append_cpu_s"],
                note="less load-sensitive than the wall figure; lower is better"),
        ]
        if "snap_s" in p:
            # Timed, not MB/s: persist's output is consolidated (rows equal in (k, v)
            # summed: 8M of 16M at 16M), delta-rs returns every row appended, so each
            # side's MB/s of its own output would fall with size by construction
            # (session 18, s18-snapscale); the MB/s ratio stays in the note.
            mb_ratio = (p["snap_mb"] / p["snap_s"]) / (dl["snap_mb"] / dl["snap_s"])
            rows.append(row(NAME, f"{label}: snapshot as written, ms", p["snap_s"] * 1e3, "ms",
                            "delta-rs to_pyarrow_table", dl["snap_s"] * 1e3,
                            note=f"rows {p['snap_rows']:,} (consolidated) vs {dl['snap_rows']:,}; "
                            f"MB/s of each side's output: {mb_ratio:.3f}x"))
        rows.append(row(NAME, f"{label}: compaction, rows/s", p["compact_rows_per_s"], "rows/s",
                        "delta-rs optimize.compact", dl["compact_rows_per_s"]))
        if "snap_c_s" in p:
            rows.append(row(NAME, f"{label}: snapshot after compaction, MB/s of Arrow", p["snap_c_mb"] / p["snap_c_s"],
                            "MB/s", "delta-rs to_pyarrow_table", dl["snap_c_mb"] / dl["snap_c_s"]))
        if "tt_s" in p:
            rows += [
                row(NAME, f"{label}: cold time travel (as of time 1 of 4), ms", p["tt_s"] * 1e3, "ms",
                    f"delta-rs version=1 ({dl['tt_rows']:,} rows)", dl["tt_s"] * 1e3,
                    note=f"persist {p['tt_rows']:,} rows, from {p['tt_fetched']['rows_read']:,} of "
                    f"{p['tt_fetched']['rows']:,} stored rows ({p['tt_fetched']['parts_read']} of "
                    f"{p['tt_fetched']['parts']} parts)"),
                row(NAME, f"{label}: cold time travel (as of time 1 of 4), one-shot read, ms",
                    p["tt_one_shot_s"] * 1e3, "ms", f"delta-rs version=1 ({dl['tt_rows']:,} rows)", dl["tt_s"] * 1e3,
                    note="client.snapshot: no reader registration or expiry"),
            ]
        if "filt_s" in p:
            rows.append(row(NAME, f"{label}: 1%-selective filtered snapshot after compaction, ms", p["filt_s"] * 1e3,
                            "ms", f"delta-rs to_pyarrow_table(filters) ({dl['filt_rows']:,} rows)",
                            dl["filt_s"] * 1e3, note=f"persist {p['filt_rows']:,} rows"))
        rows += _engine_rows(label, eng)
    _engines_done()
    return {"rows": rows, "detail": det}


def _engine_rows(label: str, eng: dict[str, Any]) -> list[dict[str, Any]]:
    """The Spark and SQL rows of one size (those measured)."""
    rows = []
    for key, what, anchor in (
            ("spark", "Spark read_snapshot + aggregate (local[2])", "spark.read.parquet of the part files"),
            ("sql", "persist sql aggregate over the snapshot", "DuckDB read_parquet of the part files"),
            ("spark_nh", "no history: Spark read_snapshot + aggregate", "spark.read.parquet of the part files"),
            ("spark_nh_lazy", "no history: Spark read_snapshot(materialize=False) + aggregate",
             "spark.read.parquet of the part files"),
            ("sql_nh", "no history: persist sql aggregate", "DuckDB read_parquet of the part files"),
            ("sql_nh_fresh", "no history: persist sql aggregate, a new session per query (one `persist sql` run)",
             "DuckDB read_parquet of the part files"),
        ):
            if key in eng:
                e = eng[key]
                # The SQL and Spark rows also give the CPU (all threads; Spark: JVM and
                # Python workers too) per query of each side: its
                # ratio is steadier than the wall one on a loaded machine.
                cpu = (
                    f"; CPU {e['persist_cpu_s'] * 1e3:.0f} vs {e['raw_cpu_s'] * 1e3:.0f} ms "
                    f"({e['raw_cpu_s'] / e['persist_cpu_s']:.2f}x)" if "persist_cpu_s" in e else ""
                )
                # The with-history Spark row also gives the mapInArrow floor (``bench.spark_floor``).
                floor = (
                    f"; mapInArrow floor {e['floor_s'] * 1e3:.0f} ms ({e['floor_s'] / e['raw_s']:.2f}x the anchor), "
                    f"CPU {e['floor_cpu_s'] * 1e3:.0f} ms" if "floor_s" in e else ""
                )
                rows.append(
                    row(NAME, f"{label}: {what}, ms", e["persist_s"] * 1e3, "ms", anchor, e["raw_s"] * 1e3,
                        goal_ratio=("<=", 1.25),
                        note=f"{e['rows']:,} rows vs {e['raw_rows']:,} updates; "
                        f"speed {e['raw_s'] / e['persist_s']:.2f}x (goal >= 0.8x){cpu}{floor}")
                )
    return rows


def _engines_done() -> None:
    if _engines() and not _sql_only():
        from bench import scaling_engines as se

        se.stop_spark()
