"""A ``polars.LazyFrame`` input streams the collection in bounded memory.

The collection (16 writes, ~9x the I/O manager's ``read_memory_budget`` decoded) is
loaded by a downstream asset as a LazyFrame and aggregated with polars' streaming
engine: Arrow (a proxy memory pool counting what the read allocates) never holds more
than a few budgets at once, where loading it as a ``polars.DataFrame`` holds it whole,
and the rows are exactly the collection's (count, unique ids, every value checked
against its id, so the ids are exactly 0..N-1 once each; projection and ``head``
honoured)."""

from typing import Any

import dagster as dg
import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from dagster_project.io_manager import PersistIOManager
from dagster_project.resources import PersistResource
from persist_lib.config import MiB

pytestmark = pytest.mark.dagster
pytest_plugins = ["tests.io_manager_fixtures"]

WRITES, ROWS = 16, 20_000
N = WRITES * ROWS
BUDGET = 1 * MiB
_POOLS: list[Any] = []  # buffers the read allocated (cached parts) may outlive the test: so must the pool


def _chunk(i: int) -> pa.Table:
    ids = pa.array(np.arange(i * ROWS, (i + 1) * ROWS, dtype=np.int64))
    return pa.table({
        "id": ids,
        "x": pc.multiply(ids, 7),
        "s": pc.binary_join_element_wise("row-", pc.cast(ids, pa.string()), ""),
    })


def _fill(persist: PersistResource) -> int:
    """The collection ``lazy.big``, written in WRITES parts; its decoded size in bytes."""
    ctl = persist.controller()
    first = _chunk(0)
    ctl.create_collection("lazy.big", first.schema.remove(2).remove(1), first.schema.remove(0))
    size = 0
    with ctl.open_writer("lazy.big") as w:
        for i in range(WRITES):
            t = _chunk(i)
            size += t.nbytes
            t = t.append_column("ts", pa.array(np.full(ROWS, i, np.int64))).append_column("diff", pa.array(np.ones(ROWS, np.int64)))
            w.compare_and_append(t, i, i + 1)
    return size


big = dg.AssetSpec(["lazy", "big"], metadata={"persist/key": ["id"]})
GOT: dict[str, Any] = {}


@dg.asset(io_manager_key="mem", ins={"big": dg.AssetIn(key=big.key, metadata={"persist/as_of": "latest"})})
def streamed(big: pl.LazyFrame) -> None:
    GOT["lazy"] = big
    GOT["stats"] = big.select(
        pl.len().alias("n"),
        pl.col("id").n_unique().alias("unique"),
        (pl.col("x") != pl.col("id") * 7).sum().alias("bad_x"),
        (pl.col("s") != pl.format("row-{}", pl.col("id"))).sum().alias("bad_s"),
        pl.col("id").min().alias("lo"),
        pl.col("id").max().alias("hi"),
    ).collect(engine="streaming").row(0, named=True)


@dg.asset(io_manager_key="mem", ins={"big": dg.AssetIn(key=big.key, metadata={"persist/as_of": "latest"})})
def eager(big: pl.DataFrame) -> None:
    GOT["eager_rows"] = big.height


def _peak(persist: PersistResource, instance: dg.DagsterInstance, asset: dg.AssetsDefinition) -> int:
    """Arrow's peak allocation while the run loads (and, for the LazyFrame, aggregates) the input."""
    default_pool = pa.default_memory_pool()
    pool = pa.proxy_memory_pool(default_pool)
    _POOLS.append(pool)
    pa.set_memory_pool(pool)
    try:
        res = dg.materialize(
            [big, asset], instance=instance,
            resources={"io_manager": PersistIOManager(persist=persist, read_memory_budget=BUDGET), "mem": dg.InMemoryIOManager()},
        )
    finally:
        pa.set_memory_pool(default_pool)
    assert res.success
    return int(pool.max_memory())


@pytest.mark.slow  # ~20 s: persist's streaming merge at a 1 MiB budget is slow (docs/dagster.md)
def test_lazy_frame_input_streams_in_bounded_memory_and_exactly(persist: PersistResource, instance: dg.DagsterInstance) -> None:
    whole = _fill(persist)
    assert whole > 8 * BUDGET, whole
    lazy_peak = _peak(persist, instance, streamed)
    eager_peak = _peak(persist, instance, eager)
    assert GOT["stats"] == {"n": N, "unique": N, "bad_x": 0, "bad_s": 0, "lo": 0, "hi": N - 1}, GOT["stats"]
    assert GOT["eager_rows"] == N
    assert eager_peak >= whole // 2, (eager_peak, whole)  # what the measure sees of a whole load
    assert 0 < lazy_peak <= min(4 * BUDGET, whole // 2), f"Arrow held {lazy_peak} bytes at once streaming {whole} bytes (budget {BUDGET})"
    # the LazyFrame reads again on each collect (after the step, too): projection, head
    lf: pl.LazyFrame = GOT["lazy"]
    first = lf.head(5).collect()
    assert first.height == 5 and first.to_dicts() == [{"id": i, "x": 7 * i, "s": f"row-{i}"} for i in first["id"]]
    assert lf.select("s").head(3).collect().columns == ["s"]
    assert lf.collect_schema() == pl.Schema({"id": pl.Int64, "x": pl.Int64, "s": pl.String})
