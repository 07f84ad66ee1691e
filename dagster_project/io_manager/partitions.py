"""Partitions: which rows of a collection a partition (or a range of them) owns.

A partitioned asset names its partition column (``persist/partition_column``; a
``{dimension: column}`` dict for multi-partitions). The rows of partition ``p`` are the
rows whose column holds ``p``:

* time-window partitions on a date or timestamp column: the rows in the window
  ``[start, end)`` (of the one partition or the whole range);
* otherwise (static, dynamic, time windows on a string column, each dimension of a
  multi-partition): the rows whose column equals the key, cast to the column's type.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from dagster_project.io_manager.errors import IOManagerConfigError, PartitionMismatch


@dataclass(frozen=True)
class PartitionSelection:
    """The rows of some partitions: a disjunction of conjunctions ``column == value``, or a
    time window on one column."""

    columns: dict[str, str]  # dimension -> column
    keys: list[dict[str, str]]  # one {dimension: key} per partition
    window: tuple[dt.datetime, dt.datetime] | None = None  # one-dimensional time windows

    def describe(self) -> str:
        if self.window is not None and len(self.keys) > 1:
            return f"{self.keys[0]['']}..{self.keys[-1]['']}"
        return ", ".join("|".join(k.values()) for k in self.keys)

    def mask(self, table: pa.Table, where: str) -> pa.ChunkedArray:
        for col in self.columns.values():
            if col not in table.column_names:
                raise IOManagerConfigError(
                    f"{where}: partition column {col!r} is not a column of the table ({table.column_names})"
                )
        if self.window is not None:
            col = table.column(self.columns[""])
            if pa.types.is_timestamp(col.type) or pa.types.is_date(col.type):
                lo, hi = (_temporal_scalar(x, col.type) for x in self.window)
                return pc.and_(pc.greater_equal(col, lo), pc.less(col, hi))
        if len(self.columns) == 1:  # one dimension: a set membership
            ((d, c),) = self.columns.items()
            col = table.column(c)
            values = _cast_keys([k[d] for k in self.keys], col.type, where)
            return pc.fill_null(pc.is_in(col, value_set=values), False)
        out = None  # several dimensions: OR over partitions of AND over dimensions
        for k in self.keys:
            clause = None
            for d, c in self.columns.items():
                col = table.column(c)
                eq = pc.equal(col, _cast_keys([k[d]], col.type, where)[0])
                clause = eq if clause is None else pc.and_(clause, eq)
            out = clause if out is None else pc.or_(out, clause)
        return pc.fill_null(out, False)

    def pushdown(self, types: dict[str, pa.DataType], where: str) -> list[tuple[str, str, Any]]:
        """A read filter (``snapshot_batches(filter=)``) every row of these partitions
        satisfies, so parts whose statistics rule it out are never fetched: the window's
        bounds, or per column ``IN`` the keys (for several dimensions a superset: each
        dimension's keys; ``mask`` then keeps exactly the partitions' rows)."""
        for col in self.columns.values():
            if col not in types:
                raise IOManagerConfigError(
                    f"{where}: partition column {col!r} is not a column of the collection ({sorted(types)})"
                )
        if self.window is not None:
            col = self.columns[""]
            typ = types[col]
            if pa.types.is_timestamp(typ) or pa.types.is_date(typ):
                lo, hi = (_temporal_scalar(x, typ) for x in self.window)
                return [(col, ">=", lo), (col, "<", hi)]
        out: list[tuple[str, str, Any]] = []
        for d, c in self.columns.items():
            keys = sorted({k[d] for k in self.keys})
            out.append((c, "in", _cast_keys(keys, types[c], where).to_pylist()))
        return out

    def check_owns(self, table: pa.Table, where: str) -> None:
        """Refuses an output with rows outside the partitions being materialized."""
        inside = self.mask(table, where)
        bad = table.num_rows - pc.sum(inside.cast(pa.int64())).as_py() if table.num_rows else 0
        if bad:
            first = pc.index(inside, False).as_py()
            row = {c: table.column(c)[first].as_py() for c in self.columns.values()}
            raise PartitionMismatch(
                f"{where}: {bad} output row(s) lie outside partition {self.describe()} (first: {row}); "
                "an asset materializing a partition must return only that partition's rows"
            )


def _cast_keys(values: Sequence[str], typ: pa.DataType, where: str) -> pa.Array:
    try:
        return pc.cast(pa.array(list(values), pa.string()), typ)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
        raise IOManagerConfigError(
            f"{where}: partition keys {list(values)[:3]} can't be cast to the partition column's type {typ}: {e}"
        ) from None


def _temporal_scalar(t: dt.datetime, typ: pa.DataType) -> pa.Scalar:
    if pa.types.is_date(typ):
        return pa.scalar(t.date(), typ)
    if t.tzinfo is not None:
        t = t.astimezone(dt.UTC).replace(tzinfo=None)
    tz = typ.tz if isinstance(typ, pa.TimestampType) else None
    return pa.scalar(t, pa.timestamp("us")).cast(pa.timestamp("us", tz)).cast(typ)
