"""Peak RSS of a streaming snapshot (``ReadHandle.snapshot_batches``) against its memory
budget, next to ``snapshot()`` (the whole table).

Run: ``.venv/bin/python -m bench.streaming_read [--quick] [--rows N] [--batches B]
[--budget-mib M] [--part-mib P] [--root DIR] [--out FILE]``.

Builds a shard of ``--rows`` updates (int64 key random in ``[0, rows)``, int64 value in
``[0, 4)``, diff 1; full: 10M) on file blob + SQLite, written as ``--batches`` batches
(8) through the writer's builder with ``--part-mib`` parts (8 MiB), so the read merges
tens of sorted runs. Then, each in a fresh subprocess (the same method as
``bench.compaction``'s memory mode):

- ``stream``: iterate ``snapshot_batches(as_of, memory_budget=budget)`` to the end,
  counting rows and dropping each batch;
- ``snapshot``: ``snapshot(as_of, memory_budget=budget)``, the table built from the
  stream (the table itself is held whole);
- ``snapshot_whole``: ``snapshot(as_of, memory_budget=huge)``, every part decoded at once
  and consolidated in one go (what ``snapshot`` did before streaming reads).

The child measures its baseline RSS after imports and a warm-up streaming read of a
small shard (interpreter, pyarrow/numpy, kernels, thread pools: the fixed overhead),
samples RSS every 5 ms while reading, and reads its own ``VmHWM``. Printed per mode:
rows, budget, baseline RSS, peak RSS above baseline and its ratio to the budget, the
merge's own accounting (``peak_bytes_held``), time and rows/s.

Each mode is measured with pyarrow's default allocator (mimalloc or jemalloc: they keep
freed pages, so RSS overstates what is live) and with the system allocator and two
glibc arenas (``ARROW_DEFAULT_MEMORY_POOL=system MALLOC_ARENA_MAX=2``), as
``bench.compaction`` does; the merge also calls ``release_unused``/``malloc_trim`` after
every part it loads.
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

from persist_lib import PersistClient, PersistConfig, ShardId
from persist_lib.shard.codec import Schemas, internal_schema

MiB = 1 << 20

CHILD = textwrap.dedent(
    """
    import json, sys, time
    import pyarrow as pa
    from persist_lib import PersistClient, PersistConfig, ShardId
    blob, cons, shard, as_of, budget, mode = (
        sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6])
    K, V = pa.schema([("k", pa.int64())]), pa.schema([("v", pa.int64())])
    cfg = PersistConfig.for_tests(read_memory_budget=budget)
    # Warm-up on a throwaway shard (streamed and whole): loads kernels, pools, threads.
    warm = PersistClient.open("mem://warm", "mem://warm", PersistConfig.for_tests(blob_target_size=64 << 10))
    ws = ShardId.new()
    w, wr = warm.open(ws, K, V)
    for t in range(3):
        w.compare_and_append([(((i,), (i,)), t, 1) for i in range(20000)], t, t + 1)
    with wr.snapshot_batches(2, memory_budget=1 << 20) as s:
        for _ in s:
            pass
    wr.snapshot(2)
    from bench.rss import RssPeak, vm_hwm
    rss = RssPeak().start()
    baseline = rss.baseline
    client = PersistClient.open(blob, cons, cfg)
    r = client.open_leased_reader(shard, K, V)
    t0 = time.perf_counter()
    rows, batches, stats = 0, 0, {}
    if mode == "stream":
        with r.snapshot_batches(as_of, memory_budget=budget) as s:
            for b in s:
                rows += b.num_rows
                batches += 1
                del b
            stats = s.stats.to_json()
    elif mode == "snapshot":
        t = r.snapshot(as_of, memory_budget=budget)
        rows, batches = t.num_rows, 1
        del t
    else:
        t = r.snapshot(as_of, memory_budget=1 << 50)
        rows, batches = t.num_rows, 1
        del t
    secs = time.perf_counter() - t0
    rss.stop()
    r.expire()
    print(json.dumps({
        "rows": rows, "batches": batches, "seconds": secs,
        "baseline_rss": baseline, "peak_rss_sampled": rss.peak,
        "vm_hwm": vm_hwm(),
        "stats": stats,
        "arrow_pool": pa.default_memory_pool().backend_name,
        "arrow_pool_max_memory": pa.default_memory_pool().max_memory(),
    }))
    """
)

ALLOCATORS = {
    "default": {},
    # Arrow on malloc and at most 2 glibc arenas: freed memory goes back to the OS
    # sooner (mimalloc/jemalloc and per-thread arenas keep freed pages in RSS).
    "system_malloc_2_arenas": {"ARROW_DEFAULT_MEMORY_POOL": "system", "MALLOC_ARENA_MAX": "2"},
}
MODES = ("stream", "snapshot", "snapshot_whole")


def build_shard(root: Path, total: int, batches: int, part_bytes: int) -> tuple[str, str, ShardId, int, dict[str, Any]]:
    d = root / "streaming_read"
    shutil.rmtree(d, ignore_errors=True)
    (d / "blob").mkdir(parents=True)
    blob, cons = f"file://{d / 'blob'}", f"sqlite:///{d / 'consensus.db'}"
    client = PersistClient.open(blob, cons, PersistConfig.for_tests(blob_target_size=part_bytes))
    shard = ShardId.new()
    schemas = Schemas.create(pa.schema([("k", pa.int64())]), pa.schema([("v", pa.int64())]))
    w = client.open_writer(shard, schemas.key, schemas.val)
    rng = np.random.default_rng(7)
    per = total // batches
    chunk = 500_000
    t0 = time.perf_counter()
    for b in range(batches):
        builder = w.builder(b)
        left = per if b < batches - 1 else total - per * (batches - 1)
        while left:
            n = min(chunk, left)
            left -= n
            builder.add(
                pa.table(
                    {
                        "k.k": rng.integers(0, total, n),
                        "v.v": rng.integers(0, 4, n),
                        "t": np.full(n, b, dtype=np.int64),
                        "d": np.ones(n, dtype=np.int64),
                    },
                    schema=internal_schema(schemas),
                )
            )
        w.compare_and_append_batch(builder.finish(b + 1), b, b + 1)
    s = client.machine(shard).fetch_latest()
    info = {
        "updates": sum(b.len for b in s.batches.values()),
        "batches": len(s.batches),
        "parts": sum(len(b.parts) for b in s.batches.values()),
        "bytes": sum(b.size for b in s.batches.values()),
        "max_part_bytes": max(p.size for b in s.batches.values() for p in b.parts),
        "build_seconds": round(time.perf_counter() - t0, 1),
    }
    w.expire()
    client.close()
    return blob, cons, shard, batches - 1, info


def _read_in_child(blob: str, cons: str, shard: ShardId, as_of: int, budget: int, mode: str, env: dict[str, str]) -> dict[str, Any]:
    full_env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), **env}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, blob, cons, str(shard), str(as_of), str(budget), mode],
        capture_output=True, text=True, env=full_env, timeout=3600,
    )
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    res = json.loads(out.stdout.strip().splitlines()[-1])
    peak = max(res["peak_rss_sampled"], res["vm_hwm"])
    base = res["baseline_rss"]
    st = res["stats"]
    row: dict[str, Any] = {
        "rows": res["rows"],
        "record_batches": res["batches"],
        "baseline_rss_bytes": base,
        "peak_rss_bytes": peak,
        "peak_above_baseline_bytes": peak - base,
        "peak_above_baseline_over_budget": round((peak - base) / budget, 3),
        "within_budget_plus_baseline": peak <= base + budget,
        "seconds": round(res["seconds"], 2),
        "rows_per_s": int(res["rows"] / max(res["seconds"], 1e-9)),
        "arrow_pool": res["arrow_pool"],
        "arrow_pool_max_memory_bytes": res["arrow_pool_max_memory"],
    }
    if st:
        row.update(
            merge_runs=st["runs"], merge_passes=st["passes"], merge_fan_in=st["fan_in"],
            merge_peak_bytes_held=st["peak_bytes_held"], spilled_bytes=st["intermediate_bytes"],
        )
    return row


def run(root: Path, total: int, batches: int, budget: int, part_bytes: int) -> dict[str, Any]:
    blob, cons, shard, as_of, info = build_shard(root, total, batches, part_bytes)
    out: dict[str, Any] = {"budget_bytes": budget, "input": info, "as_of": as_of}
    for alloc, env in ALLOCATORS.items():
        out[alloc] = {mode: _read_in_child(blob, cons, shard, as_of, budget, mode, env) for mode in MODES}
    shutil.rmtree(root / "streaming_read", ignore_errors=True)
    return out


def _fmt_mib(b: int) -> str:
    return f"{b / MiB:,.1f} MiB"


def table(res: dict[str, Any]) -> str:
    lines = [
        f"input: {res['input']['updates']:,} updates in {res['input']['batches']} batches, "
        f"{res['input']['parts']} parts ({_fmt_mib(res['input']['bytes'])} encoded); budget "
        f"{_fmt_mib(res['budget_bytes'])}",
        "",
        "| allocator | read | rows out | baseline RSS | peak above baseline | / budget | merge held (accounted) | passes | spilled | s | rows/s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for alloc in ALLOCATORS:
        for mode in MODES:
            r = res[alloc][mode]
            lines.append(
                f"| {alloc} | {mode} | {r['rows']:,} | {_fmt_mib(r['baseline_rss_bytes'])} | "
                f"{_fmt_mib(r['peak_above_baseline_bytes'])} | {r['peak_above_baseline_over_budget']}x | "
                f"{_fmt_mib(r['merge_peak_bytes_held']) if 'merge_peak_bytes_held' in r else '-'} | "
                f"{r.get('merge_passes', '-')} | "
                f"{_fmt_mib(r['spilled_bytes']) if 'spilled_bytes' in r else '-'} | {r['seconds']} | {r['rows_per_s']:,} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.streaming_read", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="1M updates, 16 MiB budget, 1 MiB parts")
    p.add_argument("--rows", type=int, default=None)
    p.add_argument("--batches", type=int, default=8)
    p.add_argument("--budget-mib", type=int, default=None)
    p.add_argument("--part-mib", type=int, default=None)
    p.add_argument("--root", type=Path, default=None, help="scratch dir (default: a temp dir)")
    p.add_argument("--out", type=Path, default=None, help="write the JSON here too")
    ns = p.parse_args(argv)
    rows = ns.rows or (1_000_000 if ns.quick else 10_000_000)
    budget = (ns.budget_mib or (16 if ns.quick else 128)) * MiB
    part = (ns.part_mib or (1 if ns.quick else 8)) * MiB
    root = ns.root or Path(tempfile.mkdtemp(prefix="bench-streaming-read-"))
    res = run(root, rows, ns.batches, budget, part)
    doc = json.dumps(res, indent=2)
    print(doc)
    print()
    print(table(res))
    if ns.out:
        ns.out.parent.mkdir(parents=True, exist_ok=True)
        ns.out.write_text(doc)
    if ns.root is None:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
