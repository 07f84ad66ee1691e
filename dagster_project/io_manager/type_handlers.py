"""Type handlers: what an asset returns (or an input asks for) <-> a ``pyarrow.Table``.

``pyarrow.Table``, ``pandas.DataFrame``, ``polars.DataFrame`` / ``polars.LazyFrame`` and
PySpark ``DataFrame``. Everything goes through Arrow: persist's write and read paths take
and give Arrow tables. pandas and polars are imported only when such a value is met.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from dagster_project.io_manager.errors import IOManagerConfigError


def _type_name(t: Any) -> str:
    mod = getattr(t, "__module__", "") or ""
    return f"{mod}.{getattr(t, '__name__', repr(t))}"


def _is_pandas(t: Any) -> bool:
    return _type_name(t).startswith("pandas.") and getattr(t, "__name__", "") == "DataFrame"


def _is_polars(t: Any, name: str) -> bool:
    return _type_name(t).startswith("polars.") and getattr(t, "__name__", "") == name


def _is_spark(t: Any) -> bool:
    return _type_name(t).startswith("pyspark.sql") and getattr(t, "__name__", "") == "DataFrame"


def is_spark_type(t: Any) -> bool:
    """Whether an input annotated ``t`` is loaded through the distributed Spark read."""
    return _is_spark(t)


def is_lazy_type(t: Any) -> bool:
    """Whether an input annotated ``t`` is loaded as a streaming polars LazyFrame."""
    return _is_polars(t, "LazyFrame")


def _normalize_arrow(table: pa.Table) -> pa.Table:
    """View types (polars exports strings as ``string_view``) cast to what persist stores."""
    fields = []
    changed = False
    for f in table.schema:
        t = f.type
        if pa.types.is_string_view(t):
            t, changed = pa.large_string(), True
        elif pa.types.is_binary_view(t):
            t, changed = pa.large_binary(), True
        fields.append(pa.field(f.name, t, f.nullable, f.metadata))
    return table.cast(pa.schema(fields, table.schema.metadata)) if changed else table


def to_arrow(obj: Any, where: str) -> tuple[pa.Table, str]:
    """The output as an Arrow table, and the handler's name (for metadata)."""
    if isinstance(obj, pa.Table):
        return obj, "pyarrow"
    if isinstance(obj, pa.RecordBatch):
        return pa.Table.from_batches([obj]), "pyarrow"
    cls = type(obj)
    if _is_pandas(cls):
        return pa.Table.from_pandas(obj, preserve_index=False), "pandas"
    if _is_polars(cls, "DataFrame"):
        return _normalize_arrow(obj.to_arrow()), "polars"
    if _is_polars(cls, "LazyFrame"):
        return _normalize_arrow(obj.collect().to_arrow()), "polars-lazy"
    if _is_spark(cls) or _type_name(cls).startswith("pyspark.sql.connect"):
        return _normalize_arrow(obj.toArrow()), "pyspark"
    raise IOManagerConfigError(
        f"{where}: can't store a {_type_name(cls)}; return a pyarrow.Table, pandas.DataFrame, "
        "polars.DataFrame/LazyFrame or a PySpark DataFrame"
    )


def from_arrow(table: pa.Table, typ: Any, where: str) -> Any:
    """The input as the type the downstream asset annotated (``pyarrow.Table`` when it did
    not). A LazyFrame (``lazy_read``) and a Spark DataFrame (``spark_read``) are read
    their own ways, not from a table."""
    if typ is None or typ is Any or typ is pa.Table or typ is object:
        return table
    if _is_pandas(typ):
        return table.to_pandas()
    if _is_polars(typ, "DataFrame"):
        import polars as pl

        return pl.from_arrow(table)
    raise IOManagerConfigError(
        f"{where}: can't load an input of type {_type_name(typ)}; annotate it as pyarrow.Table, "
        "pandas.DataFrame, polars.DataFrame/LazyFrame or a PySpark DataFrame"
    )
