"""Sorting, consolidation and time forwarding of update tables (internal layout).

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
the rows still tied. numpy then sorts the single key once and sums runs of equal
keys with ``np.add.reduceat``.

Measured on 1M rows ``(id int64, name string) -> amount double`` on the dev box
(2 cores): ~0.25 s with 200k ids x 5000 names x 10 times; ~0.3 s when all rows are
distinct. For comparison: Arrow's multi-column ``sort_indices`` + run detection took
0.3-0.5 s and ``group_by().aggregate()`` + ``sort_by`` ~0.6 s on the same data.

List columns are ranked by ranking their elements (recursively) and sorting the rows
of a padded ``rows x max_len`` matrix of element ranks (``np.lexsort``). Only lists
longer than 64 elements take a per-row Python path (values become canonical,
ordered Python tuples: temporal values as integers, floats by total order), which
costs ~4 µs per list element.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from persist_lib.errors import InvalidUsage
from persist_lib.shard.codec import D_COL, T_COL
from persist_lib.shard.kernels import (
    MIN_POLARS_ROWS,
    RowSource,
    is_var_binary,
    kernel_pool,
    sort_int64,
    take_rows,
)

_I64_MAX = (1 << 63) - 1
# Combined keys stay below this so that ``key * card + rank`` never overflows int64.
_KEY_LIMIT = 1 << 62

Ranks = tuple[np.ndarray, int]  # dense ranks (0 = null, 1.. = values in order), cardinality


def _chunked(col: pa.Array | pa.ChunkedArray) -> pa.ChunkedArray:
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
    col = _chunked(col)
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
        first = _chunked(col)
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
# temporaries stay small (the memory budget counts them).
_STEP = 1 << 20


def _int_order(vals: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The permutation sorting an integer array, and ``same`` (``same[i]``: sorted
    values ``i`` and ``i + 1`` are equal). When ``(max - min) * n`` fits 62 bits the
    values and indices are packed into one int64 and sorted by value (numpy's SIMD
    sort): the sorted values come out of the packed array, without a gather."""
    n = len(vals)
    if n > 1 << 10:
        mn = int(vals.min())
        shift = max(1, int(n - 1).bit_length())
        if int(vals.max()) - mn < (1 << (62 - shift)):
            if vals.dtype == np.uint64:
                packed = (vals - np.uint64(mn)).astype(np.int64)
            else:
                packed = vals.astype(np.int64, copy=True)
                packed -= np.int64(mn)
            packed <<= shift
            for lo in range(0, n, _STEP):  # temporaries of _STEP rows, not of n
                packed[lo : lo + _STEP] |= np.arange(lo, min(n, lo + _STEP), dtype=np.int64)
            packed = sort_int64(packed)
            same = np.empty(n - 1, dtype=bool)
            for lo in range(0, n - 1, _STEP):
                hi = min(n - 1, lo + _STEP)
                np.less(packed[lo + 1 : hi + 1] ^ packed[lo:hi], 1 << shift, out=same[lo:hi])
            packed &= (1 << shift) - 1
            return packed, same
    perm = np.argsort(vals)
    sv = vals[perm]
    return perm, sv[1:] == sv[:-1]


def _flat_int_values(col: pa.ChunkedArray) -> np.ndarray | None:
    """The column as integers in the module's order when that is a plain numpy
    conversion (integers, temporal types, booleans, floats by total order) and it has
    no nulls; else None."""
    if col.null_count:
        return None
    t = col.type
    if pa.types.is_integer(t):
        return to_numpy(col)
    if pa.types.is_floating(t) or pa.types.is_boolean(t) or pa.types.is_temporal(t):
        return to_numpy(comparable(col))
    return None


def _first_column_order(col: pa.ChunkedArray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """``_int_order`` of the leading column: its integers, a direct Arrow sort for
    strings and binaries, else its dense ranks."""
    vals = _flat_int_values(col)
    if vals is not None:
        return _int_order(vals)
    t = col.type
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t) or (
        pa.types.is_large_binary(t)
    ):
        perm = to_numpy(pc.array_sort_indices(col, order="ascending", null_placement="at_start"))
        perm = perm.astype(np.int64, copy=False)
        s = col.take(pa.array(perm))
        a, b = s.slice(0, n - 1), s.slice(1)
        eq = pc.equal(a, b)
        if s.null_count:
            eq = pc.or_kleene(pc.fill_null(eq, False), pc.and_(pc.is_null(a), pc.is_null(b)))
        return perm, to_numpy(eq).astype(bool, copy=False)
    return _int_order(row_keys([col], n))


TakeFn = Callable[[int, np.ndarray], pa.Array]


def sort_order(
    columns: Sequence[pa.Array | pa.ChunkedArray], n: int, take: TakeFn | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """A permutation sorting the rows by ``columns`` (the module's order) and ``dup``:
    ``dup[i]`` is True when sorted row ``i`` equals sorted row ``i - 1`` on every
    column (so runs of equal rows are where consolidation sums).

    One sort of the leading column (integers packed with their indices: no ranks, no
    gather), then the rows still tied are ordered by the next columns within their
    groups, column by column, only for the rows still tied: with a mostly-distinct
    leading key almost nothing is left after the first sort. ``take(i, rows)``: column
    ``i`` at ``rows`` (default ``take``; a ``RowSource`` gathers faster)."""
    if n < 2 or not columns:
        return np.arange(n, dtype=np.int64), np.zeros(n, dtype=bool)
    perm, same = _first_column_order(_chunked(columns[0]), n)
    return _break_ties(columns, perm, same, take)


def _break_ties(
    columns: Sequence[pa.Array | pa.ChunkedArray], perm: np.ndarray, same: np.ndarray,
    take: TakeFn | None,
) -> tuple[np.ndarray, np.ndarray]:
    """Orders rows sorted by the leading column (``perm``: row ids, possibly a subset of
    the table's; ``same[i]``: positions ``i`` and ``i + 1`` tie) by the later columns,
    within their groups; returns the permutation and ``dup`` (see ``sort_order``)."""
    n = len(perm)
    dup = np.zeros(n, dtype=bool)
    for ci in range(1, len(columns)):
        if not same.any():
            break
        col = _chunked(columns[ci])

        def take_rows_of(rows: np.ndarray, ci: int = ci, col: pa.ChunkedArray = col) -> pa.Array:
            return take(ci, rows) if take is not None else col.take(pa.array(rows))

        in_tie = np.zeros(n, dtype=bool)
        in_tie[1:] |= same
        in_tie[:-1] |= same
        pos = np.flatnonzero(in_tie)  # sorted positions inside groups of equal prefixes
        starts = np.ones(len(pos), dtype=bool)
        starts[1:] = ~same[pos[1:] - 1]
        new_same = np.zeros(n - 1, dtype=bool)
        rest = pos  # positions ordered by ranking below
        if _is_flat_comparable(col.type):
            # Groups of two (most ties) are ordered by comparing their two rows.
            gstart = np.flatnonzero(starts)
            pairs = gstart[np.diff(np.append(gstart, len(pos))) == 2]
            if len(pairs):
                i0, i1 = pos[pairs], pos[pairs + 1]  # neighbouring sorted positions
                r0, r1 = perm[i0], perm[i1]
                swap, eq = _pair_order(take_rows_of(r0), take_rows_of(r1))
                perm[i0] = np.where(swap, r1, r0)
                perm[i1] = np.where(swap, r0, r1)
                new_same[i0] = eq
                keep = np.ones(len(pos), dtype=bool)
                keep[pairs] = False
                keep[pairs + 1] = False
                rest = pos[keep]
        if len(rest):
            gid = np.ones(len(rest), dtype=np.int64)
            gid[1:] = ~same[rest[1:] - 1]
            gid = np.cumsum(gid)
            rows = perm[rest]
            ranks = row_keys([take_rows_of(rows)], len(rows))
            card = int(ranks.max()) + 1
            key = gid * card + ranks  # gid <= m, card <= m + 1: no overflow below 2^31 rows
            sub_perm, sub_same = _int_order(key)
            perm[rest] = rows[sub_perm]
            # Equal neighbours in the sorted subset are in one group: neighbouring positions.
            new_same[rest[1:][sub_same] - 1] = True
        same = new_same
    dup[1:] = same
    return perm, dup


def _pair_order(first: pa.Array, second: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """For pairs of values of a flat column (``first[i]``, ``second[i]``): whether the
    second sorts before the first, and whether they are equal (nulls first)."""
    a, b = comparable(first), comparable(second)
    if pa.types.is_integer(a.type) and not a.null_count and not b.null_count:
        an, bn = to_numpy(a), to_numpy(b)
        return bn < an, an == bn
    lt = to_numpy(pc.fill_null(pc.less(b, a), False)).astype(bool, copy=False)
    eq = to_numpy(pc.fill_null(pc.equal(a, b), False)).astype(bool, copy=False)
    if a.null_count or b.null_count:
        av = to_numpy(a.is_valid()).astype(bool, copy=False)
        bv = to_numpy(b.is_valid()).astype(bool, copy=False)
        lt = lt | (av & ~bv)
        eq = eq | (~av & ~bv)
    return lt, eq


def _key_columns(table: pa.Table) -> list[str]:
    if T_COL not in table.column_names or D_COL not in table.column_names:
        raise InvalidUsage(
            f"not an update table: expected columns 't' and 'd', got {table.column_names}"
        )
    return [n for n in table.column_names if n not in (T_COL, D_COL)]


# Consolidations of at least this many rows with an integer leading key sort two key
# ranges on two threads (``consolidation_plan``).
PARALLEL_PLAN_ROWS = 200_000


def consolidation_plan(table: pa.Table, source: RowSource | None = None) -> tuple[np.ndarray, np.ndarray]:
    """What ``consolidate`` returns, as row indices into ``table`` (in ``(k, v, t)``
    order, one per distinct ``(k, v, t)`` with a nonzero sum) and their summed diffs:
    callers that write the result in slices gather one slice at a time (from
    ``source``, a ``RowSource`` of ``table``, which the sort then uses too).

    A large table whose leading key is an integer, string or binary column is split at a
    sampled median key into two key ranges, sorted and summed on two threads (numpy,
    polars and Arrow release the GIL): every row of the lower range sorts before every
    row of the upper one, so the two results concatenate."""
    n = table.num_rows
    if n == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    names = _key_columns(table) + [T_COL]
    cols = [table.column(c) for c in names]
    take: TakeFn | None = None
    if source is not None:
        index = [table.schema.get_field_index(c) for c in names]
        for i in index[1:]:
            source.prepare(i)  # before the threads share it

        def take(i: int, rows: np.ndarray) -> pa.Array:
            return source.take_column(index[i], rows)

    d = to_numpy(table.column(D_COL))
    if n >= PARALLEL_PLAN_ROWS:
        split = _split_at_median(_chunked(cols[0]))
        if split is not None:
            halves, local_order = split

            def plan_half(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
                local, same = local_order(rows)
                order, dup = _break_ties(cols, rows[local], same, take)
                return _summed(order, dup, d)

            (ra, sa), (rb, sb) = kernel_pool().map(plan_half, halves)
            return np.concatenate([ra, rb]), np.concatenate([sa, sb])
    order, dup = sort_order(cols, n, take)
    return _summed(order, dup, d)


LocalOrder = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]


def _split_at_median(
    col: pa.ChunkedArray,
) -> tuple[list[np.ndarray], LocalOrder] | None:
    """The rows of a leading key column in two key ranges (at or below a sampled median
    key, and above it; nulls, which sort first, below) and how to order one range by that
    column alone (``_int_order``'s result for those rows) — or None when the column is not
    an integer, string or binary one, or one range would be empty."""
    n = len(col)
    vals = _flat_int_values(col)
    if vals is not None:
        sample = vals[np.random.default_rng(0).integers(0, n, 4096)]
        lower = vals <= int(np.median(sample))
        ints = vals

        def int_order(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            return _int_order(ints[rows])

        order: LocalOrder = int_order
    elif is_var_binary(col.type):
        picks = col.take(pa.array(np.random.default_rng(0).integers(0, n, 4096)))
        seen = sorted(x for x in picks.to_pylist() if x is not None)
        if not seen:
            return None
        pivot = pa.scalar(seen[len(seen) // 2], type=col.type)
        lower = to_numpy(pc.fill_null(pc.less_equal(col, pivot), True)).astype(bool, copy=False)

        def var_order(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            return _first_column_order(_chunked(col.take(pa.array(rows))), len(rows))

        order = var_order
    else:
        return None
    halves = [np.flatnonzero(lower), np.flatnonzero(~lower)]
    if not all(len(h) for h in halves):
        return None
    return halves, order


def _summed(order: np.ndarray, dup: np.ndarray, d: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One row per run of equal rows (``dup``) of ``order``, with the run's summed diff;
    zero sums dropped."""
    if not dup.any():
        rows, sums = order, d[order]
    else:
        starts = np.flatnonzero(~dup)
        dv = d[order]
        sums = np.add.reduceat(dv, starts)
        del dv
        rows = order[starts]
        del starts
    nz = sums != 0
    if not nz.all():
        rows, sums = rows[nz], sums[nz]
    return rows, sums


def gather_updates(table: pa.Table | RowSource, rows: np.ndarray, diffs: np.ndarray) -> pa.Table:
    """``table``'s ``rows`` with ``diffs`` as their diffs (one chunk per column); a
    ``RowSource`` when gathering several slices of one table."""
    out = table.take(rows) if isinstance(table, RowSource) else take_rows(table, rows)
    schema = out.schema
    di = schema.get_field_index(D_COL)
    return out.set_column(di, schema.field(di), pa.array(diffs, pa.int64()))


def consolidate(table: pa.Table) -> pa.Table:
    """Sorts by ``(k..., v..., t)`` and sums the diffs of equal ``(k, v, t)``; drops zeros.

    Diffs add with int64 wrap-around (like the rest of numpy); the result has one chunk
    per column and the input's schema.
    """
    if table.num_rows == 0:
        return table
    source = RowSource(table) if table.num_rows >= MIN_POLARS_ROWS else None
    rows, diffs = consolidation_plan(table, source)
    return gather_updates(source if source is not None else table, rows, diffs)


def is_consolidated(table: pa.Table) -> bool:
    """Whether ``table`` is sorted, free of duplicate ``(k, v, t)`` and of zero diffs."""
    n = table.num_rows
    if n == 0:
        return True
    if pc.any(pc.equal(table.column(D_COL), 0)).as_py():
        return False
    cols = [table.column(c) for c in _key_columns(table)] + [table.column(T_COL)]
    key = row_keys(cols, n)
    return bool(np.all(key[1:] > key[:-1]))


def merge_sorted(tables: Iterable[pa.Table]) -> pa.Table:
    """Merges update tables (sorted or not) into one consolidated table.

    The baseline: concatenate and consolidate (the inputs being sorted is not
    exploited). A streaming k-way merge under a memory budget belongs to compaction.
    """
    ts = list(tables)
    if not ts:
        raise InvalidUsage("merge_sorted needs at least one table (for its schema)")
    return consolidate(pa.concat_tables(ts))


# ---------------------------------------------------------------------------------------
# Time forwarding and filtering. None of these consolidate: callers do, once, at the end.


def _replace_t(table: pa.Table, t: pa.Array | pa.ChunkedArray) -> pa.Table:
    ti = table.schema.get_field_index(T_COL)
    return table.set_column(ti, table.schema.field(ti), t)


def snapshot_at(table: pa.Table, as_of: int) -> pa.Table:
    """Keeps updates with ``t <= as_of`` and forwards every time to ``as_of``."""
    kept = table.filter(pc.less_equal(table.column(T_COL), as_of))
    return _replace_t(kept, pa.array(np.full(kept.num_rows, as_of, dtype=np.int64)))


def advance_to_since(table: pa.Table, since: int) -> pa.Table:
    """Forwards times below ``since`` to ``since`` (what compaction does to history)."""
    t = table.column(T_COL)
    if len(t) == 0 or pc.min(t).as_py() >= since:
        return table
    return _replace_t(table, pc.max_element_wise(t, pa.scalar(since, pa.int64())))


def time_range(table: pa.Table, lower: int | None = None, upper: int | None = None) -> pa.Table:
    """Keeps updates with ``lower <= t < upper`` (``None`` bounds are open)."""
    t = table.column(T_COL)
    mask = None
    if lower is not None:
        mask = pc.greater_equal(t, lower)
    if upper is not None:
        m = pc.less(t, upper)
        mask = m if mask is None else pc.and_(mask, m)
    return table if mask is None else table.filter(mask)


def forward_and_filter(
    table: pa.Table,
    as_of: int | None = None,
    since: int | None = None,
    lower: int | None = None,
    upper: int | None = None,
) -> pa.Table:
    """Applies, in this order: ``time_range(lower, upper)``, ``advance_to_since(since)``,
    ``snapshot_at(as_of)``. Does not consolidate."""
    if lower is not None or upper is not None:
        table = time_range(table, lower, upper)
    if since is not None:
        table = advance_to_since(table, since)
    if as_of is not None:
        table = snapshot_at(table, as_of)
    return table


# ---------------------------------------------------------------------------------------
# Linear kernels on sorted tables (no ranking): order checks and bounds, for the merge.


def _is_flat_comparable(t: pa.DataType) -> bool:
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


def linear_kernels_apply(types: Iterable[pa.DataType]) -> bool:
    """Whether ``sorted_state`` and ``count_less`` handle columns of these types: flat
    types whose Arrow comparison (after ``comparable``) is the module's order. Nested
    types (structs, lists) and the rest take the ranking path."""
    return all(_is_flat_comparable(t) for t in types)


def comparable(col: pa.Array | pa.ChunkedArray) -> pa.ChunkedArray:
    """``col`` mapped so that Arrow's comparisons (``pc.less``...) give the module's
    order: floats by IEEE total order (as int64), temporal types and booleans as their
    integers; strings and binaries compare bytewise already. Nulls stay nulls."""
    c = _chunked(col)
    t = c.type
    if pa.types.is_floating(t):
        return _float_total_order(c)
    if pa.types.is_boolean(t):
        return c.cast(pa.int8())
    if pa.types.is_temporal(t):
        return c.cast(_storage_type(t))
    return c


SORTED_STRICT = 2  # sorted, no two neighbours equal
SORTED_WITH_TIES = 1  # sorted, but some neighbours are equal (not consolidated)
UNSORTED = 0


def sorted_state(columns: Sequence[pa.Array | pa.ChunkedArray]) -> int:
    """Whether rows are sorted by ``columns`` (lexicographically, nulls first): one
    vectorized comparison of each row with the next, column by column, later columns
    only for the pairs still tied. Linear, unlike ranking. Columns must pass
    ``linear_kernels_apply``."""
    n = len(columns[0]) if columns else 0
    if n < 2:
        return SORTED_STRICT
    tied: np.ndarray | None = None  # indices i of the pairs (i, i+1) equal so far
    for col in columns:
        c = comparable(col)
        a, b = c.slice(0, n - 1), c.slice(1)
        if tied is not None:
            ti = pa.array(tied)
            a, b = a.take(ti), b.take(ti)
        if c.null_count:
            av, bv = to_numpy(a.is_valid()), to_numpy(b.is_valid())
            gt = to_numpy(pc.fill_null(pc.greater(a, b), False)) | (av & ~bv)
            eq = to_numpy(pc.fill_null(pc.equal(a, b), False)) | (~av & ~bv)
        elif pa.types.is_integer(c.type):
            an, bn = to_numpy(a), to_numpy(b)
            gt, eq = an > bn, an == bn
        else:
            gt = to_numpy(pc.greater(a, b))
            eq = to_numpy(pc.equal(a, b))
        if gt.any():
            return UNSORTED
        idx = np.flatnonzero(eq)
        tied = idx if tied is None else tied[idx]
        if len(tied) == 0:
            return SORTED_STRICT
    return SORTED_WITH_TIES


def count_less(table: pa.Table, names: Sequence[str], row: pa.Table) -> int:
    """How many rows of ``table`` (sorted by ``names``) are less than ``row`` (a
    one-row table with those columns): a search column by column, each within the rows
    tied with ``row`` on the previous columns (sorted there by this column). Vectorized
    counts, not a bisection: the tied range is usually a handful of rows after the first
    column. Columns must pass ``linear_kernels_apply``."""
    lo, hi = 0, table.num_rows
    for name in names:
        if lo >= hi:
            break
        col = comparable(table.column(name).slice(lo, hi - lo))
        f = comparable(row.column(name))
        nulls = col.null_count
        if f.null_count:  # nothing is less than a null; the nulls come first
            less, leq = 0, nulls
        else:
            fv = f[0]
            if pa.types.is_integer(col.type) and nulls == 0:
                arr = to_numpy(col)
                v = fv.as_py()
                less = int(np.searchsorted(arr, v, side="left"))
                leq = int(np.searchsorted(arr, v, side="right"))
            else:
                less = nulls + int(pc.sum(pc.less(col, fv)).as_py() or 0)
                leq = nulls + int(pc.sum(pc.less_equal(col, fv)).as_py() or 0)
        lo, hi = lo + less, lo + leq
    return lo
