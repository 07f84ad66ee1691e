"""Key/value schemas of a shard and the in-memory layout of updates (docs/design.md section 3).

A shard stores updates ``((key, value), time, diff)`` whose key and value are Arrow
records described by two ``pyarrow.Schema`` objects (``Schemas``). Users hand us
updates in the *user layout* (one column per key field, one per value field, then
``ts`` and ``diff``) or as Python tuples; everything inside persist works on the
*internal layout* ("update table"): flat columns ``k.<field>``, ``v.<field>``, then
``t`` and ``d`` (both non-null int64). The ``k.``/``v.`` prefixes keep key and value
columns apart without nesting, which keeps the hot paths (sorting, consolidation,
filtering) on flat, vectorizable columns.
"""

from __future__ import annotations

import base64
import hashlib
import threading
from collections.abc import Iterable, Sequence
from dataclasses import InitVar, dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from persist_lib import utf8
from persist_lib.errors import InvalidUsage

TS = "ts"
DIFF = "diff"
RESERVED_NAMES = frozenset({TS, DIFF})
KEY_PREFIX = "k."
VAL_PREFIX = "v."
T_COL = "t"
D_COL = "d"

SUPPORTED_TYPES_TEXT = (
    "int8/16/32/64, uint8/16/32/64, float16/32/64, decimal128, decimal256, string, "
    "large_string, binary, large_binary, fixed_size_binary, bool, date32, date64, "
    "timestamp (any unit, with or without tz), time32, time64, duration, and struct, "
    "list, large_list and fixed_size_list of supported types"
)


def unsupported_reason(t: pa.DataType) -> str | None:
    """Why ``t`` can't be a key/value field type (``None`` when it is supported).

    The supported set is what survives a Parquet round trip exactly (after casting
    back to the recorded type) *and* what consolidation can compare: dictionary, map,
    union, null, view and extension types are out.
    """
    if isinstance(t, pa.BaseExtensionType):
        return f"extension type {t}"
    if (
        pa.types.is_integer(t)
        or pa.types.is_floating(t)
        or pa.types.is_decimal128(t)
        or pa.types.is_decimal256(t)
        or pa.types.is_string(t)
        or pa.types.is_large_string(t)
        or pa.types.is_binary(t)
        or pa.types.is_large_binary(t)
        or pa.types.is_fixed_size_binary(t)
        or pa.types.is_boolean(t)
        or pa.types.is_date32(t)
        or pa.types.is_date64(t)
        or pa.types.is_timestamp(t)
        or pa.types.is_time32(t)
        or pa.types.is_time64(t)
        or pa.types.is_duration(t)
    ):
        return None
    if pa.types.is_struct(t):
        if t.num_fields == 0:
            return "empty struct (Parquet cannot store it)"
        names = [t.field(i).name for i in range(t.num_fields)]
        if len(set(names)) != len(names):
            return f"struct with duplicate field names {names}"
        for i in range(t.num_fields):
            r = unsupported_reason(t.field(i).type)
            if r is not None:
                return f"{r} inside struct field {t.field(i).name!r}"
        return None
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        r = unsupported_reason(t.value_type)
        return None if r is None else f"{r} inside {t}"
    return f"type {t}"


def _field_text(f: pa.Field) -> str:
    return f"{f.name}: {f.type}" + ("" if f.nullable else " not null")


def _canonical_type(t: pa.DataType) -> str:
    """A string naming ``t`` exactly: nested field names, types and nullability."""
    if pa.types.is_struct(t):
        inner = ", ".join(
            f"{t.field(i).name}: {_canonical_type(t.field(i).type)}"
            + ("" if t.field(i).nullable else " not null")
            for i in range(t.num_fields)
        )
        return f"struct<{inner}>"
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        vf = t.value_field
        kind = (
            "list"
            if pa.types.is_list(t)
            else "large_list"
            if pa.types.is_large_list(t)
            else f"fixed_size_list[{t.list_size}]"
        )
        # The item field's *name* is irrelevant (Parquet renames it), its nullability is not.
        return f"{kind}<{_canonical_type(vf.type)}{'' if vf.nullable else ' not null'}>"
    return str(t)


def _schema_signature(s: pa.Schema) -> tuple[tuple[str, str, bool], ...]:
    return tuple((f.name, _canonical_type(f.type), f.nullable) for f in s)


@dataclass(frozen=True, eq=False)
class Schemas:
    """The key and value schemas of a shard (validated on construction).

    Equality compares field names, types and nullability (not metadata), which is
    what decides whether data written under one can be read under the other.
    """

    key: pa.Schema
    val: pa.Schema
    # The shard's earlier schema versions, oldest first (version ids 0, 1, ...; these
    # schemas are version ``len(history)``): parts written under them are migrated on
    # read (``shard.migrate``). Not part of equality or the fingerprint.
    history: tuple[Schemas, ...] = ()

    def __post_init__(self) -> None:
        _validate_schemas(self.key, self.val)

    @property
    def version(self) -> int:
        """This version's id in the shard's schema registry (0 before any evolution)."""
        return len(self.history)

    def for_fingerprint(self, fp: str) -> Schemas | None:
        """The version (these schemas or an earlier one) whose fingerprint is ``fp``."""
        if fp == self.fingerprint():
            return self
        for h in self.history:
            if h.fingerprint() == fp:
                return h
        return None

    @classmethod
    def create(cls, key_schema: pa.Schema, val_schema: pa.Schema | None = None) -> Schemas:
        """Validates and builds; ``val_schema=None`` means the unit value (no value fields)."""
        return cls(key_schema, pa.schema([]) if val_schema is None else val_schema)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Schemas):
            return NotImplemented
        return _schema_signature(self.key) == _schema_signature(other.key) and _schema_signature(
            self.val
        ) == _schema_signature(other.val)

    def __hash__(self) -> int:
        return hash((_schema_signature(self.key), _schema_signature(self.val)))

    def describe(self) -> str:
        """Short human form for error messages: ``key(id: int64) val(name: string)``."""
        k = ", ".join(_field_text(f) for f in self.key)
        v = ", ".join(_field_text(f) for f in self.val)
        return f"key({k}) val({v})"

    def __str__(self) -> str:
        return self.describe()

    def fingerprint(self) -> str:
        """SHA-256 (hex) of the canonical form of both schemas; stored in every part.

        Computed once per ``Schemas`` (every part encode and decode asks for it)."""
        fp: str | None = self.__dict__.get("_fingerprint")
        if fp is None:
            canon = repr((_schema_signature(self.key), _schema_signature(self.val)))
            fp = hashlib.sha256(canon.encode("utf-8")).hexdigest()
            self.__dict__["_fingerprint"] = fp
        return fp

    def to_json(self) -> dict[str, Any]:
        """Both schemas as base64 Arrow IPC (round-trips metadata and nested types);
        with ``versions`` (the earlier versions, oldest first) once the schemas evolved."""
        out: dict[str, Any] = {
            "key": base64.b64encode(self.key.serialize().to_pybytes()).decode("ascii"),
            "val": base64.b64encode(self.val.serialize().to_pybytes()).decode("ascii"),
        }
        if self.history:
            out["versions"] = [h.to_json() for h in self.history]
        return out

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Schemas:
        """Decodes ``to_json``'s form. Memoized by the encoded strings (shard state keeps
        them; every merge and transition that checks schemas decodes them again), so
        equal inputs give the same immutable object."""
        try:
            k, v = d["key"], d["val"]
            past = d.get("versions") or ()
            memo_key = (k, v, tuple((h["key"], h["val"]) for h in past))
            hit = _FROM_JSON.get(memo_key) if isinstance(k, str) and isinstance(v, str) else None
        except (KeyError, TypeError, AttributeError) as e:
            raise InvalidUsage(f"cannot decode schemas from {str(d)[:200]!r}: {e}") from e
        if hit is not None:
            return hit
        try:
            key = pa.ipc.read_schema(pa.py_buffer(base64.b64decode(k)))
            val = pa.ipc.read_schema(pa.py_buffer(base64.b64decode(v)))
        except (KeyError, TypeError, ValueError, pa.ArrowException) as e:
            raise InvalidUsage(f"cannot decode schemas from {str(d)[:200]!r}: {e}") from e
        history = tuple(cls.from_json({"key": h["key"], "val": h["val"]}) for h in past)
        out = cls(key, val, history)
        if isinstance(k, str) and isinstance(v, str):
            with _FROM_JSON_LOCK:
                if len(_FROM_JSON) >= _FROM_JSON_MAX:
                    _FROM_JSON.pop(next(iter(_FROM_JSON)))  # oldest first
                _FROM_JSON[memo_key] = out
        return out

    @property
    def key_names(self) -> list[str]:
        return list(self.key.names)

    @property
    def val_names(self) -> list[str]:
        return list(self.val.names)


# Schemas.from_json's memo: (key b64, val b64, earlier versions) -> Schemas, oldest evicted first.
_FROM_JSON: dict[tuple[str, str, tuple[tuple[str, str], ...]], Schemas] = {}
_FROM_JSON_MAX = 256
_FROM_JSON_LOCK = threading.Lock()


def _validate_schemas(key: object, val: object) -> None:
    if not isinstance(key, pa.Schema):
        raise InvalidUsage(
            f"key schema must be a pyarrow.Schema, got {type(key).__name__}: {str(key)[:100]!r}"
        )
    if not isinstance(val, pa.Schema):
        raise InvalidUsage(
            f"value schema must be a pyarrow.Schema (pa.schema([]) for the unit value), got "
            f"{type(val).__name__}: {str(val)[:100]!r}"
        )
    if len(key) == 0:
        raise InvalidUsage("key schema must have at least one field, got an empty schema")
    seen: dict[str, str] = {}
    for which, schema in (("key", key), ("value", val)):
        for f in schema:
            if f.name in RESERVED_NAMES:
                raise InvalidUsage(
                    f"{which} field {f.name!r}: the names 'ts' and 'diff' are reserved for the "
                    "time and diff columns; rename the field"
                )
            if f.name in seen:
                where = (
                    f"twice in the {which} schema"
                    if seen[f.name] == which
                    else "in both the key and the value schema"
                )
                raise InvalidUsage(f"field name {f.name!r} appears {where}; names must be unique")
            seen[f.name] = which
            reason = unsupported_reason(f.type)
            if reason is not None:
                raise InvalidUsage(
                    f"{which} field {f.name!r} has unsupported type {f.type} ({reason}); "
                    f"supported: {SUPPORTED_TYPES_TEXT}"
                )


def internal_schema(schemas: Schemas) -> pa.Schema:
    """The update-table layout: ``k.<f>``..., ``v.<f>``..., ``t``, ``d`` (non-null int64).

    Built once per ``Schemas`` (pyarrow schemas are immutable)."""
    out: pa.Schema | None = schemas.__dict__.get("_internal_schema")
    if out is None:
        out = schemas.__dict__["_internal_schema"] = _build_internal_schema(schemas)
    return out


def _build_internal_schema(schemas: Schemas) -> pa.Schema:
    fields = [
        pa.field(KEY_PREFIX + f.name, f.type, f.nullable, f.metadata) for f in schemas.key
    ] + [pa.field(VAL_PREFIX + f.name, f.type, f.nullable, f.metadata) for f in schemas.val]
    fields += [
        pa.field(T_COL, pa.int64(), nullable=False),
        pa.field(D_COL, pa.int64(), nullable=False),
    ]
    return pa.schema(fields)


def user_schema(schemas: Schemas) -> pa.Schema:
    """The user-facing layout: key fields, value fields, ``ts``, ``diff`` (int64)."""
    out: pa.Schema | None = schemas.__dict__.get("_user_schema")
    if out is None:
        out = schemas.__dict__["_user_schema"] = pa.schema(
            list(schemas.key)
            + list(schemas.val)
            + [pa.field(TS, pa.int64()), pa.field(DIFF, pa.int64())]
        )
    return out


def empty_updates(schemas: Schemas) -> pa.Table:
    """An update table (internal layout) with no rows."""
    return internal_schema(schemas).empty_table()


def to_user_table(internal: pa.Table, schemas: Schemas) -> pa.Table:
    """Renames an update table back to the user layout (zero-copy)."""
    return pa.Table.from_arrays(internal.columns, schema=user_schema(schemas))


# ---------------------------------------------------------------------------------------
# Normalization of user input


def _expected_layout(schemas: Schemas) -> str:
    return ", ".join(_field_text(f) for f in user_schema(schemas))


def _is_stringish(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t)


def _is_binaryish(t: pa.DataType) -> bool:
    return pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t)


def _is_numeric(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_decimal(t)


def _castable(src: pa.DataType, dst: pa.DataType) -> bool:
    """Whether a *safe* Arrow cast from ``src`` to ``dst`` is one we accept at all.

    We only allow casts within a kind (numbers, text, bytes, the same temporal type,
    structurally equal nested types): Arrow would happily parse strings into ints or
    format ints as strings, which almost always hides a bug in the caller.
    """
    if src.equals(dst) or pa.types.is_null(src):
        return True
    if _is_numeric(src) and _is_numeric(dst):
        return True
    if _is_stringish(src):
        return _is_stringish(dst) or pa.types.is_binary(dst) or pa.types.is_large_binary(dst)
    if _is_binaryish(src):
        return _is_binaryish(dst)
    if pa.types.is_timestamp(src) and pa.types.is_timestamp(dst):
        return (src.tz is None) == (dst.tz is None)
    for pred in (pa.types.is_date, pa.types.is_time, pa.types.is_duration):
        if pred(src) and pred(dst):
            return True
    if pa.types.is_struct(src) and pa.types.is_struct(dst):
        if [src.field(i).name for i in range(src.num_fields)] != [
            dst.field(i).name for i in range(dst.num_fields)
        ]:
            return False
        return all(_castable(src.field(i).type, dst.field(i).type) for i in range(src.num_fields))
    listish = (pa.types.is_list, pa.types.is_large_list, pa.types.is_fixed_size_list)
    if any(p(src) for p in listish) and any(p(dst) for p in listish):
        return _castable(src.value_type, dst.value_type)
    return False


def _first_true(mask: pa.ChunkedArray | pa.Array) -> int:
    """Index of the first true (non-null) element of a boolean array."""
    hits = np.flatnonzero(mask.to_numpy(zero_copy_only=False))
    return int(hits[0]) if len(hits) else -1


def _null_violation(arr: pa.Array, t: pa.DataType, path: str) -> str | None:
    """Finds a null where a non-nullable nested field forbids it (``arr`` non-chunked)."""
    if pa.types.is_struct(t):
        parent_valid = arr.is_valid()
        for i in range(t.num_fields):
            f = t.field(i)
            child = arr.field(i)
            if not f.nullable and child.null_count:
                bad = pc.and_(parent_valid, child.is_null())
                idx = _first_true(bad)
                if idx >= 0:
                    return f"{path}.{f.name} is null in row {idx} but the field is not nullable"
            r = _null_violation(child, f.type, f"{path}.{f.name}")
            if r is not None:
                return r
    elif pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        vf = t.value_field
        values = arr.flatten()  # only the values of valid lists
        if not vf.nullable and values.null_count:
            return f"{path} contains a null list element but its elements are not nullable"
        return _null_violation(values, vf.type, f"{path}[]")
    return None


def _has_non_nullable_nested(t: pa.DataType) -> bool:
    if pa.types.is_struct(t):
        return any(
            (not t.field(i).nullable) or _has_non_nullable_nested(t.field(i).type)
            for i in range(t.num_fields)
        )
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return (not t.value_field.nullable) or _has_non_nullable_nested(t.value_type)
    return False


def _conform_column(
    col: pa.ChunkedArray, f: pa.Field, shard: str, *, what: str = "column"
) -> pa.ChunkedArray:
    """Casts ``col`` to ``f.type`` if needed (safely) and enforces ``f``'s nullability."""
    if not col.type.equals(f.type):
        if not _castable(col.type, f.type):
            raise InvalidUsage(
                f"shard {shard}: {what} {f.name!r} has type {col.type} but the schema says "
                f"{f.type}, and {col.type} is not safely castable to {f.type}; cast the column "
                "or fix the schema"
            )
        try:
            col = pc.cast(col, f.type, safe=True)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as e:
            raise InvalidUsage(
                f"shard {shard}: {what} {f.name!r} of type {col.type} cannot be cast safely to "
                f"the schema type {f.type}: {e}"
            ) from e
    if not f.nullable and col.null_count:
        idx = _first_true(col.is_null())
        raise InvalidUsage(
            f"shard {shard}: {what} {f.name!r} is not nullable but has {col.null_count} null(s) "
            f"(first in row {idx})"
        )
    if _has_non_nullable_nested(f.type):
        offset = 0
        for chunk in col.chunks:
            r = _null_violation(chunk, f.type, f.name)
            if r is not None:
                raise InvalidUsage(f"shard {shard}: {what} {r} (rows counted from {offset})")
            offset += len(chunk)
    return col


def _time_or_diff_column(col: pa.ChunkedArray, name: str, shard: str) -> pa.ChunkedArray:
    if not pa.types.is_integer(col.type) and not (pa.types.is_null(col.type) and len(col) == 0):
        raise InvalidUsage(
            f"shard {shard}: column {name!r} must be an integer column (int64), got {col.type}"
        )
    if col.null_count:
        idx = _first_true(col.is_null())
        raise InvalidUsage(
            f"shard {shard}: column {name!r} has {col.null_count} null(s) (first in row {idx}); "
            f"every update needs a {'time' if name in (TS, T_COL) else 'diff'}"
        )
    if not col.type.equals(pa.int64()):
        try:
            col = pc.cast(col, pa.int64(), safe=True)
        except pa.ArrowInvalid as e:
            raise InvalidUsage(
                f"shard {shard}: column {name!r} of type {col.type} does not fit int64: {e}"
            ) from e
    return col


def _check_times(t: pa.ChunkedArray, shard: str, *, row_word: str = "row") -> None:
    if len(t) == 0:
        return
    mn = pc.min(t).as_py()
    if mn is not None and mn < 0:
        idx = _first_true(pc.less(t, 0))
        raise InvalidUsage(
            f"shard {shard}: update time must be >= 0 but {row_word} {idx} has time "
            f"{pc.take(t, [idx])[0].as_py()}"
        )


def _normalize_table(table: pa.Table, schemas: Schemas, shard: str) -> pa.Table:
    names = table.column_names
    if len(set(names)) != len(names):
        dups = sorted({n for n in names if names.count(n) > 1})
        raise InvalidUsage(f"shard {shard}: duplicate column names {dups} in the updates table")
    expected = schemas.key_names + schemas.val_names + [TS, DIFF]
    missing = [n for n in expected if n not in names]
    extra = [n for n in names if n not in expected]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing column(s) {missing}")
        if extra:
            parts.append(f"unexpected column(s) {extra}")
        raise InvalidUsage(
            f"shard {shard}: updates table has {' and '.join(parts)}; expected the columns "
            f"({_expected_layout(schemas)}) for schemas {schemas.describe()}"
        )
    target = internal_schema(schemas)
    cols: list[pa.ChunkedArray] = []
    for f in list(schemas.key) + list(schemas.val):
        cols.append(_conform_column(table.column(f.name), f, shard))
    t = _time_or_diff_column(table.column(TS), TS, shard)
    _check_times(t, shard)
    cols.append(t)
    cols.append(_time_or_diff_column(table.column(DIFF), DIFF, shard))
    return pa.Table.from_arrays(cols, schema=target)


def _normalize_tuples(updates: Iterable[Any], schemas: Schemas, shard: str) -> pa.Table:
    """Converts ``[((key_tuple, val_tuple), t, d), ...]``; the only per-row Python path."""
    nk, nv = len(schemas.key), len(schemas.val)
    keys: list[Sequence[Any]] = []
    vals: list[Sequence[Any]] = []
    ts: list[Any] = []
    ds: list[Any] = []
    for i, u in enumerate(updates):
        try:
            (k, v), t, d = u
        except (TypeError, ValueError):
            raise InvalidUsage(
                f"shard {shard}: update element {i} must be ((key_tuple, val_tuple), time, diff), "
                f"got {u!r:.200}"
            ) from None
        if not isinstance(k, tuple | list) or len(k) != nk:
            raise InvalidUsage(
                f"shard {shard}: update element {i}: key must be a tuple of {nk} value(s) "
                f"({', '.join(schemas.key_names)}), got {k!r:.200}"
            )
        if not isinstance(v, tuple | list) or len(v) != nv:
            raise InvalidUsage(
                f"shard {shard}: update element {i}: value must be a tuple of {nv} value(s) "
                f"({', '.join(schemas.val_names) or 'unit value: ()'}), got {v!r:.200}"
            )
        keys.append(k)
        vals.append(v)
        ts.append(t)
        ds.append(d)
    n = len(ts)
    target = internal_schema(schemas)
    cols: list[pa.Array] = []
    kcols = list(zip(*keys, strict=True)) if n else [() for _ in range(nk)]
    vcols = list(zip(*vals, strict=True)) if n and nv else [() for _ in range(nv)]
    for f, values in zip(list(schemas.key) + list(schemas.val), kcols + vcols, strict=True):
        cols.append(_array_from_py(list(values), f.type, f"field {f.name!r}", shard))
    for name, values in ((TS, ts), (DIFF, ds)):
        for i, x in enumerate(values):
            if isinstance(x, bool) or not isinstance(x, int | np.integer):
                raise InvalidUsage(
                    f"shard {shard}: update element {i}: {'time' if name == TS else 'diff'} "
                    f"must be an int, got {x!r} ({type(x).__name__})"
                )
        cols.append(_array_from_py(values, pa.int64(), name, shard))
    table = pa.Table.from_arrays(cols, names=target.names)
    out_cols = [
        _conform_column(table.column(i), f, shard, what="field")
        for i, f in enumerate(list(schemas.key) + list(schemas.val))
    ]
    _check_times(table.column(T_COL), shard, row_word="update element")
    out_cols += [table.column(T_COL), table.column(D_COL)]
    return pa.Table.from_arrays(out_cols, schema=target)


def _array_from_py(values: list[Any], t: pa.DataType, what: str, shard: str) -> pa.Array:
    try:
        return pa.array(values, type=t)
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError, TypeError, ValueError) as e:
        # Slow path, only on error: find the offending element for the message.
        for i, x in enumerate(values):
            try:
                pa.array([x], type=t)
            except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError, TypeError, ValueError):
                raise InvalidUsage(
                    f"shard {shard}: update element {i}: {what} value {x!r:.200} is not a valid "
                    f"{t}: {e}"
                ) from e
        raise InvalidUsage(f"shard {shard}: {what}: cannot convert values to {t}: {e}") from e


_MINT = object()  # only this module makes CheckedUpdates


@dataclass(frozen=True, eq=False)
class CheckedUpdates:
    """An update table (internal layout) that passed every check of this module for
    ``schemas``: types conformed, nullability enforced, times >= 0, strings valid UTF-8.

    Why it exists: a write passes its updates through several layers (a write handle, a
    batch builder, a collection writer routing rows to shards, a Spark executor), and
    each layer must refuse bad input. The checks run once, where the updates enter
    (``normalize_checked``, ``check_updates``); every layer after that takes a
    ``CheckedUpdates`` of the same schemas as it is. A row subset of a checked table is
    checked too (``filter``, ``take``, ``slice``). Only this module makes one: the
    constructor refuses any other caller, so a table can't skip the checks by being
    wrapped by hand.
    """

    table: pa.Table
    schemas: Schemas
    mint: InitVar[object] = None

    def __post_init__(self, mint: object) -> None:
        if mint is not _MINT:
            raise InvalidUsage(
                "CheckedUpdates are made only by codec.normalize_checked / codec.check_updates "
                "(or WriteHandle.normalize), which run the checks; pass the updates to one of them"
            )

    @property
    def num_rows(self) -> int:
        return int(self.table.num_rows)

    @property
    def nbytes(self) -> int:
        return int(self.table.nbytes)

    def __getitem__(self, name: str) -> pa.ChunkedArray:
        return self.table[name]

    def filter(self, mask: Any) -> CheckedUpdates:
        """The rows where ``mask`` is true (still checked: a subset of checked rows)."""
        return _checked(self.table.filter(mask), self.schemas)

    def take(self, indices: Any) -> CheckedUpdates:
        """The rows at ``indices`` (still checked)."""
        return _checked(self.table.take(indices), self.schemas)

    def slice(self, offset: int = 0, length: int | None = None) -> CheckedUpdates:
        """Rows ``offset`` to ``offset + length`` (still checked)."""
        return _checked(self.table.slice(offset, length), self.schemas)


def _checked(table: pa.Table, schemas: Schemas) -> CheckedUpdates:
    return CheckedUpdates(table, schemas, _MINT)


def _same_schemas(updates: CheckedUpdates, schemas: Schemas) -> bool:
    return updates.schemas is schemas or updates.schemas == schemas


def normalize_checked(updates: Any, schemas: Schemas, *, shard: str) -> CheckedUpdates:
    """Validates user updates once and returns them as ``CheckedUpdates`` (internal layout).

    Accepts a ``pyarrow.Table``/``RecordBatch`` (or pandas DataFrame) in the user layout
    (key fields, value fields, ``ts``, ``diff``; any column order), or an iterable of
    ``((key_tuple, val_tuple), t, d)``. Column types are cast safely to the schema;
    anything else is an ``InvalidUsage`` that names the problem. ``CheckedUpdates`` of
    the same schemas are returned as they are (checked already); of other schemas, their
    table is checked against these as an internal-layout table (``check_updates``).
    """
    if isinstance(updates, CheckedUpdates):
        return check_updates(updates, schemas, shard=shard)
    if isinstance(updates, pa.RecordBatch):
        updates = pa.Table.from_batches([updates])
    elif type(updates).__module__.startswith("pandas") and hasattr(updates, "columns"):
        try:
            updates = pa.Table.from_pandas(updates, preserve_index=False)
        except (pa.ArrowException, TypeError, ValueError) as e:
            raise InvalidUsage(f"shard {shard}: cannot convert the DataFrame to Arrow: {e}") from e
    if isinstance(updates, pa.Table):
        return _checked_strings(_normalize_table(updates, schemas, shard), schemas, shard)
    if isinstance(updates, str | bytes | dict) or not isinstance(updates, Iterable):
        raise InvalidUsage(
            f"shard {shard}: updates must be a pyarrow Table/RecordBatch or a list of "
            f"((key_tuple, val_tuple), time, diff), got {type(updates).__name__}"
        )
    return _checked_strings(_normalize_tuples(updates, schemas, shard), schemas, shard)


def normalize_updates(updates: Any, schemas: Schemas, *, shard: str) -> pa.Table:
    """``normalize_checked(updates)`` as a plain update table (internal layout), for
    callers that only read it (comparisons, schema checks)."""
    return normalize_checked(updates, schemas, shard=shard).table


def _checked_strings(table: pa.Table, schemas: Schemas, shard: str) -> CheckedUpdates:
    """``table`` (internal layout) once every string in it is valid UTF-8; else
    ``InvalidUtf8`` names the field and row. No invalid string may reach a part: readers
    would fail on it for good (``persist_lib.utf8``)."""
    names = [f.name for f in schemas.key] + [f.name for f in schemas.val]
    utf8.check_table(table, names, shard=shard)
    return _checked(table, schemas)


def check_updates(table: Any, schemas: Schemas, *, shard: str) -> CheckedUpdates:
    """What a batch builder takes: ``CheckedUpdates`` of ``schemas`` as they are (checked
    already), an update table (internal layout) once checked, with its types or
    nullability flags conformed when they differ (e.g. built by hand, or on a Spark
    executor), and anything else normalized (``normalize_checked``)."""
    if isinstance(table, CheckedUpdates):
        if _same_schemas(table, schemas):
            return table
        table = table.table
    target = internal_schema(schemas)
    if isinstance(table, pa.RecordBatch):
        table = pa.Table.from_batches([table])
    if isinstance(table, pa.Table):
        if table.schema.equals(target):
            return _checked_strings(table, schemas, shard)
        if table.column_names == target.names:
            fields = list(schemas.key) + list(schemas.val)
            cols = [
                _conform_column(table.column(i), f, shard, what="field")
                for i, f in enumerate(fields)
            ]
            t = _time_or_diff_column(table.column(T_COL), T_COL, shard)
            _check_times(t, shard)
            cols += [t, _time_or_diff_column(table.column(D_COL), D_COL, shard)]
            return _checked_strings(pa.Table.from_arrays(cols, schema=target), schemas, shard)
    return normalize_checked(table, schemas, shard=shard)


def check_update_table(table: Any, schemas: Schemas, *, shard: str) -> pa.Table:
    """``check_updates(table)`` as a plain update table (internal layout)."""
    return check_updates(table, schemas, shard=shard).table
