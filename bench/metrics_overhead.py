"""What the metrics hooks (``persist_lib.shard.metrics``) cost: the same operations with
``PersistConfig(metrics=False)`` (no counting at all) and with metrics on (the
default), interleaved in one process.

Run: ``.venv/bin/python -m bench.metrics_overhead [--rounds R] [--ops N] [--out FILE]``.

- ``blob set+get``: ``RetryingBlob`` over an in-memory blob, one 1 KiB set and one get
  per op: the blob hooks alone (a request count and the bytes per call), against the
  cheapest backend there is (a real one takes 100x-10,000x longer per request).
- ``commit``: ``compare_and_append`` of 100 rows (part uploaded to an in-memory blob,
  CAS on in-memory consensus): the CAS-loop hook, the blob hooks and the machine
  counters on the whole write path, again on the fastest backends.

Prints the median over rounds of each mode's time per op and the difference (JSON and
a table). A number within the rounds' spread is noise.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import uuid
from typing import Any

import pyarrow as pa

from persist_lib import PersistClient, PersistConfig, ShardId
from persist_lib.location.mem import MemBlob
from persist_lib.location.retry import RetryingBlob
from persist_lib.shard.metrics import PersistMetrics

K = pa.schema([("k", pa.int64())])
V = pa.schema([("v", pa.string())])


def blob_ops(metrics: PersistMetrics | None, n: int) -> float:
    """Seconds per set+get."""
    b = RetryingBlob(MemBlob(uuid.uuid4().hex), metrics=metrics)
    shard = str(ShardId.new())
    value = b"x" * 1024
    keys = [f"{shard}/w/p{i}" for i in range(n)]
    t0 = time.perf_counter()
    for k in keys:
        b.set(k, value)
        b.get(k)
    return (time.perf_counter() - t0) / n


def commits(metrics_on: bool, n: int) -> float:
    """Seconds per compare_and_append (100 rows, the part in blob)."""
    name = uuid.uuid4().hex
    cfg = PersistConfig.for_tests(metrics=metrics_on, inline_threshold=0)
    with PersistClient.open(f"mem://{name}", f"mem://{name}", cfg) as c:
        w, _ = c.open(ShardId.new(), K, V)
        batches = [[(((i,), (f"v{t}",)), t, 1) for i in range(100)] for t in range(n)]
        t0 = time.perf_counter()
        for t, b in enumerate(batches):
            w.compare_and_append(b, t, t + 1)
        return (time.perf_counter() - t0) / n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.metrics_overhead")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--ops", type=int, default=20_000, help="blob set+get per round")
    ap.add_argument("--commits", type=int, default=300, help="commits per round")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    res: dict[str, dict[str, list[float]]] = {"blob set+get": {"off": [], "on": []}, "commit": {"off": [], "on": []}}
    blob_ops(None, 1000)
    commits(True, 20)  # warm-up
    for _ in range(a.rounds):
        res["blob set+get"]["off"].append(blob_ops(None, a.ops))
        res["blob set+get"]["on"].append(blob_ops(PersistMetrics(), a.ops))
        res["commit"]["off"].append(commits(False, a.commits))
        res["commit"]["on"].append(commits(True, a.commits))
    out: dict[str, Any] = {}
    print("| operation | metrics off (median) | metrics on (median) | difference | spread of off (min-max) |")
    print("|---|---|---|---|---|")
    for op, modes in res.items():
        off, on = statistics.median(modes["off"]), statistics.median(modes["on"])
        out[op] = {"off_us": off * 1e6, "on_us": on * 1e6, "diff_us": (on - off) * 1e6, "rounds": modes}
        print(
            f"| {op} | {off * 1e6:.2f} us | {on * 1e6:.2f} us | {(on - off) * 1e6:+.2f} us "
            f"({(on - off) / off:+.1%}) | {min(modes['off']) * 1e6:.2f}-{max(modes['off']) * 1e6:.2f} us |"
        )
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=2)
    else:
        print(json.dumps({k: {x: v for x, v in d.items() if x != "rounds"} for k, d in out.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
