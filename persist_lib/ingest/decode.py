"""Schema-checked decoding: typed rows for the envelope, error records for the rest.

Bad records never crash the pipeline and are never dropped silently: each becomes an
``ErrorRecord`` (partition, address, kind, reason, raw bytes) that the driver appends
to the errors collection at the record's time.

Decoding must be **row-wise**: a record decodes the same way whatever chunk it is read
in, because a replaying instance reads a binding's range in its own chunks and must
produce identical output. The fast paths decode whole blocks with Arrow (pyarrow.json,
vectorized casts); when a block fails, it is bisected until the failing records are
isolated, so every good record is still decoded by the same code and every bad one gets
the error it would get on its own.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pj

from persist_lib.errors import InvalidUsage
from persist_lib.ingest.addresses import Address, encode_address
from persist_lib.ingest.errors import IngestConfigError
from persist_lib.shard.codec import Schemas
from persist_lib.utf8 import describe_value, invalid_rows

T = TypeVar("T")

DELETE_COL = "_delete"
UNCHANGED_COL = "_unchanged"  # CDC: value fields an update left unchanged (TOAST)
TRUNCATE_COL = "_truncate"  # CDC: the table was truncated here

# Schemas of the auxiliary collections every ingestion writes.
ERRORS_KEY = pa.schema([("partition", pa.string()), ("address", pa.string())])
ERRORS_VAL = pa.schema([("kind", pa.string()), ("reason", pa.string()), ("raw", pa.binary())])
RAW_KEY = pa.schema([("partition", pa.string()), ("address", pa.string())])
RAW_VAL = pa.schema([("format", pa.string()), ("raw", pa.binary())])


@dataclass(frozen=True)
class DecodeSpec:
    """What a record must look like: key fields, value fields, optional delete marker.

    ``delete_field`` (upsert envelope over files) names a boolean field: a record
    with it true deletes its key. ``keep_raw`` also produces the undecoded records for
    the raw collection.
    """

    key_schema: pa.Schema
    val_schema: pa.Schema
    delete_field: str | None = None
    keep_raw: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.key_schema, pa.Schema) or len(self.key_schema) == 0:
            raise IngestConfigError(
                "the ingestion schema has no key column: pass key_schema with at least one "
                "field (e.g. pa.schema([('id', pa.int64())]), or --key id:int64 on the CLI); "
                "the key identifies records for the upsert envelope and routes them to shards"
            )
        if not isinstance(self.val_schema, pa.Schema):
            raise IngestConfigError(
                f"val_schema must be a pyarrow.Schema (pa.schema([]) for none), got "
                f"{type(self.val_schema).__name__}"
            )
        try:
            Schemas.create(self.key_schema, self.val_schema)
        except InvalidUsage as e:
            raise IngestConfigError(f"invalid ingestion schema: {e}") from e
        names = set(self.key_schema.names) | set(self.val_schema.names)
        for reserved in (DELETE_COL, UNCHANGED_COL, TRUNCATE_COL):
            if reserved in names:
                raise IngestConfigError(
                    f"field name {reserved!r} is reserved by the ingestion pipeline; rename it"
                )
        if self.delete_field is not None and self.delete_field in names:
            raise IngestConfigError(
                f"delete_field {self.delete_field!r} is also a key/value field; the delete "
                "marker must be a separate boolean field of the input records"
            )

    @property
    def schemas(self) -> Schemas:
        return Schemas.create(self.key_schema, self.val_schema)

    @property
    def key_names(self) -> list[str]:
        return list(self.key_schema.names)

    @property
    def val_names(self) -> list[str]:
        return list(self.val_schema.names)

    def input_fields(self) -> list[pa.Field]:
        """Fields read from input records (all nullable: absence is checked afterwards)."""
        fs = [pa.field(f.name, f.type, True) for f in self.key_schema]
        fs += [pa.field(f.name, f.type, True) for f in self.val_schema]
        if self.delete_field is not None:
            fs.append(pa.field(self.delete_field, pa.bool_(), True))
        return fs

    def input_schema(self) -> pa.Schema:
        return pa.schema(self.input_fields())

    def rows_schema(self) -> pa.Schema:
        """Layout of ``Decoded.rows``: key fields, value fields, ``_delete``."""
        return pa.schema(
            list(self.key_schema) + list(self.val_schema) + [pa.field(DELETE_COL, pa.bool_(), False)]
        )

    def fingerprint(self) -> str:
        return json.dumps(
            {
                "schemas": self.schemas.fingerprint(),
                "delete_field": self.delete_field,
            },
            sort_keys=True,
        )


@dataclass
class ErrorRecord:
    partition: str
    address: Address
    kind: str
    reason: str
    raw: bytes | None = None


@dataclass
class Decoded:
    """The decoded content of a chunk: rows in address order plus error records."""

    rows: pa.Table
    errors: list[ErrorRecord] = field(default_factory=list)
    raw: pa.Table | None = None  # RAW_KEY + RAW_VAL columns (user layout, no ts/diff)

    @property
    def num_rows(self) -> int:
        return int(self.rows.num_rows)


def empty_rows(spec: DecodeSpec) -> pa.Table:
    return spec.rows_schema().empty_table()


def errors_table(errs: Sequence[ErrorRecord], t: int) -> pa.Table:
    """Error records as updates (user layout) at time ``t``."""
    return pa.table(
        {
            "partition": pa.array([e.partition for e in errs], pa.string()),
            "address": pa.array([encode_address(e.address) for e in errs], pa.string()),
            "kind": pa.array([e.kind for e in errs], pa.string()),
            "reason": pa.array([e.reason for e in errs], pa.string()),
            "raw": pa.array([e.raw for e in errs], pa.binary()),
            "ts": pa.array([t] * len(errs), pa.int64()),
            "diff": pa.array([1] * len(errs), pa.int64()),
        }
    )


def raw_table(partition: str, addresses: Sequence[Address], fmt: str, raws: Sequence[bytes]) -> pa.Table:
    n = len(addresses)
    return pa.table(
        {
            "partition": pa.array([partition] * n, pa.string()),
            "address": pa.array([encode_address(a) for a in addresses], pa.string()),
            "format": pa.array([fmt] * n, pa.string()),
            "raw": pa.array(list(raws), pa.binary()),
        }
    )


# ---------------------------------------------------------------------------------------
# Row-wise block decoding with bisection


def bisect_blocks(
    items: Sequence[T],
    decode_block: Callable[[Sequence[T]], pa.Table],
    expected_rows: Callable[[Sequence[T]], int] = len,
) -> tuple[list[tuple[int, pa.Table]], list[tuple[int, Exception | None]]]:
    """Decodes ``items`` in as few blocks as possible, isolating the failing items.

    Returns ``(good, bad)``: ``good`` is a list of ``(start index, table)`` in order,
    each table having one row per item of its run; ``bad`` lists ``(index, error)``
    of items that failed alone (``error`` is None when the item decoded to a row count
    other than one).
    """
    good: list[tuple[int, pa.Table]] = []
    bad: list[tuple[int, Exception | None]] = []
    stack: list[tuple[int, int]] = [(0, len(items))]
    while stack:
        lo, hi = stack.pop()
        if lo >= hi:
            continue
        block = items[lo:hi]
        err: Exception | None = None
        try:
            table = decode_block(block)
            if table.num_rows == expected_rows(block):
                good.append((lo, table))
                continue
        except (pa.ArrowException, ValueError, TypeError, OverflowError, UnicodeDecodeError) as e:
            err = e
        if hi - lo == 1:
            bad.append((lo, err))
            continue
        mid = (lo + hi) // 2
        stack.append((mid, hi))  # popped second: keeps the result in order
        stack.append((lo, mid))
    good.sort(key=lambda g: g[0])
    bad.sort(key=lambda b: b[0])
    return good, bad


def cast_rowwise(arr: pa.Array, target: pa.DataType) -> tuple[pa.Array, dict[int, str]]:
    """Safe cast of ``arr`` to ``target``; failing elements become null and are reported.

    Element-wise by construction (bisection), so a value casts the same way whatever
    block it is in.
    """
    bad: dict[int, str] = {}

    def go(a: pa.Array, off: int) -> pa.Array:
        try:
            return pc.cast(a, target, safe=True)
        except (pa.ArrowException, ValueError, OverflowError) as e:
            if len(a) == 1:
                bad[off] = str(e).split("\n")[0]
                return pa.nulls(1, target)
            mid = len(a) // 2
            return pa.concat_arrays([go(a.slice(0, mid), off), go(a.slice(mid), off + mid)])

    if len(arr) == 0:
        return pa.array([], target), bad
    return go(arr, 0), bad


def same_kind(src: pa.DataType, dst: pa.DataType) -> bool:
    """Whether a (safe) cast from ``src`` to ``dst`` is a conversion we accept at all.

    Numbers to numbers, text to text, temporal to the same temporal kind; Arrow would
    also parse text into numbers, which for typed inputs (Parquet) hides a schema bug.
    """
    if src.equals(dst) or pa.types.is_null(src):
        return True
    num = (pa.types.is_integer, pa.types.is_floating, pa.types.is_decimal)
    if any(p(src) for p in num) and any(p(dst) for p in num):
        return True
    for group in (
        (pa.types.is_string, pa.types.is_large_string),
        (pa.types.is_binary, pa.types.is_large_binary, pa.types.is_fixed_size_binary),
        (pa.types.is_timestamp,),
        (pa.types.is_date,),
        (pa.types.is_time,),
        (pa.types.is_duration,),
        (pa.types.is_boolean,),
        (pa.types.is_struct,),
        (pa.types.is_list, pa.types.is_large_list, pa.types.is_fixed_size_list),
    ):
        if any(p(src) for p in group) and any(p(dst) for p in group):
            return True
    if pa.types.is_date(src) and pa.types.is_timestamp(dst):
        return True
    return False


def check_rows(
    spec: DecodeSpec, table: pa.Table
) -> tuple[pa.Table, list[tuple[int, str, str]]]:
    """Checks decoded input rows (``spec.input_schema()`` layout) row by row.

    Returns ``(rows, bad)``: ``rows`` in the ``spec.rows_schema()`` layout for the good
    rows only, and ``bad`` as ``(row index, kind, reason)`` for rows holding a string
    that is not valid UTF-8 (``invalid_utf8``: pyarrow's JSON and Parquet readers don't
    check), missing a key field or a required (non-nullable) value field (deletes need
    only the key).
    """
    n = table.num_rows
    if spec.delete_field is not None and spec.delete_field in table.column_names:
        dcol = table.column(spec.delete_field)
        is_delete = pc.fill_null(dcol, False).to_numpy(zero_copy_only=False).astype(bool)
    else:
        is_delete = np.zeros(n, dtype=bool)
    bad_mask = np.zeros(n, dtype=bool)
    reasons: dict[int, tuple[str, str]] = {}
    for f in list(spec.key_schema) + list(spec.val_schema):
        col = table.column(f.name)
        for j in invalid_rows(col):  # (no invalid string may reach a part)
            if not bad_mask[j]:
                reasons[j] = ("invalid_utf8", f"field {f.name!r} is not valid UTF-8 ({describe_value(col, j)})")
                bad_mask[j] = True
    for f in spec.key_schema:
        nulls = table.column(f.name).is_null().to_numpy(zero_copy_only=False).astype(bool)
        for i in np.flatnonzero(nulls & ~bad_mask):
            reasons[int(i)] = (
                "missing_key",
                f"key field {f.name!r} is missing or null; every record needs its key fields "
                f"({', '.join(spec.key_names)})",
            )
        bad_mask |= nulls
    for f in spec.val_schema:
        if f.nullable:
            continue
        nulls = table.column(f.name).is_null().to_numpy(zero_copy_only=False).astype(bool)
        nulls &= ~is_delete
        for i in np.flatnonzero(nulls & ~bad_mask):
            reasons[int(i)] = (
                "missing_field",
                f"required field {f.name!r} ({f.type}, not nullable) is missing or null",
            )
        bad_mask |= nulls
    keep = ~bad_mask
    cols: list[pa.ChunkedArray | pa.Array] = []
    out_fields = spec.rows_schema()
    sel = pa.array(keep)
    filtered = table.filter(sel) if bad_mask.any() else table
    for f in list(spec.key_schema) + list(spec.val_schema):
        cols.append(filtered.column(f.name).cast(f.type))
    cols.append(pa.array(is_delete[keep], pa.bool_()))
    rows = pa.Table.from_arrays(cols, schema=out_fields)
    bad = [(i, k, r) for i, (k, r) in sorted(reasons.items())]
    return rows, bad


# ---------------------------------------------------------------------------------------
# JSON lines


_JSON_KIND = {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "an array", dict: "an object"}


def _json_fits(v: object, t: pa.DataType) -> bool:
    if pa.types.is_boolean(t):
        return isinstance(v, bool)
    if pa.types.is_integer(t):
        return isinstance(v, int) and not isinstance(v, bool)
    if pa.types.is_floating(t) or pa.types.is_decimal(t):
        return isinstance(v, int | float) and not isinstance(v, bool)
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return isinstance(v, str)
    if pa.types.is_struct(t):
        return isinstance(v, dict)
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return isinstance(v, list)
    return True  # temporal and binary types: leave the verdict to Arrow


def _json_failure(spec: DecodeSpec, line: bytes, err: Exception | None) -> tuple[str, str]:
    try:
        obj = json.loads(line)
    except UnicodeDecodeError as e:
        return "invalid_utf8", f"the line is not valid UTF-8: {e}"
    except json.JSONDecodeError as e:
        return "invalid_json", f"invalid JSON: {e}"
    except RecursionError:
        return "invalid_json", "invalid JSON: nested too deeply"
    try:
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:  # a "\ud800" escape: a lone surrogate is no text
        return "invalid_utf8", f"the line escapes a lone UTF-16 surrogate, which is not text: {e}"
    except RecursionError:
        return "invalid_json", "invalid JSON: nested too deeply"
    if not isinstance(obj, dict):
        return "not_an_object", f"expected a JSON object, got {_JSON_KIND.get(type(obj), type(obj).__name__)}"
    for f in spec.input_fields():
        v = obj.get(f.name)
        if v is not None and not _json_fits(v, f.type):
            return "type_mismatch", (
                f"field {f.name!r}: expected {f.type}, got {_JSON_KIND.get(type(v), type(v).__name__)} "
                f"({json.dumps(v)[:80]})"
            )
    msg = str(err).split("\n")[0] if err is not None else "the record decoded to no row"
    msg = msg.replace("JSON parse error: ", "")
    return "type_mismatch", f"the record does not match the schema: {msg}"


def decode_json_lines(
    spec: DecodeSpec, lines: Sequence[bytes], schema: pa.Schema | None = None, joined: bytes | None = None
) -> tuple[pa.Table, list[tuple[int, str, str]]]:
    """Decodes JSON-lines records (no blank lines) into ``spec.input_schema()`` rows
    (or ``schema``: a subset of its fields, e.g. the ones a Kafka message value holds).
    ``joined``: ``b"\\n".join(lines)`` if the caller has it already (not joined again).

    Returns ``(table, bad)`` where ``table`` has one row per *good* line (in order) and
    ``bad`` lists ``(line index, kind, reason)``.
    """
    schema = spec.input_schema() if schema is None else schema
    opts = pj.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore")
    # One block per call, parsed on the calling thread: with a single block the thread
    # pool parallelizes nothing, and its hand-off cost ~20% more CPU (1M Kafka values in
    # 10k-line calls: 0.56 s vs 0.46 s of CPU, and more wall time).
    ropts = pj.ReadOptions(block_size=1 << 24, use_threads=False)

    def block(ls: Sequence[bytes]) -> pa.Table:
        buf = joined if joined is not None and len(ls) == len(lines) else b"\n".join(ls)
        ropts.block_size = max(1 << 20, min(len(buf) + 1, 1 << 30))
        # (a native reader: a Python file object takes the GIL back for every read)
        t = pj.read_json(pa.BufferReader(buf), read_options=ropts, parse_options=opts)
        return t.select(schema.names).cast(schema)

    not_objects = _not_objects(lines, joined)
    if not_objects:  # never handed to pyarrow (see _not_objects)
        skip = set(not_objects)
        keep = [i for i in range(len(lines)) if i not in skip]
        lines_in: Sequence[bytes] = [lines[i] for i in keep]
        joined = None
    else:
        keep, lines_in = [], lines
    good, bad = bisect_blocks(lines_in, block)
    if not_objects:
        bad = sorted([(keep[i], e) for i, e in bad] + [(i, None) for i in not_objects], key=lambda b: b[0])
    bad_out = [(i, *_json_failure(spec, lines[i], e)) for i, e in bad]
    tables = [t for _, t in good]
    table = pa.concat_tables(tables).combine_chunks() if tables else schema.empty_table()
    return table, bad_out


def _not_objects(lines: Sequence[bytes], joined: bytes | None) -> list[int]:
    """Indices of the lines that don't start with ``{`` (after whitespace): they can't
    be records, and pyarrow's JSON reader must never see one at the start of a block: a
    block starting with ``null`` crashes the process (pyarrow 26, a null pointer in
    ``HandlerBase::Null``, apache/arrow#47409), so one such Kafka message or file line
    would kill the ingestion at every restart. Vectorized over the joined lines."""
    if not lines:
        return []
    buf = joined if joined is not None else b"\n".join(lines)
    arr = np.frombuffer(buf, dtype=np.uint8)
    starts = np.concatenate(([0], np.flatnonzero(arr == 10) + 1))
    if len(starts) != len(lines):  # a line holds a line break: line by line
        return [i for i, ln in enumerate(lines) if ln.lstrip()[:1] != b"{"]
    first = np.full(len(starts), -1, dtype=np.int64)
    inside = starts < len(arr)
    first[inside] = arr[starts[inside]]
    return [int(i) for i in np.flatnonzero(first != 0x7B) if lines[int(i)].lstrip()[:1] != b"{"]


# ---------------------------------------------------------------------------------------
# Text columns (CSV, Postgres text format)


def _strings_to(arr: pa.Array, f: pa.Field) -> tuple[pa.Array, dict[int, str]]:
    t = f.type
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return arr.cast(t), {}
    if pa.types.is_boolean(t):
        low = pc.utf8_lower(pc.utf8_trim_whitespace(arr))
        tv = pc.is_in(low, pa.array(["true", "t", "1", "yes", "y"]))
        fv = pc.is_in(low, pa.array(["false", "f", "0", "no", "n"]))
        out = pc.if_else(tv, True, pc.if_else(fv, False, pa.scalar(None, pa.bool_())))
        valid_in = pc.is_valid(arr).to_numpy(zero_copy_only=False)
        ok = pc.or_(tv, fv).to_numpy(zero_copy_only=False)
        bad = {int(i): f"{arr[int(i)].as_py()!r} is not a boolean" for i in np.flatnonzero(valid_in & ~ok)}
        return out, bad
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return arr.cast(t), {}
    return cast_rowwise(arr, t)


def decode_text_columns(
    spec: DecodeSpec, columns: dict[str, pa.Array], n: int, *, empty_is_null: bool = True
) -> tuple[pa.Table, list[tuple[int, str, str]]]:
    """Converts string columns (by field name) into ``spec.input_schema()`` rows.

    Missing columns are all-null (the row check then reports missing keys/fields).
    Empty strings are null for non-string types. Returns ``(table, bad)`` like
    ``decode_json_lines`` (``table`` holds only the good rows).
    """
    schema = spec.input_schema()
    arrays: list[pa.Array] = []
    bad: dict[int, tuple[str, str]] = {}
    for f in schema:
        col = columns.get(f.name)
        if col is None:
            arrays.append(pa.nulls(n, f.type))
            continue
        if pa.types.is_binary(col.type) and (pa.types.is_binary(f.type) or pa.types.is_large_binary(f.type)):
            arrays.append(col.cast(f.type))
            continue
        col = col.cast(pa.string())
        is_text = pa.types.is_string(f.type) or pa.types.is_large_string(f.type)
        if empty_is_null and not is_text:
            col = pc.if_else(pc.equal(col, ""), pa.scalar(None, pa.string()), col)
        out, errs = _strings_to(col, f)
        for i, msg in errs.items():
            bad.setdefault(i, ("type_mismatch", f"field {f.name!r}: cannot convert to {f.type}: {msg}"))
        arrays.append(out)
    table = pa.Table.from_arrays(arrays, schema=schema)
    if bad:
        mask = np.ones(n, dtype=bool)
        mask[list(bad)] = False
        table = table.filter(pa.array(mask))
    return table, [(i, k, r) for i, (k, r) in sorted(bad.items())]


# ---------------------------------------------------------------------------------------
# Typed (Arrow/Parquet) input


def conform_typed(
    spec: DecodeSpec, table: pa.Table
) -> tuple[pa.Table | None, str | None, list[tuple[int, str, str]]]:
    """Conforms a typed table to ``spec.input_schema()``.

    Returns ``(table, file_error, bad)``: ``file_error`` is set when the *schema* is
    wrong (a key column or required column absent, a column of another kind), which
    applies to every row; otherwise ``table`` has the good rows and ``bad`` the rows
    whose values don't fit (e.g. an int64 too large for int32).
    """
    schema = spec.input_schema()
    n = table.num_rows
    for f in spec.key_schema:
        if f.name not in table.column_names:
            return None, (
                f"the file has no key column {f.name!r} (columns: {table.column_names}); "
                "every row of it is skipped"
            ), []
    for f in spec.val_schema:
        if f.name not in table.column_names and not f.nullable:
            return None, (
                f"the file has no column {f.name!r}, which is required ({f.type}, not nullable); "
                "every row of it is skipped"
            ), []
    arrays: list[pa.Array] = []
    bad: dict[int, tuple[str, str]] = {}
    for f in schema:
        if f.name not in table.column_names:
            arrays.append(pa.nulls(n, f.type))
            continue
        col = table.column(f.name).combine_chunks()
        if not same_kind(col.type, f.type):
            return None, (
                f"column {f.name!r} has type {col.type}, expected {f.type}; every row of the "
                "file is skipped"
            ), []
        out, errs = cast_rowwise(col, f.type)
        for i, msg in errs.items():
            bad.setdefault(i, ("type_mismatch", f"field {f.name!r}: {msg}"))
        arrays.append(out)
    result = pa.Table.from_arrays(arrays, schema=schema)
    if bad:
        mask = np.ones(n, dtype=bool)
        mask[list(bad)] = False
        result = result.filter(pa.array(mask))
    return result, None, [(i, k, r) for i, (k, r) in sorted(bad.items())]


def rows_to_json_lines(table: pa.Table) -> list[bytes]:
    """Row-wise JSON of a typed table (the raw form of Parquet rows).

    A string that is not valid UTF-8 is kept as its bytes decoded with
    ``surrogateescape``, which JSON writes as ``\\udcXX`` escapes: decoding the raw
    form again (a rebuild) finds the same record invalid (``invalid_utf8``)."""
    try:
        rows = table.to_pylist()
    except UnicodeDecodeError:
        types = [f.type for f in table.schema]
        binary = pa.schema([pa.field(f.name, _text_as_binary(f.type)) for f in table.schema])
        rows = [
            {k: _escaped_text(v, t) for (k, v), t in zip(r.items(), types, strict=True)}
            for r in table.cast(binary).to_pylist()
        ]
    return [json.dumps(r, default=str, sort_keys=True, separators=(",", ":")).encode() for r in rows]


def _text_as_binary(t: pa.DataType) -> pa.DataType:
    if pa.types.is_string(t):
        return pa.binary()
    if pa.types.is_large_string(t):
        return pa.large_binary()
    if pa.types.is_struct(t):
        return pa.struct([pa.field(f.name, _text_as_binary(f.type), f.nullable) for f in t])
    if pa.types.is_list(t):
        return pa.list_(_text_as_binary(t.value_type))
    if pa.types.is_large_list(t):
        return pa.large_list(_text_as_binary(t.value_type))
    if pa.types.is_fixed_size_list(t):
        return pa.list_(_text_as_binary(t.value_type), t.list_size)
    return t


def _escaped_text(v: object, t: pa.DataType) -> object:
    """``v`` (read with ``_text_as_binary(t)``) with its text fields back as ``str``."""
    if v is None:
        return None
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        assert isinstance(v, bytes)
        return v.decode("utf-8", errors="surrogateescape")
    if pa.types.is_struct(t):
        assert isinstance(v, dict)
        return {f.name: _escaped_text(v.get(f.name), f.type) for f in t}
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        assert isinstance(v, list)
        return [_escaped_text(x, t.value_type) for x in v]
    return v


def merge_good_and_bad(
    spec: DecodeSpec,
    n: int,
    table: pa.Table,
    bad: list[tuple[int, str, str]],
) -> tuple[pa.Table, list[tuple[int, str, str]]]:
    """Applies the row checks to ``table`` (the good rows of ``n`` inputs, in order).

    Returns the final rows and every bad input index (decode failures and row-check
    failures, mapped back to input indices), sorted.
    """
    rows, bad2 = check_rows(spec, table)
    if not bad:
        out = list(bad2)
        return rows, out
    bad_idx = {i for i, _, _ in bad}
    good_idx = [i for i in range(n) if i not in bad_idx]
    out = list(bad) + [(good_idx[j], k, r) for j, k, r in bad2]
    out.sort(key=lambda x: x[0])
    return rows, out
