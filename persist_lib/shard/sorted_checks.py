"""Linear kernels on sorted update tables (no ranking): order checks and bounds.

The streaming merge and the read path use them to tell whether a part is already
sorted (and consolidated) and to find where a bound falls in a sorted part, in one
vectorized pass instead of ranking every row (``ranks``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from persist_lib.shard.ranks import comparable, is_flat_comparable, to_numpy


def linear_kernels_apply(types: Iterable[pa.DataType]) -> bool:
    """Whether ``sorted_state`` and ``count_less`` handle columns of these types: flat
    types whose Arrow comparison (after ``comparable``) is persist's row order (``ranks``). Nested
    types (structs, lists) and the rest take the ranking path."""
    return all(is_flat_comparable(t) for t in types)



SORTED_STRICT = 2  # sorted, no two neighbours equal
SORTED_WITH_TIES = 1  # sorted, but some neighbours are equal (not consolidated)
UNSORTED = 0


def sorted_state(columns: Sequence[pa.Array | pa.ChunkedArray]) -> int:
    """Whether rows are sorted by ``columns`` (lexicographically, nulls first): one
    vectorized comparison of each row with the next, column by column, later columns
    only for the pairs still tied. Linear, unlike ranking. Columns must pass
    ``linear_kernels_apply``."""
    tied = sorted_ties(columns)
    if tied is None:
        return UNSORTED
    return SORTED_WITH_TIES if len(tied) else SORTED_STRICT


def sorted_ties(
    columns: Sequence[pa.Array | pa.ChunkedArray], rows: np.ndarray | None = None
) -> np.ndarray | None:
    """For rows sorted by ``columns``: the indices ``i`` of the neighbouring pairs
    ``(i, i + 1)`` equal on every column (empty when strictly increasing); None when
    the rows are not sorted. The comparisons of ``sorted_state``. ``rows``: check only
    these rows, in this order (indices into the columns; ``i`` then indexes ``rows``),
    as if the columns had been taken at them: only the pairs still tied are taken (an
    integer column is gathered as numpy)."""
    n = len(rows) if rows is not None else (len(columns[0]) if columns else 0)
    if n < 2:
        return np.zeros(0, dtype=np.int64)
    tied: np.ndarray | None = None  # indices i of the pairs (i, i+1) equal so far
    for col in columns:
        c = comparable(col)
        if pa.types.is_integer(c.type) and not c.null_count:
            # One conversion (a view for one chunk), compared with itself shifted.
            v = to_numpy(c)
            if rows is None:
                an, bn = (v[:-1], v[1:]) if tied is None else (v[tied], v[tied + 1])
            elif tied is None:
                g = v[rows]  # (one gather, compared with itself shifted: ~5x cheaper than two)
                an, bn = g[:-1], g[1:]
            else:
                an, bn = v[rows[tied]], v[rows[tied + 1]]
            gt, eq = an > bn, an == bn
        else:
            if rows is None:
                a, b = c.slice(0, n - 1), c.slice(1)
                if tied is not None:
                    ti = pa.array(tied)
                    a, b = a.take(ti), b.take(ti)
            else:
                left = rows[:-1] if tied is None else rows[tied]
                a, b = c.take(pa.array(left)), c.take(pa.array(rows[1:] if tied is None else rows[tied + 1]))
            if c.null_count:
                av, bv = to_numpy(a.is_valid()), to_numpy(b.is_valid())
                gt = to_numpy(pc.fill_null(pc.greater(a, b), False)) | (av & ~bv)
                eq = to_numpy(pc.fill_null(pc.equal(a, b), False)) | (~av & ~bv)
            else:
                gt = to_numpy(pc.greater(a, b))
                eq = to_numpy(pc.equal(a, b))
        if gt.any():
            return None
        idx = np.flatnonzero(eq)
        tied = idx if tied is None else tied[idx]
        if len(tied) == 0:
            break
    assert tied is not None
    return tied.astype(np.int64, copy=False)


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
