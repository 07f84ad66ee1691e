"""``persist sql QUERY``: SQL (DuckDB) over collections and shards, as of any time.

Registered by ``persist_lib.cli.main``; the syntax is ``persist_lib.sql.engine``'s. Read-only: it
registers one reader per table it reads and expires them all before it exits, and its
DuckDB connection can touch no file, network, extension or setting (``SqlReadOnly``).
"""

from __future__ import annotations

import argparse
import decimal
import json
import sys
from collections.abc import Iterator, Sequence
from typing import Any

from persist_lib.cli.fit import elide, fit_widths
from persist_lib.cli.main import command
from persist_lib.cli.values import bytes_text
from persist_lib.errors import InvalidUsage
from persist_lib.handles.client import PersistClient
from persist_lib.timefmt import short_time_text, time_text

EPILOG = """\
Tables are collection names (orders, orders.raw: a dotted name may be written bare;
quote other names "like-this") and shard ids. Columns: the key and value fields, ts
(the time) and diff (the multiplicity). Times are integers (ingested data: milliseconds
since the epoch) or ISO 8601 timestamps in quotes (no offset = UTC).

  FROM orders                          the latest readable time (or --as-of)
  FROM orders AS OF 1714564800000      the collection as of that time
  FROM orders AS OF '2024-05-01 12:00:00'
  FROM changes(orders, T1, T2)         the updates after T1 up to T2 (T1 < ts <= T2):
                                       orders AS OF T1 plus these is orders AS OF T2

Read-only: no file or network access (COPY, ATTACH, read_csv/read_text/read_parquet
on a path or URL), no INSTALL/LOAD, no SET/RESET/PRAGMA of settings; export rows
with --json.

A time must be readable: since <= time < upper (`persist describe NAME` shows both;
`persist sql --tables` too). Before the since it is an error (that history was
compacted); at or past the upper the command waits --wait seconds for the data, then
fails.

Examples:
  persist sql "SELECT status, sum(diff) AS n FROM orders GROUP BY status"
  persist sql "SELECT count(*) FROM orders AS OF '2024-05-01T12:00:00Z'"
  persist sql --as-of 1714564800000 "SELECT * FROM orders LIMIT 10"
  persist sql "SELECT o.*, epoch_ms(o.ts) AS at FROM changes(orders, 1714564800000,
               1714568400000) o ORDER BY ts"
  persist sql --json "SELECT * FROM orders" | jq .
  persist sql --tables
"""


def _args(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = EPILOG
    p.add_argument("query", nargs="?", help="the SQL query (DuckDB dialect); '-' reads it from stdin")
    p.add_argument(
        "--as-of",
        metavar="TIME",
        default=None,
        help="the time of every table written without AS OF (default: each table's latest "
        "readable time, upper - 1)",
    )
    p.add_argument("--json", action="store_true", help="print the rows as a JSON array of objects")
    p.add_argument(
        "--max-rows",
        type=int,
        default=100,
        metavar="N",
        help="rows to show in the table (default 100; --json prints every row)",
    )
    p.add_argument(
        "--wait",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="how long to wait for a time at or past a table's upper (default 0: fail at once)",
    )
    p.add_argument(
        "--memory-budget-mib",
        type=int,
        default=256,
        metavar="MIB",
        help="memory budget of each streaming read (default 256)",
    )
    p.add_argument(
        "--tables",
        action="store_true",
        help="list the tables (collections) with their readable times and columns instead",
    )


@command("sql", "query collections and shards with SQL (DuckDB), as of any time", _args)
def _cmd_sql(client: PersistClient, ns: argparse.Namespace) -> Any:
    from persist_lib.sql.engine import SqlSession

    try:
        import duckdb  # noqa: F401
    except ModuleNotFoundError:
        raise InvalidUsage(
            "persist sql needs DuckDB: pip install 'persist-platform[sql]' (duckdb, polars)"
        ) from None
    if ns.max_rows < 0:
        raise InvalidUsage(f"--max-rows must be >= 0, got {ns.max_rows}")
    if ns.wait < 0:
        raise InvalidUsage(f"--wait must be >= 0, got {ns.wait}")
    with SqlSession(
        client, as_of=ns.as_of, timeout_s=ns.wait, memory_budget=max(1, ns.memory_budget_mib) << 20
    ) as s:
        if ns.tables:
            cols = ["table", "since", "upper", "latest", "columns"]
            listed = [tuple(r[c] for c in cols) for r in _tables(s, as_json=ns.json)]
            if ns.json:
                _print_json_rows(cols, listed)
            else:
                print_table(cols, listed, len(listed), keep=cols[:4])
            return None
        query = ns.query
        if query is None:
            raise InvalidUsage("give a query (or --tables); see `persist sql --help`")
        if query == "-":
            query = sys.stdin.read()
        rel = _run(s, query)
        if rel is None:
            return None
        if ns.json:
            _print_json(rel)
        else:
            rows: list[tuple[Any, ...]] = []
            for row in _rows(rel):
                rows.append(row)
                if len(rows) > ns.max_rows:
                    break
            more = len(rows) > ns.max_rows
            print_table(list(rel.columns), rows[: ns.max_rows], None if more else len(rows))
            if more:
                print(f"(only the first {ns.max_rows} rows are shown: --max-rows N, or --json for all)")
    return None


def _rows(rel: Any) -> Iterator[tuple[Any, ...]]:
    """The relation's rows, streamed (the query stops when the iteration does)."""
    with rel.to_arrow_reader(batch_size=1024) as reader:
        for b in reader:
            yield from zip(*(c.to_pylist() for c in b.columns), strict=True)


def _run(s: Any, query: str) -> Any:
    import duckdb

    try:
        return s.sql(query)
    except duckdb.CatalogException as e:
        raise InvalidUsage(
            f"{_first_line(e)} (tables are collections: {', '.join(s.collections()) or 'none'}; "
            "or shard ids: `persist shards`)"
        ) from None
    except duckdb.Error as e:
        raise InvalidUsage(f"DuckDB: {e}") from None


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def _tables(s: Any, *, as_json: bool = False) -> list[dict[str, Any]]:
    """The tables with their readable times: ``--json`` as ``format_time`` gives them (the
    integer and its timestamp), the table as timestamps alone (fits 120 columns)."""
    from persist_lib.sql.times import format_time

    when = format_time if as_json else (lambda t: "-" if t is None else short_time_text(t))

    out = []
    for name in s.collections():
        t = s.table(name)
        since, upper = t.since, t.upper
        latest = upper.time - 1 if upper.time is not None and upper.time > 0 else None
        out.append(
            {
                "table": name,
                "since": when(since.time),
                "upper": when(upper.time),
                "latest": "-" if latest is None or not since.less_equal(latest) else when(latest),
                "columns": ", ".join(f.name for f in t.schema),
            }
        )
    return out


def _jsonable(v: Any) -> Any:
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (bytes, bytearray)):
        return v.hex()
    if isinstance(v, decimal.Decimal):  # DuckDB's sum() of BIGINT is a HUGEINT (decimal)
        return int(v) if v.is_finite() and v == v.to_integral_value() else float(v)
    return str(v)  # dates, decimals, UUIDs, ...


def _print_json(rel: Any) -> None:
    cols = list(rel.columns)
    out = sys.stdout
    out.write("[")
    first = True
    for row in _rows(rel):
        out.write("\n  " if first else ",\n  ")
        first = False
        out.write(json.dumps({c: _jsonable(v) for c, v in zip(cols, row, strict=True)}))
    out.write("\n]\n" if not first else "]\n")


def _print_json_rows(cols: list[str], rows: Sequence[Sequence[Any]]) -> None:
    json.dump([{c: _jsonable(v) for c, v in zip(cols, r, strict=True)} for r in rows], sys.stdout, indent=2)
    sys.stdout.write("\n")


def _cell(v: Any, col: str) -> str:
    if v is None:
        return "NULL"
    if col == "ts" and isinstance(v, int) and not isinstance(v, bool):
        return time_text(v)  # the time column: a timestamp beside an epoch-ms integer
    if isinstance(v, (bytes, bytearray)):
        return bytes_text(v)
    return str(v).replace("\n", " ")


def print_table(
    cols: list[str], rows: Sequence[Sequence[Any]], total: int | None, *, keep: Sequence[str] = ("ts",)
) -> None:
    """A plain-text table fitted to the line width (``persist_lib.cli.fit``): numbers
    right-aligned, long text cells cut (never those of the ``keep`` columns); ``ts`` with
    its timestamp; bytes as text; ``total`` rows in the footer when known."""
    cells = [[_cell(v, c) for v, c in zip(r, cols, strict=True)] for r in rows]
    numeric = [
        c != "ts"
        and all(
            isinstance(r[i], (int, float, decimal.Decimal)) and not isinstance(r[i], bool)
            for r in rows
            if r[i] is not None
        )
        for i, c in enumerate(cols)
    ]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(cols)]
    widths = fit_widths(widths, [not n and c not in keep for n, c in zip(numeric, cols, strict=True)])

    def line(vals: Sequence[str]) -> str:
        return "  ".join(
            elide(v, w).rjust(w) if num else elide(v, w).ljust(w)
            for v, w, num in zip(vals, widths, numeric, strict=True)
        ).rstrip()

    print(line(cols))
    print("  ".join("-" * w for w in widths))
    for r in cells:
        print(line(r))
    if total is not None:
        print(f"({total} row{'s' if total != 1 else ''})")
