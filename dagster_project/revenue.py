"""The I/O manager's demo: daily revenue per order status, stored in persist.

``orders_daily_revenue`` (partitioned by day) reads the ``orders`` collection as of the
end of its day (time travel: each partition is the orders as they stood that day, or at
the latest decided time for today) and returns one row per status; ``PersistIOManager``
stores it in the collection ``demo.orders_daily_revenue``, replacing exactly that day's
rows. ``orders_revenue_trend`` loads every day of it as of the time that materialization
recorded (not whatever was written since) and is stored through the I/O manager too.
"""


import datetime as dt

import dagster as dg
import pyarrow as pa
import pyarrow.compute as pc

from dagster_project.checks import latest_as_of
from dagster_project.io_manager.write_modes import expand
from dagster_project.resources import PersistResource

IO_MANAGER_KEY = "persist_io"
daily = dg.DailyPartitionsDefinition(start_date="2026-01-01", end_offset=1)

REVENUE_SCHEMA = pa.schema(
    [("day", pa.date32()), ("status", pa.string()), ("orders", pa.int64()), ("revenue", pa.float64())]
)


def end_of_day_ms(day: dt.date) -> int:
    start = dt.datetime(day.year, day.month, day.day, tzinfo=dt.UTC) + dt.timedelta(days=1)
    return int(start.timestamp() * 1000)


def revenue_per_status(orders: pa.Table, day: dt.date) -> pa.Table:
    """One row per status: how many orders and their total amount."""
    if orders.num_rows == 0:
        return REVENUE_SCHEMA.empty_table()
    agg = orders.group_by("status").aggregate([("order_id", "count"), ("amount", "sum")])
    agg = agg.sort_by("status")
    return pa.table(
        {
            "day": pa.array([day] * agg.num_rows, pa.date32()),
            "status": agg["status"],
            "orders": agg["order_id_count"].cast(pa.int64()),
            "revenue": agg["amount_sum"],
        },
        schema=REVENUE_SCHEMA,
    )


@dg.asset(
    key_prefix=["demo"],
    partitions_def=daily,
    deps=["orders"],
    io_manager_key=IO_MANAGER_KEY,
    group_name="demo",
    kinds={"persist", "pyarrow"},
    metadata={"persist/key": ["day", "status"], "persist/partition_column": "day"},
    description=(
        "Revenue per order status for one day: the `orders` collection read AS OF the end of "
        "the day (or its latest decided time), stored in persist by PersistIOManager "
        "(collection `demo.orders_daily_revenue`, one partition's rows replaced per run)."
    ),
)
def orders_daily_revenue(context: dg.AssetExecutionContext, persist: PersistResource) -> pa.Table:
    day = dt.date.fromisoformat(context.partition_key)
    latest = latest_as_of(persist, "orders")
    if latest is None:
        return REVENUE_SCHEMA.empty_table()
    as_of = min(latest, end_of_day_ms(day) - 1)
    with persist.controller().acquire_read_handle("orders") as r:
        readable = r.since.time or 0
        orders = expand(r.snapshot(as_of)) if as_of >= readable else None
    if orders is None:
        context.log.info(f"orders are not readable at {as_of} any more; nothing for {day}")
        return REVENUE_SCHEMA.empty_table()
    context.add_output_metadata({"orders_as_of": dg.MetadataValue.int(as_of)})
    return revenue_per_status(orders, day)


@dg.asset(
    key_prefix=["demo"],
    ins={"daily": dg.AssetIn(key=["demo", "orders_daily_revenue"])},
    io_manager_key=IO_MANAGER_KEY,
    group_name="demo",
    kinds={"persist", "pyarrow"},
    metadata={"persist/key": ["status"]},
    description=(
        "Per status, over every day materialized: days seen, total orders and revenue, and the "
        "last day's revenue. Reads `demo/orders_daily_revenue` as of the time its "
        "materialization recorded."
    ),
)
def orders_revenue_trend(daily: pa.Table) -> pa.Table:
    if daily.num_rows == 0:
        return pa.table({"status": pa.array([], pa.string()), "days": pa.array([], pa.int64()),
                         "orders": pa.array([], pa.int64()), "revenue": pa.array([], pa.float64()),
                         "last_day_revenue": pa.array([], pa.float64())})
    last_day = pc.max(daily["day"])
    last = daily.filter(pc.equal(daily["day"], last_day)).select(["status", "revenue"])
    last = last.rename_columns(["status", "last_day_revenue"])
    agg = daily.group_by("status").aggregate([("day", "count"), ("orders", "sum"), ("revenue", "sum")])
    agg = agg.rename_columns(["status", "days", "orders", "revenue"])
    out = agg.join(last, "status", join_type="left outer").sort_by("status")
    return out.select(["status", "days", "orders", "revenue", "last_day_revenue"]).cast(
        pa.schema([("status", pa.string()), ("days", pa.int64()), ("orders", pa.int64()),
                   ("revenue", pa.float64()), ("last_day_revenue", pa.float64())])
    )


REVENUE_ASSETS = [orders_daily_revenue, orders_revenue_trend]

#: The demo's jobs: one day of revenue (partitioned), then the trend over every day.
orders_daily_revenue_job = dg.define_asset_job(
    "orders_daily_revenue_job", selection=dg.AssetSelection.assets(orders_daily_revenue), partitions_def=daily
)
orders_revenue_trend_job = dg.define_asset_job(
    "orders_revenue_trend_job", selection=dg.AssetSelection.assets(orders_revenue_trend)
)
REVENUE_JOBS = [orders_daily_revenue_job, orders_revenue_trend_job]
