"""The scaling table's Spark rows alone, with the default read's old materialization
(``localCheckpoint``) and its pinned lazy read (``spark.pins``) interleaved in one
process against ``spark.read.parquet`` of the same part files (issue 28).

Per size: the same shard as ``bench.scaling`` (4 commits of n/4 ``update_batch`` rows at
times 0..3, compacted; then the "no history" state: since advanced to the as-of and
compacted again). For each state, ``REPS`` rounds of: the raw read + aggregate, the
default ``read_snapshot`` + aggregate (pinned), the same with pinning switched off (the
code path of ``608d34a``: materialized before the hold is released) and
``materialize=False`` (lazy, hold kept), the order rotating per round; medians, and each
as speed against the raw read (raw ms / persist ms; the goal is >= 0.8x). The aggregate
is ``bench.scaling_engines``'s (the weighted sums are checked against the raw read's).

Run: ``PERSIST_BENCH_SIZES=1,4 python -m bench.scaling_spark_ab [--reps 5]``.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import KEY_SCHEMA, VAL_SCHEMA, persist_file_client, update_batch
from bench.scaling_engines import (
    AS_OF,
    _check,
    drop_history,
    part_files_of,
    spark_session,
    stop_spark,
)

COMMITS = 4


def _sizes() -> list[int]:
    env = os.environ.get("PERSIST_BENCH_SIZES", "1,4")
    return [int(float(x) * 1_000_000) for x in env.split(",") if x.strip()]


def _build(d: Path, n: int) -> Any:
    from persist_lib.ids import ShardId

    client = persist_file_client(d, compaction_enabled=False)
    shard = ShardId.new()
    w, r = client.open(shard, KEY_SCHEMA, VAL_SCHEMA)
    for i in range(COMMITS):
        w.compare_and_append(update_batch(n // COMMITS, i, 1000 + i), i, i + 1)
    client.compact(shard)
    w.expire()
    r.expire()
    client.close()
    return shard


def _agg(df: Any, k: str, v: str, d: str) -> tuple[Any, ...]:
    from pyspark.sql import functions as F

    row = df.agg(F.count("*"), F.sum(F.col(k) * F.col(d)), F.sum(F.length(v) * F.col(d)), F.sum(d)).collect()[0]
    return tuple(row)


def _sides(d: Path, shard: Any, spark: Any, client: Any, r: Any) -> dict[str, Callable[[], tuple[Any, ...]]]:
    import persist_lib.spark.read as read_mod
    from persist_lib.spark import read_snapshot

    files = part_files_of(d, shard)
    pin = read_mod.pin_parts

    def persist(mode: str) -> tuple[Any, ...]:
        r.release_splits()  # the previous lazy read's hold (materialize=False)
        read_mod.pin_parts = pin if mode == "pinned" else (lambda *_a, **_k: None)  # type: ignore[assignment]
        try:
            df = read_snapshot(spark, r, AS_OF, **({"materialize": False} if mode == "lazy" else {}))
        finally:
            read_mod.pin_parts = pin
        return _agg(df, "key", "value", "diff")

    return {
        "raw": lambda: _agg(spark.read.parquet(*files), "k.key", "v.value", "d"),
        "pinned (new default)": lambda: persist("pinned"),
        "localCheckpoint (old default)": lambda: persist("old"),
        "materialize=False": lambda: persist("lazy"),
    }


def _round_robin(fns: dict[str, Callable[[], Any]], reps: int) -> dict[str, tuple[list[float], Any]]:
    names = list(fns)
    out: dict[str, tuple[list[float], Any]] = {k: ([], None) for k in names}
    for i in range(reps):
        for k in names[i % len(names):] + names[: i % len(names)]:
            gc.collect()
            t0 = time.perf_counter()
            res = fns[k]()
            out[k] = ([*out[k][0], time.perf_counter() - t0], res)
    return out


def measure(d: Path, shard: Any, reps: int) -> dict[str, dict[str, float]]:
    from persist_lib.spark.pins import release_pins

    spark = spark_session()
    client = persist_file_client(d)
    r = client.open_leased_reader(shard, KEY_SCHEMA, VAL_SCHEMA)
    try:
        fns = _sides(d, shard, spark, client, r)
        for f in fns.values():  # warm every path once
            f()
        got = _round_robin(fns, reps)
    finally:
        r.expire()
        client.close()
        release_pins()
    raw_t, raw_out = got["raw"]
    out: dict[str, dict[str, float]] = {}
    for k, (ts, res) in got.items():
        if k != "raw":
            _check(k, res, raw_out)
        out[k] = {"ms": statistics.median(ts) * 1e3, "speed": statistics.median(raw_t) / statistics.median(ts)}
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    print(f"load: {os.getloadavg()}", flush=True)
    try:
        for n in _sizes():
            with tempfile.TemporaryDirectory(prefix="spark-ab-") as tmp:
                d = Path(tmp)
                shard = _build(d, n)
                for state in ("history", "no history"):
                    if state == "no history":
                        drop_history(d, shard)
                    res = measure(d, shard, args.reps)
                    print(f"\n{n / 1e6:g}M, {state} (load {os.getloadavg()[0]:.1f}), median of {args.reps}:")
                    print("| side | ms | speed vs raw |\n|---|---|---|")
                    for k, v in res.items():
                        print(f"| {k} | {v['ms']:,.0f} | {v['speed']:.2f}x |")
                    sys.stdout.flush()
    finally:
        stop_spark()


if __name__ == "__main__":
    main()
