"""Which rows of a split read (Spark executors, a parallel SQL scan) may share a record with another split.

A snapshot (or time range) read on executors consolidates each split on its own; the
same ``(key, value)`` can still sit in two splits, so the splits' rows must be
consolidated across splits too. Grouping *every* row for that is a shuffle of the whole
read, yet with statistics most rows provably appear in one split only: a record's
first key field has one value ``x``, and if ``x`` lies outside every part of the
other splits (their recorded min/max of that field, ``shard.stats``), no other split
holds it. So each split carries the bounds of the other splits' parts
(``SplitOverlap``), its executor marks the rows whose first key field falls inside
them (or is null while another split has nulls), and only the marked rows are grouped.
For a compacted shard (one sorted run, parts key-disjoint but for shared endpoints)
that is a handful of rows; for overlapping runs it is most of them, which is as
before.

Planned only when every part records bounds of the first key field and that field is
an integer (ordered exactly as Spark and persist order it); otherwise ``plan`` returns
None and the read groups every row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from persist_lib.shard.batch_meta import PartMeta
from persist_lib.shard.codec import KEY_PREFIX, Schemas


@dataclass(frozen=True)
class SplitOverlap:
    """The first key field's values that other splits may hold: the closed intervals
    ``[los[i], his[i]]`` (sorted, disjoint) and, with ``nulls``, null."""

    column: str  # the user-layout name of the first key field
    los: tuple[int, ...]
    his: tuple[int, ...]
    nulls: bool

    def mask(self, table: pa.Table) -> pa.Array:
        """True for the rows of ``table`` (user layout) another split may also hold."""
        col = table.column(self.column)
        n = table.num_rows
        if not self.los or n == 0:
            out = np.zeros(n, dtype=bool)
        else:
            x = pc.fill_null(col, 0).to_numpy() if col.null_count else col.to_numpy()
            los = np.asarray(self.los, dtype=x.dtype if x.dtype.kind in "iu" else np.int64)
            his = np.asarray(self.his, dtype=los.dtype)
            i = np.searchsorted(los, x, side="right") - 1
            out = (i >= 0) & (x <= his[np.clip(i, 0, None)])
        if col.null_count:
            isnull = pc.is_null(col).to_numpy(zero_copy_only=False)
            out = np.where(isnull, self.nulls, out)
        return pa.array(out, pa.bool_())


def _bounds(p: PartMeta, column: str) -> tuple[int, int, int] | None:
    """``(min, max, null count)`` of ``column`` in part ``p`` (min > max when every value
    is null), or None when not recorded."""
    if p.count == 0:
        return (1, 0, 0)
    for name, lo, hi, nulls in p.stats or ():
        if name == column:
            if lo is None or hi is None:
                return (1, 0, int(nulls)) if nulls == p.count else None
            if isinstance(lo, bool) or isinstance(hi, bool) or not isinstance(lo, int) or not isinstance(hi, int):
                return None
            return (lo, hi, int(nulls))
    return None


def _merged(intervals: list[tuple[int, int]]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    los: list[int] = []
    his: list[int] = []
    for lo, hi in sorted(intervals):
        if los and lo <= his[-1]:
            his[-1] = max(his[-1], hi)
        else:
            los.append(lo)
            his.append(hi)
    return tuple(los), tuple(his)


def plan(parts_of_splits: Sequence[Sequence[PartMeta]], schemas: Schemas) -> list[SplitOverlap] | None:
    """One ``SplitOverlap`` per split (in order), or None when the parts' statistics
    can't bound the overlap (then every row must be grouped)."""
    if not len(schemas.key) or not pa.types.is_integer(schemas.key.field(0).type):
        return None
    name = schemas.key.field(0).name
    column = KEY_PREFIX + name
    per_split: list[tuple[list[tuple[int, int]], bool]] = []
    for parts in parts_of_splits:
        intervals: list[tuple[int, int]] = []
        has_nulls = False
        for p in parts:
            b = _bounds(p, column)
            if b is None:
                return None
            lo, hi, nulls = b
            if lo <= hi:
                intervals.append((lo, hi))
            has_nulls = has_nulls or nulls > 0
        per_split.append((intervals, has_nulls))
    out: list[SplitOverlap] = []
    for i in range(len(per_split)):
        others = [iv for j, (ivs, _) in enumerate(per_split) if j != i for iv in ivs]
        nulls = any(n for j, (_, n) in enumerate(per_split) if j != i)
        los, his = _merged(others)
        out.append(SplitOverlap(name, los, his, nulls))
    return out


def disjoint_overlaps(
    parts: Sequence[PartMeta], schemas: Schemas
) -> tuple[list[PartMeta], list[SplitOverlap]] | None:
    """For a read with one split per part: the parts in key order and one
    ``SplitOverlap`` each, when the parts' recorded ranges of the first key field (an
    integer without nulls) are disjoint but for shared endpoints (a compacted shard's
    sorted run, or key-disjoint bulk parts); None otherwise (or when a bound is missing).

    Only a row whose first key field is a shared endpoint can sit in another part, so
    each overlap is that handful of values: ``plan`` finds the same, in linear time."""
    if not len(schemas.key) or not pa.types.is_integer(schemas.key.field(0).type):
        return None
    name = schemas.key.field(0).name
    column = KEY_PREFIX + name
    ranged: list[tuple[int, int, PartMeta]] = []
    for p in parts:
        b = _bounds(p, column)
        if b is None or b[2] or b[0] > b[1]:  # no bounds, nulls, or every value null
            return None
        ranged.append((b[0], b[1], p))
    ranged.sort(key=lambda r: (r[0], r[1]))
    shared: list[set[int]] = [set() for _ in ranged]
    for i in range(1, len(ranged)):
        prev_hi, lo = ranged[i - 1][1], ranged[i][0]
        if lo < prev_hi:
            return None  # overlapping ranges: most rows may be shared
        if lo == prev_hi:
            shared[i - 1].add(lo)
            shared[i].add(lo)
    # A value spanning several parts ([1, 5], [5, 5], [5, 9]) is shared by each of them.
    out = [SplitOverlap(name, tuple(sorted(s)), tuple(sorted(s)), False) for s in shared]
    return [p for _, _, p in ranged], out


def run_groups(parts: Sequence[PartMeta], runs: Sequence[int] | None) -> list[list[PartMeta]]:
    """``parts`` grouped by their run index (groups in run order, parts in their given
    order within a group); one group of them all when ``runs`` is None."""
    if runs is None:
        return [list(parts)] if parts else []
    by_run: dict[int, list[PartMeta]] = {}
    for p, r in zip(parts, runs, strict=True):
        by_run.setdefault(r, []).append(p)
    return [by_run[r] for r in sorted(by_run)]


def grouped_overlaps(
    parts: Sequence[PartMeta], runs: Sequence[int] | None, schemas: Schemas
) -> tuple[list[PartMeta], list[SplitOverlap]] | None:
    """``disjoint_overlaps`` for parts that know their run (``SnapshotSplit.runs``: runs
    of one batch whose runs share no ``(k, v)``): the key ranges need to be disjoint
    only *within* each run, since a part of one run shares no record with a part of
    another. The parts come run by run (key order within a run), each with the
    overlap of its own run's parts; None when a run's parts overlap (or lack bounds).
    With ``runs`` None it is ``disjoint_overlaps`` itself."""
    if runs is None:
        return disjoint_overlaps(parts, schemas)
    ordered: list[PartMeta] = []
    overlaps: list[SplitOverlap] = []
    for group in run_groups(parts, runs):
        planned = disjoint_overlaps(group, schemas)
        if planned is None:
            return None
        ordered += planned[0]
        overlaps += planned[1]
    return ordered, overlaps
