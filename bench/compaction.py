"""Compaction and GC figures: write amplification, batch counts, logical compaction,
GC under a held reader, and peak RSS of a bounded-memory merge.

Run: ``.venv/bin/python -m bench.compaction [--quick] [--only NAME ...] [--root DIR]
[--out FILE]``. Sections (``--only``):

- ``appends``: N appends of one update each (N=10,000), compaction driven after every
  append; plus 1,000 appends of 1,000 updates (where bytes, not per-part overhead,
  dominate). Prints the most batches ever seen against ``2*log2(N)+2`` and write
  amplification (bytes compaction wrote / bytes appended, and updates rewritten /
  updates appended) against ``log2(N)+2``.
- ``logical``: 1,000 timestamps of one key whose value changes at every time (1,999
  updates); the since advances past them; bytes and records before/after.
- ``gc``: a reader holds an old seqno (snapshot splits) and keeps reading while
  appends, compaction and GC run in another thread; then it releases and GC runs.
- ``memory``: builds a 10M-update shard (8 batches of random keys; quick: 1M) on file
  blob + SQLite, then compacts it in a fresh subprocess under a 64 MiB budget (quick:
  16 MiB: the streaming k-way merge), and a 4M-update one (quick: 1M) under the default
  1 GiB (quick: 192 MiB), which it fits, so that the merge runs in memory with one sort
  of all rows; reports peak
  RSS against budget + the process's fixed overhead (RSS after imports and a warm-up
  merge).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from persist_lib import Antichain, PersistClient, PersistConfig, ShardId
from persist_lib.handles import maintenance as mn
from persist_lib.shard.batch_meta import HollowBatch
from persist_lib.shard.codec import Schemas, internal_schema, normalize_updates
from persist_lib.shard.parts import encode_part, part_meta_for

KEY = pa.schema([("k", pa.int64())])
VAL = pa.schema([("v", pa.string())])
MiB = 1 << 20


def mem_client(**cfg: Any) -> PersistClient:
    name = uuid.uuid4().hex
    return PersistClient.open(f"mem://{name}", f"mem://{name}", PersistConfig.for_tests(**cfg))


def _inline_batch(schemas: Schemas, shard: str, updates: list, lo: int, hi: int) -> HollowBatch:
    t = normalize_updates(updates, schemas, shard=shard)
    data = encode_part(t, schemas)
    meta = part_meta_for(data, t, None, inline=True)
    return HollowBatch(Antichain([lo]), Antichain([hi]), Antichain([lo]), (meta,))


# ----- appends: batch counts and write amplification ------------------------------------


def appends_single(n: int) -> dict[str, Any]:
    client = mem_client()
    shard = ShardId.new()
    w, r = client.open(shard, KEY, VAL)
    appended = written = rewritten = merges = 0
    max_batches = 0
    t0 = time.perf_counter()
    for t in range(n):
        b = _inline_batch(w.schemas, str(shard), [(((t,), (f"v{t}",)), t, 1)], t, t + 1)
        appended += b.size
        w.compare_and_append_batch(b, t, t + 1)
        res = mn.compact(client, shard)
        written += res["bytes_written"]
        rewritten += res["rows_rewritten"]
        merges += res["merges_applied"]
        max_batches = max(max_batches, res["batches_after"])
        if t % 1000 == 999:  # heartbeat + GC, as a deployment would (keeps consensus short)
            r.heartbeat()
            mn.gc(client, shard)
    secs = time.perf_counter() - t0
    s = client.machine(shard).fetch_latest()
    assert r.snapshot(n - 1).num_rows == n
    return {
        "appends": n,
        "updates": n,
        "max_batches": max_batches,
        "final_batches": len(s.batches),
        "batch_bound_2log2N_plus_2": round(2 * math.log2(n) + 2, 1),
        "merges": merges,
        "bytes_appended": appended,
        "bytes_written_by_compaction": written,
        "write_amplification_bytes": round(written / appended, 3),
        "write_amplification_updates": round(rewritten / n, 3),
        "wa_bound_log2N_plus_2": round(math.log2(n) + 2, 1),
        "seconds": round(secs, 1),
    }


def appends_bulk(n_appends: int, per: int) -> dict[str, Any]:
    client = mem_client(blob_target_size=8 * MiB)
    shard = ShardId.new()
    w, r = client.open(shard, KEY, VAL)
    rng = np.random.default_rng(1)
    appended = written = rewritten = 0
    max_batches = 0
    t0 = time.perf_counter()
    for t in range(n_appends):
        ks = rng.integers(0, 1 << 40, per)
        table = pa.table({"k": ks, "v": [f"v{int(x) % 97}" for x in ks], "ts": np.full(per, t), "diff": np.ones(per, dtype=np.int64)})
        w.compare_and_append(table, t, t + 1)
        s = client.machine(shard).cached()
        appended += max(s.batches.items())[1].size
        res = mn.compact(client, shard)
        written += res["bytes_written"]
        rewritten += res["rows_rewritten"]
        max_batches = max(max_batches, res["batches_after"])
    secs = time.perf_counter() - t0
    total = n_appends * per
    s = client.machine(shard).fetch_latest()
    return {
        "appends": n_appends,
        "updates": total,
        "max_batches": max_batches,
        "final_batches": len(s.batches),
        "batch_bound_2log2N_plus_2": round(2 * math.log2(total) + 2, 1),
        "bytes_appended": appended,
        "bytes_written_by_compaction": written,
        "write_amplification_bytes": round(written / appended, 3),
        "write_amplification_updates": round(rewritten / total, 3),
        "wa_bound_log2N_plus_2": round(math.log2(n_appends) + 2, 1),
        "seconds": round(secs, 1),
    }


# ----- logical compaction -----------------------------------------------------------------


def logical() -> dict[str, Any]:
    client = mem_client(blob_target_size=MiB)
    shard = ShardId.new()
    w, r = client.open(shard, KEY, VAL)
    n = 1000
    for t in range(0, n, 100):
        ups = []
        for tt in range(t, t + 100):
            if tt > 0:
                ups.append((((7,), (f"v{tt - 1}",)), tt, -1))
            ups.append((((7,), (f"v{tt}",)), tt, 1))
        w.compare_and_append(ups, t, t + 100)
    mn.compact(client, shard)
    s0 = client.machine(shard).fetch_latest()
    before = (sum(b.len for b in s0.batches.values()), sum(b.size for b in s0.batches.values()), len(s0.batches))
    r.downgrade_since(n)
    w.compare_and_append([], n, n + 1)
    res = mn.compact(client, shard)
    s1 = client.machine(shard).fetch_latest()
    after = (sum(b.len for b in s1.batches.values()), sum(b.size for b in s1.batches.values()), len(s1.batches))
    snap = r.snapshot(n)
    return {
        "timestamps": n,
        "updates_appended": 2 * n - 1,
        "records_before": before[0],
        "bytes_before": before[1],
        "batches_before": before[2],
        "records_after": after[0],
        "bytes_after": after[1],
        "batches_after": after[2],
        "shrink_factor_bytes": round(before[1] / max(after[1], 1), 1),
        "snapshot_rows": snap.num_rows,
        "merges": res["merges_applied"],
    }


# ----- GC with a held reader ----------------------------------------------------------------


def _contents(t: pa.Table) -> dict:
    c: Counter = Counter()
    for row in t.to_pylist():
        c[(row["k"], row["v"])] += row["diff"]
    return {k: v for k, v in c.items() if v}


def gc_held_reader() -> dict[str, Any]:
    client = mem_client(blob_target_size=4096, inline_threshold=0, rollup_interval=16)
    shard = ShardId.new()
    w, r = client.open(shard, KEY, VAL)
    upper = 0

    def append(k: int) -> None:
        nonlocal upper
        for _ in range(k):
            w.compare_and_append([(((i,), (f"v{upper % 3}",)), upper, 1) for i in range(300)], upper, upper + 1)
            upper += 1

    append(8)
    as_of = 5
    expected = _contents(r.snapshot(as_of))
    splits = r.snapshot_splits(as_of, 3)
    held_seqno = client.machine(shard).cached().seqno
    stop = threading.Event()
    errors: list[str] = []
    reads = [0]

    def reader() -> None:
        while not stop.is_set():
            try:
                got = pa.concat_tables([sp.fetch(client.blob) for sp in splits])
                if _contents(got) != expected or _contents(r.snapshot(as_of)) != expected:
                    errors.append("contents differ")
                r.heartbeat()
                reads[0] += 1
            except Exception as e:  # noqa: BLE001 - counted
                errors.append(f"{type(e).__name__}: {e}")
                return

    gcs: list[dict] = []
    th = threading.Thread(target=reader)
    th.start()
    for _ in range(6):
        append(3)
        mn.compact(client, shard)
        gcs.append(mn.gc(client, shard))
    stop.set()
    th.join()
    s = client.machine(shard).fetch_latest()
    during = {
        "reads_while_held": reads[0],
        "missing_blob_or_other_errors": len(errors),
        "held_seqno": held_seqno,
        "seqno_since": s.seqno_since(),
        "head_seqno": s.seqno,
        "garbage_pending": len(s.garbage),
        "blobs_deleted_while_held": sum(g["blobs_deleted"] for g in gcs),
    }
    r.release_splits()
    r.heartbeat()
    w.heartbeat()
    g = mn.gc(client, shard)
    again = mn.gc(client, shard)
    after = {
        "blobs_deleted": g["blobs_deleted"],
        "bytes_deleted": g["bytes_deleted"],
        "consensus_entries_truncated": g["consensus_entries_truncated"],
        "rollups_removed": g["rollups_removed"],
        "garbage_left": len(client.machine(shard).fetch_latest().garbage),
        "second_run_changed_anything": any(
            again[k] for k in ("blobs_deleted", "garbage_entries_removed", "consensus_entries_truncated", "rollups_removed")
        ),
        "leaked_blobs": len(mn.unreferenced_blobs(client, shard, 0)),
    }
    return {"during_hold": during, "after_release": after, "errors": errors[:3]}


# ----- memory: 10M updates under a budget, in a fresh subprocess ---------------------------

CHILD = textwrap.dedent(
    """
    import json, sys, time
    import os
    if os.environ.get("PERSIST_BENCH_ENTRY_POINT"):  # what the persist CLI and Dagster do
        from persist_lib.allocator import configure_bounded_allocator
        assert configure_bounded_allocator()
    import pyarrow as pa
    from persist_lib import PersistClient, PersistConfig, ShardId
    from persist_lib.handles import maintenance as mn
    blob, cons, shard, budget, target = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    cfg = PersistConfig.for_tests(compaction_memory_budget=budget, blob_target_size=target)
    # Warm-up merge on a throwaway shard: loads kernels and pools (the fixed overhead).
    warm = PersistClient.open("mem://warm", "mem://warm", cfg)
    ws = ShardId.new()
    w, _ = warm.open(ws, pa.schema([("k", pa.int64())]), pa.schema([("v", pa.int64())]))
    for t in range(3):
        w.compare_and_append([(((i,), (i,)), t, 1) for i in range(2000)], t, t + 1)
    mn.compact(warm, ws)
    from bench.rss import RssPeak, vm_hwm
    rss = RssPeak().start()
    baseline = rss.baseline
    client = PersistClient.open(blob, cons, cfg)
    t0 = time.perf_counter()
    res = mn.compact(client, shard)
    secs = time.perf_counter() - t0
    rss.stop()
    print(json.dumps({
        "baseline_rss": baseline, "peak_rss_sampled": rss.peak,
        # VmHWM: this process's own high-water mark (ru_maxrss would include the
        # parent's, inherited across fork+exec on Linux).
        "vm_hwm": vm_hwm(),
        "compact": res, "seconds": secs,
        "arrow_pool": pa.default_memory_pool().backend_name,
        "arrow_pool_max_memory": pa.default_memory_pool().max_memory(),
    }))
    """
)


def build_big_shard(root: Path, total: int, batches: int, target: int) -> tuple[str, str, ShardId, dict]:
    d = root / "memory"
    shutil.rmtree(d, ignore_errors=True)
    (d / "blob").mkdir(parents=True)
    blob, cons = f"file://{d / 'blob'}", f"sqlite:///{d / 'consensus.db'}"
    client = PersistClient.open(blob, cons, PersistConfig.for_tests(blob_target_size=target))
    shard = ShardId.new()
    schemas = Schemas.create(pa.schema([("k", pa.int64())]), pa.schema([("v", pa.int64())]))
    w = client.open_writer(shard, schemas.key, schemas.val)
    rng = np.random.default_rng(7)
    per = total // batches
    chunk = 500_000
    t0 = time.perf_counter()
    for b in range(batches):
        builder = w.builder(b)
        left = per
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
    return blob, cons, shard, info


ALLOCATORS = {
    "default": {},
    # Arrow on malloc and at most 2 glibc arenas: freed memory goes back to the OS
    # sooner (mimalloc/jemalloc and per-thread arenas keep freed pages in RSS).
    "system_malloc_2_arenas": {"ARROW_DEFAULT_MEMORY_POOL": "system", "MALLOC_ARENA_MAX": "2"},
    # What persist's own processes do at start (persist_lib/allocator.py).
    "persist_entry_point": {"PERSIST_BENCH_ENTRY_POINT": "1"},
}


def _compact_in_child(blob: str, cons: str, shard: ShardId, budget: int, target: int, extra_env: dict[str, str]) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), **extra_env}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, blob, cons, str(shard), str(budget), str(target)],
        capture_output=True, text=True, env=env, timeout=3600,
    )
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    res = json.loads(out.stdout.strip().splitlines()[-1])
    peak = max(res["peak_rss_sampled"], res["vm_hwm"])
    base = res["baseline_rss"]
    c = res["compact"]
    return {
        "fixed_overhead_rss_bytes": base,
        "peak_rss_bytes": peak,
        "peak_minus_overhead_bytes": peak - base,
        "peak_minus_overhead_over_budget": round((peak - base) / budget, 3),
        "within_budget_plus_overhead": peak <= base + budget,
        "arrow_pool": res["arrow_pool"],
        "arrow_pool_max_memory_bytes": res["arrow_pool_max_memory"],
        "merge_peak_bytes_held": c["peak_bytes_held"],
        "merge_peak_rows_held": c["peak_rows_held"],
        "bytes_read": c["bytes_read"],
        "bytes_written": c["bytes_written"],
        "batches_after": c["batches_after"],
        "compact_seconds": round(res["seconds"], 1),
    }


def memory(root: Path, total: int, budget: int, target: int) -> dict[str, Any]:
    out: dict[str, Any] = {"budget_bytes": budget}
    for name, env in ALLOCATORS.items():
        blob, cons, shard, info = build_big_shard(root, total, 8, target)
        out["input"] = info
        out[name] = _compact_in_child(blob, cons, shard, budget, target, env)
    shutil.rmtree(root / "memory", ignore_errors=True)
    return out


def memory_in_memory_merge(root: Path, total: int, budget: int, target: int) -> dict[str, Any]:
    """The same, under a budget the input fits (decoded, with the sort's working set):
    the merge decodes everything and sorts once; the bound must hold there too."""
    out: dict[str, Any] = {"budget_bytes": budget}
    blob, cons, shard, info = build_big_shard(root, total, 8, target)
    out["input"] = info
    res = _compact_in_child(blob, cons, shard, budget, target, ALLOCATORS["persist_entry_point"])
    res["merged_in_memory"] = res["merge_peak_rows_held"] >= info["updates"]
    out["persist_entry_point"] = res
    shutil.rmtree(root / "memory", ignore_errors=True)
    return out


# ----- driver -----------------------------------------------------------------------------


def _table(results: dict[str, Any]) -> str:
    lines = ["| section | figure | value |", "| --- | --- | --- |"]
    for sec, vals in results.items():
        flat: dict[str, Any] = {}
        stack = [("", vals)]
        while stack:
            prefix, v = stack.pop()
            if isinstance(v, dict):
                for k, x in reversed(list(v.items())):
                    stack.append((f"{prefix}{k}." if not isinstance(x, dict) else f"{prefix}{k}.", x) if isinstance(x, dict) else (f"{prefix}{k}", x))
            else:
                flat[prefix] = v
        for k, v in flat.items():
            lines.append(f"| {sec} | {k} | {v} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.compaction", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smaller sizes (1M updates, 16 MiB)")
    p.add_argument("--only", nargs="*", choices=["appends", "logical", "gc", "memory"])
    p.add_argument("--root", type=Path, default=None, help="scratch dir (default: a temp dir)")
    p.add_argument("--out", type=Path, default=None, help="write the JSON here too")
    ns = p.parse_args(argv)
    only = set(ns.only or ["appends", "logical", "gc", "memory"])
    root = ns.root or Path(tempfile.mkdtemp(prefix="bench-compaction-"))
    results: dict[str, Any] = {}
    if "appends" in only:
        results["appends_single"] = appends_single(2_000 if ns.quick else 10_000)
        results["appends_bulk"] = appends_bulk(200 if ns.quick else 1_000, 1_000)
    if "logical" in only:
        results["logical"] = logical()
    if "gc" in only:
        results["gc"] = gc_held_reader()
    if "memory" in only:
        if ns.quick:
            results["memory"] = memory(root, 1_000_000, 16 * MiB, 2 * MiB)
            results["memory_in_memory_merge"] = memory_in_memory_merge(root, 1_000_000, 192 * MiB, 2 * MiB)
        else:
            results["memory"] = memory(root, 10_000_000, 64 * MiB, 8 * MiB)
            results["memory_in_memory_merge"] = memory_in_memory_merge(root, 4_000_000, 1024 * MiB, 8 * MiB)
    doc = json.dumps(results, indent=2)
    print(doc)
    print()
    print(_table(results))
    if ns.out:
        ns.out.parent.mkdir(parents=True, exist_ok=True)
        ns.out.write_text(doc)
    if ns.root is None:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
