"""A sorted run's part at an as-of with one copy: filtered, forwarded and consolidated.

Reading a part of a sorted run at ``as_of`` takes two steps, each copying the rows it
keeps: ``snapshot_at`` (drop the updates after ``as_of``, forward the rest) and
``consolidate_sorted`` (sum the rows that forwarding made equal). A part of a
(k, v)-whole time layer holds each ``(k, v)`` with its later history, so an old as-of
both drops rows and finds ties, and both copies happen (issue 28: together 43% of the
fetch threads' time in the cold time-travel read at 4M rows).

``consolidate_sorted_at`` copies once: it finds the rows at or before ``as_of`` as
indices, checks their order and finds their ties on the columns *gathered* at those
indices (``sorted_ties(rows=...)``: a leading integer column as numpy, later columns
taken only at the pairs still tied), sums the tied rows' diffs into the first of each
group, and takes the surviving rows from the part once. The result is exactly
``consolidate_sorted(snapshot_at(table, as_of))``, with the same order check of the
rows returned. It applies when the first key column is a non-null integer (the gather
is then cheap); otherwise, and when no row is dropped, the two steps run as before.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from persist_lib.shard.codec import D_COL, T_COL
from persist_lib.shard.consolidate import consolidate_sorted
from persist_lib.shard.ranks import comparable, to_numpy
from persist_lib.shard.sorted_checks import sorted_ties
from persist_lib.shard.time_filters import constant_times, snapshot_at


def consolidate_sorted_at(table: pa.Table, as_of: int, *, all_at_or_before: bool = False) -> pa.Table | None:
    """``consolidate_sorted(snapshot_at(table, as_of))`` for a table sorted by ``(k,
    v, t)`` (internal layout): the updates after ``as_of`` dropped, times forwarded to
    it, equal rows summed, zero sums dropped, order kept; None when the rows at or
    before ``as_of`` are not sorted by ``(k, v)``. Columns as for
    ``consolidate_sorted``. ``all_at_or_before``: the caller knows from the part's
    recorded bounds that no time is after ``as_of`` (a latest read): the two steps
    run as they are, without looking at the times."""
    if all_at_or_before:
        return consolidate_sorted(snapshot_at(table, as_of, all_at_or_before=True))
    n = table.num_rows
    kv = [table.column(c) for c in table.column_names if c not in (T_COL, D_COL)]
    t = to_numpy(table.column(T_COL)) if n else np.zeros(0, dtype=np.int64)
    kept = t <= as_of
    lead = comparable(kv[0]) if kv else None
    if kept.all() or lead is None or not pa.types.is_integer(lead.type) or lead.null_count:
        return consolidate_sorted(snapshot_at(table, as_of, all_at_or_before=bool(kept.all())))
    rows = np.flatnonzero(kept)
    tied = sorted_ties(kv, rows)
    if tied is None:
        return None
    diffs = to_numpy(table.column(D_COL))[rows]
    if len(tied):
        # Runs of consecutive tied pairs are the groups: each head takes its group's sum.
        cont = np.zeros(len(tied), dtype=bool)
        cont[1:] = tied[1:] == tied[:-1] + 1  # pair i continues the group of pair i - 1
        heads = tied[~cont]
        diffs[heads] += np.add.reduceat(diffs[tied + 1], np.flatnonzero(~cont))
    keep = diffs != 0
    keep[tied + 1] = False
    # Only the key and value columns are taken (the times and diffs are new), and
    # without a bounds check: the indices are positions of a mask over the table.
    names = table.column_names
    taken = pc.take(table.select([c for c in names if c not in (T_COL, D_COL)]), pa.array(rows[keep]), boundscheck=False)
    new = {T_COL: constant_times(as_of, taken.num_rows), D_COL: pa.array(diffs[keep], pa.int64())}
    return pa.Table.from_arrays([new[c] if c in new else taken.column(c) for c in names], schema=table.schema)
