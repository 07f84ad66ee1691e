"""Arrow <-> Spark types for shard schemas, decided once on the driver.

A shard's key and value fields are Arrow-typed; Spark has a smaller type system. Each
supported Arrow type maps to one Spark type that holds every value *exactly*, and
the way back is a safe Arrow cast (``codec.normalize_updates`` on writes, ``to_spark_arrow``
on reads), so a value that doesn't fit (a ``uint32`` column given ``-1``, a
nanosecond timestamp read into Spark's microseconds) raises instead of being changed:

============================  ===========================  ===============================
Arrow                         Spark                        note
============================  ===========================  ===============================
int8/16/32/64                 Byte/Short/Integer/Long
uint8/16/32                   Short/Integer/Long           widened
uint64                        Decimal(20, 0)
float16/32, float64           Float, Double
decimal128/256 (p <= 38)      Decimal(p, s)
string, large_string          String
binary, large_binary,         Binary
fixed_size_binary
bool                          Boolean
date32, date64                Date                         date64 must be midnight-aligned
timestamp[unit, tz]           Timestamp (an instant)       ns: sub-us values fail on reads
timestamp[unit] (no tz)       TimestampNTZ
duration[unit]                DayTimeInterval              ns: sub-us values fail on reads
struct, list, large_list,     Struct, Array
fixed_size_list
============================  ===========================  ===============================

Anything else (``time32``/``time64`` — Spark 4.0 has no TIME type —, ``decimal256``
with precision > 38, and types shards don't support at all) is an ``InvalidUsage``
naming the field and the type, raised before any Spark job starts.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from persist_lib.errors import InvalidUsage
from persist_lib.shard.codec import DIFF, TS, Schemas

SPARK_MAX_DECIMAL_PRECISION = 38


class UnsupportedSparkType(InvalidUsage):
    """A shard field whose Arrow type has no exact Spark counterpart."""


def spark_type(t: pa.DataType, path: str = "?", kind: str = "") -> Any:
    """The Spark ``DataType`` that holds every value of Arrow type ``t`` exactly.

    Raises ``UnsupportedSparkType`` naming the field otherwise: ``path`` is its dotted
    name (``[]`` for list elements), ``kind`` says ``key`` or ``value``.
    """
    from pyspark.sql import types as T

    def bad(why: str) -> UnsupportedSparkType:
        return UnsupportedSparkType(
            f"{kind + ' ' if kind else ''}field {path!r} has Arrow type {t}, which Spark can't hold exactly: {why}. Supported in "
            "Spark reads/writes: integers (uint64 as decimal(20,0)), floats, decimals up to "
            "precision 38, strings, binaries, booleans, dates, timestamps (with or without "
            "time zone), durations, and structs/lists of those"
        )

    if pa.types.is_int8(t):
        return T.ByteType()
    if pa.types.is_int16(t) or pa.types.is_uint8(t):
        return T.ShortType()
    if pa.types.is_int32(t) or pa.types.is_uint16(t):
        return T.IntegerType()
    if pa.types.is_int64(t) or pa.types.is_uint32(t):
        return T.LongType()
    if pa.types.is_uint64(t):
        return T.DecimalType(20, 0)
    if pa.types.is_float16(t) or pa.types.is_float32(t):
        return T.FloatType()
    if pa.types.is_float64(t):
        return T.DoubleType()
    if pa.types.is_decimal(t):
        if t.precision > SPARK_MAX_DECIMAL_PRECISION:
            raise bad(f"Spark decimals have at most {SPARK_MAX_DECIMAL_PRECISION} digits")
        return T.DecimalType(t.precision, t.scale)
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return T.StringType()
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t):
        return T.BinaryType()
    if pa.types.is_boolean(t):
        return T.BooleanType()
    if pa.types.is_date(t):
        return T.DateType()
    if pa.types.is_timestamp(t):
        return T.TimestampType() if t.tz is not None else T.TimestampNTZType()
    if pa.types.is_duration(t):
        return T.DayTimeIntervalType()
    if pa.types.is_time(t):
        raise bad("Spark 4.0 has no TIME type; store it as an integer or a duration")
    if pa.types.is_struct(t):
        return T.StructType(
            [
                T.StructField(
                    t.field(i).name,
                    spark_type(t.field(i).type, f"{path}.{t.field(i).name}", kind),
                    t.field(i).nullable,
                )
                for i in range(t.num_fields)
            ]
        )
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return T.ArrayType(spark_type(t.value_type, f"{path}[]", kind), t.value_field.nullable)
    raise bad("no Spark counterpart")


def spark_schema(schemas: Schemas) -> Any:
    """The Spark ``StructType`` of the user layout: key fields, value fields, ``ts``, ``diff``.

    Raises ``UnsupportedSparkType`` for the first field Spark can't hold exactly, and
    ``InvalidUsage`` when two field names differ only in case (Spark resolves column
    names case-insensitively by default).
    """
    from pyspark.sql import types as T

    fields = []
    seen: dict[str, str] = {}
    for which, schema in (("key", schemas.key), ("value", schemas.val)):
        for f in schema:
            low = f.name.lower()
            if low in seen:
                raise InvalidUsage(
                    f"{which} field {f.name!r} and field {seen[low]!r} differ only in case; "
                    "Spark resolves column names case-insensitively: rename one"
                )
            seen[low] = f.name
            fields.append(
                T.StructField(f.name, spark_type(f.type, f.name, which), f.nullable)
            )
    fields.append(T.StructField(TS, T.LongType(), False))
    fields.append(T.StructField(DIFF, T.LongType(), False))
    return T.StructType(fields)


def spark_arrow_schema(sschema: Any) -> pa.Schema:
    """The Arrow schema Spark exchanges with Python for ``sschema`` (``mapInArrow``)."""
    from pyspark.sql.pandas.types import to_arrow_schema

    return to_arrow_schema(sschema, timestamp_utc=True, prefers_large_types=False)


def to_spark_arrow(table: pa.Table, target: pa.Schema) -> pa.Table:
    """Casts a user-layout table (shard types) to Spark's Arrow types, safely.

    A value Spark can't hold (a nanosecond timestamp with sub-microsecond digits)
    raises ``InvalidUsage`` rather than being truncated.
    """
    cols = []
    for name, f in zip(table.column_names, target, strict=True):
        col = table.column(name)
        if not col.type.equals(f.type):
            try:
                col = col.cast(f.type, safe=True)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as e:
                raise InvalidUsage(
                    f"column {name!r} of type {col.type} can't be given to Spark as {f.type} "
                    f"without changing values: {e}"
                ) from e
        cols.append(col)
    return pa.Table.from_arrays(cols, schema=target)


def check_dataframe_schema(df_schema: Any, schemas: Schemas, what: str) -> list[str]:
    """Checks on the driver that a DataFrame's columns can be written to a shard.

    Returns the column order to select (key fields, value fields, ``ts``, ``diff``).
    The check runs ``normalize_updates`` on an empty Arrow table with the DataFrame's
    Arrow types, so exactly the executors' casting rules apply and a mismatch is an
    ``InvalidUsage`` before any part is written.
    """
    from persist_lib.shard.codec import normalize_updates

    names = schemas.key_names + schemas.val_names + [TS, DIFF]
    present = {f.name for f in df_schema.fields}
    missing = [n for n in names if n not in present]
    extra = sorted(present.difference(names))
    if missing or extra:
        raise InvalidUsage(
            f"{what}: the DataFrame has columns {sorted(present)}; expected exactly {names} "
            f"(missing {missing}, unexpected {extra}) for schemas {schemas.describe()}"
        )
    from pyspark.sql import types as T

    ordered = T.StructType([df_schema[n] for n in names])
    empty = spark_arrow_schema(ordered).empty_table()
    normalize_updates(empty, schemas, shard=what)
    return names
