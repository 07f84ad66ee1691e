"""Postgres consensus: aggregate compare-and-set/s of 8 writer processes on 8 keys.

Every writer is its own process (spawned: no GIL shared between writers) with its own
``PostgresConsensus`` and appends to its own key (shard) as fast as it can for
``--seconds``; nothing conflicts, so the only thing that can serialize writers is the
server: a CAS that sends its ``pg_notify`` inside its own transaction holds Postgres's
cluster-wide notify lock from pre-commit until after the commit record is flushed, so
every notifying CAS of every shard queues behind the previous one's fsync.

Listeners are present throughout (``--listeners`` processes, each with one
``PostgresConsensus`` whose threads follow every key with ``wait_for_change``, the way
persist readers listen), so notifications are actually queued and delivered.

Measured side by side, in alternating rounds (so a change of background load hits all):

- ``persist``: ``PostgresConsensus`` with notifications (the default);
- ``persist_no_notify``: ``PostgresConsensus(notify=False)``;
- ``raw_insert``: a raw psycopg loop of autocommit ``INSERT``s into an identical table
  (no notify, no CAS check): the server's limit for 8 committing writers.

While the writers run, the parent samples ``pg_locks`` every 10 ms: how many sessions
wait for the notify lock (the mechanism; the CAS/s also depend on how fast the disk
fsyncs and on CPU: with a fast fsync and few cores, CPU can hide the serialization).

Payload 600 bytes. Server: a throwaway Postgres (``tests/support/pg_server.py``,
``fsync=on``, default ``synchronous_commit``) unless ``--pg-url`` names one (a role that
may ``CREATE DATABASE``).

Run: ``.venv/bin/python -m bench.pg_cas_concurrency [--writers 8] [--seconds 10]
[--rounds 3] [--listeners 1] [--pg-url URL] [--out FILE]``.
Prints the JSON, then a markdown table.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import threading
import time
from multiprocessing.synchronize import Barrier as BarrierT
from multiprocessing.synchronize import Event as EventT
from pathlib import Path
from typing import Any

from bench.common import REPO, lat_summary

NAME = "pg_cas_concurrency"
PAYLOAD = 600
VARIANTS = ("persist", "persist_no_notify", "raw_insert")
_RAW_TABLE = "raw_insert"


def _key(i: int) -> str:
    return f"bench-w{i}"


# ----- child processes ---------------------------------------------------------------


def _writer(
    url: str,
    variant: str,
    index: int,
    seconds: float,
    barrier: BarrierT,
    out: Any,
) -> None:
    """One writer: warm up, wait for everyone, then CAS (or INSERT) for ``seconds``."""
    try:
        res = _write_loop(url, variant, _key(index), seconds, barrier)
        out.put((index, res))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which fails the run
        barrier.abort()
        out.put((index, {"error": f"{type(e).__name__}: {e}"}))


def _write_loop(
    url: str, variant: str, key: str, seconds: float, barrier: BarrierT
) -> dict[str, Any]:
    data = os.urandom(PAYLOAD)
    lat: list[float] = []
    if variant == "raw_insert":
        import psycopg

        with psycopg.connect(url, autocommit=True) as conn:
            row = conn.execute(
                f"SELECT coalesce(max(seqno), -1) FROM {_RAW_TABLE} WHERE shard = %s",  # noqa: S608 - a constant
                (key,),
            ).fetchone()
            seq = int(row[0]) if row else -1
            q = f"INSERT INTO {_RAW_TABLE} (shard, seqno, data) VALUES (%s, %s, %s)"  # noqa: S608
            seq += 1
            conn.execute(q, (key, seq, data))  # warm-up, not timed
            barrier.wait(timeout=120)
            t_start = time.perf_counter()
            deadline = t_start + seconds
            while True:
                seq += 1
                t0 = time.perf_counter()
                conn.execute(q, (key, seq, data))
                t1 = time.perf_counter()
                lat.append(t1 - t0)
                if t1 >= deadline:
                    break
            elapsed = time.perf_counter() - t_start
    else:
        from persist_lib.location.base import CaSResult, VersionedData
        from persist_lib.location.postgres_consensus import PostgresConsensus

        cons = PostgresConsensus(url, notify=(variant == "persist"))
        try:
            h = cons.head(key)
            cur = h.seqno if h is not None else None

            def cas() -> None:
                nonlocal cur
                new = 0 if cur is None else cur + 1
                r = cons.compare_and_set(key, cur, VersionedData(new, data))
                if r is not CaSResult.COMMITTED:
                    raise RuntimeError(f"CAS of {key} at {new} was not committed: {r}")
                cur = new

            cas()  # warm-up (connection, first write), not timed
            barrier.wait(timeout=120)
            t_start = time.perf_counter()
            deadline = t_start + seconds
            while True:
                t0 = time.perf_counter()
                cas()
                t1 = time.perf_counter()
                lat.append(t1 - t0)
                if t1 >= deadline:
                    break
            elapsed = time.perf_counter() - t_start
        finally:
            cons.close()
    return {"ops": len(lat), "elapsed_s": elapsed, "lat": lat}


def _listener(url: str, keys: list[str], stop: EventT, ready: EventT, out: Any) -> None:
    """Follows every key with ``wait_for_change`` (one thread per key) until ``stop``."""
    from persist_lib.location.postgres_consensus import PostgresConsensus

    cons = PostgresConsensus(url)
    wakeups = [0] * len(keys)
    errors: list[str] = []

    def follow(i: int, key: str) -> None:
        try:
            h = cons.head(key)
            seen = h.seqno if h is not None else None
            while not stop.is_set():
                cons.wait_for_change(key, seen, timeout_s=1.0)
                h = cons.head(key)
                now = h.seqno if h is not None else None
                if now != seen:
                    wakeups[i] += 1
                    seen = now
        except BaseException as e:  # noqa: BLE001 - reported
            errors.append(f"{key}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=follow, args=(i, k), daemon=True) for i, k in enumerate(keys)]
    for t in threads:
        t.start()
    ready.set()
    stop.wait()
    for t in threads:
        t.join(timeout=10)
    cons.close()
    out.put({"wakeups": sum(wakeups), "errors": errors})


# ----- the parent ----------------------------------------------------------------------


def _prepare(url: str) -> None:
    """Creates both tables outside any timed section."""
    import psycopg

    from persist_lib.location.postgres_consensus import PostgresConsensus

    c = PostgresConsensus(url)
    c.head("warmup")  # creates the consensus table
    c.close()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            f"CREATE TABLE IF NOT EXISTS {_RAW_TABLE} (shard text NOT NULL, seqno bigint NOT NULL,"
            " data bytea NOT NULL, PRIMARY KEY (shard, seqno))"
        )


def _measure(ctx: Any, url: str, variant: str, writers: int, seconds: float) -> dict[str, Any]:
    barrier = ctx.Barrier(writers + 1)
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_writer, args=(url, variant, i, seconds, barrier, out), daemon=True)
        for i in range(writers)
    ]
    for p in procs:
        p.start()
    load_before = _loadavg()
    sampler = _NotifyLockSampler(url)
    try:
        barrier.wait(timeout=300)
    except threading.BrokenBarrierError:
        pass  # a writer failed before the start: its error is in the queue
    sampler.start()
    results: dict[int, dict[str, Any]] = {}
    try:
        for _ in procs:
            i, r = out.get(timeout=seconds + 300)
            results[i] = r
    finally:
        lock_waits = sampler.stop()
    for p in procs:
        p.join(timeout=60)
    errors = [r["error"] for r in results.values() if "error" in r]
    if errors:
        raise RuntimeError(f"{variant}: writer(s) failed: {errors}")
    rate = sum(r["ops"] / r["elapsed_s"] for r in results.values())
    lat = [x for r in results.values() for x in r["lat"]]
    s = lat_summary(lat)
    return {
        "variant": variant,
        "ops": sum(r["ops"] for r in results.values()),
        "ops_per_s": round(rate, 1),
        "per_writer_ops_per_s": [
            round(results[i]["ops"] / results[i]["elapsed_s"], 1) for i in sorted(results)
        ],
        "notify_lock": lock_waits,
        "p50_ms": s["p50_ms"],
        "p95_ms": s["p95_ms"],
        "p99_ms": s["p99_ms"],
        "max_ms": s["max_ms"],
        "loadavg_before": load_before,
        "loadavg_after": _loadavg(),
    }


class _NotifyLockSampler:
    """Samples, every 10 ms while the writers run, how many sessions wait for Postgres's
    cluster-wide notify lock (``LockSharedObject(DatabaseRelationId, 0)``: pg_locks
    ``locktype='object'``, ``classid=pg_database``, ``objid=0``), which a notifying
    transaction takes at pre-commit and holds until its commit is over."""

    QUERY = (
        "SELECT count(*) FILTER (WHERE NOT granted), count(*) FILTER (WHERE granted) "
        "FROM pg_locks WHERE locktype = 'object' AND classid = 'pg_database'::regclass "
        "AND objid = 0"
    )

    def __init__(self, url: str) -> None:
        self.url = url
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.waiting: list[int] = []
        self.held: list[int] = []

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        import psycopg

        with psycopg.connect(self.url, autocommit=True) as conn:
            while not self._stop.wait(0.01):
                row = conn.execute(self.QUERY).fetchone()
                if row is not None:
                    self.waiting.append(int(row[0]))
                    self.held.append(int(row[1]))

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join(timeout=30)
        n = len(self.waiting)
        return {
            "samples": n,
            "mean_waiting": round(sum(self.waiting) / n, 2) if n else None,
            "max_waiting": max(self.waiting, default=0),
            "share_held": round(sum(1 for h in self.held if h) / n, 3) if n else None,
        }


def _loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "?"


def _git() -> str:
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            cwd=REPO,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "persist_lib"],
            capture_output=True,
            text=True,
            timeout=10,
            cwd=REPO,
        ).stdout.strip()
        return head + (" + uncommitted persist_lib changes" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "?"


def run(
    url: str, *, writers: int, seconds: float, rounds: int, listeners: int
) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    _prepare(url)
    keys = [_key(i) for i in range(writers)]
    stop = ctx.Event()
    lst_out = ctx.Queue()
    readies = [ctx.Event() for _ in range(listeners)]
    lst_procs = [
        ctx.Process(target=_listener, args=(url, keys, stop, readies[j], lst_out), daemon=True)
        for j in range(listeners)
    ]
    for p in lst_procs:
        p.start()
    for ev in readies:
        ev.wait(timeout=120)
    measurements: list[dict[str, Any]] = []
    try:
        for r in range(rounds):
            for variant in VARIANTS:
                print(f"[{NAME}] round {r + 1}/{rounds}: {variant} ...", file=sys.stderr, flush=True)
                m = _measure(ctx, url, variant, writers, seconds)
                m["round"] = r + 1
                measurements.append(m)
                print(
                    f"[{NAME}]   {m['ops_per_s']} ops/s (load {m['loadavg_after']})",
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        stop.set()
        listener_reports = []
        for _ in lst_procs:
            try:
                listener_reports.append(lst_out.get(timeout=60))
            except Exception as e:  # noqa: BLE001 - a listener that died is reported
                listener_reports.append({"error": f"{type(e).__name__}: {e}"})
        for p in lst_procs:
            p.join(timeout=30)
    summary: dict[str, Any] = {}
    for variant in VARIANTS:
        rates = [m["ops_per_s"] for m in measurements if m["variant"] == variant]
        summary[variant] = {
            "median_ops_per_s": round(statistics.median(rates), 1),
            "ops_per_s_by_round": rates,
            "median_p50_ms": statistics.median(
                m["p50_ms"] for m in measurements if m["variant"] == variant
            ),
            "mean_waiting_for_notify_lock": [
                m["notify_lock"]["mean_waiting"] for m in measurements if m["variant"] == variant
            ],
        }
    raw = summary["raw_insert"]["median_ops_per_s"]
    for variant in VARIANTS:
        summary[variant]["ratio_to_raw_insert"] = (
            round(summary[variant]["median_ops_per_s"] / raw, 3) if raw else None
        )
    return {
        "benchmark": NAME,
        "writers": writers,
        "seconds_per_measurement": seconds,
        "rounds": rounds,
        "listener_processes": listeners,
        "payload_bytes": PAYLOAD,
        "summary": summary,
        "measurements": measurements,
        "listeners": listener_reports,
    }


def _table(doc: dict[str, Any]) -> str:
    lines = [
        f"{doc['writers']} writer processes on {doc['writers']} keys, "
        f"{doc['listener_processes']} listener process(es), {doc['seconds_per_measurement']} s "
        f"per measurement, {doc['rounds']} round(s); git {doc['meta']['git']}",
        "",
        "| variant | median ops/s | by round | median p50 (ms) | / raw insert "
        "| sessions waiting for the notify lock (mean, by round) |",
        "|---|---|---|---|---|---|",
    ]
    for variant, s in doc["summary"].items():
        by_round = ", ".join(f"{x:g}" for x in s["ops_per_s_by_round"])
        waits = ", ".join(str(x) for x in s["mean_waiting_for_notify_lock"])
        lines.append(
            f"| {variant} | {s['median_ops_per_s']:g} | {by_round} | {s['median_p50_ms']:g} | "
            f"{s['ratio_to_raw_insert']} | {waits} |"
        )
    lines.append("")
    lines.append(
        "load average (1/5/15 min): start "
        f"{doc['meta']['loadavg_start']}, end {doc['meta']['loadavg_end']}"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--writers", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--listeners", type=int, default=1, help="listener processes")
    ap.add_argument("--pg-url", default=None, help="an existing server (default: throwaway)")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    a = ap.parse_args(argv)
    meta: dict[str, Any] = {
        "git": _git(),
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
        "loadavg_start": _loadavg(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from tests.support.pg_server import PgServer

    if a.pg_url:
        os.environ["PERSIST_TEST_PG_URL"] = a.pg_url
    server: Any = None
    try:
        server = PgServer.start()
        url = server.create_database("bench_cas_conc")
        doc = run(
            url,
            writers=a.writers,
            seconds=a.seconds,
            rounds=a.rounds,
            listeners=a.listeners,
        )
        import psycopg

        with psycopg.connect(url) as conn:
            row = conn.execute("SHOW server_version").fetchone()
            meta["postgres"] = row[0] if row else "?"
    finally:
        if server is not None:
            server.stop()
    meta["loadavg_end"] = _loadavg()
    doc = {"meta": meta, **doc}
    print(json.dumps(doc, indent=1))
    print()
    print(_table(doc))
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
