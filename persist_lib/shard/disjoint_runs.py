"""Sorted runs whose key ranges don't overlap read as one run (issue 28).

A batch written by a user is one sorted run per part (``runs.batch_runs``), and each
batch of the trace is its own run(s): a snapshot of several of them merges runs (or
sorts everything). When the recorded statistics (``shard.stats``) prove that runs hold
disjoint ranges of the leading key — an integer key column without nulls, each run's
largest key below the next run's smallest — their parts, laid end to end in key order,
already are one sorted run, and the read takes the linear path (``consolidate_sorted``:
a neighbour check, no sort, no merge). The statistics are only a hint: the linear path
checks the order of every row and falls back to a merge with a run per part when it
does not hold, so a wrong record costs time, never rows.
"""

from __future__ import annotations

import pyarrow as pa

from persist_lib.shard.batch_meta import PartMeta
from persist_lib.shard.codec import KEY_PREFIX, Schemas


def _key_bounds(run: list[PartMeta], column: str) -> tuple[int, int] | None:
    """The smallest and largest leading key of a run of sorted parts, from their
    statistics; None when a part is unsorted, has no statistics for it, or nulls."""
    lo: int | None = None
    hi: int | None = None
    for p in run:
        if not p.sorted or p.stats is None:
            return None
        entry = next((s for s in p.stats if s[0] == column), None)
        if entry is None:
            return None
        _, plo, phi, nulls = entry
        if nulls or not isinstance(plo, int) or not isinstance(phi, int) or isinstance(plo, bool):
            return None
        lo = plo if lo is None else min(lo, plo)
        hi = phi if hi is None else max(hi, phi)
    return None if lo is None or hi is None else (lo, hi)


def chain_disjoint_runs(runs: list[list[PartMeta]], schemas: Schemas) -> list[list[PartMeta]]:
    """``runs`` with those whose leading-key ranges are disjoint (by their statistics)
    joined end to end in key order; runs that overlap another, or can't be bounded,
    stay as they are. One run in, or no integer leading key: unchanged."""
    if len(runs) < 2 or not len(schemas.key) or not pa.types.is_integer(schemas.key.field(0).type):
        return runs
    column = KEY_PREFIX + schemas.key.field(0).name
    bounded: list[tuple[int, int, list[PartMeta]]] = []
    rest: list[list[PartMeta]] = []
    for run in runs:
        b = _key_bounds(run, column)
        if b is None:
            rest.append(run)
        else:
            bounded.append((b[0], b[1], run))
    bounded.sort(key=lambda x: (x[0], x[1]))
    chains: list[tuple[int, list[PartMeta]]] = []  # (largest key so far, parts)
    for lo, hi, run in bounded:
        # Extend the chain ending closest below this run (runs come by smallest key).
        fits = [i for i, (end, _) in enumerate(chains) if end < lo]
        if fits:
            i = max(fits, key=lambda i: chains[i][0])
            chains[i] = (hi, chains[i][1] + run)
        else:
            chains.append((hi, list(run)))
    return [parts for _, parts in chains] + rest
