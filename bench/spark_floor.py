"""What any Python read into Spark costs before it reads a byte: the ``mapInArrow``
hand-off floor of the Spark rows of the scaling table (issue 28, session 18).

``read_snapshot`` of a shard with history fetches, verifies, decodes and consolidates
on the executors' Python workers and hands Spark Arrow batches (``mapInArrow``); Spark
then turns them into rows one by one before its aggregate. ``spark.read.parquet`` (the
anchor) decodes in the JVM straight into the aggregate's columnar input. The floor is
the same ``mapInArrow`` query over rows the Python workers already hold in memory
(built once per worker, the persist result's row count and shape): no fetch, no
decode, no consolidation. Its time ratio to the anchor is the best a
``mapInArrow``-based read can reach; persist over the floor is what persist's own
work adds.

``tree_cpu_s`` is the CPU of this process and every process under it: Spark's JVM, its
Python daemon and workers (``time.process_time`` sees only the driver's Python).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import psutil


def tree_cpu_s() -> float:
    """User + system CPU seconds of this process and all its live descendants."""
    me = psutil.Process()
    total = 0.0
    for p in [me, *me.children(recursive=True)]:
        try:
            t = p.cpu_times()
        except psutil.Error:  # exited meanwhile
            continue
        total += t.user + t.system
    return total


_SCHEMA = "key long, value string, ts long, diff long"


def _held_rows(rows: int, tasks: int) -> Callable[[Iterator[Any]], Iterator[Any]]:
    """The task function: yields ``rows / tasks`` rows of the bench's shape per task,
    built on the worker's first call and kept in the worker for the next ones."""

    def run(ids: Iterator[Any]) -> Iterator[Any]:
        import sys
        import types

        import numpy as np
        import pyarrow as pa
        import pyarrow.compute as pc

        cache = sys.modules.setdefault("_persist_bench_floor", types.ModuleType("_persist_bench_floor"))
        for rb in ids:
            for i in rb.column(0).to_pylist():
                n = rows // tasks + (1 if i < rows % tasks else 0)
                key = (n, i)
                t = cache.__dict__.get(str(key))
                if t is None:
                    k = pa.array(np.random.default_rng(i).integers(0, 10_000_000, n, dtype=np.int64))
                    t = pa.table({
                        "key": k, "value": pc.binary_join_element_wise("val_", pc.cast(k, pa.string()), ""),
                        "ts": pa.array(np.full(n, 3, dtype=np.int64)), "diff": pa.array(np.ones(n, dtype=np.int64)),
                    }).combine_chunks()
                    cache.__dict__[str(key)] = t
                yield from t.to_batches(max_chunksize=1 << 20)

    return run


def floor_query(spark: Any, rows: int, tasks: int = 2) -> Callable[[], tuple[Any, ...]]:
    """The floor query: ``rows`` rows held by ``tasks`` Python tasks, handed to Spark by
    ``mapInArrow`` and aggregated as the persist side is (count and the three sums)."""
    from pyspark.sql import functions as F

    def run() -> tuple[Any, ...]:
        df = spark.range(0, tasks, 1, tasks).mapInArrow(_held_rows(rows, tasks), _SCHEMA)
        return tuple(df.agg(
            F.count("*"), F.sum(F.col("key") * F.col("diff")),
            F.sum(F.length("value") * F.col("diff")), F.sum("diff"),
        ).collect()[0])

    return run
