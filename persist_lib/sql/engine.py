"""SQL time travel: collections and shards as DuckDB relations and polars frames, as of
any time in ``[since, upper)``, streamed (nothing is materialized whole).

A ``SqlSession`` opens readers on a location and hands out *sources*: Arrow streams
(``__arrow_c_stream__``) of a collection or shard as of a time (``snapshot``), or of
its changes between two times (``changes``). Each scan of a source opens a fresh
streaming read (``snapshot_batches`` / ``updates_between_batches``, within the
session's memory budget), so a DuckDB relation or polars LazyFrame built on one can be
evaluated any number of times and always gives the same rows: times in ``[since,
upper)`` are definite. The session expires every reader it registered on ``close()``
(use it as a context manager); nothing is written to the location.

    from persist_lib.sql.engine import SqlSession
    with SqlSession(client) as s:
        s.relation("orders", as_of=1714564800000).aggregate("count(*)").fetchall()
        s.lazy_frame("orders", as_of="2024-05-01T12:00:00Z").filter(...).collect()
        s.sql("SELECT status, sum(diff) FROM orders AS OF '2024-05-01 12:00' GROUP BY 1")
        s.sql("SELECT * FROM changes(orders, 1714564800000, 1714568400000)")

**Tables.** A collection by name (``orders``, ``orders.raw``: a dotted name may be
written bare) or a shard by id (``s0a1b...``). Columns: key fields, value fields,
``ts`` (int64) and ``diff`` (int64): a snapshot has ``ts = as_of`` and one row per
distinct record with its multiplicity in ``diff``; ``changes`` has the updates with
their own times.

**Times** are ints (ingested data: milliseconds since the epoch) or ISO 8601 strings
(``2024-05-01T12:00:00Z``; no offset means UTC). A snapshot at ``as_of`` is valid for
``since <= as_of < upper``: before the since it is an ``InvalidUsage`` (history there
is compacted), at or past the upper the read waits up to ``timeout_s`` for it and
then raises ``Timeout`` - the errors of the reads themselves, with the readable range
added to the message. Without a time, a table is read at its latest readable time
(``upper - 1``), fixed when the source is made.

**SQL syntax** (``SqlSession.sql`` and ``persist sql``), rewritten before DuckDB sees it:

* ``FROM orders`` - the latest readable time (or the session default ``as_of``);
* ``FROM orders AS OF 1714564800000`` / ``AS OF '2024-05-01 12:00:00'`` /
  ``AS OF TIMESTAMP '2024-05-01T12:00:00Z'`` - that time (before or after an alias:
  ``orders AS OF t o`` or ``orders o AS OF t``);
* ``FROM changes(orders, T1, T2)`` - every update after ``T1`` up to and including
  ``T2`` (``T1 < ts <= T2``), so that ``orders AS OF T1`` plus these changes is
  ``orders AS OF T2``; both must be readable times (``since <= T1 <= T2 < upper``).

Table references are recognised after ``FROM``, ``JOIN``, a comma of a ``FROM`` list,
``DESCRIBE`` and ``SUMMARIZE``; names that are not collections or shards (a CTE, a
DuckDB table function such as ``read_parquet``) are left to DuckDB. The same table may
appear at several times in one query (``orders AS OF t1 JOIN orders AS OF t2``).

**Read-only.** A session's own DuckDB connection can touch no file (but its private
spill directory), no network, no extension and no setting (``guard``): such a
statement raises ``SqlReadOnly`` (an ``InvalidUsage``). To export rows, write
``snapshot(...).batches()`` with pyarrow, or use ``persist sql --json``.

The session (this module) opens tables and registers them as DuckDB views; the tables
and their Arrow sources are in ``sources``, the query rewrite in ``rewrite``, time
parsing and display in ``times``.

DuckDB and polars are optional dependencies (``pip install persist-platform[sql]``),
imported when first used.
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from persist_lib.errors import InvalidUsage, ShardTombstoned, Timeout
from persist_lib.frontier import Antichain
from persist_lib.ids import ShardId
from persist_lib.shard.codec import Schemas
from persist_lib.shard.predicate import Predicate
from persist_lib.sql.direct_scan import direct_relation
from persist_lib.sql.guard import SqlReadOnly as SqlReadOnly
from persist_lib.sql.guard import read_only_connection, read_only_error
from persist_lib.sql.pushdown import filter_terms, scan_filters
from persist_lib.sql.rewrite import Span, TableRef, explain_error, rewrite_sql
from persist_lib.sql.sources import ArrowSource, Scan, Table, lazy_frame
from persist_lib.sql.times import TimeLike, format_time, parse_time

if TYPE_CHECKING:  # pragma: no cover
    from persist_lib.handles.client import PersistClient
    from persist_lib.storage import StorageController

# ----- the session -----------------------------------------------------------------------


class SqlSession:
    """Time-travel reads of one location through DuckDB and polars (read-only).

    ``as_of`` (optional) is the default time of table references without one in
    ``sql``; ``memory_budget`` bounds each streaming read (``ReadHandle.snapshot_batches``);
    ``timeout_s`` is how long a read waits for a time at or past the upper (default:
    the client's ``snapshot_timeout_s``, as for reads). ``connection`` is the DuckDB
    connection to use (default: a new in-memory, read-only one -- ``read_only_connection``
    -- closed with the session; a connection you pass is used as it is, with whatever
    file and network access you gave it). ``direct_reads`` (default on): a shard snapshot
    whose parts need no consolidation is read by DuckDB from verified copies of its
    parts (``direct_scan``; own connection only); off, every source is streamed.
    """

    def __init__(
        self,
        client: PersistClient,
        *,
        as_of: TimeLike | None = None,
        memory_budget: int | None = None,
        timeout_s: float | None = None,
        connection: Any | None = None,
        owns_client: bool = False,
        direct_reads: bool = True,
    ) -> None:
        self.client = client
        self.as_of = None if as_of is None else parse_time(as_of, "as_of")
        self.memory_budget = memory_budget
        self.timeout_s = timeout_s
        self._con = connection
        self._owns_con = connection is None
        self._scratch: str | None = None  # the own connection's spill directory
        self._copies: str | None = None  # verified part copies of direct views (own connection only)
        self._direct_reads = direct_reads
        self._owns_client = owns_client
        self._ctl: StorageController | None = None
        self._tables: dict[str, Table] = {}
        self._views: dict[tuple[str, Scan], str] = {}
        self._view_sources: dict[str, ArrowSource] = {}
        self._pushed_views: dict[tuple[str, str], str] = {}  # (view, filter) -> view
        self._direct_views: dict[tuple[str, Scan, str], str | None] = {}  # (table, scan, filter) -> view
        self._view_ids = itertools.count()
        self._collections: list[str] | None = None
        self._closed = False

    # ----- lifecycle ---------------------------------------------------------------

    def close(self) -> None:
        """Expires every reader the session registered; closes its DuckDB connection
        (if it made it) and its client (if it owns it). Relations and frames built
        from the session can't be evaluated afterwards."""
        if self._closed:
            return
        self._closed = True
        tables, self._tables = list(self._tables.values()), {}
        for t in tables:
            t.close()
        if self._ctl is not None:
            self._ctl.close()
            self._ctl = None
        if self._con is not None and self._owns_con:
            self._con.close()
            self._con = None
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None
        if self._owns_client:
            self.client.close()

    def __repr__(self) -> str:
        # The client's repr redacts its location's credentials.
        return f"SqlSession(client={self.client!r}, as_of={self.as_of!r}, closed={self._closed})"

    def __enter__(self) -> SqlSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def connection(self) -> Any:
        """The DuckDB connection (``duckdb.DuckDBPyConnection``): by default a
        read-only one (``read_only_connection``)."""
        self._check_open()
        if self._con is None:
            self._scratch = tempfile.mkdtemp(prefix="persist-sql-")  # private: 0700
            try:
                copies = os.path.join(self._scratch, "parts")
                os.mkdir(copies, 0o700)
                self._con = read_only_connection(self._scratch, copies)
                self._copies = copies
            except BaseException:
                shutil.rmtree(self._scratch, ignore_errors=True)
                self._scratch = None
                raise
        return self._con

    # ----- tables ------------------------------------------------------------------

    def collections(self) -> list[str]:
        """The names of the location's collections."""
        if self._collections is None:
            self._collections = self._controller().list_collections()
        return list(self._collections)

    def table(self, name: str) -> Table:
        """The collection ``name`` or the shard with that id, opened for reading
        (once per session)."""
        self._check_open()
        key = self.resolve(name)
        if key is None:
            raise InvalidUsage(
                f"no collection or shard named {name!r}; collections: {self.collections()} "
                "(shards: `persist shards`)"
            )
        t = self._tables.get(key)
        if t is None:
            t = self._tables[key] = self._open_table(key)
        return t

    def resolve(self, name: str) -> str | None:
        """The collection name or shard id ``name`` refers to (collections first; a
        collection name matches case-insensitively when unambiguous), or None."""
        cols = self.collections()
        if name in cols:
            return name
        folded = [c for c in cols if c.lower() == name.lower()]
        if len(folded) == 1:
            return folded[0]
        try:
            sid = str(ShardId.parse(name.lower()))
        except InvalidUsage:
            return None
        return sid if self.client.machine(sid).fetch_latest().exists else None

    def readable(self, name: str) -> tuple[Antichain, Antichain]:
        """``(since, upper)``: the table can be read at times in ``[since, upper)``."""
        t = self.table(name)
        return t.since, t.upper

    # ----- sources -----------------------------------------------------------------

    def snapshot(self, name: str, as_of: TimeLike | None = None) -> ArrowSource:
        """The table as of ``as_of`` (default: the session's ``as_of``, else the latest
        readable time, fixed now) as a re-scannable Arrow stream source. The time is
        checked now (``InvalidUsage`` before the since; past the upper this waits up
        to ``timeout_s``, then ``Timeout``)."""
        t = self.table(name)
        if as_of is None:
            at = self.as_of if self.as_of is not None else self._latest(t)
        else:
            at = parse_time(as_of, "as_of")
        src = ArrowSource(t, Scan(as_of=at), self.memory_budget, self.timeout_s)
        self._check_source(src, f"as of {format_time(at)}")
        return src

    def changes(self, name: str, t1: TimeLike, t2: TimeLike) -> ArrowSource:
        """The updates after ``t1`` up to and including ``t2`` (``t1 < ts <= t2``),
        times not forwarded: ``snapshot(t1)`` plus these is ``snapshot(t2)``. Both
        must be readable times (``since <= t1 <= t2 < upper``)."""
        t = self.table(name)
        lo = parse_time(t1, "t1")
        hi = parse_time(t2, "t2")
        if hi < lo:
            raise InvalidUsage(f"{t.label}: changes({format_time(lo)}, {format_time(hi)}): t2 is before t1")
        src = ArrowSource(t, Scan(lower=lo + 1, upper=hi + 1), self.memory_budget, self.timeout_s)
        self._check_source(src, f"changes after {format_time(lo)} up to {format_time(hi)}")
        return src

    def reader(self, name: str, as_of: TimeLike | None = None) -> pa.RecordBatchReader:
        """One streaming scan of ``snapshot(name, as_of)`` as a ``RecordBatchReader``."""
        return self.snapshot(name, as_of).reader()

    # ----- DuckDB --------------------------------------------------------------------

    def relation(self, name: str, as_of: TimeLike | None = None) -> Any:
        """A DuckDB relation of the table as of ``as_of`` (streamed on every evaluation)."""
        return self.connection.from_arrow(self.snapshot(name, as_of))

    def changes_relation(self, name: str, t1: TimeLike, t2: TimeLike) -> Any:
        """A DuckDB relation of ``changes(name, t1, t2)``."""
        return self.connection.from_arrow(self.changes(name, t1, t2))

    def register(self, view: str, source: ArrowSource) -> str:
        """Registers ``source`` under the name ``view`` in the DuckDB connection."""
        self.connection.register(view, source)
        self._view_sources[view] = source
        return view

    def sql(self, query: str, *, as_of: TimeLike | None = None) -> Any:
        """Runs ``query`` (the syntax of the module docstring) in DuckDB and returns its
        relation (``None`` for a statement without a result). ``as_of`` overrides the
        session's default time for table references without ``AS OF``. A statement that
        touches a file, the network, an extension or a setting raises ``SqlReadOnly``;
        other DuckDB errors are DuckDB's own."""
        import duckdb

        default = self.as_of if as_of is None else parse_time(as_of, "as_of")
        latest: dict[str, int] = {}  # one "latest" time per table within a query
        used: list[str] = []
        spans: list[Span] = []
        refs: dict[str, str] = {}  # view name -> the user's text of the reference

        def view_for(ref: TableRef) -> str | None:
            view = self._view_for(ref, default, latest)
            if view is not None:
                used.append(view)
                refs.setdefault(view, ref.text)
            return view

        text = rewrite_sql(query, view_for, spans)
        con = self.connection
        # Each source's view is replaced by a direct view (DuckDB reading verified part
        # copies) where the parts allow, else by the stream with the query's filter pushed
        # down (one source only), else kept.
        pred = self._pushed_filter(text, used)
        replace: dict[str, str] = {}
        for v in dict.fromkeys(used):
            src = self._view_sources[v]
            direct = self._direct_view(src, pred)
            if direct is not None:
                replace[v] = direct
            elif pred is not None:
                replace[v] = self._pushed_stream(v, src, pred)
        if replace:
            spans.clear()  # positions of the second rewrite, for ``explain_error``

            def final_for(ref: TableRef) -> str | None:
                v = self._view_for(ref, default, latest)
                if v is None:
                    return None
                out = replace.get(v, v)
                refs.setdefault(out, ref.text)
                return out

            text = rewrite_sql(query, final_for, spans)
        try:
            return con.sql(text)
        except duckdb.Error as e:
            refused = read_only_error(e)
            if refused is not None:
                raise refused from None
            told = explain_error(str(e), query, text, spans, refs) if text != query else str(e)
            if told == str(e):
                raise
            # DuckDB's own error, told about the user's query (never the internal views)
            raise type(e)(told) from None

    def _pushed_filter(self, text: str, used: list[str]) -> Predicate | None:
        """The query's filter on its one persist source, to push down to its reads
        (``sql.pushdown``), or None (several sources or none, or nothing to push).
        DuckDB still applies the whole filter: the rows are the same."""
        import duckdb

        if len(set(used)) != 1:
            return None
        src = self._view_sources[used[0]]
        try:
            plan = self.connection.sql("EXPLAIN (FORMAT json) " + text).fetchall()
        except duckdb.Error:
            return None  # not a query DuckDB plans (DESCRIBE, a refused statement...)
        exprs = scan_filters(str(plan[0][1])) if plan else None
        if not exprs or len(exprs) != 1 or not exprs[0]:
            return None
        terms = []
        for term in filter_terms(exprs[0], src.schema):
            try:
                Predicate((term,)).bind(src.table.schemas, shard=src.table.label)
            except InvalidUsage:
                continue  # a literal the column's type can't hold: leave it to DuckDB
            terms.append(term)
        if not terms:
            return None
        return Predicate(tuple(terms))

    def _pushed_stream(self, view: str, src: ArrowSource, pred: Predicate) -> str:
        """The stream view of ``src`` with ``pred`` pushed down to its reads."""
        k = (view, pred.describe())
        pushed = self._pushed_views.get(k)
        if pushed is None:
            pushed = self._pushed_views[k] = self.register(
                f"__persist_{next(self._view_ids)}", src.with_filter(pred)
            )
        return pushed

    def _view_for(self, ref: TableRef, default: int | None, latest: dict[str, int]) -> str | None:
        key = self.resolve(ref.name)
        if key is None:
            if ref.kind == "changes" or ref.as_of is not None:
                raise InvalidUsage(
                    f"no collection or shard named {ref.name!r} (in {ref.text!r}); collections: "
                    f"{self.collections()}"
                )
            return None  # a CTE, a DuckDB table or view: DuckDB resolves it
        if ref.kind == "changes":
            assert ref.t1 is not None and ref.t2 is not None
            src = self.changes(key, ref.t1, ref.t2)
        else:
            at = ref.as_of if ref.as_of is not None else default
            if at is None:
                at = latest.get(key)
                if at is None:
                    at = latest[key] = self.table(key).latest()
            src = self.snapshot(key, at)
        k = (src.table.label, src.scan)
        view = self._views.get(k)
        if view is None:
            view = self._views[k] = self.register(f"__persist_{next(self._view_ids)}", src)
        return view

    def _direct_view(self, src: ArrowSource, pred: Predicate | None) -> str | None:
        """A view of ``src`` that DuckDB reads from verified copies of its parts
        (``direct_scan``; with ``pred``, only the parts its statistics don't rule out),
        when ``src`` is a shard snapshot whose parts need no consolidation and the session
        owns its connection; None otherwise. Decided (and copied) once per session for a
        source and filter."""
        if not self._direct_reads or self._copies is None or src.scan.as_of is None:
            return None
        k = (src.table.label, src.scan, pred.describe() if pred is not None else "")
        if k in self._direct_views:
            return self._direct_views[k]
        view = f"__persist_{next(self._view_ids)}"
        paths = src.table.direct_paths(src.scan.as_of, self.timeout_s, Path(self._copies) / view, pred)
        if paths is not None:
            direct_relation(self.connection, src.table.schemas, paths, src.scan.as_of).create_view(view)
        self._direct_views[k] = out = view if paths is not None else None
        return out

    # ----- polars ----------------------------------------------------------------------

    def lazy_frame(self, name: str, as_of: TimeLike | None = None) -> Any:
        """A polars ``LazyFrame`` of the table as of ``as_of``: each ``collect`` streams
        a new read (projection, filters and ``head`` applied batch by batch)."""
        return lazy_frame(self.snapshot(name, as_of))

    def changes_lazy_frame(self, name: str, t1: TimeLike, t2: TimeLike) -> Any:
        """A polars ``LazyFrame`` of ``changes(name, t1, t2)``."""
        return lazy_frame(self.changes(name, t1, t2))

    # ----- internals -----------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidUsage("this SqlSession was closed; open a new one")

    def _controller(self) -> StorageController:
        self._check_open()
        if self._ctl is None:
            from persist_lib.storage import StorageController

            self._ctl = StorageController(self.client, read_only=True)
        return self._ctl

    def _open_table(self, key: str) -> Table:
        if key in (self._collections or []):
            ctl = self._controller()
            r = ctl.acquire_read_handle(key)
            return Table(f"collection {key}", r.schemas, r)
        state = self.client.machine(key).fetch_latest()
        if state.tombstone:
            raise ShardTombstoned(f"shard {key} was finalized: it has no data to read")
        if state.schemas is None:
            raise InvalidUsage(f"shard {key} has no schemas recorded yet")
        schemas = Schemas.from_json(state.schemas)
        h = self.client.open_leased_reader(key, schemas.key, schemas.val, purpose="persist sql")
        return Table(f"shard {key}", schemas, h)

    def _latest(self, t: Table) -> int:
        return t.latest()

    def _check_source(self, src: ArrowSource, what: str) -> None:
        """Runs the read's own checks now (since, upper with the wait), so a bad time
        fails here with the read's error type rather than inside a DuckDB scan."""
        try:
            src.open_stream().close()
        except (InvalidUsage, Timeout) as e:
            if type(e) in (InvalidUsage, Timeout):
                raise src.table.explain(e, what) from e
            raise


def connect(
    blob_uri: str | None = None,
    consensus_uri: str | None = None,
    **kwargs: Any,
) -> SqlSession:
    """A session on an existing location (default: the ``PERSIST_*`` variables, else the
    embedded default); it owns its client. A missing local location is a
    ``LocationNotFound`` (nothing is created)."""
    from persist_lib.config import PersistConfig
    from persist_lib.handles.client import PersistClient, default_uris

    blob, consensus = default_uris()
    client = PersistClient.open_existing(
        blob_uri or blob, consensus_uri or consensus, PersistConfig(background_heartbeats=True)
    )
    return SqlSession(client, owns_client=True, **kwargs)
