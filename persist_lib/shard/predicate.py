"""Read filters: conjunctions of comparisons, IN and IS NULL on a shard's columns.

A ``Predicate`` names columns the way a read returns them: the key and value field
names, and ``ts`` for the update time. It is evaluated on update tables (the internal
layout, ``mask``) and on column statistics (``may_match``: False only when no row with
those bounds can satisfy it, so the part or row group can be skipped).

Why a read may filter *before* consolidating (docs/design.md section 6 on reads):
consolidation sums the diffs of rows with equal ``(k, v)`` at the (forwarded) time,
and a conjunct on key and value columns has the same truth value on every row of such
a group; so dropping rows by it drops whole groups, and the surviving groups
consolidate exactly as they would have. A conjunct on ``ts`` is evaluated after
consolidation (a snapshot forwards every time to its as-of; a range read compares the
update's own time, which consolidation keeps).

Semantics follow SQL and Arrow compute: a comparison with a null is not true (the row
is dropped), ``IN`` never matches null, ``IS NULL`` / ``IS NOT NULL`` test nullness.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from persist_lib.errors import InvalidUsage
from persist_lib.shard.codec import KEY_PREFIX, T_COL, VAL_PREFIX, Schemas
from persist_lib.shard.stats import ColumnStats, comparable

TIME_NAME = "ts"
OPS = ("==", "!=", "<", "<=", ">", ">=", "in", "is_null", "is_not_null")
_ARROW_CMP = {
    "==": pc.equal, "!=": pc.not_equal, "<": pc.less, "<=": pc.less_equal,
    ">": pc.greater, ">=": pc.greater_equal,
}


@dataclass(frozen=True)
class Term:
    """One conjunct: ``column op value`` (``value``: a list for ``in``, unused for the
    null tests)."""

    column: str
    op: str
    value: Any = None

    def describe(self) -> str:
        if self.op in ("is_null", "is_not_null"):
            return f"{self.column} {self.op.replace('_', ' ').upper()}"
        return f"{self.column} {self.op.upper() if self.op == 'in' else self.op} {self.value!r}"


@dataclass(frozen=True)
class Predicate:
    """A conjunction of ``Term``s (no terms: every row matches)."""

    terms: tuple[Term, ...] = ()

    @classmethod
    def of(cls, spec: Any) -> Predicate | None:
        """A predicate from a ``Predicate``, a ``Term``, or a list of ``(column, op,
        value)`` / ``(column, op)`` tuples (their conjunction; the form pyarrow's
        ``filters=`` takes); None stays None."""
        if spec is None or isinstance(spec, Predicate):
            return spec
        if isinstance(spec, Term):
            return cls((spec,))
        if isinstance(spec, tuple) and spec and isinstance(spec[0], str):
            spec = [spec]
        if not isinstance(spec, Iterable) or isinstance(spec, str | bytes):
            raise InvalidUsage(
                f"filter must be a Predicate or a list of (column, op, value) tuples, got {spec!r}"
            )
        terms = []
        for item in spec:
            if isinstance(item, Term):
                terms.append(item)
            elif isinstance(item, Sequence) and len(item) in (2, 3) and isinstance(item[0], str):
                terms.append(Term(item[0], str(item[1]).lower(), item[2] if len(item) == 3 else None))
            else:
                raise InvalidUsage(f"filter term must be (column, op, value), got {item!r}")
        return cls(tuple(terms))

    def describe(self) -> str:
        return " AND ".join(t.describe() for t in self.terms) or "TRUE"

    def columns(self) -> set[str]:
        return {t.column for t in self.terms}

    def bind(self, schemas: Schemas, *, shard: str) -> BoundPredicate:
        """Checks the columns, operators and constants against ``schemas``."""
        types = _user_types(schemas)
        bound = []
        for t in self.terms:
            if t.column not in types:
                raise InvalidUsage(
                    f"shard {shard}: filter {t.describe()}: no column {t.column!r}; the columns are "
                    f"{sorted(types)}"
                )
            if t.op not in OPS:
                raise InvalidUsage(f"shard {shard}: filter {t.describe()}: unknown operator; use one of {OPS}")
            name, typ = types[t.column]
            if pa.types.is_nested(typ) and t.op not in ("is_null", "is_not_null"):
                raise InvalidUsage(
                    f"shard {shard}: filter {t.describe()}: column {t.column!r} is {typ}; nested "
                    "columns can only be tested with is_null / is_not_null"
                )
            value: Any = None
            if t.op == "in":
                if isinstance(t.value, str | bytes) or not isinstance(t.value, Iterable):
                    raise InvalidUsage(f"shard {shard}: filter {t.describe()}: IN takes a list of values")
                value = _array(list(t.value), typ, t, shard)
            elif t.op in _ARROW_CMP:
                value = _scalar(t.value, typ, t, shard)
            bound.append(BoundTerm(t, name, typ, value))
        return BoundPredicate(tuple(bound))


def _user_types(schemas: Schemas) -> dict[str, tuple[str, pa.DataType]]:
    out = {f.name: (KEY_PREFIX + f.name, f.type) for f in schemas.key}
    out.update({f.name: (VAL_PREFIX + f.name, f.type) for f in schemas.val})
    out[TIME_NAME] = (T_COL, pa.int64())
    return out


def _scalar(value: Any, typ: pa.DataType, t: Term, shard: str) -> pa.Scalar:
    if value is None:
        raise InvalidUsage(
            f"shard {shard}: filter {t.describe()}: comparing with null is never true; use "
            "is_null / is_not_null"
        )
    try:
        return value if isinstance(value, pa.Scalar) and value.type.equals(typ) else pa.scalar(value, type=typ)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, OverflowError) as e:
        raise InvalidUsage(f"shard {shard}: filter {t.describe()}: {value!r} is not a {typ} ({e})") from e


def _array(values: list[Any], typ: pa.DataType, t: Term, shard: str) -> pa.Array:
    try:
        return pa.array(values, type=typ)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, OverflowError) as e:
        raise InvalidUsage(f"shard {shard}: filter {t.describe()}: values are not {typ} ({e})") from e


@dataclass(frozen=True)
class BoundTerm:
    term: Term
    name: str  # internal column
    typ: pa.DataType
    value: Any  # pa.Scalar (comparisons), pa.Array (in), None (null tests)

    def mask(self, table: pa.Table) -> pa.ChunkedArray:
        col = table.column(self.name)
        op = self.term.op
        if op == "is_null":
            return pc.is_null(col)
        if op == "is_not_null":
            return pc.is_valid(col)
        if op == "in":
            return pc.is_in(col, value_set=self.value, skip_nulls=True)
        return pc.fill_null(_ARROW_CMP[op](col, self.value), False)

    def may_match(self, s: ColumnStats | None, rows: int) -> bool:
        """False only when no row of a part with statistics ``s`` (of ``rows`` rows)
        can satisfy this term."""
        if s is None:
            return True
        op = self.term.op
        if op == "is_null":
            return s.nulls > 0
        if op == "is_not_null":
            return s.nulls < rows
        if s.lo is None or s.hi is None:
            return False  # every value null: no comparison or IN is true
        if op == "in":
            vals = [comparable(v, self.typ) for v in self.value.to_pylist() if v is not None]
            return any(_between(v, s) for v in vals)
        v = comparable(self.value, self.typ)
        try:
            if op == "==":
                return _between(v, s)
            if op == "!=":
                return s.nulls < rows and not (s.lo == s.hi == v)
            if op == "<":
                return bool(s.lo < v)
            if op == "<=":
                return bool(s.lo <= v)
            if op == ">":
                return bool(s.hi > v)
            return bool(s.hi >= v)
        except TypeError:
            return True  # bounds of another type than expected: don't prune


def _between(v: Any, s: ColumnStats) -> bool:
    try:
        return bool(s.lo <= v <= s.hi)
    except TypeError:
        return True


@dataclass(frozen=True)
class BoundPredicate:
    """A predicate checked against a shard's schemas, ready to evaluate."""

    terms: tuple[BoundTerm, ...]

    def data_terms(self) -> BoundPredicate:
        """The conjuncts on key and value columns (safe to apply before consolidation)."""
        return BoundPredicate(tuple(t for t in self.terms if t.name != T_COL))

    def time_terms(self) -> BoundPredicate:
        return BoundPredicate(tuple(t for t in self.terms if t.name == T_COL))

    def columns(self) -> set[str]:
        """The internal columns it reads."""
        return {t.name for t in self.terms}

    def __bool__(self) -> bool:
        return bool(self.terms)

    def mask(self, table: pa.Table) -> pa.ChunkedArray | None:
        """The rows of ``table`` (internal layout) that satisfy every term (None: all)."""
        m: pa.ChunkedArray | None = None
        for t in self.terms:
            tm = t.mask(table)
            m = tm if m is None else pc.and_(m, tm)
        return m

    def apply(self, table: pa.Table) -> pa.Table:
        m = self.mask(table)
        return table if m is None else table.filter(m)

    def may_match(self, stats: dict[str, ColumnStats] | None, rows: int) -> bool:
        """False only when statistics prove no row of the part can satisfy every term
        (None statistics: the part predates them, anything may match)."""
        if stats is None:
            return True
        return all(t.may_match(stats.get(t.name), rows) for t in self.terms)


def bind_filter(spec: Any, schemas: Schemas, *, shard: str) -> BoundPredicate | None:
    """``Predicate.of(spec).bind(schemas)``, None for no filter (or an empty one)."""
    p = Predicate.of(spec)
    if p is None or not p.terms:
        return None
    return p.bind(schemas, shard=shard)
