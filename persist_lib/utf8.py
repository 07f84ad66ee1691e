"""UTF-8 validity of Arrow string data: the check every write and every part read makes.

Arrow string columns are bytes that are *supposed* to be UTF-8, but several producers
don't check (pyarrow's JSON reader inside strings, Parquet files written with an unsafe
cast, ``Array.from_buffers``). Invalid bytes in a part poison a shard: every reader that
turns the column into Python text raises a bare ``UnicodeDecodeError``. So writers pass
their update tables through ``check_table`` (``codec.normalize_checked`` and
``check_updates`` call it, once per table: ``compare_and_append``, batch builders, Spark
writes, ingestion and rebuilds all go through those), part decoding checks what it read, and
ingestion routes bad records to its errors collection with ``invalid_rows``.

The fast path is for flat string arrays whose bytes are all ASCII (most text is):
every byte below 0x80 and the offsets ascending within the data buffer means every
string is valid UTF-8; one numpy pass, ~0.3 ms per 1M short strings (issue 28: the
check is in the serial head of every bulk write). Anything else (non-ASCII bytes
anywhere in the data, nested types) goes through ``Array.validate(full=True)``, which
checks UTF-8 for string arrays (pyarrow 26 has no ``utf8_is_valid`` kernel): ~4-9 ms
per 1M short strings, about 3 GB/s. Only a column that fails it is searched row by row.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from persist_lib.errors import InvalidUtf8


def has_strings(t: pa.DataType) -> bool:
    """Whether ``t`` is, or contains, a string/large_string type."""
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return True
    if pa.types.is_struct(t):
        return any(has_strings(t.field(i).type) for i in range(t.num_fields))
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return has_strings(t.value_type)
    return False


def _ascii_ok(arr: pa.Array) -> bool:
    """True when ``arr`` is a flat string array whose offsets ascend within its data
    buffer and whose bytes between its first and last offset are all ASCII: then every
    element is valid UTF-8. False decides nothing (the caller checks in full)."""
    t = arr.type
    if not (pa.types.is_string(t) or pa.types.is_large_string(t)):
        return False
    n = len(arr)
    bufs = arr.buffers()
    if n == 0:
        return True
    if len(bufs) != 3 or bufs[1] is None:
        return False
    width = 8 if pa.types.is_large_string(t) else 4
    odt = np.dtype(np.int64) if width == 8 else np.dtype(np.int32)
    if bufs[1].size < (arr.offset + n + 1) * width:
        return False
    off = np.frombuffer(bufs[1], dtype=odt, count=n + 1, offset=arr.offset * width)
    lo, hi = int(off[0]), int(off[-1])
    data = bufs[2]
    if lo < 0 or hi > (0 if data is None else data.size) or bool(np.any(np.less(off[1:], off[:-1]))):
        return False
    if lo == hi or data is None:
        return True  # every string empty
    raw = np.frombuffer(data, dtype=np.uint8, count=hi - lo, offset=lo)
    whole = len(raw) // 8 * 8  # eight bytes at a time: one OR-reduction of words
    words = raw[:whole].view(np.uint64)
    high = np.uint64(0x8080808080808080)
    if len(words) and int(np.bitwise_or.reduce(words) & high):
        return False
    return not bool(np.any(raw[whole:] & np.uint8(0x80)))


def _fast_ok(arr: pa.Array) -> bool:
    if _ascii_ok(arr):
        return True
    try:
        arr.validate(full=True)
    except pa.ArrowInvalid:
        return False
    return True


def _valid_text(b: bytes | None) -> bool:
    if b is None:
        return True
    try:
        b.decode("utf-8")  # strict: rejects overlongs, surrogates and > U+10FFFF like Arrow
    except UnicodeDecodeError:
        return False
    return True


def _bad_mask(arr: pa.Array) -> np.ndarray:
    """One bool per element of ``arr``: it holds (somewhere inside) invalid UTF-8."""
    t = arr.type
    n = len(arr)
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        if _fast_ok(arr):
            return np.zeros(n, dtype=bool)
        raw = arr.cast(pa.large_binary() if pa.types.is_large_string(t) else pa.binary())
        return np.fromiter((not _valid_text(b) for b in raw.to_pylist()), dtype=bool, count=n)
    out = np.zeros(n, dtype=bool)
    if pa.types.is_struct(t):
        for i in range(t.num_fields):
            if has_strings(t.field(i).type):
                out |= _bad_mask(arr.field(i))  # (field() honours the slice offset)
    elif pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        if has_strings(t.value_type):
            values = arr.flatten()
            inner = _bad_mask(values)
            if inner.any():
                parents = pc.list_parent_indices(arr).to_numpy(zero_copy_only=False)
                out[np.unique(parents[inner])] = True
    return out


def invalid_rows(col: pa.Array | pa.ChunkedArray) -> list[int]:
    """Indices of the elements of ``col`` holding invalid UTF-8 (empty when it has no
    string data, or all of it is valid)."""
    if not has_strings(col.type):
        return []
    chunks = col.chunks if isinstance(col, pa.ChunkedArray) else [col]
    out: list[int] = []
    offset = 0
    for c in chunks:
        if not _fast_ok(c):
            out.extend(int(i) + offset for i in np.flatnonzero(_bad_mask(c)))
        offset += len(c)
    return out


def first_invalid(col: pa.Array | pa.ChunkedArray) -> int | None:
    """Index of the first element of ``col`` holding invalid UTF-8, or None."""
    rows = invalid_rows(col)
    return rows[0] if rows else None


def describe_value(col: pa.Array | pa.ChunkedArray, row: int) -> str:
    """The offending value for a message: its bytes (first 60) when it is a flat string."""
    v = col.slice(row, 1)
    if isinstance(v, pa.ChunkedArray):
        v = v.combine_chunks()
    t = v.type
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        b = v.cast(pa.large_binary())[0].as_py()
        if b is not None:
            return f"bytes {b[:60]!r}{'...' if len(b) > 60 else ''}"
    return f"a {t} value"


def check_table(table: pa.Table, names: list[str], *, shard: str) -> None:
    """Raises ``InvalidUtf8`` naming the first column (by its name in ``names``, one per
    column of ``table``) and row that hold invalid UTF-8. Columns without string data
    cost nothing."""
    for name, col in zip(names, table.columns, strict=False):
        row = first_invalid(col)
        if row is not None:
            raise InvalidUtf8(shard, name, row, describe_value(col, row))
