"""GC transition cost by garbage size (issue 13, defect 6), with the quadratic code it
replaced as the anchor, in one run.

``gc_remove_garbage`` / ``gc_remove_rollups`` run inside the CAS loop (again on every
mismatch), so their cost matters on shards with much garbage. The old versions rebuilt
a set of the removed keys for every entry kept (``k not in set(present)`` inside a
comprehension). Usage: ``python -m bench.gc_transitions [--sizes 2000,4000,8000]``.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from typing import Any

from persist_lib.shard import maintenance_transitions as mt
from persist_lib.shard import state as st


def _old_remove_garbage(state: st.ShardState, keys: tuple[str, ...], gc_seqno: int) -> Any:
    present = [k for k in keys if k in state.garbage]
    garbage = {k: v for k, v in state.garbage.items() if k not in set(present)}
    return replace(state, garbage=garbage, last_gc_seqno=max(state.last_gc_seqno, gc_seqno))


def _old_remove_rollups(state: st.ShardState, seqnos: tuple[int, ...]) -> Any:
    latest = state.latest_rollup()
    drop = [s for s in seqnos if s in state.rollups and (latest is None or s != latest[0])]
    return replace(state, rollups={s: r for s, r in state.rollups.items() if s not in set(drop)})


def _time(fn: Any, max_s: float = 30.0) -> float | None:
    t0 = time.perf_counter()
    fn()
    dt = time.perf_counter() - t0
    return dt if dt <= max_s else None


def run(sizes: list[int], old_limit: int) -> list[dict[str, Any]]:
    rows = []
    for n in sizes:
        garbage = {f"s/w/p{i}": st.GarbageEntry(i, 1) for i in range(n)}
        s = st.ShardState("s", seqno=n + 1, garbage=garbage)
        half = tuple(f"s/w/p{i}" for i in range(0, n, 2))
        rollups = {i: st.RollupRef(f"s/rollup/{i}-x") for i in range(n)}
        r = st.ShardState("s", seqno=n + 1, rollups=rollups)
        seqnos = tuple(range(0, n, 2))
        new_g = _time(lambda s=s, half=half, n=n: mt.gc_remove_garbage(s, 0, keys=half, gc_seqno=n))
        new_r = _time(lambda r=r, seqnos=seqnos: mt.gc_remove_rollups(r, 0, seqnos=seqnos))
        old_g = _time(lambda s=s, half=half, n=n: _old_remove_garbage(s, half, n)) if n <= old_limit else None
        old_r = _time(lambda r=r, seqnos=seqnos: _old_remove_rollups(r, seqnos)) if n <= old_limit else None
        rows.append({"entries": n, "garbage_s": new_g, "garbage_old_s": old_g,
                     "rollups_s": new_r, "rollups_old_s": old_r})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", default="2000,4000,8000,64000")
    ap.add_argument("--old-limit", type=int, default=8000, help="largest size to run the old code at")
    a = ap.parse_args()
    rows = run([int(x) for x in a.sizes.split(",")], a.old_limit)
    print(json.dumps(rows, indent=2))

    def f(x: float | None) -> str:
        return "-" if x is None else f"{x * 1000:.1f} ms"

    print(f"{'entries':>8} {'garbage':>12} {'old':>12} {'ratio':>8} {'rollups':>12} {'old':>12} {'ratio':>8}")
    for r in rows:
        gr = f"{r['garbage_s'] / r['garbage_old_s']:.4f}x" if r["garbage_old_s"] else "-"
        rr = f"{r['rollups_s'] / r['rollups_old_s']:.4f}x" if r["rollups_old_s"] else "-"
        print(f"{r['entries']:>8} {f(r['garbage_s']):>12} {f(r['garbage_old_s']):>12} {gr:>8} "
              f"{f(r['rollups_s']):>12} {f(r['rollups_old_s']):>12} {rr:>8}")


if __name__ == "__main__":
    main()
