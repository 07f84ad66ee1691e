"""Cost of opening a shard after N appends: rollups keep it flat.

Opening = a process with a cold cache reads the consensus head, fetches the latest
rollup and applies the diffs after it. Without rollups it would replay every diff.
Run: ``.venv/bin/python -m bench.open_cost [--counts 50 5000] [--root DIR]``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import pyarrow as pa

from persist_lib import PersistClient, PersistConfig, ShardId
from persist_lib.shard.machine import clear_state_cache

KEY = pa.schema([("k", pa.int64())])
VAL = pa.schema([("v", pa.int64())])


def open_ms(blob: str, cons: str, shard: ShardId, reps: int = 7) -> tuple[float, dict]:
    times = []
    info: dict = {}
    for _ in range(reps):
        clear_state_cache()
        t0 = time.perf_counter()
        client = PersistClient.open(blob, cons, PersistConfig(background_heartbeats=False))
        m = client.machine(shard)
        s = m.fetch_latest()
        times.append((time.perf_counter() - t0) * 1e3)
        info = {"seqno": s.seqno, "rollup_loads": m.metrics.rollup_loads, "latest_rollup": (s.latest_rollup() or (0,))[0]}
        client.close()
    return statistics.median(times), info


def run(counts: list[int], root: Path) -> dict:
    out: dict = {"counts": {}}
    for n in counts:
        d = root / f"n{n}"
        shutil.rmtree(d, ignore_errors=True)
        (d / "blob").mkdir(parents=True)
        blob, cons = f"file://{d / 'blob'}", f"sqlite:///{d / 'consensus.db'}"
        client = PersistClient.open(
            blob, cons, PersistConfig(background_heartbeats=False, compaction_enabled=True)
        )
        shard = ShardId.new()
        w = client.open_writer(shard, KEY, VAL)
        t0 = time.perf_counter()
        for t in range(n):
            w.compare_and_append([(((t,), (t,)), t, 1)], t, t + 1)
        append_s = time.perf_counter() - t0
        batches = len(client.machine(shard).fetch_latest().batches)
        client.close()
        ms, info = open_ms(blob, cons, shard)
        out["counts"][n] = {
            "open_ms": round(ms, 2), "append_s": round(append_s, 2), "batches": batches, **info
        }
    ns = sorted(out["counts"])
    out["ratio_open_last_vs_first"] = round(
        out["counts"][ns[-1]]["open_ms"] / out["counts"][ns[0]]["open_ms"], 2
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--counts", type=int, nargs="+", default=[50, 5000])
    ap.add_argument("--root", type=Path, default=None)
    a = ap.parse_args()
    root = a.root or Path(tempfile.mkdtemp(prefix="persist-open-bench-"))
    res = run(a.counts, root)
    print(json.dumps(res, indent=1))
    print()
    print("| appends | open (ms, median of 7) | seqno | batches | loaded from rollup at |")
    print("|---|---|---|---|---|")
    for n, r in sorted(res["counts"].items()):
        print(f"| {n} | {r['open_ms']} | {r['seqno']} | {r['batches']} | {r['latest_rollup']} |")
    print(f"\nopen after {max(res['counts'])} / open after {min(res['counts'])} = {res['ratio_open_last_vs_first']}")


if __name__ == "__main__":
    main()
