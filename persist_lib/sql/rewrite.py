"""The ``AS OF`` / ``changes()`` rewrite of a SQL query before DuckDB sees it.

The query is tokenized (strings, quoted identifiers, comments and dollar quotes kept
whole); each table reference after ``FROM``, ``JOIN``, a comma of a ``FROM`` list,
``DESCRIBE`` or ``SUMMARIZE`` becomes a ``TableRef`` and is replaced by the view name
the session's callback returns for it (``None`` leaves it to DuckDB). The accepted
syntax is described in ``persist_lib.sql.engine``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from persist_lib.errors import InvalidUsage
from persist_lib.sql.times import parse_time


@dataclass(frozen=True)
class TableRef:
    """A table reference found in a query: ``name [AS OF t]`` or ``changes(name, t1, t2)``."""

    kind: str  # "snapshot" | "changes"
    name: str
    text: str
    as_of: int | None = None
    t1: int | None = None
    t2: int | None = None


_TOKEN = re.compile(
    r"""
    (?P<ws>\s+)
  | (?P<comment>--[^\n]*|/\*.*?\*/)
  | (?P<string>[eE]?'(?:[^']|'')*')
  | (?P<dollar>\$(?P<tag>[A-Za-z_]*)\$.*?\$(?P=tag)\$)
  | (?P<qident>"(?:[^"]|"")*")
  | (?P<shard>s[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}(?![\w$]))
  | (?P<ident>[^\W\d][\w$]*)
  | (?P<number>\d+(?:\.\d*)?(?:[eE][+-]?\d+)?|\.\d+)
  | (?P<op>::|<=|>=|<>|!=|\|\||->>|->|=>|.)
    """,
    re.X | re.S,
)


@dataclass
class _Tok:
    kind: str
    text: str
    start: int
    end: int

    @property
    def upper(self) -> str:
        return self.text.upper() if self.kind == "ident" else ""


def _tokens(query: str) -> list[_Tok]:
    out = []
    for m in _TOKEN.finditer(query):
        kind = m.lastgroup or "op"
        if kind == "tag":
            kind = "dollar"
        if kind in ("ws", "comment"):
            continue
        out.append(_Tok(kind, m.group(), m.start(), m.end()))
    return out


# Keywords after which a table reference follows.
_TABLE_INTRO = {"FROM", "JOIN", "DESCRIBE", "SUMMARIZE"}
# Keywords that end a FROM list at their paren depth.
_CLAUSE_END = {
    "WHERE", "GROUP", "ORDER", "HAVING", "LIMIT", "OFFSET", "QUALIFY", "WINDOW", "UNION",
    "EXCEPT", "INTERSECT", "SELECT", "RETURNING", "FETCH", "VALUES", "SET",
}
# Words that may follow a table reference without being its alias.
_NOT_ALIAS = _CLAUSE_END | {
    "JOIN", "INNER", "LEFT", "RIGHT", "FULL", "OUTER", "CROSS", "NATURAL", "POSITIONAL",
    "ASOF", "ANTI", "SEMI", "ON", "USING", "SAMPLE", "TABLESAMPLE", "PIVOT", "UNPIVOT",
    "LATERAL", "FOR", "AT", "INTO", "WITH", "FROM",
}
# Functions whose arguments use the keyword FROM (not a table).
_FROM_FUNCTIONS = {"EXTRACT", "TRIM", "SUBSTRING", "SUBSTR", "OVERLAY", "POSITION"}


def _unquote_ident(t: _Tok) -> str:
    return t.text[1:-1].replace('""', '"') if t.kind == "qident" else t.text


def _quote_ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _time_literal(toks: list[_Tok], i: int, what: str) -> tuple[int, int]:
    """Parses a time at ``toks[i]``: an integer, a string, or ``TIMESTAMP 'string'``.
    Returns the time and the index after it."""
    if i < len(toks) and toks[i].upper == "TIMESTAMP" and i + 1 < len(toks) and toks[i + 1].kind == "string":
        i += 1
    if i < len(toks):
        t = toks[i]
        if t.kind == "number" and t.text.isdigit():
            return parse_time(int(t.text), what), i + 1
        if t.kind == "string" and t.text[0] not in "eE":
            return parse_time(t.text[1:-1].replace("''", "'"), what), i + 1
    got = toks[i].text if i < len(toks) else "the end of the query"
    raise InvalidUsage(
        f"{what}: expected a time (an integer, or a quoted ISO timestamp such as "
        f"'2024-05-01T12:00:00Z'), got {got!r}"
    )


def _name_at(toks: list[_Tok], i: int) -> tuple[str, int] | None:
    """A (possibly dotted) table name at ``toks[i]``: its text and the index after it."""
    if i >= len(toks) or toks[i].kind not in ("ident", "qident", "shard"):
        return None
    parts = [_unquote_ident(toks[i])]
    j = i + 1
    while (
        j + 1 < len(toks)
        and toks[j].text == "."
        and toks[j].start == toks[j - 1].end
        and toks[j + 1].kind in ("ident", "qident")
        and toks[j + 1].start == toks[j].end
    ):
        parts.append(_unquote_ident(toks[j + 1]))
        j += 2
    return ".".join(parts), j


def _has_alias(toks: list[_Tok], j: int) -> bool:
    if j >= len(toks):
        return False
    t = toks[j]
    if t.kind == "qident":
        return True
    return t.kind == "ident" and (t.upper == "AS" or t.upper not in _NOT_ALIAS)


def _cte_names(toks: list[_Tok]) -> set[str]:
    """Names defined by ``WITH name AS (...)`` (they shadow collections)."""
    out = set()
    for i, t in enumerate(toks[:-2]):
        if t.kind in ("ident", "qident") and toks[i + 1].upper == "AS":
            k = i + 2
            while k < len(toks) and toks[k].upper in ("NOT", "MATERIALIZED"):
                k += 1
            if k < len(toks) and toks[k].text == "(":
                out.add(_unquote_ident(t).lower())
    return out


def rewrite_sql(
    query: str,
    view_for: Callable[[TableRef], str | None],
    spans: list[Span] | None = None,
) -> str:
    """Rewrites the table references of ``query`` (the syntax in ``engine``'s docstring) to the views
    ``view_for`` returns (``None``: leave the reference to DuckDB). ``spans``, when given,
    receives where each rewritten piece is, for ``explain_error``."""
    toks = _tokens(query)
    ctes = _cte_names(toks)
    edits: list[tuple[int, int, str]] = []
    in_from = [False]  # per paren depth: inside a FROM list
    fn_paren = [False]  # per paren depth: the arguments of EXTRACT/TRIM/...
    expect = ""  # the next token is in a table position (after this keyword or ',')
    i = 0
    while i < len(toks):
        t = toks[i]
        if expect:
            alias_ok = expect in ("FROM", "JOIN", ",")
            expect = ""
            done = _table_ref(query, toks, i, ctes, view_for, edits, alias_ok)
            if done is not None:
                i = done
                continue
        if t.text == "(":
            fn_paren.append(i > 0 and toks[i - 1].upper in _FROM_FUNCTIONS)
            in_from.append(False)
        elif t.text == ")":
            if len(in_from) > 1:
                in_from.pop()
                fn_paren.pop()
        elif t.text == ";":
            in_from = [False]
            fn_paren = [False]
        elif t.text == ",":
            expect = "," if in_from[-1] else ""
        elif t.upper in _TABLE_INTRO and not fn_paren[-1]:
            expect = t.upper
            if t.upper == "FROM":
                in_from[-1] = True
        elif t.upper in _CLAUSE_END:
            in_from[-1] = False
        i += 1
    if spans is not None:
        shift = 0
        for start, end, text in sorted(edits):
            spans.append(Span(start + shift, start + shift + len(text), start, end))
            shift += len(text) - (end - start)
    for start, end, text in sorted(edits, reverse=True):
        query = query[:start] + text + query[end:]
    return query


@dataclass(frozen=True)
class Span:
    """A rewritten piece: ``[new_start, new_end)`` of the rewritten query replaced
    ``[start, end)`` of the user's."""

    new_start: int
    new_end: int
    start: int
    end: int


def original_position(spans: list[Span], pos: int) -> int:
    """Where position ``pos`` of the rewritten query is in the user's query (the start of
    the reference when it falls inside a rewritten piece)."""
    shift = 0
    for sp in spans:
        if pos < sp.new_start:
            break
        if pos < sp.new_end:
            return sp.start
        shift = sp.end - sp.new_end
    return pos + shift


_LINE = re.compile(r"^LINE (\d+): (.*)\n( *)(\^+) *$", re.M)
_VIEW = re.compile(r'"?__persist_\d+"?')


def explain_error(message: str, query: str, rewritten: str, spans: list[Span], views: dict[str, str]) -> str:
    """A DuckDB error message about ``rewritten`` told in terms of the user's ``query``:
    the internal view names (``"__persist_0"``) become the user's table references
    (``views``: view name -> the reference's text) and the ``LINE n: ...`` excerpt with its
    caret points into the user's query."""

    def name(m: re.Match[str]) -> str:
        return views.get(m.group().strip('"'), m.group())

    m = _LINE.search(message)
    if m is None:
        return _VIEW.sub(name, message)
    head = _VIEW.sub(name, message[: m.start()])
    tail = _VIEW.sub(name, message[m.end() :])
    line_no, shown, caret = int(m.group(1)), m.group(2), len(m.group(3)) - len(f"LINE {m.group(1)}: ")
    lines = rewritten.split("\n")
    if not 1 <= line_no <= len(lines):
        return _VIEW.sub(name, message)
    line = lines[line_no - 1]
    body = shown[3:] if shown.startswith("...") else shown
    off = line.find(body.rstrip(".")) if body else -1
    if off < 0 or caret < 0:
        return _VIEW.sub(name, message)
    line_start = sum(len(x) + 1 for x in lines[: line_no - 1])
    pos = line_start + off + caret - (len(shown) - len(body))
    orig = original_position(spans, pos)
    o_line_no = query.count("\n", 0, orig) + 1
    o_start = query.rfind("\n", 0, orig) + 1
    o_end = query.find("\n", orig)
    o_line = query[o_start : len(query) if o_end < 0 else o_end]
    prefix = f"LINE {o_line_no}: "
    excerpt = f"{prefix}{o_line}\n{' ' * (len(prefix) + orig - o_start)}{m.group(4)}"
    return f"{head}{excerpt}{tail}"


def _table_ref(
    query: str,
    toks: list[_Tok],
    i: int,
    ctes: set[str],
    view_for: Callable[[TableRef], str | None],
    edits: list[tuple[int, int, str]],
    alias_ok: bool,
) -> int | None:
    """Handles a table reference at ``toks[i]``; returns the index after it if it
    rewrote it, else None."""
    named = _name_at(toks, i)
    if named is None:
        return None
    name, j = named
    if j < len(toks) and toks[j].text == "(":
        if name.lower() != "changes" or "changes" in ctes:
            return None  # a DuckDB table function (read_parquet, ...)
        arg = _name_at(toks, j + 1)
        if arg is not None:
            target, k = arg
        elif j + 1 < len(toks) and toks[j + 1].kind == "string":
            target, k = toks[j + 1].text[1:-1].replace("''", "'"), j + 2
        else:
            raise InvalidUsage(f"changes(...): expected a collection name or shard id first, in {query!r}")
        where = "changes(" + target + ", ...)"
        if k >= len(toks) or toks[k].text != ",":
            raise InvalidUsage(f"{where}: expected changes(NAME, T1, T2)")
        t1, k = _time_literal(toks, k + 1, f"{where} T1")
        if k >= len(toks) or toks[k].text != ",":
            raise InvalidUsage(f"{where}: expected changes(NAME, T1, T2)")
        t2, k = _time_literal(toks, k + 1, f"{where} T2")
        if k >= len(toks) or toks[k].text != ")":
            raise InvalidUsage(f"{where}: expected ')' after T2")
        k += 1
        text = query[toks[i].start : toks[k - 1].end]
        view = view_for(TableRef("changes", target, text, t1=t1, t2=t2))
        if view is None:
            return None
        alias = "" if not alias_ok or _has_alias(toks, k) else " AS changes"
        edits.append((toks[i].start, toks[k - 1].end, _quote_ident(view) + alias))
        return k
    if name.lower() in ctes:
        return None
    as_of = None
    k = j
    late: tuple[int, int] | None = None  # an AS OF written after the alias: removed
    if _is_as_of(toks, k):
        as_of, k = _time_literal(toks, k + 2, f"{name} AS OF")
    elif alias_ok and _has_alias(toks, k):
        a = k + 2 if toks[k].upper == "AS" else k + 1  # after `[AS] alias`
        if _is_as_of(toks, a):
            as_of, end = _time_literal(toks, a + 2, f"{name} AS OF")
            late = (toks[a].start, toks[end - 1].end)
    text = query[toks[i].start : toks[k - 1].end]
    view = view_for(TableRef("snapshot", name, text, as_of=as_of))
    if view is None:
        return None
    alias = "" if not alias_ok or _has_alias(toks, k) else " AS " + _quote_ident(name.split(".")[-1])
    edits.append((toks[i].start, toks[k - 1].end, _quote_ident(view) + alias))
    if late is not None:
        edits.append((late[0], late[1], ""))
    return k


def _is_as_of(toks: list[_Tok], k: int) -> bool:
    return k + 1 < len(toks) and toks[k].upper == "AS" and toks[k + 1].upper == "OF"
