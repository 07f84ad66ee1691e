"""Peak RSS of a collection listener across a handover against its memory budget.

Run: ``.venv/bin/python -m bench.collection_listen_rss [--quick] [--rows N]
[--old-shards S] [--new-shards S] [--budget-mib M (64; quick 8)] [--part-mib P] [--root DIR]
[--in-memory] [--from-start] [--out FILE]``.

Builds a collection on file blob + SQLite: rendition ``r0`` of ``--old-shards`` shards
(4) holding ``--rows`` records (int64 key random in ``[0, 2^40)``, int64 value in
``[0, 4)``, diff 1; full: 10M, quick: 1M) written in 10 appends, and rendition ``r1``
of ``--new-shards`` shards (3: coprime with 4, so every shard of both meets in one
merge — the costliest case) holding the same records with ~10% of the values changed
plus ~1% new ones; then hands over to ``r1`` right after the last append. Then, in a
fresh subprocess each:

- ``listen``: ``reader.listen(h - 1, memory_budget=budget)`` drained with ``next`` until
  its frontier passes the handover: the whole diff ``-r0@(h-1) + r1@h`` (equal records
  cancel), streamed; with ``--from-start`` the listener starts at 0, far behind: it
  reads r0's updates at ``[1, h)`` (shard by shard, streamed) before the handover;
- ``in_memory`` (``--in-memory``, on in quick mode): both renditions' snapshots whole and
  one consolidate, as the listener did before it streamed (for comparison).

The child measures its baseline RSS after imports and a warm-up (a small collection's
handover, streamed), samples RSS every 5 ms while reading, and reads its ``VmHWM``.
Printed per mode: rows out, budget, peak RSS above baseline and its ratio to the
budget, the diff's own accounting (``peak_bytes_held``, spill bytes), seconds. Measured
with Arrow on the system allocator and two glibc arenas
(``ARROW_DEFAULT_MEMORY_POOL=system MALLOC_ARENA_MAX=2``: freed pages go back to the
OS, as in ``bench.streaming_read``) and with Arrow's default allocator.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from persist_lib import PersistClient, PersistConfig
from persist_lib.storage import StorageController

MiB = 1 << 20

CHILD = textwrap.dedent(
    """
    import json, sys, time
    import pyarrow as pa
    import pyarrow.compute as pc
    from persist_lib import PersistClient, PersistConfig
    from persist_lib.handles.listen import ListenUpdates
    from persist_lib.shard.codec import normalize_updates
    from persist_lib.shard.consolidate import consolidate
    from persist_lib.storage import StorageController
    blob, cons, at, budget, mode, as_of = (
        sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], int(sys.argv[6]))
    K, V = pa.schema([("k", pa.int64())]), pa.schema([("v", pa.int64())])
    # Warm-up: a small collection's streamed handover (kernels, pools, threads).
    warm = StorageController(PersistClient.open("mem://w", "mem://w", PersistConfig.for_tests(blob_target_size=64 << 10)))
    warm.create_collection("w", K, V, num_shards=2)
    ww = warm.open_writer("w")
    ww.append([(((i,), (i,)), 0, 1) for i in range(20000)], 0, 1)
    warm.create_rendition("w", "r1", 3)
    w1 = warm.open_writer("w", "r1")
    w1.append([(((i,), (i % 3,)), 0, 1) for i in range(20000)], 0, 2)
    warm.handover("w", to="r1", at=1)
    wl = warm.acquire_read_handle("w").listen(0, memory_budget=1 << 20)
    wl.read_until(2)
    from bench.rss import RssPeak, vm_hwm
    rss = RssPeak().start()
    baseline = rss.baseline
    ctl = StorageController(PersistClient.open(blob, cons, PersistConfig.for_tests(read_memory_budget=budget)))
    reader = ctl.acquire_read_handle("c")
    t0 = time.perf_counter()
    rows, stats, calls = 0, {}, 0
    if mode == "listen":
        listen = reader.listen(as_of, memory_budget=budget)
        while listen.frontier.time <= at:
            for e in listen.next(5.0):
                if isinstance(e, ListenUpdates):
                    rows += e.table.num_rows
            calls += 1
        ls = listen.stats
        stats = {"next_calls": calls, "diff_peak_bytes_held": ls.peak_bytes_held, "spilled_bytes": ls.intermediate_bytes}
    else:
        old = reader._rendition_snapshot("r0", at - 1, None)
        new = reader._rendition_snapshot("r1", at, None)
        neg = old.set_column(3, "diff", pc.negate(old["diff"]))
        both = pa.concat_tables([neg, new])
        both = both.set_column(2, "ts", pa.array([at] * both.num_rows, pa.int64()))
        del old, new, neg
        out = consolidate(normalize_updates(both, reader.schemas, shard="handover"))
        rows = out.num_rows
        del both, out
    secs = time.perf_counter() - t0
    rss.stop()
    reader.expire()
    print(json.dumps({
        "rows": rows, "seconds": secs, "baseline_rss": baseline, "peak_rss_sampled": rss.peak,
        "vm_hwm": vm_hwm(),
        "stats": stats, "arrow_pool": pa.default_memory_pool().backend_name,
    }))
    """
)

ALLOCATORS = {
    "system_malloc_2_arenas": {"ARROW_DEFAULT_MEMORY_POOL": "system", "MALLOC_ARENA_MAX": "2"},
    "default": {},
}


def build(root: Path, total: int, old_shards: int, new_shards: int, part_bytes: int) -> tuple[str, str, int, dict[str, Any]]:
    """The collection (see the module doc); returns its location and the handover time."""
    d = root / "collection_listen_rss"
    shutil.rmtree(d, ignore_errors=True)
    (d / "blob").mkdir(parents=True)
    blob, cons = f"file://{d / 'blob'}", f"sqlite:///{d / 'consensus.db'}"
    ctl = StorageController(PersistClient.open(blob, cons, PersistConfig.for_tests(blob_target_size=part_bytes)))
    K, V = pa.schema([("k", pa.int64())]), pa.schema([("v", pa.int64())])
    ctl.create_collection("c", K, V, num_shards=old_shards)
    ctl.create_rendition("c", "r1", new_shards)
    w0, w1 = ctl.open_writer("c"), ctl.open_writer("c", "r1")
    rng = np.random.default_rng(7)
    appends = 10
    per = total // appends
    t0 = time.perf_counter()
    for t in range(appends):
        n = per if t < appends - 1 else total - per * (appends - 1)
        k = rng.integers(0, 1 << 40, n)
        v = rng.integers(0, 4, n)
        ones = np.ones(n, dtype=np.int64)
        w0.append(pa.table({"k": k, "v": v, "ts": np.full(n, t, dtype=np.int64), "diff": ones}), t, t + 1)
        v1 = np.where(rng.random(n) < 0.1, v + 4, v)  # ~10% of the values changed
        extra = n // 100
        k1 = np.concatenate([k, rng.integers(0, 1 << 40, extra)])
        v1 = np.concatenate([v1, rng.integers(0, 4, extra)])
        w1.append(pa.table({"k": k1, "v": v1, "ts": np.full(len(k1), t, dtype=np.int64),
                            "diff": np.ones(len(k1), dtype=np.int64)}), t, t + 1)
    at = appends
    w1.append([], at, at + 1)
    ctl.handover("c", to="r1", at=at)
    w0.expire()
    w1.expire()
    return blob, cons, at, {"write_seconds": round(time.perf_counter() - t0, 1)}


def run_child(
    blob: str, cons: str, at: int, budget: int, mode: str, as_of: int, env_extra: dict[str, str]
) -> dict[str, Any]:
    env = dict(os.environ, **env_extra)
    env["PYTHONPATH"] = str(Path(__file__).resolve().parent.parent)
    out = subprocess.run(
        [sys.executable, "-c", CHILD, blob, cons, str(at), str(budget), mode, str(as_of)],
        capture_output=True, text=True, env=env, check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"child {mode} failed:\n{out.stderr[-4000:]}")
    res: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="1M rows instead of 10M")
    ap.add_argument("--rows", type=int, default=None)
    ap.add_argument("--old-shards", type=int, default=4)
    ap.add_argument("--new-shards", type=int, default=3)
    ap.add_argument("--budget-mib", type=int, default=None, help="default 64 (quick: 8)")
    ap.add_argument("--part-mib", type=int, default=8)
    ap.add_argument("--root", default=None, help="where to build the collection (default: a temp dir)")
    ap.add_argument("--in-memory", action="store_true", help="also measure the in-memory diff")
    ap.add_argument("--from-start", action="store_true",
                    help="the listener starts at 0 (far behind: all of r0's updates, then the handover)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    a = ap.parse_args(argv)
    total = a.rows if a.rows is not None else (1_000_000 if a.quick else 10_000_000)
    budget_mib = a.budget_mib if a.budget_mib is not None else (8 if a.quick else 64)
    budget = budget_mib * MiB
    root = Path(a.root) if a.root else Path(tempfile.mkdtemp(prefix="bench-collection-listen-"))
    try:
        blob, cons, at, info = build(root, total, a.old_shards, a.new_shards, a.part_mib * MiB)
        print(f"collection: {total:,} rows, {a.old_shards} -> {a.new_shards} shards, handover at {at}; "
              f"listen from {0 if a.from_start else at - 1}; "
              f"budget {budget_mib} MiB; built in {info['write_seconds']}s")
        modes = ["listen"] + (["in_memory"] if a.in_memory or a.quick else [])
        results: list[dict[str, Any]] = []
        for alloc, env in ALLOCATORS.items():
            for mode in modes:
                r = run_child(blob, cons, at, budget, mode, 0 if a.from_start else at - 1, env)
                above = max(r["peak_rss_sampled"], r["vm_hwm"]) - r["baseline_rss"]
                r.update(mode=mode, allocator=alloc, rows_in=total, budget=budget, peak_above_baseline=above,
                         ratio_to_budget=round(above / budget, 2))
                results.append(r)
                print(f"{alloc:24s} {mode:10s} rows out {r['rows']:>10,}  peak RSS above baseline "
                      f"{above / MiB:8.1f} MiB = {above / budget:5.2f} x budget  "
                      f"(baseline {r['baseline_rss'] / MiB:.0f} MiB)  {r['seconds']:.1f}s  {r['stats']}")
        if a.out:
            Path(a.out).write_text(json.dumps({"build": info, "results": results}, indent=2))
    finally:
        if not a.root:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
