"""What a read pushes down: the columns it returns and the filter its rows satisfy.

``ReadPushdown.plan(schemas, columns, filter)`` checks both against the shard's schemas
once; a read then uses it at three places:

1. choosing parts: a part whose recorded statistics (``shard.stats``) prove that no
   row can satisfy the filter is skipped, never fetched (a part without statistics,
   written before they existed, is always read); within an indexed part
   (``shard.part_index``), so is a row group whose footer statistics prove it (or
   whose times are all after a snapshot's as-of: ``snapshot_groups``);
2. after decoding each part, *before* consolidation: its rows are filtered by the
   conjuncts on key and value columns. That is exact: consolidation sums diffs within
   equal ``(k, v)`` (at equal forwarded time), and such a conjunct is true or false
   for a whole group (``shard.predicate``). For a snapshot, a conjunct on ``ts`` is
   decided once on the as-of (every time is forwarded to it); for a time-range read
   (times kept) it is a filter like the others;
3. on the consolidated output: the user table is cut to the projected columns.
   Consolidation needs every key and value column, so a projection can't skip decoding
   a column a part holds: it saves the columns' conversion and the caller's memory,
   and the filter's pruning saves the bytes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from persist_lib.errors import InvalidUsage
from persist_lib.shard.batch_meta import PartMeta
from persist_lib.shard.codec import T_COL, Schemas, user_schema
from persist_lib.shard.predicate import BoundPredicate, bind_filter
from persist_lib.shard.ranged_fetch import GroupFilter
from persist_lib.shard.stats import ColumnStats, parse_stats

ALWAYS = ("ts", "diff")


@dataclass(frozen=True)
class ReadPushdown:
    """A read's projection and filter, checked against the shard's schemas."""

    schemas: Schemas
    columns: tuple[str, ...] | None  # user columns to return, in the shard's order (None: all)
    pred: BoundPredicate | None

    @classmethod
    def plan(cls, schemas: Schemas, columns: Any, filter: Any, *, shard: str) -> ReadPushdown:
        """``columns``: names of key/value fields to return (``ts`` and ``diff`` always
        come back); ``filter``: a ``Predicate`` or a list of ``(column, op, value)``
        conjuncts (``shard.predicate``). Unknown names raise ``InvalidUsage``."""
        return cls(schemas, _columns(schemas, columns, shard), bind_filter(filter, schemas, shard=shard))

    @property
    def trivial(self) -> bool:
        return self.columns is None and self.pred is None

    # -- 1. parts ------------------------------------------------------------------

    def keeps_part(self, p: PartMeta) -> bool:
        """Whether part ``p`` may hold rows satisfying the filter (by its statistics)."""
        if self.pred is None or p.stats is None:
            return True
        return self.pred.data_terms().may_match(parse_stats(p.stats, self.schemas), p.count)

    def keeps_range_part(self, p: PartMeta) -> bool:
        """``keeps_part`` for a time-range read: the time conjuncts prune too (on the
        part's time bounds, which every part has)."""
        if self.pred is None:
            return True
        t = self.pred.time_terms()
        if t and not t.may_match(_time_stats(p), p.count):
            return False
        return self.keeps_part(p)

    def snapshot_time_ok(self, as_of: int) -> bool:
        """Whether a snapshot at ``as_of`` (every ``ts`` = ``as_of``) passes the time conjuncts."""
        if self.pred is None or not self.pred.time_terms():
            return True
        probe = pa.table({"t": pa.array([as_of], pa.int64())})
        m = self.pred.time_terms().mask(probe)
        return m is None or bool(m[0].as_py())

    # -- 1b. row groups of indexed parts (``shard.ranged_fetch``) -------------------

    def snapshot_groups(self, p: PartMeta, as_of: int) -> GroupFilter | None:
        """Which row groups of ``p`` a snapshot at ``as_of`` reads: those that may hold
        a time ``<= as_of`` (a later update adds nothing at ``as_of``) and rows passing
        the key/value conjuncts. None when the part's bounds leave nothing to prune."""
        data = self.pred.data_terms() if self.pred is not None else None
        if not data and (p.tmax <= as_of or (p.footer is not None and as_of >= p.footer[2])):
            return None  # every row group may hold a time <= as_of: read the part whole

        def keep(rows: int, s: dict[str, ColumnStats]) -> bool:
            t = s.get(T_COL)
            if t is not None and t.lo is not None and t.lo > as_of:
                return False
            return not data or data.may_match(s, rows)

        return keep

    def range_groups(self, p: PartMeta, lower: int, upper: int | None) -> GroupFilter | None:
        """Which row groups of ``p`` a time-range read of ``[lower, upper)`` reads (every
        conjunct prunes: times are kept). None when nothing can be pruned."""
        inside = lower <= p.tmin and (upper is None or p.tmax < upper)
        if inside and self.pred is None:
            return None
        pred = self.pred

        def keep(rows: int, s: dict[str, ColumnStats]) -> bool:
            t = s.get(T_COL)
            if t is not None and t.lo is not None and (t.hi < lower or (upper is not None and t.lo >= upper)):
                return False
            return pred is None or pred.may_match(s, rows)

        return keep

    # -- 2. rows -------------------------------------------------------------------

    def filter_data(self, t: pa.Table) -> pa.Table:
        """Rows of an update table (internal layout) passing the key/value conjuncts."""
        if self.pred is None:
            return t
        d = self.pred.data_terms()
        return d.apply(t) if d else t

    def filter_range(self, t: pa.Table) -> pa.Table:
        """Rows of a time-range read's update table passing every conjunct."""
        return t if self.pred is None else self.pred.apply(t)

    # -- 3. columns ----------------------------------------------------------------

    def project(self, user: pa.Table) -> pa.Table:
        """A user-layout table cut to the projected columns."""
        return user if self.columns is None else user.select(list(self.columns))

    def user_schema(self) -> pa.Schema:
        s = user_schema(self.schemas)
        if self.columns is None:
            return s
        return pa.schema([s.field(n) for n in self.columns])


def _time_stats(p: PartMeta) -> dict[str, ColumnStats]:
    return {"t": ColumnStats(p.tmin, p.tmax, 0)}


def _columns(schemas: Schemas, columns: Any, shard: str) -> tuple[str, ...] | None:
    if columns is None:
        return None
    if isinstance(columns, str) or not isinstance(columns, Iterable | Sequence):
        raise InvalidUsage(f"shard {shard}: columns must be a list of column names, got {columns!r}")
    wanted = list(columns)
    names = [f.name for f in schemas.key] + [f.name for f in schemas.val]
    unknown = [c for c in wanted if c not in names and c not in ALWAYS]
    if unknown:
        raise InvalidUsage(
            f"shard {shard}: columns {unknown} are not in the shard; its columns are {names} "
            f"(plus {list(ALWAYS)}, always returned)"
        )
    keep = set(wanted)
    return tuple(n for n in names if n in keep) + ALWAYS
