"""Sorted runs whose key ranges don't overlap read as one run (issue 28).

A batch written by a user is one sorted run per part (``runs.batch_runs``), and each
batch of the trace is its own run(s): a snapshot of several of them merges runs (or
sorts everything). When the recorded statistics (``shard.stats``) prove that runs hold
disjoint ranges of the leading key — each run's largest leading key below the next
run's smallest — their parts, laid end to end in key order, already are one sorted run,
and the read takes the linear path (``consolidate_sorted``: a neighbour check, no sort,
no merge). A bulk write's key-range parts (``batch_builder``) are made to chain so.

Leading key columns of integer, string, binary and temporal types chain (the types
whose recorded bounds compare in persist's row order: integers, strings and bytes as
themselves, temporal values as their physical integers; not floats, whose ``-0.0`` and
``0.0`` compare equal in Python but not in that order). Nulls sort first: a run holding
null leading keys can only start a chain. A string bound too long to be recorded
(``stats.MAX_STAT_BYTES``) leaves its run unchained.

The statistics are only a hint: the linear path checks the order of every row and
falls back to a merge with a run per part when it does not hold, so a wrong record
costs time, never rows.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from persist_lib.errors import BlobNotFound
from persist_lib.location.base import Blob
from persist_lib.shard.batch_meta import PartMeta
from persist_lib.shard.codec import KEY_PREFIX, Schemas
from persist_lib.shard.part_index import group_stats, open_footer
from persist_lib.shard.stats import ColumnStats, stats_type_ok

# A bound as compared here: ``(0,)`` is a null (below every value), ``(1, value)`` a value.
Bound = tuple[Any, ...]
_NULL: Bound = (0,)


def chainable_type(t: pa.DataType) -> bool:
    """Whether a leading key column of type ``t`` can chain by its recorded bounds: the
    types with statistics (``stats.stats_type_ok``) but floats and booleans."""
    return stats_type_ok(t) and not (pa.types.is_floating(t) or pa.types.is_boolean(t))


def _python_type(t: pa.DataType) -> type:
    """The Python type of ``t``'s bounds as ``ColumnStats.from_json`` returns them."""
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return str
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return bytes
    return int  # integers, and temporal types by their physical value


def _part_bounds(p: PartMeta, column: str, t: pa.DataType) -> tuple[Bound, Bound] | None:
    """A sorted part's smallest and largest leading key (nulls as ``_NULL``), from its
    statistics; None when it is unsorted or they don't say."""
    if not p.sorted or p.stats is None:
        return None
    entry = next((s for s in p.stats if s[0] == column), None)
    if entry is None:
        return None
    _, lo, hi, nulls = entry
    try:
        s = ColumnStats.from_json([lo, hi, nulls], t)
    except (TypeError, ValueError):
        return None  # (a damaged record: no chaining, not an error)
    if s.lo is None or s.hi is None:
        return (_NULL, _NULL) if s.nulls else None
    want = _python_type(t)
    if type(s.lo) is not want or type(s.hi) is not want:
        return None  # (a damaged record: no chaining, not an error)
    return (_NULL if s.nulls else (1, s.lo)), (1, s.hi)


def _run_bounds(run: list[PartMeta], column: str, t: pa.DataType) -> tuple[Bound, Bound] | None:
    """The smallest and largest leading key of a run of sorted parts; None when a part's
    can't be known."""
    lo: Bound | None = None
    hi: Bound | None = None
    for p in run:
        b = _part_bounds(p, column, t)
        if b is None:
            return None
        lo = b[0] if lo is None else min(lo, b[0])
        hi = b[1] if hi is None else max(hi, b[1])
    return None if lo is None or hi is None else (lo, hi)


def chain_disjoint_runs(runs: list[list[PartMeta]], schemas: Schemas) -> list[list[PartMeta]]:
    """``runs`` with those whose leading-key ranges are disjoint (by their statistics)
    joined end to end in key order; runs that overlap another, or can't be bounded,
    stay as they are. One run in, or a leading key of another type: unchanged."""
    if len(runs) < 2 or not len(schemas.key) or not chainable_type(schemas.key.field(0).type):
        return runs
    field = schemas.key.field(0)
    column = KEY_PREFIX + field.name
    bounded: list[tuple[Bound, Bound, list[PartMeta]]] = []
    rest: list[list[PartMeta]] = []
    for run in runs:
        b = _run_bounds(run, column, field.type)
        if b is None:
            rest.append(run)
        else:
            bounded.append((b[0], b[1], run))
    bounded.sort(key=lambda x: (x[0], x[1]))
    chains: list[tuple[Bound, list[PartMeta]]] = []  # (largest key so far, parts)
    for lo, hi, run in bounded:
        # Extend the chain ending closest below this run (runs come by smallest key).
        # Nulls are below every value but not below each other: two runs with null keys
        # never chain.
        fits = [i for i, (end, _) in enumerate(chains) if end < lo]
        if fits:
            i = max(fits, key=lambda i: chains[i][0])
            chains[i] = (hi, chains[i][1] + run)
        else:
            chains.append((hi, list(run)))
    return [parts for _, parts in chains] + rest


def _footer_bounds(blob: Blob, p: PartMeta, schemas: Schemas, shard: str) -> tuple[Bound, Bound] | None:
    """A part's smallest and largest leading key from the row-group statistics of its
    verified footer (indexed parts: ``part_index``); None when it has no footer or they
    don't say."""
    if p.footer is None or p.key is None or p.inline is not None or not 0 < p.footer[0] <= p.size:
        return None
    footer = blob.get_range(p.key, p.size - p.footer[0], p.size)
    if footer is None:
        raise BlobNotFound(f"shard {shard}: part {p.key} is missing from blob")
    opened = open_footer(footer, p.size, p.footer, shard=shard, key=p.key)
    column = KEY_PREFIX + schemas.key.field(0).name
    lo: Bound | None = None
    hi: Bound | None = None
    for i in range(opened.num_groups):
        s = group_stats(opened, i, [column])[1].get(column)
        if s is None:
            return None
        if s.lo is None or s.hi is None:
            glo, ghi = _NULL, _NULL
        else:
            glo, ghi = (_NULL if s.nulls else (1, s.lo)), (1, s.hi)
        lo = glo if lo is None else min(lo, glo)
        hi = ghi if hi is None else max(hi, ghi)
    return None if lo is None or hi is None else (lo, hi)


def footers_confirm_chain(blob: Blob, parts: list[PartMeta], schemas: Schemas, shard: str) -> bool | None:
    """Whether the verified footers of a chain's parts (``chain_disjoint_runs``) agree
    that each part's leading keys lie below the next part's: True, False (a recorded
    range lied), or None when some part has no footer statistics to tell. A streamed
    read asks before handing out any row, since after that a lie can only stop it."""
    prev: Bound | None = None
    for p in parts:
        b = _footer_bounds(blob, p, schemas, shard)
        if b is None:
            return None
        if prev is not None and not prev < b[0]:
            return False
        prev = b[1]
    return True
