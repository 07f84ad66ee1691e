"""Ranking rows in persist's order: dense int64 ranks per column, one int64 key per row.

**Order.** An update table is sorted by ``(k..., v..., t)``: columns are compared left
to right, each column by its value with *nulls first*; numbers numerically; floats by
IEEE-754 total order (``-NaN < -inf < ... < -0.0 < 0.0 < ... < inf < NaN``, so ``-0.0``
and ``0.0`` are *different* values and a NaN equals only a NaN with the same bits);
strings and binaries bytewise; ``false < true``; a struct as (null-ness, then its
fields left to right); a list lexicographically by its elements (a prefix first).

**How.** Each column is turned into dense int64 ranks: by hashing
(``dictionary_encode``, then sorting only the distinct values) when a fixed random
sample suggests few distinct values, else by one Arrow sort of the column
(``rank``). The ranks of successive columns are combined into one int64 key per row
(re-densified when the product of the cardinalities would overflow); rows whose
first column is already unique are settled, so later columns are ranked only for
the rows still tied (``row_keys``).

List columns are ranked by ranking their elements (recursively) and sorting the rows
of a padded ``rows x max_len`` matrix of element ranks (``np.lexsort``). Only lists
longer than 64 elements take a per-row Python path (values become canonical,
ordered Python tuples: temporal values as integers, floats by total order), which
costs ~4 µs per list element.

``comparable`` maps a flat column so that Arrow's own comparisons give this order; the
sort (``consolidate``) and the merge's linear checks (``sorted_checks``) build on it.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

_I64_MAX = (1 << 63) - 1
# Combined keys stay below this so that ``key * card + rank`` never overflows int64.
_KEY_LIMIT = 1 << 62

Ranks = tuple[np.ndarray, int]  # dense ranks (0 = null, 1.. = values in order), cardinality


def as_chunked(col: pa.Array | pa.ChunkedArray) -> pa.ChunkedArray:
    return col if isinstance(col, pa.ChunkedArray) else pa.chunked_array([col], col.type)


def _dense_by_dictionary(col: pa.ChunkedArray) -> Ranks:
    """Dense ranks of a hashable, sortable column: hash it, sort only distinct values."""
    n = len(col)
    if n == 0:
        return np.zeros(0, dtype=np.int64), 1
    de = pc.dictionary_encode(col)
    if de.num_chunks > 1:
        de = de.unify_dictionaries()
    dictionary = de.chunk(de.num_chunks - 1).dictionary
    u = len(dictionary)
    rank_of = np.empty(u + 1, dtype=np.int64)
    rank_of[pc.sort_indices(dictionary).to_numpy()] = np.arange(1, u + 1, dtype=np.int64)
    rank_of[u] = 0  # nulls (encoded as index u below) come first
    parts = []
    for ch in de.chunks:
        idx = ch.indices
        if idx.null_count:
            idx = idx.fill_null(u)
        parts.append(idx.to_numpy(zero_copy_only=False))
    indices = parts[0] if len(parts) == 1 else np.concatenate(parts)
    return rank_of[indices], u + 1


def _dense_by_sort(col: pa.ChunkedArray) -> Ranks:
    """Dense ranks by sorting the whole column: better when most values are distinct."""
    ranks = to_numpy(pc.rank(col, sort_keys="ascending", tiebreaker="dense")).astype(np.int64)
    if col.null_count:  # nulls were ranked last; they come first
        ranks[~to_numpy(col.is_valid())] = 0
    return ranks, int(ranks.max()) + 1


_SAMPLE = 4096


@functools.lru_cache(maxsize=64)
def _sample_rows(n: int) -> pa.Array:
    """The fixed random sample of ``_SAMPLE`` row numbers out of ``n`` (memoized: drawing
    it permutes all ``n``, ~1 ms for 100k rows, and parts of one size recur)."""
    return pa.array(np.sort(np.random.default_rng(0).choice(n, _SAMPLE, replace=False)))


def _estimated_distinct(col: pa.Array | pa.ChunkedArray) -> float:
    """Estimates the number of distinct values from duplicates in a fixed random sample
    (of ``_SAMPLE`` rows: ``col`` must be longer)."""
    n = len(col)
    sample = col.take(_sample_rows(n))
    dups = _SAMPLE - pc.count_distinct(sample, mode="all").as_py()
    if dups <= 0:
        return float(n)
    # Birthday estimate: s samples from u equally likely values have ~s^2/2u duplicates.
    return min(float(n), _SAMPLE * _SAMPLE / (2.0 * dups))


def estimated_distinct(col: pa.Array | pa.ChunkedArray) -> float:
    """``_estimated_distinct`` for other modules (part encoding)."""
    return _estimated_distinct(col)


def _dense(col: pa.ChunkedArray) -> Ranks:
    """Dense ranks, by hashing (few distinct values) or by sorting (mostly distinct)."""
    n = len(col)
    if n > 4 * _SAMPLE and _estimated_distinct(col) > n / 4:
        return _dense_by_sort(col)
    return _dense_by_dictionary(col)


def _float_total_order(col: pa.ChunkedArray) -> pa.ChunkedArray:
    """Maps floats to int64s with the same (IEEE total) order; keeps nulls."""
    bits = col.type.bit_width
    itype = {16: np.int16, 32: np.int32, 64: np.int64}[bits]
    filled = col.fill_null(0) if col.null_count else col
    vals = to_numpy(filled).view(itype).astype(np.int64)  # sign-extends narrow widths
    flip = (1 << (bits - 1)) - 1  # the magnitude bits
    vals = np.where(vals < 0, vals ^ flip, vals)
    valid = to_numpy(col.is_valid()) if col.null_count else None
    return pa.chunked_array([pa.array(vals, mask=None if valid is None else ~valid)])


def _float_key(v: float) -> int:
    b: int = struct.unpack("<q", struct.pack("<d", v))[0]
    return b ^ _I64_MAX if b < 0 else b


def _storage_type(t: pa.DataType) -> pa.DataType:
    """``t`` with every temporal type replaced by its integer storage (for ``to_pylist``)."""
    if pa.types.is_date32(t) or pa.types.is_time32(t):
        return pa.int32()
    if (
        pa.types.is_date64(t)
        or pa.types.is_timestamp(t)
        or pa.types.is_time64(t)
        or pa.types.is_duration(t)
    ):
        return pa.int64()
    if pa.types.is_struct(t):
        return pa.struct(
            [pa.field(t.field(i).name, _storage_type(t.field(i).type)) for i in range(t.num_fields)]
        )
    if pa.types.is_list(t):
        return pa.list_(_storage_type(t.value_type))
    if pa.types.is_large_list(t):
        return pa.large_list(_storage_type(t.value_type))
    if pa.types.is_fixed_size_list(t):
        return pa.list_(_storage_type(t.value_type), t.list_size)
    return t


def _canonical(t: pa.DataType) -> Callable[[Any], Any]:
    """A function mapping a ``to_pylist`` value of (storage) type ``t`` to an ordered key."""
    if pa.types.is_floating(t):
        return lambda v: (0,) if v is None else (1, _float_key(float(v)))
    if pa.types.is_struct(t):
        fields = [(t.field(i).name, _canonical(t.field(i).type)) for i in range(t.num_fields)]
        return lambda v: (0,) if v is None else (1, tuple(f(v[name]) for name, f in fields))
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        elem = _canonical(t.value_type)
        return lambda v: (0,) if v is None else (1, tuple(elem(x) for x in v))
    return lambda v: (0,) if v is None else (1, v)


def _dense_by_python(col: pa.ChunkedArray) -> Ranks:
    """Dense ranks of a column Arrow can't hash or sort (lists): the slow, correct path."""
    st = _storage_type(col.type)
    if not st.equals(col.type):
        col = col.cast(st)
    conv = _canonical(st)
    keys = [conv(v) for v in col.to_pylist()]
    uniq = sorted(set(keys))
    pos = {k: i for i, k in enumerate(uniq)}  # (0,) -- the null -- sorts first anyway
    return np.fromiter((pos[k] for k in keys), dtype=np.int64, count=len(keys)), len(uniq)


# Lists longer than this (or too many cells in all) are ranked by the Python path.
_MAX_VECTOR_LIST_LEN = 64
_MAX_VECTOR_LIST_CELLS = 1 << 25


def _dense_lists(col: pa.ChunkedArray) -> Ranks:
    """Dense ranks of a list column, vectorized: rank the elements (recursively), lay
    them out as a padded ``rows x max_len`` matrix (0 = past the end, so a prefix sorts
    first) and sort its rows lexicographically. Falls back to the Python path for very
    long lists."""
    arr = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    n = len(arr)
    lengths = pc.list_value_length(arr).fill_null(0).to_numpy(zero_copy_only=False)
    lengths = lengths.astype(np.int64)
    max_len = int(lengths.max()) if n else 0
    values = pc.list_flatten(arr)
    if (
        max_len > _MAX_VECTOR_LIST_LEN
        or n * max_len > _MAX_VECTOR_LIST_CELLS
        or int(lengths.sum()) != len(values)
    ):
        return _dense_by_python(col)
    valid = arr.is_valid().to_numpy(zero_copy_only=False).astype(np.int64)
    elem = row_keys([values], len(values)) + 1  # element keys >= 1 (nulls: 1)
    mat = np.zeros((n, max_len), dtype=np.int64)
    if len(values):
        starts = np.cumsum(lengths) - lengths
        rows = np.repeat(np.arange(n), lengths)
        pos = np.arange(len(values)) - np.repeat(starts, lengths)
        mat[rows, pos] = elem
    # np.lexsort sorts by its *last* key first: validity, then element 0, 1, ...
    order = np.lexsort([mat[:, j] for j in range(max_len - 1, -1, -1)] + [valid])
    smat, svalid = mat[order], valid[order]
    new = np.empty(n, dtype=bool)
    if n:
        new[0] = True
        new[1:] = (svalid[1:] != svalid[:-1]) | np.any(smat[1:] != smat[:-1], axis=1)
    ranks = np.empty(n, dtype=np.int64)
    ranks[order] = np.cumsum(new) - 1  # 0 = the smallest: a null list if there is one
    return ranks, int(ranks.max()) + 1 if n else 1


def _is_listish(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)


def column_ranks(col: pa.Array | pa.ChunkedArray) -> list[Ranks]:
    """Dense rank columns whose lexicographic order is the order of ``col`` (see module doc).

    A struct expands into its validity followed by its (recursively ranked) fields.
    """
    col = as_chunked(col)
    t = col.type
    if pa.types.is_struct(t):
        valid = to_numpy(col.is_valid()).astype(np.int64)
        out: list[Ranks] = [(valid, 2)]
        children = col.flatten()  # children are null wherever the struct is
        for child in children:
            out.extend(column_ranks(child))
        return out
    if _is_listish(t):
        return [_dense_lists(col)]
    if pa.types.is_floating(t):
        return [_dense(_float_total_order(col))]
    return [_dense(col)]


def _int_column(key: np.ndarray) -> pa.ChunkedArray:
    return pa.chunked_array([pa.array(key)])


def row_keys(columns: Sequence[pa.Array | pa.ChunkedArray], n: int) -> np.ndarray:
    """One int64 per row such that equal keys <=> equal rows and key order = row order.

    After the first column, rows whose value is unique are settled: later columns are
    only ranked for the rows still tied (for a mostly-distinct leading key, that skips
    all the other columns).
    """
    return row_keys_with_hint(columns, n)[0]


def _numpy_dtype(t: pa.DataType) -> np.dtype[Any] | None:
    """The numpy dtype whose bytes are an Arrow array's data buffer (integers, floats)."""
    if pa.types.is_integer(t) or (pa.types.is_floating(t) and t.bit_width >= 32):
        kind = "f" if pa.types.is_floating(t) else ("i" if pa.types.is_signed_integer(t) else "u")
        return np.dtype(f"{kind}{t.bit_width // 8}")
    return None


def _array_to_numpy(a: pa.Array) -> np.ndarray:
    if a.null_count == 0:
        # Straight from the data buffer: ``Array.to_numpy`` goes through pyarrow's pandas
        # shim, which imports pandas (~0.25 s) on a process's first call.
        dt = _numpy_dtype(a.type)
        if dt is not None:  # a read-only view, like pyarrow's zero-copy conversion
            return np.frombuffer(a.buffers()[1], dtype=dt, count=len(a), offset=a.offset * dt.itemsize)
        if pa.types.is_boolean(a.type):
            n, off = len(a), a.offset
            nbytes = (off + n + 7) // 8
            bits = np.unpackbits(np.frombuffer(a.buffers()[1], dtype=np.uint8, count=nbytes), bitorder="little")
            return bits[off : off + n].astype(bool)
    return a.to_numpy(zero_copy_only=False)


def to_numpy(col: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """``col`` as numpy, one chunk at a time (``ChunkedArray.to_numpy`` and, for most
    types, ``Array.to_numpy`` go through pyarrow's pandas shim)."""
    if isinstance(col, pa.Array):
        return _array_to_numpy(col)
    if col.num_chunks == 1:
        return _array_to_numpy(col.chunk(0))
    if col.num_chunks == 0:
        return _array_to_numpy(col.combine_chunks())
    return np.concatenate([_array_to_numpy(c) for c in col.chunks])


def _argsort_ints(vals: np.ndarray, presorted_runs: bool) -> np.ndarray:
    """A permutation sorting an integer array.

    ``presorted_runs``: the array is a concatenation of a few sorted runs (a merge
    step's input); numpy's stable sort (timsort) detects and merges them, ~10x faster
    than a quicksort there. Otherwise, when ``(max - min) * n`` fits 63 bits, the
    values and their indices are packed into one int64 and sorted by value (numpy's
    SIMD sort), ~1.5x faster than ``argsort``; ties come out in index order, which
    nothing relies on.
    """
    n = len(vals)
    if presorted_runs:
        return np.argsort(vals, kind="stable")
    if n > 1 << 12:
        mn = vals.min()
        shift = max(1, int(n - 1).bit_length())
        if int(vals.max()) - int(mn) < (1 << (62 - shift)):
            # (the range check makes the subtraction safe in int64, and in uint64)
            if vals.dtype == np.uint64:
                packed = (vals - mn).astype(np.int64)
            else:
                packed = vals.astype(np.int64) - np.int64(mn)
            packed <<= shift
            packed |= np.arange(n, dtype=np.int64)
            packed.sort()
            packed &= (1 << shift) - 1
            return packed
    return np.argsort(vals)


def _dense_ints_with_order(
    col: pa.ChunkedArray, presorted_runs: bool = False
) -> tuple[Ranks, np.ndarray]:
    """Dense ranks of an integer column without nulls, and the permutation sorting it."""
    vals = to_numpy(col)
    perm = _argsort_ints(vals, presorted_runs)
    sv = vals[perm]
    new = np.empty(len(sv), dtype=np.int64)
    new[0] = 1
    new[1:] = sv[1:] != sv[:-1]
    ranks = np.empty(len(sv), dtype=np.int64)
    ranks[perm] = np.cumsum(new)  # 1.. (0 would be the null)
    return (ranks, int(ranks[perm[-1]]) + 1), perm


def row_keys_with_hint(
    columns: Sequence[pa.Array | pa.ChunkedArray], n: int, *, presorted_runs: bool = False
) -> tuple[np.ndarray, np.ndarray | None]:
    """``row_keys``, plus (when the first column is an integer column without nulls, the
    common case of an integer key) a permutation sorting the rows by that column: the
    keys taken in that order are sorted except within runs of equal first values, so
    sorting them again is nearly linear (``consolidate`` sorts once, not twice).

    ``presorted_runs``: the rows are a concatenation of a few sorted runs (only a
    hint for the choice of sort algorithm; any input gives correct keys)."""
    key: np.ndarray | None = None
    hint: np.ndarray | None = None
    card = 1
    active: np.ndarray | None = None  # indices of the rows still tied; None = all rows
    for ci, col in enumerate(columns):
        if active is not None:
            if len(active) == 0:
                break
            col = col.take(pa.array(active))
        col_ranks: list[Ranks]
        first = as_chunked(col)
        if ci == 0 and n > 1 and pa.types.is_integer(first.type) and first.null_count == 0:
            r0, hint = _dense_ints_with_order(first, presorted_runs)
            col_ranks = [r0]
        else:
            col_ranks = column_ranks(col)
        for ranks, m in col_ranks:
            if key is None:
                key, card = ranks, m
                continue
            if card * m >= _KEY_LIMIT:
                key, card = _dense(_int_column(key))
            # Settled rows get rank 0: their prefix is unique, so order is unaffected.
            key = key * m
            if active is None:
                key += ranks
            else:
                key[active] += ranks
            card = card * m
        if ci == 0 and len(columns) > 1 and key is not None:
            if card > 4 * n:
                key, card = _dense(_int_column(key))
            tied = np.bincount(key, minlength=card)[key] > 1
            if not tied.all():
                active = np.flatnonzero(tied)
    if key is None:
        return np.zeros(n, dtype=np.int64), None
    return key, hint


# Elementwise passes over big arrays go in steps of this many rows, so that their



def is_flat_comparable(t: pa.DataType) -> bool:
    return (
        pa.types.is_integer(t)
        or pa.types.is_floating(t)
        or pa.types.is_boolean(t)
        or pa.types.is_temporal(t)
        or pa.types.is_string(t)
        or pa.types.is_large_string(t)
        or pa.types.is_binary(t)
        or pa.types.is_large_binary(t)
    )

def comparable(col: pa.Array | pa.ChunkedArray) -> pa.ChunkedArray:
    """``col`` mapped so that Arrow's comparisons (``pc.less``...) give the module's
    order: floats by IEEE total order (as int64), temporal types and booleans as their
    integers; strings and binaries compare bytewise already. Nulls stay nulls."""
    c = as_chunked(col)
    t = c.type
    if pa.types.is_floating(t):
        return _float_total_order(c)
    if pa.types.is_boolean(t):
        return c.cast(pa.int8())
    if pa.types.is_temporal(t):
        return c.cast(_storage_type(t))
    return c
