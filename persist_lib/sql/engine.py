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
spill directory), no network, no extension and no setting (``sql_guard``): such a
statement raises ``SqlReadOnly`` (an ``InvalidUsage``). To export rows, write
``snapshot(...).batches()`` with pyarrow, or use ``persist sql --json``.

DuckDB and polars are optional dependencies (``pip install persist-platform[sql]``),
imported when first used.
"""

from __future__ import annotations

import datetime as dt
import itertools
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from persist_lib.errors import InvalidUsage, ShardTombstoned, Timeout
from persist_lib.frontier import Antichain, check_time
from persist_lib.handles.batch_stream import BatchStream
from persist_lib.handles.read import ReadHandle
from persist_lib.ids import ShardId
from persist_lib.shard.codec import Schemas, user_schema
from persist_lib.sql.guard import SqlReadOnly as SqlReadOnly
from persist_lib.sql.guard import read_only_connection, read_only_error

if TYPE_CHECKING:  # pragma: no cover
    from persist_lib.handles.client import PersistClient
    from persist_lib.storage import CollectionReader, StorageController

TimeLike = int | str

#: Times at or above this are shown as UTC timestamps too (ms since the epoch, >= 1973).
_EPOCH_MS_FROM = 10**11
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)


# ----- times -------------------------------------------------------------------------


def parse_time(value: object, what: str = "time") -> int:
    """A time from an int, a string of digits, or an ISO 8601 timestamp (milliseconds
    since the epoch; a timestamp without an offset is UTC)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return check_time(value, what)
    if isinstance(value, dt.datetime):
        d = value if value.tzinfo else value.replace(tzinfo=dt.UTC)
        return check_time((d - _EPOCH) // dt.timedelta(milliseconds=1), what)
    if isinstance(value, str):
        text = value.strip()
        if re.fullmatch(r"\d+", text):
            return check_time(int(text), what)
        try:
            d = dt.datetime.fromisoformat(text)
        except ValueError:
            pass
        else:
            return parse_time(d, what)
    raise InvalidUsage(
        f"{what} {value!r} is not a time: give an integer (ingested times are milliseconds "
        "since the epoch, e.g. 1714564800000) or an ISO 8601 timestamp (e.g. "
        "'2024-05-01T12:00:00Z'; without an offset it is UTC)"
    )


def format_time(t: int | None) -> str:
    """``1714564800000 (2024-05-01T12:00:00Z)``; small times (not epoch ms) as is."""
    if t is None:
        return "(none: closed)"
    if t >= _EPOCH_MS_FROM:
        try:
            d = dt.datetime.fromtimestamp(t / 1000, dt.UTC)
        except (OverflowError, ValueError, OSError):
            return str(t)
        iso = d.strftime("%Y-%m-%dT%H:%M:%S")
        if t % 1000:
            iso += f".{t % 1000:03d}"
        return f"{t} ({iso}Z)"
    return str(t)


def _range_text(since: Antichain, upper: Antichain) -> str:
    if upper.time is not None and since.time is not None and upper.time <= since.time:
        return f"none yet (since {format_time(since.time)}, upper {format_time(upper.time)})"
    hi = "no end (closed)" if upper.time is None else format_time(upper.time)
    return f"[{format_time(since.time)}, {hi})"


# ----- tables --------------------------------------------------------------------------


class Table:
    """A collection or a shard opened for reading by a session (one leased reader, or a
    collection reader, expired by ``close``)."""

    def __init__(self, label: str, schemas: Schemas, reader: ReadHandle | CollectionReader) -> None:
        self.label = label  # "collection orders" / "shard s..."
        self.schemas = schemas
        self.schema = user_schema(schemas)
        self._reader = reader

    @property
    def since(self) -> Antichain:
        return self._reader.since

    @property
    def upper(self) -> Antichain:
        """Every time before it is readable (read from consensus now)."""
        r = self._reader
        if isinstance(r, ReadHandle):
            return r._machine.fetch_latest().upper
        return r.upper

    def latest(self) -> int:
        """The latest readable time (``upper - 1``)."""
        since, upper = self.since, self.upper
        if upper.time is None:
            raise InvalidUsage(
                f"{self.label}: its upper is closed (no more writes); give an explicit time "
                f"(readable: from {format_time(since.time)})"
            )
        if upper.time == 0 or not since.less_equal(upper.time - 1):
            raise InvalidUsage(
                f"{self.label} has no readable time yet (readable times: {_range_text(since, upper)}): "
                "nothing was written to it"
            )
        return upper.time - 1

    def snapshot_batches(
        self, as_of: int, *, memory_budget: int | None, timeout_s: float | None
    ) -> BatchStream:
        return self._reader.snapshot_batches(as_of, memory_budget=memory_budget, timeout_s=timeout_s)

    def updates_between_batches(
        self, lower: int, upper: int, *, memory_budget: int | None, timeout_s: float | None
    ) -> BatchStream:
        return self._reader.updates_between_batches(
            lower, upper, memory_budget=memory_budget, timeout_s=timeout_s
        )

    def explain(self, e: Exception, what: str) -> Exception:
        """``e`` (an ``InvalidUsage`` or ``Timeout`` of a read) with the table, the
        time asked for and the readable range added; same type."""
        try:
            rng = _range_text(self.since, self.upper)
        except Exception:  # noqa: BLE001 - the message is best effort
            rng = "unknown"
        msg = f"{self.label} {what}: {e} (readable times: {rng})"
        try:
            return type(e)(msg)
        except TypeError:
            return e

    def close(self) -> None:
        from persist_lib.errors import PersistError

        try:
            self._reader.expire()
        except PersistError:  # already expired (its lease lapsed) or the shard is gone
            pass


@dataclass(frozen=True)
class _Scan:
    """What a source reads: a snapshot at ``as_of``, or the updates in ``[lower, upper)``."""

    as_of: int | None = None
    lower: int = 0
    upper: int = 0


class ArrowSource:
    """A re-scannable Arrow stream of a table as of a time (or of its changes).

    Every consumer that takes the Arrow PyCapsule stream interface (DuckDB, polars,
    pyarrow) can read it; each ``__arrow_c_stream__`` call (each scan) opens a new
    streaming read when its first batch is pulled and releases it when the scan ends.
    ``reader()`` is one such scan as a ``pyarrow.RecordBatchReader``.
    """

    def __init__(self, table: Table, scan: _Scan, memory_budget: int | None, timeout_s: float | None) -> None:
        self.table = table
        self.scan = scan
        self.schema = table.schema
        self._budget = memory_budget
        self._timeout = timeout_s

    @property
    def description(self) -> str:
        s = self.scan
        if s.as_of is not None:
            return f"{self.table.label} as of {format_time(s.as_of)}"
        return f"{self.table.label} changes in [{format_time(s.lower)}, {format_time(s.upper)})"

    def open_stream(self) -> BatchStream:
        s = self.scan
        if s.as_of is not None:
            return self.table.snapshot_batches(s.as_of, memory_budget=self._budget, timeout_s=self._timeout)
        return self.table.updates_between_batches(
            s.lower, s.upper, memory_budget=self._budget, timeout_s=self._timeout
        )

    def batches(self) -> Iterator[pa.RecordBatch]:
        """One scan: opens the read on the first ``next``, releases it when exhausted,
        closed or collected."""
        with self.open_stream() as stream:
            yield from stream

    def reader(self) -> pa.RecordBatchReader:
        return pa.RecordBatchReader.from_batches(self.schema, self.batches())

    def __arrow_c_stream__(self, requested_schema: object | None = None) -> object:
        return self.reader().__arrow_c_stream__(requested_schema)

    def __arrow_c_schema__(self) -> object:
        return self.schema.__arrow_c_schema__()

    def read_all(self) -> pa.Table:
        """The whole scan as one table (materialized: for small results)."""
        return self.reader().read_all()

    def __repr__(self) -> str:
        return f"ArrowSource({self.description})"


# ----- the session -----------------------------------------------------------------------


class SqlSession:
    """Time-travel reads of one location through DuckDB and polars (read-only).

    ``as_of`` (optional) is the default time of table references without one in
    ``sql``; ``memory_budget`` bounds each streaming read (``ReadHandle.snapshot_batches``);
    ``timeout_s`` is how long a read waits for a time at or past the upper (default:
    the client's ``snapshot_timeout_s``, as for reads). ``connection`` is the DuckDB
    connection to use (default: a new in-memory, read-only one -- ``read_only_connection``
    -- closed with the session; a connection you pass is used as it is, with whatever
    file and network access you gave it).
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
    ) -> None:
        self.client = client
        self.as_of = None if as_of is None else parse_time(as_of, "as_of")
        self.memory_budget = memory_budget
        self.timeout_s = timeout_s
        self._con = connection
        self._owns_con = connection is None
        self._scratch: str | None = None  # the own connection's spill directory
        self._owns_client = owns_client
        self._ctl: StorageController | None = None
        self._tables: dict[str, Table] = {}
        self._views: dict[tuple[str, _Scan], str] = {}
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
                self._con = read_only_connection(self._scratch)
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
        src = ArrowSource(t, _Scan(as_of=at), self.memory_budget, self.timeout_s)
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
        src = ArrowSource(t, _Scan(lower=lo + 1, upper=hi + 1), self.memory_budget, self.timeout_s)
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
        text = rewrite_sql(query, lambda ref: self._view_for(ref, default, latest))
        con = self.connection
        try:
            return con.sql(text)
        except duckdb.Error as e:
            refused = read_only_error(e)
            if refused is not None:
                raise refused from None
            raise

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

    # ----- polars ----------------------------------------------------------------------

    def lazy_frame(self, name: str, as_of: TimeLike | None = None) -> Any:
        """A polars ``LazyFrame`` of the table as of ``as_of``: each ``collect`` streams
        a new read (projection, filters and ``head`` applied batch by batch)."""
        return _lazy_frame(self.snapshot(name, as_of))

    def changes_lazy_frame(self, name: str, t1: TimeLike, t2: TimeLike) -> Any:
        """A polars ``LazyFrame`` of ``changes(name, t1, t2)``."""
        return _lazy_frame(self.changes(name, t1, t2))

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


def _lazy_frame(src: ArrowSource) -> Any:
    import polars as pl
    from polars.io.plugins import register_io_source

    schema = pl.from_arrow(src.schema.empty_table()).schema  # type: ignore[union-attr]

    def io_source(
        with_columns: list[str] | None, predicate: Any, n_rows: int | None, batch_size: int | None
    ) -> Iterator[Any]:
        left = n_rows
        with src.open_stream() as stream:
            for b in stream:
                if left is not None and left <= 0:
                    return
                df = pl.from_arrow(b)
                assert isinstance(df, pl.DataFrame)
                if predicate is not None:
                    df = df.filter(predicate)
                if with_columns is not None:
                    df = df.select(with_columns)
                if left is not None:
                    df = df.head(left)
                    left -= df.height
                yield df

    return register_io_source(io_source, schema=schema)


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


# ----- the SQL rewrite -----------------------------------------------------------------


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


def rewrite_sql(query: str, view_for: Callable[[TableRef], str | None]) -> str:
    """Rewrites the table references of ``query`` (module docstring) to the views
    ``view_for`` returns (``None``: leave the reference to DuckDB)."""
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
    for start, end, text in sorted(edits, reverse=True):
        query = query[:start] + text + query[end:]
    return query


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
