"""Statistics of a part recorded at write time: min, max and null count per column.

A part's statistics live in shard state (``PartMeta.stats``), so a read can skip a part
whose rows cannot match its filter without fetching a byte of it (as Iceberg and Delta
keep per-file column statistics in their manifests, and Materialize persist keeps part
stats). They are *optional*: parts written before statistics existed have none (and an
old reader ignores the field), and a column whose bounds can't be kept exactly
(nested types, decimals, floats holding NaN, strings or bytes longer than
``MAX_STAT_BYTES``) simply has no entry: no entry means "anything may be in there".

Per row group, Parquet's own footer statistics are the record: an indexed part
(``part_index``) has them for ``t`` and the key and value fields of exact types, read
from its verified footer by ranged reads, not copied into state, which would grow with
every row group of every part.

The values are kept in their JSON form: integers, floats, booleans and strings as
themselves; dates, times and timestamps as their integer physical value (days, or units
since the epoch); binary as hex. ``ColumnStats.bounds`` turns them back into Python
values comparable with a predicate's constants (``predicate``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from persist_lib.shard.codec import D_COL, KEY_PREFIX, T_COL, VAL_PREFIX, Schemas

# A string or binary bound longer than this is not recorded (bounds are exact or absent).
MAX_STAT_BYTES = 64
# At most this many key/value columns get statistics (the first ones: keys first), so a
# very wide shard's state doesn't grow by its width for every part.
MAX_STAT_COLUMNS = 32


def stats_type_ok(t: pa.DataType) -> bool:
    """Whether columns of type ``t`` get statistics."""
    return (
        pa.types.is_integer(t)
        # float16: Arrow has no min/max kernel for it
        or (pa.types.is_floating(t) and not pa.types.is_float16(t))
        or pa.types.is_boolean(t)
        or pa.types.is_string(t)
        or pa.types.is_large_string(t)
        or pa.types.is_binary(t)
        or pa.types.is_large_binary(t)
        or pa.types.is_date(t)
        or pa.types.is_timestamp(t)
        or pa.types.is_time(t)
    )


def _is_temporal(t: pa.DataType) -> bool:
    return pa.types.is_date(t) or pa.types.is_timestamp(t) or pa.types.is_time(t) or pa.types.is_duration(t)


def physical_int(value: Any, t: pa.DataType) -> int:
    """The integer physical value of a temporal ``value`` of type ``t`` (days for date32,
    milliseconds for date64, units of ``t`` otherwise)."""
    s = value if isinstance(value, pa.Scalar) else pa.scalar(value, type=t)
    if not s.type.equals(t):
        s = s.cast(t)
    width = pa.int32() if t.bit_width == 32 else pa.int64()
    return int(s.cast(width).as_py())


def to_json_value(value: Any, t: pa.DataType) -> Any:
    """A bound (an Arrow scalar's Python value) as recorded in state."""
    if _is_temporal(t):
        return physical_int(value, t)
    if isinstance(value, bytes):
        return value.hex()
    return value


def from_json_value(value: Any, t: pa.DataType) -> Any:
    """A recorded bound back as a value comparable with ``comparable`` constants."""
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return bytes.fromhex(value)
    if pa.types.is_floating(t):
        return float(value)
    if pa.types.is_boolean(t):
        return bool(value)
    return value


def comparable(value: Any, t: pa.DataType) -> Any:
    """A predicate constant in the domain bounds are compared in (temporal values as
    their physical integer)."""
    if value is None:
        return None
    if _is_temporal(t):
        return physical_int(value, t)
    if isinstance(value, pa.Scalar):
        return value.as_py()
    return value


@dataclass(frozen=True)
class ColumnStats:
    """The bounds of one column of a part: ``lo``/``hi`` are None when every value is null."""

    lo: Any
    hi: Any
    nulls: int

    def to_json(self) -> list[Any]:
        return [self.lo, self.hi, self.nulls]

    @classmethod
    def from_json(cls, d: list[Any], t: pa.DataType) -> ColumnStats:
        lo, hi, nulls = d
        return cls(
            None if lo is None else from_json_value(lo, t),
            None if hi is None else from_json_value(hi, t),
            int(nulls),
        )


def stat_columns(schemas: Schemas) -> list[tuple[str, pa.DataType]]:
    """The internal columns that get statistics, with their types: the time column, then
    the first ``MAX_STAT_COLUMNS`` key and value fields of a supported type."""
    cols: list[tuple[str, pa.DataType]] = [(T_COL, pa.int64())]
    fields = [(KEY_PREFIX + f.name, f.type) for f in schemas.key] + [
        (VAL_PREFIX + f.name, f.type) for f in schemas.val
    ]
    cols += [(n, t) for n, t in fields[:MAX_STAT_COLUMNS] if stats_type_ok(t)]
    return cols


def column_stats(col: pa.ChunkedArray | pa.Array, t: pa.DataType) -> ColumnStats | None:
    """The exact bounds of one column, or None when they can't be recorded exactly."""
    nulls = col.null_count
    if nulls == len(col):
        return ColumnStats(None, None, nulls)
    if pa.types.is_floating(t) and pc.any(pc.is_nan(col)).as_py():
        return None  # NaN compares false to everything: bounds would lie about it
    try:
        mm = pc.min_max(col)
    except pa.ArrowNotImplementedError:
        return None  # no min/max kernel for this type (e.g. duration in pyarrow 2x)
    try:
        lo, hi = mm["min"].as_py(), mm["max"].as_py()
    except UnicodeDecodeError:
        # Only a part that bypassed the write-boundary UTF-8 check (old code) gets here;
        # readers refuse its bytes anyway (``InvalidUtf8InPart``): no bounds for it.
        return None
    return _recorded(lo, hi, nulls, t)


def _recorded(lo: Any, hi: Any, nulls: int, t: pa.DataType) -> ColumnStats | None:
    """Exact bounds ``lo``/``hi`` (Python values, not None) as recorded in state, or None
    when state keeps none for them (long strings, non-finite floats)."""
    if isinstance(lo, str | bytes) and max(len(lo), len(hi)) > MAX_STAT_BYTES:
        return None
    if isinstance(lo, float) and not (math.isfinite(lo) and math.isfinite(hi)):
        return None  # state is JSON: no infinities
    return ColumnStats(to_json_value(lo, t), to_json_value(hi, t), nulls)


# How a part's statistics are held in ``PartMeta.stats`` (hashable, JSON-ready):
# ``(column, lo, hi, nulls)`` per column with statistics.
StatsRecord = tuple[tuple[str, Any, Any, int], ...]


def part_stats(table: pa.Table, schemas: Schemas) -> StatsRecord:
    """The statistics of a part (its update table, internal layout) for state."""
    out: list[tuple[str, Any, Any, int]] = []
    for name, t in stat_columns(schemas):
        s = column_stats(table.column(name), t)
        if s is not None:
            out.append((name, s.lo, s.hi, s.nulls))
    return tuple(out)


def footer_exact(t: pa.DataType) -> bool:
    """Whether Parquet's statistics of a column of type ``t`` are its exact Arrow
    ``min_max`` bounds: integers (unsigned included), booleans, strings and binaries
    (Parquet orders byte arrays by unsigned bytes, as Arrow does). Not floats (NaN,
    signed zeros) nor temporal types (Parquet may store another unit)."""
    return pa.types.is_integer(t) or pa.types.is_boolean(t) or (
        pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t) or pa.types.is_large_binary(t)
    )


def _footer_bounds(md: pq.FileMetaData, names: set[str]) -> dict[str, tuple[Any, Any, int]]:
    """``(lo, hi, nulls)`` over every row group of the columns ``names`` whose every row
    group has Parquet statistics that bound all its non-null values (``lo``/``hi`` None
    when all are null). A group without a min/max yet with values (a value past the
    writer's statistics size limit) leaves its column out."""
    acc: dict[str, tuple[Any, Any, int]] = {}
    bad: set[str] = set()
    for g in range(md.num_row_groups):
        rg = md.row_group(g)
        for j in range(rg.num_columns):
            c = rg.column(j)
            name = c.path_in_schema
            if name not in names or name in bad:
                continue
            st = c.statistics if c.is_stats_set else None
            if st is None or not st.has_null_count:
                bad.add(name)
                continue
            lo, hi, nulls = acc.get(name, (None, None, 0))
            nulls += st.null_count
            if st.has_min_max:
                lo = st.min if lo is None else min(lo, st.min)
                hi = st.max if hi is None else max(hi, st.max)
            elif st.null_count != rg.num_rows:
                bad.add(name)
                continue
            acc[name] = (lo, hi, nulls)
        for name in names - bad - acc.keys():
            bad.add(name)  # no chunk of it in this group: not a part of ours
    return {n: v for n, v in acc.items() if n not in bad}


def footer_part_stats(table: pa.Table, schemas: Schemas, md: pq.FileMetaData) -> StatsRecord:
    """``part_stats(table, schemas)`` of a part encoded as ``md`` says (its Parquet
    footer), the same record: the bounds of columns with exact Parquet statistics
    (``footer_exact``) in every row group (an indexed part: ``part_index``) come from
    the footer, which the writer filled while it encoded; the others (floats, temporal
    types, columns without statistics) are computed from ``table`` as ``part_stats``
    does. Measured on a 500k-row part of (int64, string): 4.4 ms of CPU -> 0.35 ms."""
    cols = stat_columns(schemas)
    if md.num_rows != table.num_rows:  # (not this table's encoding)
        return part_stats(table, schemas)
    bounds = _footer_bounds(md, {n for n, t in cols if footer_exact(t)})
    out: list[tuple[str, Any, Any, int]] = []
    for name, t in cols:
        b = bounds.get(name)
        if b is None:
            s = column_stats(table.column(name), t)
        elif b[2] == table.num_rows:
            s = ColumnStats(None, None, b[2])
        else:
            s = _recorded(b[0], b[1], b[2], t)
        if s is not None:
            out.append((name, s.lo, s.hi, s.nulls))
    return tuple(out)


def parse_stats(record: StatsRecord | None, schemas: Schemas) -> dict[str, ColumnStats] | None:
    """A part's recorded statistics as ``ColumnStats`` by internal column (None: the part
    has none, it was written before statistics); entries of columns ``schemas`` doesn't
    give statistics to are dropped."""
    if record is None:
        return None
    types = dict(stat_columns(schemas))
    return {
        n: ColumnStats.from_json([lo, hi, nulls], types[n])
        for n, lo, hi, nulls in record
        if n in types and n != D_COL
    }
