"""PersistIOManager reads push their partition selection and ``columns`` down to persist
(``snapshot_batches(columns=, filter=)``): a downstream partition's load fetches only the
parts that can hold that partition's rows (counted by the client's blob metrics), and
returns exactly the rows the full read holds for it."""

import datetime as dt
from typing import Any

import dagster as dg
import pyarrow as pa
import pytest

from dagster_project.io_manager import PersistIOManager
from dagster_project.resources import PersistResource
from persist_lib.shard.metrics import process_counters

pytestmark = pytest.mark.dagster
pytest_plugins = ["tests.io_manager_fixtures"]

DAYS = [f"2026-02-{d:02d}" for d in range(1, 11)]
daily = dg.DailyPartitionsDefinition(start_date=DAYS[0], end_date="2026-02-11")
ROWS_PER_DAY = 1500  # well above the inline threshold: each day's write is a blob part


def _day(day: str) -> pa.Table:
    d = dt.date.fromisoformat(day)
    n = ROWS_PER_DAY
    return pa.table({
        "day": pa.array([d] * n, pa.date32()), "id": pa.array(range(n), pa.int64()),
        "v": [f"{day}-{i}-payload" for i in range(n)], "w": pa.array([i * 0.5 for i in range(n)]),
    })


@dg.asset(key_prefix=["push"], partitions_def=daily,
          metadata={"persist/key": ["day", "id"], "persist/partition_column": "day"})
def events(context: dg.AssetExecutionContext) -> pa.Table:
    return _day(context.partition_key)


SEEN: dict[str, pa.Table] = {}


@dg.asset(key_prefix=["push"], partitions_def=daily, io_manager_key="mem",
          ins={"events": dg.AssetIn(key=["push", "events"], metadata={"columns": ["id", "v"]})})
def one_day(events: pa.Table) -> None:
    SEEN["one_day"] = events


@dg.asset(key_prefix=["push"], io_manager_key="mem", ins={"events": dg.AssetIn(key=["push", "events"])})
def every_day(events: pa.Table) -> None:
    SEEN["every_day"] = events


def _reads(shards: list[str]) -> tuple[int, int]:
    """(parts, bytes) read from blob for ``shards`` by every client of this process (the
    run's resources are copies with clients of their own)."""
    c = process_counters()
    return (sum(c[s].parts_read for s in shards if s in c), sum(c[s].bytes_read for s in shards if s in c))


def _load(persist: PersistResource, instance: dg.DagsterInstance, asset: Any, **kw: Any) -> tuple[int, int]:
    """(parts, bytes) the run read from blob for the collection's shards."""
    shards = persist.controller().describe("push.events")["renditions"]["r0"]["shards"]
    before = _reads(shards)
    res = dg.materialize(
        [events, asset], selection=[asset], instance=instance,
        resources={"io_manager": PersistIOManager(persist=persist), "mem": dg.InMemoryIOManager()}, **kw,
    )
    assert res.success
    after = _reads(shards)
    return after[0] - before[0], after[1] - before[1]


def test_partition_load_fetches_only_its_parts_and_the_same_rows(
    persist: PersistResource, instance: dg.DagsterInstance
) -> None:
    io = {"io_manager": PersistIOManager(persist=persist)}
    for day in DAYS:  # one write (one part) per day
        assert dg.materialize([events], partition_key=day, resources=io, instance=instance).success
    full_parts, full_bytes = _load(persist, instance, every_day)
    day_parts, day_bytes = _load(persist, instance, one_day, partition_key=DAYS[3])
    assert full_parts >= len(DAYS) and day_parts >= 1
    assert day_parts < full_parts and day_bytes * 3 < full_bytes, (day_parts, full_parts, day_bytes, full_bytes)
    # the same rows the full read holds for that day, in just the asked-for columns
    full = SEEN["every_day"]
    want = full.filter(pa.compute.equal(full["day"], pa.scalar(dt.date.fromisoformat(DAYS[3]), pa.date32())))
    got = SEEN["one_day"]
    assert got.column_names == ["id", "v"]
    assert sorted(got.to_pylist(), key=lambda r: r["id"]) == sorted(
        want.select(["id", "v"]).to_pylist(), key=lambda r: r["id"]
    )
    assert got.num_rows == ROWS_PER_DAY
