"""Time forwarding and filtering of update tables: as-of snapshots, since, time ranges.

None of these consolidate: callers do, once, at the end (``consolidate``).
"""

from __future__ import annotations

import threading

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from persist_lib.shard.codec import T_COL


def _replace_t(table: pa.Table, t: pa.Array | pa.ChunkedArray) -> pa.Table:
    ti = table.schema.get_field_index(T_COL)
    return table.set_column(ti, table.schema.field(ti), t)


#: The largest constant time column kept per time (``constant_times``), in rows.
CONSTANT_TIMES_MAX_ROWS = 1 << 18  # (at most 4 x 2 MiB kept per process)
_CONSTANT_TIMES: dict[int, pa.Array] = {}
_CONSTANT_TIMES_KEPT = 4
_CONSTANT_TIMES_LOCK = threading.Lock()


def constant_times(t: int, n: int) -> pa.Array:
    """A time column of ``n`` rows all at ``t`` (int64). The parts of a read forwarded
    to one as-of share one buffer (a slice of an array kept for each of the last few
    times asked) instead of each filling a new one: a fresh ``n * 8``-byte allocation
    per part with its pages faulted in was ~15% of the as-of pass of a cold time-travel
    read (issue 28). Arrow arrays are immutable, so sharing is safe; a slice is handed
    out only when it covers at least half of the kept array (a pickled slice carries
    the whole buffer: at most twice its bytes), else a new array is made."""
    if n > CONSTANT_TIMES_MAX_ROWS:
        return pa.array(np.full(n, t, dtype=np.int64))
    with _CONSTANT_TIMES_LOCK:
        got = _CONSTANT_TIMES.get(t)
        if got is None or len(got) < n:
            got = pa.array(np.full(n, t, dtype=np.int64))
            if t not in _CONSTANT_TIMES and len(_CONSTANT_TIMES) >= _CONSTANT_TIMES_KEPT:
                del _CONSTANT_TIMES[next(iter(_CONSTANT_TIMES))]  # the oldest time asked
            _CONSTANT_TIMES[t] = got
    if 2 * n < len(got):
        return pa.array(np.full(n, t, dtype=np.int64))
    return got.slice(0, n)


def snapshot_at(table: pa.Table, as_of: int, *, all_at_or_before: bool = False) -> pa.Table:
    """Keeps updates with ``t <= as_of`` and forwards every time to ``as_of``.

    When every time already is ``<= as_of`` (``all_at_or_before``: the caller knows it
    from the part's recorded bounds, else one pass over ``t`` finds out) no row is
    filtered out and only the time column is replaced: the other columns are the
    input's buffers, not copies."""
    t = table.column(T_COL)
    if not all_at_or_before and len(t) and pc.max(t).as_py() > as_of:
        table = table.filter(pc.less_equal(t, as_of))
    return _replace_t(table, constant_times(as_of, table.num_rows))


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
