"""Arrow types through Spark: persist -> Spark DataFrame -> persist is exact for the types
users have, and types Spark can't hold are refused up front, naming the field."""

from __future__ import annotations

import datetime as dt
from decimal import Decimal
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from persist_lib.errors import InvalidUsage
from persist_lib.shard.codec import Schemas
from persist_lib.spark.types import UnsupportedSparkType, spark_schema
from tests.test_spark_support import file_location, open_client

pytest_plugins = ["tests.spark_fixtures"]
pytestmark = pytest.mark.spark

UTC = dt.UTC

KEY = pa.schema([pa.field("k", pa.int64(), nullable=False), ("ks", pa.string())])
VAL = pa.schema(
    [
        ("i8", pa.int8()), ("i16", pa.int16()), ("i32", pa.int32()),
        ("u8", pa.uint8()), ("u16", pa.uint16()), ("u32", pa.uint32()), ("u64", pa.uint64()),
        ("f16", pa.float16()), ("f32", pa.float32()), ("f64", pa.float64()),
        ("dec", pa.decimal128(12, 3)), ("dec256", pa.decimal256(20, 2)),
        ("s", pa.large_string()), ("b", pa.binary()), ("lb", pa.large_binary()),
        ("fb", pa.binary(3)), ("flag", pa.bool_()),
        ("d32", pa.date32()), ("d64", pa.date64()),
        ("ts_s", pa.timestamp("s", tz="UTC")), ("ts_ms", pa.timestamp("ms", tz="America/New_York")),
        ("ts_us", pa.timestamp("us")), ("ts_ns", pa.timestamp("ns", tz="UTC")),
        ("dur", pa.duration("us")),
        ("st", pa.struct([("a", pa.int32()), ("l", pa.list_(pa.string())), ("c", pa.struct([("x", pa.float64())]))])),
        ("lst", pa.list_(pa.field("item", pa.int64(), nullable=False))),
        ("llst", pa.large_list(pa.struct([("p", pa.string())]))),
        ("fsl", pa.list_(pa.float32(), 2)),
    ]
)


def _rows(n: int) -> pa.Table:
    import numpy as np

    def nul(i: int, v: Any) -> Any:
        return None if i % 7 == 3 else v

    base = dt.datetime(2024, 2, 29, 12, 30, 15, tzinfo=UTC)
    cols: dict[str, list[Any]] = {f.name: [] for f in list(KEY) + list(VAL)}
    for i in range(n):
        cols["k"].append(i)
        cols["ks"].append(nul(i, f"key-{i % 5}"))
        cols["i8"].append(nul(i, (i % 256) - 128))
        cols["i16"].append(nul(i, -i))
        cols["i32"].append(nul(i, i * 1000))
        cols["u8"].append(nul(i, 255 - i % 256))
        cols["u16"].append(nul(i, 65535 - i))
        cols["u32"].append(nul(i, 4_294_967_295 - i))
        cols["u64"].append(nul(i, 18_446_744_073_709_551_615 - i))
        cols["f16"].append(nul(i, np.float16(i / 8)))
        cols["f32"].append(nul(i, float(np.float32(i / 3))))
        cols["f64"].append(nul(i, i / 7 if i % 11 else float("-inf")))
        cols["dec"].append(nul(i, Decimal(i) / Decimal(8)))
        cols["dec256"].append(nul(i, Decimal(10**17 + i) / Decimal(100)))
        cols["s"].append(nul(i, "é✓" * (i % 3)))
        cols["b"].append(nul(i, bytes([i % 256, 0, 255])))
        cols["lb"].append(nul(i, b"\x00" * (i % 4)))
        cols["fb"].append(nul(i, bytes([1, 2, i % 256])))
        cols["flag"].append(nul(i, i % 2 == 0))
        cols["d32"].append(nul(i, dt.date(1969, 12, 31) + dt.timedelta(days=i)))
        cols["d64"].append(nul(i, dt.date(2000, 1, 1) + dt.timedelta(days=i)))
        cols["ts_s"].append(nul(i, base + dt.timedelta(seconds=i)))
        cols["ts_ms"].append(nul(i, base + dt.timedelta(milliseconds=i)))
        cols["ts_us"].append(nul(i, dt.datetime(1960, 1, 1) + dt.timedelta(microseconds=i)))
        cols["ts_ns"].append(nul(i, base + dt.timedelta(microseconds=i)))
        cols["dur"].append(nul(i, dt.timedelta(microseconds=i * 1001)))
        cols["st"].append(nul(i, {"a": i, "l": [str(i), None], "c": {"x": i / 2} if i % 2 else None}))
        cols["lst"].append(nul(i, list(range(i % 4))))
        cols["llst"].append(nul(i, [{"p": "x"}, None]))
        cols["fsl"].append(nul(i, [float(i), None]))
    arrays = [pa.array(cols[f.name], f.type) for f in list(KEY) + list(VAL)]
    t = pa.Table.from_arrays(arrays, schema=pa.schema(list(KEY) + list(VAL)))
    t = t.append_column("ts", pa.array([i % 3 for i in range(n)], pa.int64()))
    return t.append_column("diff", pa.array([1] * n, pa.int64()))


def test_every_supported_type_round_trips_through_spark(spark: Any, tmp_path: Path) -> None:
    from persist_lib.spark import read_snapshot, write_batch

    client = open_client(file_location(tmp_path))
    a = "s00000000-0000-4000-8000-0000000000b1"
    b = "s00000000-0000-4000-8000-0000000000b2"
    wa, ra = client.open(a, KEY, VAL)
    wb, rb = client.open(b, KEY, VAL)
    wa.compare_and_append(_rows(500), 0, 3)
    df = read_snapshot(spark, ra, 2, num_splits=1)  # one split: no Spark-side groupBy
    assert str(df.schema["u64"].dataType) == "DecimalType(20,0)"
    assert str(df.schema["ts_us"].dataType) == "TimestampNTZType()"
    assert not df.schema["k"].nullable and df.schema["ks"].nullable
    write_batch(df, wb, 0, 3)
    sa, sb = ra.snapshot(2), rb.snapshot(2)
    assert sa.schema.equals(sb.schema)
    assert sa.num_rows == 500 and sa.equals(sb), "persist -> Spark -> persist changed some value"
    # Spark sees the values themselves, not encodings of them.
    row = df.where("k = 5").toArrow().to_pylist()[0]
    assert row["u64"] == Decimal(18_446_744_073_709_551_610)
    assert row["dec256"] == Decimal("1000000000000000.05")
    assert row["st"] == {"a": 5, "l": ["5", None], "c": {"x": 2.5}}
    assert row["fsl"] == [5.0, None]
    client.close()


@pytest.mark.parametrize(
    ("field", "needle"),
    [
        (pa.field("t", pa.time64("us")), "TIME"),
        (pa.field("big", pa.decimal256(50, 2)), "38"),
        (pa.field("nested", pa.struct([("inner", pa.time32("s"))])), "nested.inner"),
    ],
)
def test_unsupported_types_are_refused_up_front(spark: Any, tmp_path: Path, field: pa.Field, needle: str) -> None:
    from persist_lib.spark import read_snapshot, write_batch

    val = pa.schema([field])
    with pytest.raises(UnsupportedSparkType, match=needle) as ei:
        spark_schema(Schemas.create(KEY, val))
    assert repr(field.name) in str(ei.value) or field.name in str(ei.value)
    client = open_client(file_location(tmp_path))
    w, r = client.open("s00000000-0000-4000-8000-0000000000b3", KEY, val)
    with pytest.raises(InvalidUsage, match=field.name):
        read_snapshot(spark, r, 0, timeout_s=0.1)
    df = spark.createDataFrame([(1, "x", 0, 1)], "k long, ks string, ts long, diff long")
    with pytest.raises(InvalidUsage, match=field.name):
        write_batch(df, w, 0, 1)
    assert client.inspect(w.shard_id)["seqno"] == 1  # nothing happened but the registration
    client.close()


def test_values_spark_cant_hold_fail_the_read(spark: Any, tmp_path: Path) -> None:
    from persist_lib.spark import read_snapshot

    key = pa.schema([("k", pa.int64())])
    val = pa.schema([("t", pa.timestamp("ns"))])
    client = open_client(file_location(tmp_path))
    w, r = client.open("s00000000-0000-4000-8000-0000000000b4", key, val)
    w.compare_and_append(pa.table({"k": [1], "t": pa.array([1_001], pa.timestamp("ns")), "ts": [0], "diff": [1]}), 0, 1)
    with pytest.raises(Exception, match="without changing values"):
        read_snapshot(spark, r, 0).collect()  # the default read is lazy on a file blob: the action fails
    client.close()
