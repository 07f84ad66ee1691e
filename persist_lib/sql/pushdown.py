"""The filter a SQL query applies to a persist source, taken from DuckDB's plan.

DuckDB (2.0) scans an Arrow PyCapsule stream whole: it asks the source for no column
subset and no filter (``__arrow_c_stream__`` gets ``requested_schema=None``), and
applies the query's filter in a ``FILTER`` node right above the scan. So the session
reads the plan instead (``EXPLAIN (FORMAT json)``), takes that node's expression, and
hands the conjuncts it can state exactly as a ``shard.predicate.Predicate`` to the
read, which then skips the parts whose statistics rule it out
(``handles.pushdown``). DuckDB still applies its whole filter above the scan, so
pushing a subset of the conjuncts (those recognised here) never changes the result;
anything else (ORs of different columns, functions, casts, floats, whose NaN DuckDB
orders above every number where Arrow compares it false) is simply not pushed.

The projection needs no pushing: DuckDB reads only the columns it needs from the
stream, and the read has to decode every key and value column to consolidate anyway.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pyarrow as pa

from persist_lib.shard.predicate import Term

SCAN = "PYTHON_ARROW_SCAN"
_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_LIT = r"-?\d+|'(?:[^']|'')*'"
_CMP = re.compile(rf"^\(({_IDENT}) (=|!=|<|<=|>|>=) ({_LIT})\)$")
_NULL = re.compile(rf"^\(({_IDENT}) IS (NOT )?NULL\)$")
_BETWEEN = re.compile(rf"^\(({_IDENT}) BETWEEN ({_LIT}) AND ({_LIT})\)$")
_EQ = re.compile(rf"^\(({_IDENT}) = ({_LIT})\)$")


def scan_filters(plan_json: str) -> list[str] | None:
    """The expressions of the ``FILTER`` nodes right above each Arrow scan of a plan
    (``""`` for a scan without one), or None when the plan can't be read."""
    try:
        plan = json.loads(plan_json)
    except ValueError:
        return None
    out: list[str] = []

    def walk(node: dict[str, Any], parent: dict[str, Any] | None) -> None:
        if node.get("name") == SCAN:
            ok = parent is not None and parent.get("name") == "FILTER"
            out.append(str((parent or {}).get("extra_info", {}).get("Expression", "")) if ok else "")
        for c in node.get("children", []):
            walk(c, node)

    for root in plan if isinstance(plan, list) else [plan]:
        walk(root, None)
    return out


def _depths(expr: str) -> list[int]:
    """For each character of ``expr``: its parenthesis depth after it, or -1 inside a
    quoted string (a quote itself included)."""
    out: list[int] = []
    depth, quoted = 0, False
    for c in expr:
        if c == "'":
            quoted = not quoted
            out.append(-1)
            continue
        if not quoted:
            depth += (c == "(") - (c == ")")
        out.append(-1 if quoted else depth)
    return out


def _split_top(expr: str, sep: str) -> list[str]:
    """``expr`` split on ``sep`` where it is outside parentheses and quotes."""
    depths = _depths(expr)
    parts: list[str] = []
    start = i = 0
    while i < len(expr):
        if depths[i] == 0 and (i == 0 or depths[i - 1] == 0) and expr.startswith(sep, i):
            parts.append(expr[start:i])
            i += len(sep)
            start = i
        else:
            i += 1
    parts.append(expr[start:])
    return parts


def _encloses(expr: str) -> bool:
    """Whether the parenthesis opening ``expr`` closes at its very end."""
    return 0 not in _depths(expr)[:-1]


def _strip_parens(expr: str) -> str:
    """``expr`` without parentheses that enclose all of it."""
    expr = expr.strip()
    while expr.startswith("(") and expr.endswith(")") and _encloses(expr):
        expr = expr[1:-1].strip()
    return expr


def _literal(text: str) -> Any:
    if text.startswith("'"):
        return text[1:-1].replace("''", "'")
    return int(text)


def _conjunct_terms(c: str) -> list[Term]:
    c = f"({_strip_parens(c)})"
    m = _CMP.match(c)
    if m:
        op = "==" if m.group(2) == "=" else m.group(2)
        return [Term(m.group(1), op, _literal(m.group(3)))]
    m = _NULL.match(c)
    if m:
        return [Term(m.group(1), "is_not_null" if m.group(2) else "is_null")]
    m = _BETWEEN.match(c)
    if m:
        return [Term(m.group(1), ">=", _literal(m.group(2))), Term(m.group(1), "<=", _literal(m.group(3)))]
    ors = _split_top(_strip_parens(c), " OR ")
    if len(ors) > 1:  # x IN (...) is planned as an OR of equalities on one column
        eqs = [_EQ.match(o.strip()) for o in ors]
        if all(eqs) and len({e.group(1) for e in eqs if e}) == 1:
            col = next(e.group(1) for e in eqs if e)
            return [Term(col, "in", [_literal(e.group(2)) for e in eqs if e])]
    return []


def filter_terms(expr: str, schema: pa.Schema) -> list[Term]:
    """The conjuncts of a DuckDB filter expression that can be pushed exactly to a
    persist read of ``schema`` (user layout): comparisons of a column with an integer or
    string literal, IS [NOT] NULL, BETWEEN and IN, on integer and string columns and
    ``ts``; never ``diff`` (a consolidated sum) nor floating-point columns."""
    pushable = {
        f.name
        for f in schema
        if f.name != "diff"
        and (pa.types.is_integer(f.type) or pa.types.is_string(f.type) or pa.types.is_large_string(f.type))
    }
    conjuncts: list[str] = []
    for piece in _split_top(_strip_parens(expr), " AND "):
        if conjuncts and re.search(rf"\sBETWEEN ({_LIT})$", conjuncts[-1]):
            conjuncts[-1] += " AND " + piece  # the AND of a BETWEEN
        else:
            conjuncts.append(piece)
    terms: list[Term] = []
    for c in conjuncts:
        for t in _conjunct_terms(c):
            if t.column not in pushable:
                continue
            typ = schema.field(t.column).type
            values = t.value if t.op == "in" else [t.value] if t.op not in ("is_null", "is_not_null") else []
            if any(isinstance(v, str) != (not pa.types.is_integer(typ)) for v in values):
                continue  # a literal of another type than the column: DuckDB casts; don't push
            terms.append(t)
    return terms
