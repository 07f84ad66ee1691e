"""Write modes: the updates (rows with a ``diff``) that turn old contents into new ones.

* ``overwrite``: the new contents (of the whole collection, or of the partitions being
  materialized) are exactly the output; written as the multiset difference against the
  old ones, so unchanged rows are not written again and history stays readable.
* ``append``: every output row is added (``diff`` +1).
* ``upsert``: rows whose key is in the output are replaced by the output's rows; an
  output row whose delete column is true deletes its key instead.

The caller adds the time (``ts``) and commits the result in one compare-and-append.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dagster_project.io_manager.errors import IOManagerConfigError
from dagster_project.io_manager.keyed_diff import keyed_difference
from persist_lib.shard.codec import D_COL, T_COL
from persist_lib.shard.consolidate import consolidate

DIFF = "diff"


def expand(snapshot: pa.Table) -> pa.Table:
    """A consolidated snapshot (``ts``, ``diff`` columns) as plain rows, each repeated
    ``diff`` times (an append-mode collection may hold a row more than once)."""
    diffs = snapshot.column(DIFF).to_numpy()
    rows = snapshot.drop_columns(["ts", DIFF])
    if len(diffs) and (diffs < 0).any():
        raise IOManagerConfigError(
            "a snapshot holds rows with negative multiplicity; the collection was not written "
            "by this I/O manager alone"
        )
    if len(diffs) == 0 or (diffs == 1).all():
        return rows
    return rows.take(pa.array(np.repeat(np.arange(len(diffs)), diffs)))


def _with_diff(table: pa.Table, d: int) -> pa.Table:
    return table.append_column(DIFF, pa.array(np.full(table.num_rows, d, dtype=np.int64)))


def multiset_difference(old: pa.Table, new: pa.Table, key: list[str] | None = None) -> pa.Table:
    """``new - old`` as updates: each distinct row once with the change of its count.

    With ``key`` and each key at most once per side: by a sort on the key columns
    (``keyed_diff``). Otherwise computed by persist's own consolidation (``shard.consolidate``: a multi-threaded
    sort, equal rows' diffs summed, zeros dropped), on the columns renamed to positions
    so that no user column can be taken for its time or diff column."""
    if key and old.num_rows:
        keyed = keyed_difference(old, new, key)
        if keyed is not None:
            return keyed
    names = old.column_names
    both = pa.concat_tables([_with_diff(old, -1), _with_diff(new.select(names), 1)])
    if both.num_rows == 0:
        return both
    if old.num_rows == 0:
        return both  # nothing to cancel: the batch builder consolidates duplicates
    positional = [f"c{i}" for i in range(len(names))]
    internal = both.rename_columns([*positional, D_COL])
    internal = internal.add_column(len(names), T_COL, pa.array(np.zeros(both.num_rows, dtype=np.int64)))
    out = consolidate(internal).drop_columns([T_COL])
    return out.rename_columns([*names, DIFF])


def overwrite(old: pa.Table, new: pa.Table, key: list[str]) -> pa.Table:
    return multiset_difference(old, new, key)


def append(new: pa.Table) -> pa.Table:
    return _with_diff(new, 1)


def upsert(old: pa.Table, new: pa.Table, key: list[str], delete_column: str | None) -> pa.Table:
    """Replace (or delete) by key. ``old`` is the whole current contents; ``new`` holds
    each key at most once (and the delete column, when there is one)."""
    keys = new.select(key)
    if keys.group_by(key).aggregate([]).num_rows != keys.num_rows:
        raise IOManagerConfigError(
            f"upsert output holds a key of {key} more than once; each key may appear once per write"
        )
    if delete_column is not None:
        flag = pc.fill_null(new.column(delete_column), False)
        live = new.filter(pc.invert(flag)).drop_columns([delete_column])
    else:
        live = new
    marker = "__persist_io_hit"
    hits = keys.append_column(marker, pa.array(np.ones(keys.num_rows, dtype=np.int8)))
    joined = old.join(hits, key, join_type="left outer", use_threads=False)
    touched = joined.filter(pc.is_valid(joined.column(marker))).drop_columns([marker])
    return multiset_difference(touched.select(old.column_names), live, key)
