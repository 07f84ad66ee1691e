"""Equal neighbouring rows of a sorted table: whether there may be any, and folding a
table whose rows are all equal (the k-way merge's helpers, ``kway_merge``)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from persist_lib.shard.codec import D_COL, T_COL
from persist_lib.shard.ranks import to_numpy


def consolidate_sorted_equal(t: pa.Table) -> pa.Table:
    """Collapses a table whose rows are all equal in ``(k, v, t)`` to one row (or none)."""
    if t.num_rows <= 1:
        return t if t.num_rows == 0 or t.column(D_COL)[0].as_py() != 0 else t.slice(0, 0)
    total = int(np.sum(to_numpy(t.column(D_COL)), dtype=np.int64))
    if total == 0:
        return t.slice(0, 0)
    one = t.slice(0, 1)
    di = one.schema.get_field_index(D_COL)
    return one.set_column(di, one.schema.field(di), pa.array([total], pa.int64()))


def has_adjacent_equal_rows(t: pa.Table) -> bool:
    """Whether two neighbouring rows of ``t`` (sorted by ``(k, v, t)``) may be equal in
    ``(k, v, t)``: in a sorted table equal rows are neighbours, so when none are, the
    table is already consolidated (given nonzero diffs) and consolidating it again —
    a sort — would change nothing. A linear, vectorized comparison; conservative (True)
    for nested types. Equality here may differ from the ranking's on floats (NaN, -0.0):
    a missed duplicate is summed by the merge step anyway."""
    n = t.num_rows
    if n < 2:
        return False
    names = [T_COL] + [c for c in t.column_names if c not in (T_COL, D_COL)]
    mask: pa.ChunkedArray | pa.Array | None = None
    for name in names:
        col = t.column(name)
        if pa.types.is_nested(col.type):
            return True
        a, b = col.slice(0, n - 1), col.slice(1)
        try:
            eq = pc.equal(a, b)
            if col.null_count:
                eq = pc.or_kleene(pc.fill_null(eq, False), pc.and_(pc.is_null(a), pc.is_null(b)))
            mask = eq if mask is None else pc.and_(mask, eq)
            if not pc.any(mask).as_py():
                return False
        except (pa.ArrowNotImplementedError, pa.ArrowInvalid, pa.ArrowTypeError):
            return True  # a type Arrow can't compare: consolidate to be sure
    return True
