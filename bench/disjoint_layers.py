"""Disjoint time layers, emulated: what a read would cost if a compacted batch kept each
``(k, v)`` whole in the layer of its oldest update (issue 28, session 15; not built).

The scaling shard (4 commits of n/4 random keys at times 0..3, ``update_batch``) is
consolidated into one run sorted by ``(k, v, t)``, as the compactor writes it, and is
also split into two layers that share no ``(k, v)``: layer 0 holds every group whose
oldest time is 0 or 1 (with the group's later updates), layer 1 the rest. Each is
written as zstd Parquet files in row groups of 16,384 rows; then, interleaved in a
rotating order, the read-side work of persist's linear path (``pq.read_table`` of the
files on 4 threads, ``snapshot_at``, ``consolidate_sorted``) is timed:
- at the latest time: the one run, against both layers read the same way and
  concatenated (no consolidation across them is needed: no ``(k, v)`` is in both);
- as of time 1: the one run, against layer 0 alone (layer 1's parts would be skipped by
  their ``tmin``).
No fetch from blob, no checksum, no state: only the decode and the fold. The row counts
of each pair are printed and must agree.

Run: ``.venv/bin/python -m bench.disjoint_layers [--millions 1] [--rounds 5]``.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from bench.common import update_batch
from persist_lib.shard.codec import D_COL, KEY_PREFIX, T_COL, VAL_PREFIX
from persist_lib.shard.consolidate import consolidate_sorted
from persist_lib.shard.time_filters import snapshot_at

KEY, VAL = f"{KEY_PREFIX}key", f"{VAL_PREFIX}value"


def compacted_run(n: int) -> pa.Table:
    """The scaling shard's ``n`` updates consolidated into one ``(k, v, t)``-sorted run."""
    t = pa.concat_tables([update_batch(n // 4, i, 1000 + i) for i in range(4)])
    t = t.rename_columns([KEY, VAL, T_COL, D_COL])
    g = t.group_by([KEY, VAL, T_COL]).aggregate([(D_COL, "sum")]).rename_columns([KEY, VAL, T_COL, D_COL])
    return g.sort_by([(KEY, "ascending"), (VAL, "ascending"), (T_COL, "ascending")]).combine_chunks()


def disjoint_layers(run: pa.Table, bound: int) -> tuple[pa.Table, pa.Table]:
    """``run`` split by the oldest time of each ``(k, v)`` group: ``< bound`` or not.
    (``update_batch``'s value is a function of its key, so a group is a key.)"""
    k = run.column(KEY).to_numpy()
    first = np.ones(len(k), dtype=bool)
    first[1:] = k[1:] != k[:-1]
    oldest = np.minimum.reduceat(run.column(T_COL).to_numpy(), np.flatnonzero(first))[np.cumsum(first) - 1]
    return run.filter(pa.array(oldest < bound)), run.filter(pa.array(oldest >= bound))


def write_files(table: pa.Table, d: Path, name: str, files: int) -> list[Path]:
    step = -(-table.num_rows // files)
    paths = [d / f"{name}{i}.parquet" for i in range(files)]
    for i, p in enumerate(paths):
        pq.write_table(table.slice(i * step, step), p, compression="zstd", row_group_size=16384)
    return paths


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--millions", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    run = compacted_run(int(args.millions * 1_000_000))
    l0, l1 = disjoint_layers(run, 2)
    carried = int(pc.sum(pc.greater(l0.column(T_COL), 1)).as_py() or 0)
    print(f"one run {run.num_rows:,} rows; layer 0 {l0.num_rows:,} (of which {carried:,} at times > 1), "
          f"layer 1 {l1.num_rows:,}")
    pool = ThreadPoolExecutor(4)
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        one, f0, f1 = write_files(run, d, "run", 4), write_files(l0, d, "l0", 2), write_files(l1, d, "l1", 2)

        def read(paths: list[Path], as_of: int) -> int:
            tables = list(pool.map(lambda p: snapshot_at(pq.read_table(p), as_of), paths))
            out = consolidate_sorted(pa.concat_tables(tables))
            if out is None:
                raise AssertionError("the emulated run is not sorted")
            return out.num_rows

        fns: dict[str, Callable[[], int]] = {
            "one run, latest": lambda: read(one, 3),
            "disjoint layers, latest (concatenated)": lambda: read(f0, 3) + read(f1, 3),
            "one run, as of 1": lambda: read(one, 1),
            "disjoint layers, as of 1 (layer 0)": lambda: read(f0, 1),
        }
        names = list(fns)
        times: dict[str, list[float]] = {k: [] for k in names}
        rows: dict[str, int] = {}
        for r in range(args.rounds):
            for k in names[r % len(names):] + names[: r % len(names)]:
                gc.collect()
                t0 = time.perf_counter()
                rows[k] = fns[k]()
                times[k].append(time.perf_counter() - t0)
    pool.shutdown()
    print(f"{args.millions:g}M updates, {args.rounds} rounds, load {os.getloadavg()[0]:.1f}")
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    for k in names:
        print(f"  {k:40s} {med[k]:8.0f} ms  {rows[k]:,} rows")
    return med


if __name__ == "__main__":
    main()
