"""Postgres column types -> Arrow types for CDC: which mappings are exact, and the
conversion of Postgres's text form into them.

Every value the CDC source handles is the text its type's *output function* produces
(what ``pgoutput`` sends, and what the snapshot reads: never a ``::text`` cast, which
differs for ``character(n)``, ``boolean`` and ``inet``). The output of several types
depends on session settings, so every CDC connection pins them (``SESSION_OPTIONS``):
the text of a value is the same on every instance, through every path.

A column is ingested exactly or refused up front (``UnsupportedColumnType``, when the
ingestion starts). The table (also in docs/ingestion.md):

=====================  ===================================================================
Postgres               Arrow field type(s) that represent it exactly
=====================  ===================================================================
any type               ``string`` / ``large_string``: the text form (pinned settings)
bool                   ``bool``
int2 / int4 / int8     ``int16``+ / ``int32``+ / ``int64``
numeric(p, s)          ``decimal128/256(P, s)`` with P >= p; ``float64`` if p <= 15
                       (NaN: ``float64`` NaN; in a decimal an error record)
float4 / float8        ``float32`` / ``float64`` (NaN, +-Infinity and -0 kept)
bytea                  ``binary`` / ``large_binary``
date                   ``date32``
time                   ``time64("us")``
timestamp              ``timestamp("us")`` (no zone)
timestamptz            ``timestamp("us", tz=...)`` (any zone: the instant is kept)
a domain               as its base type
text / varchar         any scalar type: the text is *parsed* (a value that doesn't parse
                       is an error record, like a CSV field)
=====================  ===================================================================

Everything else (char(n) except as text, unconstrained numeric, timetz, interval, uuid,
json/jsonb, arrays, enums, inet/cidr, ...) is ingested as its text form only. A value
the Arrow type can't hold (a date or timestamp +-infinity, BC or past year 9999, a
decimal NaN, time 24:00:00) becomes an error record naming the field: never a changed
value.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from persist_lib.ingest.decode import (
    DELETE_COL,
    TRUNCATE_COL,
    UNCHANGED_COL,
    DecodeSpec,
    cast_rowwise,
)
from persist_lib.ingest.errors import IngestConfigError

#: Session settings of every CDC connection (the snapshot's, the peeks'): the output
#: functions of timestamptz, date, interval, float, bytea and money depend on them.
SESSION_SETTINGS = {
    "TimeZone": "UTC",
    "DateStyle": "ISO, YMD",
    "IntervalStyle": "postgres",
    "extra_float_digits": "1",
    "bytea_output": "hex",
    "lc_monetary": "C",
}
SESSION_OPTIONS = " ".join(f"-c {k}={v.replace(' ', '')}" for k, v in SESSION_SETTINGS.items())


class UnsupportedColumnType(IngestConfigError):
    """A column's Postgres type can't be represented exactly by the Arrow type asked for."""


@dataclass(frozen=True)
class PgType:
    """A column's type, domains resolved to their base type."""

    name: str  # pg_type.typname of the base type (e.g. "numeric", "_int4", "bpchar")
    typmod: int
    declared: str  # format_type() of the column's declared type, for messages
    kind: str  # pg_type.typtype of the base type: b base, e enum, r range, c composite...

    def numeric_precision_scale(self) -> tuple[int, int] | None:
        if self.name != "numeric" or self.typmod < 4:
            return None
        m = self.typmod - 4
        return (m >> 16) & 0xFFFF, m & 0xFFFF


def column_types(conn: Any, reloid: int) -> dict[str, PgType]:
    """The (domain-resolved) type of every column of relation ``reloid``."""
    rows = conn.execute(
        "SELECT a.attname, a.atttypid, a.atttypmod, format_type(a.atttypid, a.atttypmod) "
        "FROM pg_attribute a WHERE a.attrelid = %s AND a.attnum > 0 AND NOT a.attisdropped",
        (reloid,),
    ).fetchall()
    out: dict[str, PgType] = {}
    for name, oid, typmod, declared in rows:
        for _ in range(32):  # a domain over a domain ...: follow to the base type
            t = conn.execute(
                "SELECT typname, typtype, typbasetype, typtypmod FROM pg_type WHERE oid = %s", (oid,)
            ).fetchone()
            if t[1] != "d":
                break
            oid, typmod = t[2], (t[3] if t[3] >= 0 else typmod)
        out[name] = PgType(t[0], int(typmod), str(declared), t[1])
    return out


_TEXT_TYPES = {"text", "varchar"}
_INTS = {"int2": 16, "int4": 32, "int8": 64}


def _exact(pg: PgType, t: pa.DataType) -> bool:
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return True  # the text form
    if pg.name in _TEXT_TYPES:  # parsed into a scalar (errors per value)
        return not pa.types.is_nested(t) and not pa.types.is_duration(t) and not pa.types.is_interval(t)
    n = pg.name
    if n == "bool":
        return pa.types.is_boolean(t)
    if n in _INTS:
        return pa.types.is_signed_integer(t) and t.bit_width >= _INTS[n]
    if n == "numeric":
        ps = pg.numeric_precision_scale()
        if ps is None:
            return False
        p, s = ps
        if pa.types.is_decimal(t):
            return bool(t.scale == s and t.precision - t.scale >= p - s)
        return pa.types.is_float64(t) and p <= 15
    if n == "float4":
        return pa.types.is_float32(t)
    if n == "float8":
        return pa.types.is_float64(t)
    if n == "bytea":
        return pa.types.is_binary(t) or pa.types.is_large_binary(t)
    if n == "date":
        return pa.types.is_date32(t)
    if n == "time":
        return pa.types.is_time64(t) and t.unit == "us"
    if n == "timestamp":
        return pa.types.is_timestamp(t) and t.unit == "us" and t.tz is None
    if n == "timestamptz":
        return pa.types.is_timestamp(t) and t.unit == "us" and t.tz is not None
    return False


def _suggest(pg: PgType) -> str:
    n = pg.name
    ps = pg.numeric_precision_scale()
    exact = {
        "bool": "pa.bool_()",
        "int2": "pa.int16()",
        "int4": "pa.int32()",
        "int8": "pa.int64()",
        "float4": "pa.float32()",
        "float8": "pa.float64()",
        "bytea": "pa.binary()",
        "date": "pa.date32()",
        "time": "pa.time64('us')",
        "timestamp": "pa.timestamp('us')",
        "timestamptz": "pa.timestamp('us', tz='UTC')",
    }.get(n)
    if n == "numeric":
        if ps is None:
            return (
                "pa.string() (an unconstrained numeric has no fixed scale; or declare the column "
                "numeric(p, s) and use pa.decimal128(p, s))"
            )
        exact = f"pa.decimal128({max(ps[0], 1)}, {ps[1]})"
    if exact is None:
        return "pa.string() (its Postgres text form)"
    return f"{exact} or pa.string()"


def check_column_types(table: str, types: dict[str, PgType], fields: list[pa.Field]) -> None:
    """Raises ``UnsupportedColumnType`` for the first field whose Arrow type does not
    represent its column's Postgres type exactly (see the module docstring)."""
    for f in fields:
        pg = types.get(f.name)
        if pg is None or _exact(pg, f.type):
            continue
        raise UnsupportedColumnType(
            f"column {f.name!r} of {table} is {pg.declared}, which can't be ingested exactly as "
            f"{f.type}: use {_suggest(pg)} for it (see the Postgres type table in docs/ingestion.md)"
        )


# ---------------------------------------------------------------------------------------
# Text form -> Arrow, value by value (so a record decodes the same in any chunk)

_TIME = re.compile(r"(\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,6}))?")
_INFINITE = {"infinity", "-infinity", "NaN", "Infinity", "-Infinity"}


def _bool(v: str) -> bool:
    low = v.strip().lower()
    if low in ("t", "true", "1", "yes", "y", "on"):
        return True
    if low in ("f", "false", "0", "no", "n", "off"):
        return False
    raise ValueError(f"{v!r} is not a boolean")


def _bytea(v: str) -> bytes:
    if not v.startswith("\\x"):
        raise ValueError(f"{v[:40]!r} is not hex-format bytea")
    return bytes.fromhex(v[2:])


def _time_us(v: str) -> int:
    m = _TIME.fullmatch(v)
    if m is None:
        raise ValueError(f"{v!r} is not a time of day")
    h, mi, s = int(m[1]), int(m[2]), int(m[3])
    us = int((m[4] or "").ljust(6, "0") or 0)
    total = ((h * 60 + mi) * 60 + s) * 1_000_000 + us
    if total >= 86_400_000_000:
        raise ValueError(f"{v!r} is past the last time of day an Arrow time64 holds (24:00:00 is not)")
    return total


def _rowwise(vals: list[str | None], conv: Any, t: pa.DataType) -> tuple[pa.Array, dict[int, str]]:
    out: list[Any] = []
    bad: dict[int, str] = {}
    for i, v in enumerate(vals):
        if v is None:
            out.append(None)
            continue
        try:
            out.append(conv(v))
        except ValueError as e:
            bad[i] = str(e)
            out.append(None)
    return pa.array(out, t), bad


def text_to_arrow(vals: list[str | None], t: pa.DataType) -> tuple[pa.Array, dict[int, str]]:
    """Postgres text values -> an Arrow array of ``t``; failing values are null and
    reported by index."""
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return pa.array(vals, t), {}
    if pa.types.is_boolean(t):
        return _rowwise(vals, _bool, t)
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return _rowwise(vals, _bytea, t)
    if pa.types.is_time64(t):
        arr, bad = _rowwise(vals, _time_us, pa.int64())
        return arr.cast(pa.time64("us")).cast(t), bad
    arr, bad = cast_rowwise(pa.array(vals, pa.string()), t)
    for i in bad:
        v = vals[i]
        if v in _INFINITE or (isinstance(v, str) and v.endswith(" BC")):
            bad[i] = f"{v!r} has no {t} value (ingest the column as pa.string() to keep it)"
    return arr, bad


def text_columns_to_arrow(
    fields: list[pa.Field], recs: list[dict[str, Any]]
) -> tuple[pa.Table, list[tuple[int, str, str]]]:
    """Records of text values -> rows of ``fields`` (only the good records, in order)
    and ``(index, kind, reason)`` of the others."""
    n = len(recs)
    arrays: list[pa.Array] = []
    bad: dict[int, tuple[str, str]] = {}
    for f in fields:
        arr, errs = text_to_arrow([r.get(f.name) for r in recs], f.type)
        for i, msg in errs.items():
            bad.setdefault(i, ("type_mismatch", f"field {f.name!r}: cannot convert to {f.type}: {msg}"))
        arrays.append(arr)
    table = pa.Table.from_arrays(arrays, schema=pa.schema(fields))
    if bad:
        mask = np.ones(n, dtype=bool)
        mask[list(bad)] = False
        table = table.filter(pa.array(mask))
    return table, [(i, k, r) for i, (k, r) in sorted(bad.items())]


def decode_change_records(
    spec: DecodeSpec,
    recs: list[dict[str, Any]],
    deletes: list[bool],
    truncs: list[bool],
    unchanged: list[list[str] | None],
) -> tuple[pa.Table, list[tuple[int, str, str]]]:
    """Text-format row changes -> typed rows (with delete/unchanged/truncate columns).

    Returns the rows of the good records (in order) and ``(index, kind, reason)`` for
    the others. Row-wise, so the rebuild from the raw collection decodes identically.
    """
    import pyarrow.compute as pc

    n = len(recs)
    keys = spec.key_names
    table, bad = text_columns_to_arrow(list(spec.input_schema()), recs)
    bad_idx = {i for i, _, _ in bad}
    keep = [i for i in range(n) if i not in bad_idx]
    out_bad = list(bad)
    rows_cols: dict[str, pa.Array] = {}
    for f in list(spec.key_schema) + list(spec.val_schema):
        rows_cols[f.name] = table.column(f.name).combine_chunks().cast(f.type)
    rows = pa.table(rows_cols) if rows_cols else pa.table({})
    rows = rows.append_column(DELETE_COL, pa.array([deletes[i] for i in keep], pa.bool_()))
    rows = rows.append_column(UNCHANGED_COL, pa.array([unchanged[i] for i in keep], pa.list_(pa.string())))
    rows = rows.append_column(TRUNCATE_COL, pa.array([truncs[i] for i in keep], pa.bool_()))
    key_null: Any = None
    for k in keys:
        m = rows.column(k).is_null()
        key_null = m if key_null is None else pc.or_(key_null, m)
    if key_null is not None:
        bad_key = pc.and_(key_null, pc.invert(rows.column(TRUNCATE_COL)))
        mask = bad_key.to_pylist()
        if any(mask):
            for j, b in enumerate(mask):
                if b:
                    out_bad.append((keep[j], "missing_key", f"key column(s) {keys} null"))
            rows = rows.filter(pc.invert(bad_key))
    out_bad.sort()
    return rows, out_bad
