"""Consolidation kernels side by side: what earned polars its place (docs/benchmarks.md).

The task is what compaction and reads do to a table of updates: sort by ``(k, v, t)``,
sum the diffs of equal rows, drop zero sums. Inputs (random, seeded): an int64 key with
a ``"val_<key>"`` string value (the benchmarks' shape: keys from 10M, so 1M rows have
~5% and 5M rows ~20% tied keys) and a ``"user_<n>"`` string key with an int64 value
(keys from n/2: every key about twice), 1M and 5M rows, times in [0, 10), diffs in
{1, -1, 2}. Each kernel's result is checked equal to persist's.

- ``persist (numpy only)``: ``consolidate`` with ``PERSIST_KERNELS=numpy``;
- ``persist (polars kernels)``: ``consolidate`` as shipped (polars sorts and gathers);
- ``polars group_by + sort``: ``group_by(k, v, t).agg(sum(d)).filter(d != 0).sort(k, v, t)``;
- ``duckdb GROUP BY + ORDER BY``: the same in SQL on the Arrow table (2 threads).

Run: ``.venv/bin/python -m bench.kernels [--rows 1000000 5000000] [--reps 3]``.
Prints wall and CPU ms (best of ``--reps``) and each kernel's wall time relative to
persist's, with the load average.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc


def table(n: int, kind: str, seed: int = 1) -> pa.Table:
    rng = np.random.default_rng(seed)
    if kind == "int key":
        k = pa.array(rng.integers(0, 10_000_000, n, dtype=np.int64))
        v = pc.binary_join_element_wise("val_", pc.cast(k, pa.string()), "")
    else:
        ids = pa.array(rng.integers(0, max(1, n // 2), n, dtype=np.int64))
        k = pc.binary_join_element_wise("user_", pc.cast(ids, pa.string()), "")
        v = pa.array(rng.integers(0, 100, n, dtype=np.int64))
    t = pa.array(rng.integers(0, 10, n, dtype=np.int64))
    d = pa.array(rng.choice(np.array([1, -1, 2], dtype=np.int64), n))
    return pa.table({"k": k, "v": v, "t": t, "d": d})


def _persist(engine: str) -> Callable[[pa.Table], pa.Table]:
    from persist_lib.shard.consolidate import consolidate

    def run(t: pa.Table) -> pa.Table:
        old = os.environ.get("PERSIST_KERNELS")
        os.environ["PERSIST_KERNELS"] = engine
        try:
            return consolidate(t)
        finally:
            if old is None:
                os.environ.pop("PERSIST_KERNELS", None)
            else:
                os.environ["PERSIST_KERNELS"] = old

    return run


def _polars(t: pa.Table) -> pa.Table:
    import polars as pl

    df = pl.from_arrow(t)
    assert isinstance(df, pl.DataFrame)
    out = df.group_by(["k", "v", "t"]).agg(pl.col("d").sum()).filter(pl.col("d") != 0).sort(["k", "v", "t"])
    return out.to_arrow()


def _duckdb() -> Callable[[pa.Table], pa.Table]:
    import duckdb

    con = duckdb.connect()
    con.execute("SET threads=2")

    def run(t: pa.Table) -> pa.Table:
        con.register("updates", t)
        try:
            return con.sql(
                "SELECT k, v, t, SUM(d)::BIGINT AS d FROM updates GROUP BY ALL HAVING SUM(d) != 0 "
                "ORDER BY k, v, t"
            ).to_arrow_table()
        finally:
            con.unregister("updates")

    return run


def _timed(f: Callable[[], Any], reps: int) -> tuple[float, float, Any]:
    best_w = best_c = float("inf")
    out = None
    for _ in range(reps):
        w0, c0 = time.perf_counter(), time.process_time()
        out = f()
        best_w = min(best_w, time.perf_counter() - w0)
        best_c = min(best_c, time.process_time() - c0)
    return best_w, best_c, out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.kernels", description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, nargs="*", default=[1_000_000, 5_000_000])
    p.add_argument("--reps", type=int, default=3)
    ns = p.parse_args(argv)
    kernels: dict[str, Callable[[pa.Table], pa.Table]] = {
        "persist (numpy only)": _persist("numpy"),
        "persist (polars kernels)": _persist("polars"),
        "polars group_by + sort": _polars,
        "duckdb GROUP BY + ORDER BY": _duckdb(),
    }
    print(f"load average at start: {os.getloadavg()[0]:.1f}, {os.cpu_count()} CPUs")
    print("| input | rows | kernel | wall ms | CPU ms | wall vs persist (polars) | same result |")
    print("|---|---|---|---|---|---|---|")
    for kind in ("int key", "string key"):
        for n in ns.rows:
            t = table(n, kind)
            kernels["persist (polars kernels)"](t)  # warm-up (imports, pools)
            res: dict[str, tuple[float, float, pa.Table]] = {}
            for name, f in kernels.items():
                res[name] = _timed(lambda f=f, t=t: f(t), ns.reps)  # type: ignore[misc]
            ref = res["persist (polars kernels)"]
            for name, (w, c, out) in res.items():
                same = out.cast(ref[2].schema).equals(ref[2])
                print(f"| {kind} | {n:,} | {name} | {w * 1e3:,.0f} | {c * 1e3:,.0f} | {w / ref[0]:.2f}x | {same} |")
    print(f"load average at end: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
