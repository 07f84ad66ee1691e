"""8. Listen latency: an append in this process -> a listener in another process sees it.

After one unmeasured warm-up append (the listener's first delivery pays lazy imports),
the writer (this process) appends 10 updates at time ``i`` every 30-80 ms (random
pauses, so the listener is idle and waiting when the write lands); a child process
(``python -m bench.listen_latency --child ...``) holds a leased reader and calls
``listen(0).next(timeout)`` in a loop, recording ``time.monotonic()`` (CLOCK_MONOTONIC:
one clock for every process on the machine) when each time's updates arrive.
Latency = seen - start of the writer's ``compare_and_append`` (end to end); the delay
after the append returned is reported too.
- SQLite consensus: the listener polls the head with backoff (5 ms doubling to 250 ms);
- Postgres consensus: ``LISTEN/NOTIFY`` wakes ``PostgresConsensus.wait_for_change``.
Blob: a file directory in both cases (the 10-update parts are inline anyway).
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from typing import Any

from bench.common import (
    KEY_SCHEMA,
    REPO,
    VAL_SCHEMA,
    Ctx,
    file_location,
    lat_summary,
    persist_config,
    row,
    update_batch,
)

NAME = "listen_latency"
ROWS = 10


def child(blob: str, cons: str, shard: str, n: int) -> None:
    from persist_lib.handles.client import PersistClient
    from persist_lib.handles.listen import ListenUpdates

    client = PersistClient.open(blob, cons, persist_config())
    r = client.open_leased_reader(shard, KEY_SCHEMA, VAL_SCHEMA)
    lst = r.listen(0)
    print("READY", flush=True)
    seen: dict[int, float] = {}
    deadline = time.monotonic() + 300
    warm = False
    while (lst.frontier.time or 0) <= n and time.monotonic() < deadline:
        for e in lst.next(timeout_s=5.0):
            if isinstance(e, ListenUpdates):
                now = time.monotonic()
                for t in set(e.table.column("ts").to_pylist()):
                    seen.setdefault(int(t), now)
                if not warm:  # the first delivery pays lazy imports etc.: not measured
                    warm = True
                    print("WARM", flush=True)
    print("SEEN " + json.dumps(seen), flush=True)
    r.expire()
    client.close()


def _measure(ctx: Ctx, blob: str, cons: str, n: int, label: str) -> dict[str, Any]:
    from persist_lib.handles.client import PersistClient
    from persist_lib.ids import ShardId

    client = PersistClient.open(blob, cons, persist_config())
    shard = ShardId.new()
    w = client.open_writer(shard, KEY_SCHEMA, VAL_SCHEMA)
    w.compare_and_append(update_batch(ROWS, 0, 0), 0, 1)  # the listener starts at as_of 0
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "bench.listen_latency",
            "--child",
            "--blob",
            blob,
            "--consensus",
            cons,
            "--shard",
            str(shard),
            "--n",
            str(n),
        ],
        cwd=str(REPO),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line.startswith("READY"):
            raise RuntimeError(f"listener did not start ({label}): {line!r}")
        w.compare_and_append(update_batch(ROWS, 1, 1), 1, 2)  # warm-up, not measured
        line = proc.stdout.readline()
        if not line.startswith("WARM"):
            raise RuntimeError(f"listener did not see the warm-up append ({label}): {line!r}")
        rng = random.Random(7)
        data = [update_batch(ROWS, i, 7000 + i) for i in range(2, n + 1)]
        start: dict[int, float] = {}
        done: dict[int, float] = {}
        for i, b in enumerate(data, start=2):
            time.sleep(rng.uniform(0.03, 0.08))
            start[i] = time.monotonic()
            w.compare_and_append(b, i, i + 1)
            done[i] = time.monotonic()
        out_line = ""
        for line in proc.stdout:
            if line.startswith("SEEN "):
                out_line = line
                break
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        client.close()
    if not out_line:
        raise RuntimeError(f"listener ({label}) reported nothing")
    seen = {int(k): v for k, v in json.loads(out_line[5:]).items()}
    measured = range(2, n + 1)
    missing = [i for i in measured if i not in seen]
    if missing:
        raise RuntimeError(f"listener ({label}) never saw times {missing[:5]}...")
    e2e = [seen[i] - start[i] for i in measured]
    after = [max(0.0, seen[i] - done[i]) for i in measured]
    out = lat_summary(e2e)
    out["after_append_returned"] = lat_summary(after)
    out["append"] = lat_summary([done[i] - start[i] for i in measured])
    return out


def run(ctx: Ctx) -> dict[str, Any]:
    n = ctx.pick(60, 300)
    det: dict[str, Any] = {"appends": n, "rows_per_append": ROWS}
    d = ctx.dir("listen_sqlite")
    blob, cons = file_location(d)
    det["sqlite"] = _measure(ctx, blob, cons, n, "sqlite")
    rows = [
        row(
            NAME,
            f"SQLite: listener sees append, p50 ({n} appends)",
            det["sqlite"]["p50_ms"],
            "ms",
            "append itself (p50)",
            det["sqlite"]["append"]["p50_ms"],
        ),
        row(
            NAME,
            "SQLite: listener sees append, p95",
            det["sqlite"]["p95_ms"],
            "ms",
            "append itself (p95)",
            det["sqlite"]["append"]["p95_ms"],
        ),
    ]
    try:
        url = ctx.pg().create_database("bench_listen")
        d = ctx.dir("listen_pg")
        blob, _ = file_location(d)
        det["postgres"] = _measure(ctx, blob, url, n, "postgres")
        rows += [
            row(
                NAME,
                "Postgres (LISTEN/NOTIFY): listener sees append, p50",
                det["postgres"]["p50_ms"],
                "ms",
                "append itself (p50)",
                det["postgres"]["append"]["p50_ms"],
                goal_value=("<=", 50),
            ),
            row(
                NAME,
                "Postgres (LISTEN/NOTIFY): listener sees append, p95",
                det["postgres"]["p95_ms"],
                "ms",
                "append itself (p95)",
                det["postgres"]["append"]["p95_ms"],
            ),
        ]
    except Exception as e:  # noqa: BLE001
        det["postgres"] = {"error": f"{type(e).__name__}: {e}"}
        rows.append(
            row(NAME, f"Postgres: FAILED ({type(e).__name__})", None, "ms", goal_value=("<=", 50))
        )
    return {"rows": rows, "detail": det}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--blob")
    ap.add_argument("--consensus")
    ap.add_argument("--shard")
    ap.add_argument("--n", type=int)
    a = ap.parse_args()
    if not a.child:
        raise SystemExit("run through `python -m bench --only listen_latency`")
    child(a.blob, a.consensus, a.shard, a.n)


if __name__ == "__main__":
    main()
