"""Postgres CDC: a publication + a logical replication slot, decoded from ``pgoutput``.

One partition, ``wal``; the address of a transaction is its commit LSN, and the
frontier ``(L,)`` covers every transaction that committed before ``L``. Transactions
are whole messages: a binding never splits one, so a transaction is applied at one
time, all of it (never half-applied). Inserts, updates and deletes go into an upsert
collection keyed by the replica identity.

Reading uses the SQL interface (``pg_logical_slot_peek_binary_changes``): peeking
never consumes, so the slot stays replayable from its position, and the slot is
advanced (``pg_replication_slot_advance``) only up to the frontier bound at a time the
outputs have durably passed. If the slot is ever ahead of the address an instance
needs, the data is gone for it (``SourceDataGone``), which the driver treats as "another
instance made it durable; resynchronize" when the outputs have moved on.

The initial snapshot: the slot is created with an exported snapshot, the table is read
in that snapshot (exactly the state at the slot's consistent point ``C``), and the rows
are *staged* in a persist shard before any binding can cover them, so the snapshot is
replayable like everything else. The table is read through a server-side cursor,
``SNAPSHOT_FETCH_ROWS`` rows at a time, and each chunk goes into the staging batch's
bounded-memory builder before the next is fetched, so staging a large table holds a
chunk and the builder's parts in flight, not the table. It is the message at address ``(0,)``; the frontier
after it is ``(C,)``. An advisory lock serializes slot creation among instances; a slot
left without a staged snapshot (its creator crashed) is dropped and recreated.

REPLICA IDENTITY is checked explicitly: ``DEFAULT`` needs a primary key equal to the
collection key, ``USING INDEX`` an index on exactly the key columns, ``FULL`` works with
any declared key (it must be unique), ``NOTHING`` is refused (deletes and updates would
carry no key).
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pyarrow as pa
from psycopg.adapt import Loader

from persist_lib.config_rules import Rule
from persist_lib.ingest.addresses import Address, Frontier, Note
from persist_lib.ingest.decode import (
    Decoded,
    DecodeSpec,
    ErrorRecord,
    raw_table,
)
from persist_lib.ingest.errors import IngestConfigError, SourceDataGone, SourceUnavailable
from persist_lib.ingest.ingest_config import require_valid_settings
from persist_lib.ingest.pg_types import (
    SESSION_OPTIONS,
    check_column_types,
    column_types,
    decode_change_records,
)
from persist_lib.ingest.pgoutput import (
    UNCHANGED,
    Relation,
    TupleValue,
    Txn,
    TxnAssembler,
    int_to_lsn,
    lsn_to_int,
)
from persist_lib.ingest.source import Chunk, Lag
from persist_lib.location.redaction import SensitiveUrl, redacted_dataclass_repr

if TYPE_CHECKING:  # pragma: no cover
    from persist_lib.handles.client import PersistClient

log = logging.getLogger(__name__)

PARTITION = "wal"
SNAPSHOT_KEY = pa.schema([("i", pa.int64())])
SNAPSHOT_VAL = pa.schema([("values", pa.string())])
#: Rows per fetch of the initial snapshot's server-side cursor (each chunk is staged
#: before the next is fetched).
SNAPSHOT_FETCH_ROWS = 10_000
_IDENT = re.compile(r"[a-z_][a-z0-9_]{0,62}")


def _connect(dsn: str, **kw: Any) -> Any:
    """A connection to the source; errors say why with the DSN's secrets scrubbed (and
    chain no psycopg exception, whose message is not)."""
    import psycopg

    url = SensitiveUrl(dsn)
    if url.problem:  # refused before libpq, whose errors would quote a piece of it
        raise IngestConfigError(f"the CDC source DSN {url} is ambiguous: {url.problem}")
    err: Exception | None = None
    # every CDC session has the same settings: the text form of a value (pgoutput's, the
    # snapshot's) depends on them (pg_types.SESSION_SETTINGS)
    try:
        from psycopg.conninfo import conninfo_to_dict

        own = conninfo_to_dict(url.raw).get("options")  # the DSN's options= come first
        opts = f"{own} {SESSION_OPTIONS}" if own else SESSION_OPTIONS
        return psycopg.connect(url.raw, autocommit=True, connect_timeout=10, options=opts, **kw)
    except psycopg.OperationalError as e:
        msg = url.scrub(str(e)).strip()
        if "does not exist" in msg or "password authentication failed" in msg or "invalid" in msg:
            err = IngestConfigError(
                f"cannot connect to the CDC source database {url}: {msg}; fix the DSN"
            )
        else:
            err = SourceUnavailable(f"cannot connect to the CDC source database {url}: {msg}")
    except psycopg.Error as e:  # a DSN libpq can't parse (ProgrammingError)
        err = IngestConfigError(
            f"the CDC source DSN {url} is not valid: {url.scrub(str(e)).strip()}; fix the DSN"
        )
    raise err


class _RawText(Loader):
    """A psycopg loader: a text-format value as the server sent it (no parsing)."""

    def load(self, data: Any) -> str:
        return bytes(data).decode("utf-8")


def _fetch_chunks(cur: Any, n: int) -> Iterator[list[tuple[str | None, ...]]]:
    """The rows of an executed cursor, ``n`` at a time."""
    while True:
        rows = cur.fetchmany(n)
        if not rows:
            return
        yield rows


def _staged_rows(first: int, values: list[str]) -> pa.Table:
    """Rows ``first, first + 1, ...`` of the snapshot staging shard, at time 0."""
    n = len(values)
    return pa.table(
        {
            "i": pa.array(range(first, first + n), pa.int64()),
            "values": pa.array(values, pa.string()),
            "ts": pa.array([0] * n, pa.int64()),
            "diff": pa.array([1] * n, pa.int64()),
        }
    )


def _safe_name(s: str) -> str:
    return re.sub(r"[^a-z0-9_]", "_", s.lower())[:63]


@dataclass
class _Snapshot:
    lsn: int
    columns: list[str]
    rows: list[list[str | None]]


class CdcChunk(Chunk):
    """Whole transactions with commit LSNs in ``[start, end)`` (or the initial snapshot)."""

    def __init__(
        self,
        src: PgCdcSource,
        start: Address,
        end: Address,
        txns: list[Txn],
        snapshot: _Snapshot | None = None,
    ) -> None:
        self.src = src
        self.partition = PARTITION
        self.start = start
        self.end = end
        self.txns = txns
        self.snapshot = snapshot
        self.num_records = (len(snapshot.rows) if snapshot else 0) + sum(len(t.changes) for t in txns)
        self.nbytes = 0
        for t in txns:
            for c in t.changes:
                for tup in (c.old, c.new):
                    if tup:
                        self.nbytes += sum(len(v) for v in tup if isinstance(v, str))
        if snapshot:
            self.nbytes += sum(sum(len(v) for v in r if v) for r in snapshot.rows)
        self.notes: tuple[Note, ...] = ()

    def split(self, at: Address) -> tuple[Chunk | None, Chunk | None]:
        a = int(at[0])
        if a >= int(self.end[0]):
            return self, None
        if a <= int(self.start[0]):
            return None, self
        head = [t for t in self.txns if t.commit_lsn < a]
        tail = [t for t in self.txns if t.commit_lsn >= a]
        snap_head = self.snapshot if int(self.start[0]) == 0 else None
        return (
            CdcChunk(self.src, self.start, (a,), head, snap_head),
            CdcChunk(self.src, (a,), self.end, tail, None),
        )

    def take(self, n: int) -> tuple[Chunk, Chunk | None]:
        """Whole transactions (and the snapshot) until at least ``n`` records."""
        if n >= self.num_records:
            return self, None
        count = len(self.snapshot.rows) if self.snapshot else 0
        cut: int | None = None
        if count >= n and self.txns:
            cut = self.txns[0].commit_lsn
        else:
            for i, t in enumerate(self.txns):
                count += len(t.changes)
                if count >= n:
                    if i + 1 < len(self.txns):
                        cut = t.end_lsn
                    break
        if cut is None or cut <= int(self.start[0]):
            return self, None
        head, tail = self.split((cut,))
        assert head is not None
        return head, tail

    def decode(self, spec: DecodeSpec) -> Decoded:
        return self.src._decode(self, spec)

    def __repr__(self) -> str:
        return f"CdcChunk([{self.start[0]}, {self.end[0]}), {len(self.txns)} txns)"


#: The rules of a CDC source's plain settings (the DSN is checked apart: its value, which
#: holds a password, is never shown).
CDC_RULES: dict[str, Rule] = {
    "table": Rule("str", lo=1, meaning="TABLE or SCHEMA.TABLE"),
    "slot": Rule("str", optional=True, meaning="None: persist_NAME"),
    "publication": Rule("str", optional=True, meaning="None: persist_NAME"),
    "create": Rule("bool"),
    "snapshot": Rule("bool"),
}


@dataclass
class PgCdcSource:
    """Change data capture of one Postgres table (see the module docstring).

    ``dsn`` is a libpq URL of a role with REPLICATION (or superuser) on a server with
    ``wal_level=logical``. ``slot`` and ``publication`` default to names derived from
    the ingestion name; they are created when missing (``create=True``).
    """

    dsn: str
    table: str
    slot: str | None = None
    publication: str | None = None
    create: bool = True
    snapshot: bool = True
    kind: str = "postgres_cdc"
    _client: Any = field(default=None, init=False, repr=False)
    _name: str = field(default="", init=False, repr=False)
    _conn: Any = field(default=None, init=False, repr=False)
    _schema: str = field(default="public", init=False, repr=False)
    _relname: str = field(default="", init=False, repr=False)
    _key_names: list[str] = field(default_factory=list, init=False, repr=False)
    _spec: DecodeSpec | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.dsn, str) or not self.dsn.startswith(("postgresql://", "postgres://")):
            raise IngestConfigError(
                "the CDC source DSN must be a postgresql://USER:PASSWORD@HOST:PORT/DB URL"
            )
        problem = SensitiveUrl(self.dsn).problem
        if problem:
            raise IngestConfigError(f"the CDC source DSN {SensitiveUrl(self.dsn)} is ambiguous: {problem}")
        require_valid_settings(self, CDC_RULES, "PgCdcSource")
        parts = self.table.split(".")
        if len(parts) == 1:
            self._schema, self._relname = "public", parts[0]
        elif len(parts) == 2:
            self._schema, self._relname = parts
        else:
            raise IngestConfigError(f"table {self.table!r}: use TABLE or SCHEMA.TABLE")
        for what, v in (("slot", self.slot), ("publication", self.publication)):
            if v is not None and not _IDENT.fullmatch(v):
                raise IngestConfigError(
                    f"{what} name {v!r} is not valid: lowercase letters, digits and '_', at most 63"
                )

    # ----- identity -------------------------------------------------------------------

    def attach(self, client: PersistClient, name: str, spec: DecodeSpec | None = None) -> None:
        """Called by the driver: where to stage the snapshot, what to name the slot."""
        self._client = client
        self._name = name
        self._spec = spec
        if self.slot is None:
            self.slot = _safe_name(f"persist_{name}")
        if self.publication is None:
            self.publication = _safe_name(f"persist_{name}")

    def __repr__(self) -> str:  # the DSN holds a password
        return redacted_dataclass_repr(self)

    def describe(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "dsn": SensitiveUrl(self.dsn).redacted,
            "table": f"{self._schema}.{self._relname}",
            "slot": self.slot,
            "publication": self.publication,
        }

    def partitions(self) -> tuple[str, ...]:
        return (PARTITION,)

    def initial_frontier(self) -> Frontier:
        return {PARTITION: (0,)}

    # ----- connections ----------------------------------------------------------------

    def conn(self) -> Any:
        if self._conn is None or self._conn.closed:
            self._conn = _connect(self.dsn)
        return self._conn

    def close(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            except Exception:  # noqa: BLE001
                pass
            self._conn = None

    # ----- configuration checks -------------------------------------------------------

    def check(self) -> None:
        spec = self._spec
        c = self.conn()
        enc = c.execute(
            "SELECT pg_encoding_to_char(encoding) FROM pg_database WHERE datname = current_database()"
        ).fetchone()[0]
        enc = enc.decode("ascii", "replace") if isinstance(enc, bytes) else str(enc)
        if enc != "UTF8":
            # pgoutput sends text in the server's encoding; a non-UTF8 database's bytes would
            # be read as UTF-8 (SQL_ASCII: any bytes at all), so it is refused up front.
            raise IngestConfigError(
                f"the source database has server encoding {enc}; CDC needs a UTF8 database "
                "(create one with CREATE DATABASE ... ENCODING 'UTF8' TEMPLATE template0 and move "
                "the table there, or ingest the table's rows through a landing zone)"
            )
        wal = c.execute("SHOW wal_level").fetchone()[0]
        if wal != "logical":
            raise IngestConfigError(
                f"the source server has wal_level={wal}; logical replication needs wal_level=logical "
                "(ALTER SYSTEM SET wal_level = logical; then restart the server)"
            )
        row = c.execute(
            "SELECT c.oid, c.relreplident FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = %s AND c.relname = %s AND c.relkind IN ('r', 'p')",
            (self._schema, self._relname),
        ).fetchone()
        if row is None:
            raise IngestConfigError(
                f"table {self._schema}.{self._relname} does not exist in the source database; create it "
                "or fix the table name"
            )
        oid, ident = row[0], row[1]
        cols = {
            r[0]: r[1]
            for r in c.execute(
                "SELECT attname, attnotnull FROM pg_attribute WHERE attrelid = %s AND attnum > 0 AND NOT attisdropped",
                (oid,),
            ).fetchall()
        }
        if ident == "n":
            raise IngestConfigError(
                f"table {self.table} has REPLICA IDENTITY NOTHING: updates and deletes would carry no "
                f"key, so they can't be applied; run ALTER TABLE {self.table} REPLICA IDENTITY DEFAULT "
                "(with a primary key), USING INDEX, or FULL"
            )
        if ident == "d":
            pk = [
                r[0]
                for r in c.execute(
                    "SELECT a.attname FROM pg_index i JOIN pg_attribute a ON a.attrelid = i.indrelid "
                    "AND a.attnum = ANY(i.indkey) WHERE i.indrelid = %s AND i.indisprimary",
                    (oid,),
                ).fetchall()
            ]
            if not pk:
                raise IngestConfigError(
                    f"table {self.table} has REPLICA IDENTITY DEFAULT but no primary key: deletes would "
                    f"carry no key; add a primary key or run ALTER TABLE {self.table} REPLICA IDENTITY FULL"
                )
            self._key_names = sorted(pk)
        elif ident == "i":
            self._key_names = sorted(
                r[0]
                for r in c.execute(
                    "SELECT a.attname FROM pg_index i JOIN pg_attribute a ON a.attrelid = i.indrelid "
                    "AND a.attnum = ANY(i.indkey) WHERE i.indrelid = %s AND i.indisreplident",
                    (oid,),
                ).fetchall()
            )
        else:  # 'f': the full old row is sent; any declared (unique) key works
            self._key_names = []
        if spec is not None:
            missing = [n for n in spec.key_names + spec.val_names if n not in cols]
            if missing:
                raise IngestConfigError(
                    f"table {self.table} has no column(s) {missing} (columns: {sorted(cols)}); fix the "
                    "key/value schema"
                )
            fields = list(spec.key_schema) + list(spec.val_schema)
            check_column_types(f"{self._schema}.{self._relname}", column_types(c, oid), fields)
            if self._key_names and sorted(spec.key_names) != self._key_names:
                what = "primary key" if ident == "d" else "replica identity index"
                raise IngestConfigError(
                    f"the collection key {spec.key_names} must equal the table's {what} "
                    f"{self._key_names} (REPLICA IDENTITY {'DEFAULT' if ident == 'd' else 'USING INDEX'}: "
                    f"deletes carry only those columns); use them as the key, or ALTER TABLE "
                    f"{self.table} REPLICA IDENTITY FULL"
                )

    # ----- slot, publication, snapshot ------------------------------------------------

    def _snapshot_shard(self) -> Any:
        from persist_lib.ingest.outputs import shard_id_for

        if self._client is None:
            raise IngestConfigError("PgCdcSource must be attached to an ingestion (Ingestion does this)")
        return shard_id_for(self._name, "cdc-snapshot")

    def _staged(self) -> bool:
        return bool((self._client.machine(self._snapshot_shard()).fetch_latest().upper.time or 0) >= 1)

    def prepare(self) -> None:
        """Creates the publication and the slot (with the staged snapshot) if missing."""
        if self._client is None:
            raise IngestConfigError("PgCdcSource must be attached to an ingestion (Ingestion does this)")
        c = self.conn()
        c.execute("SELECT pg_advisory_lock(hashtext(%s))", (f"persist-cdc:{self.slot}",))
        try:
            pub = c.execute("SELECT 1 FROM pg_publication WHERE pubname = %s", (self.publication,)).fetchone()
            if pub is None:
                if not self.create:
                    raise IngestConfigError(
                        f"publication {self.publication} does not exist: CREATE PUBLICATION "
                        f"{self.publication} FOR TABLE {self.table}, or pass create=True"
                    )
                from psycopg import sql

                c.execute(
                    sql.SQL("CREATE PUBLICATION {} FOR TABLE {}").format(
                        sql.Identifier(str(self.publication)), sql.Identifier(self._schema, self._relname)
                    )
                )
            slot = c.execute(
                "SELECT plugin, database, active FROM pg_replication_slots WHERE slot_name = %s", (self.slot,)
            ).fetchone()
            staged = self._staged()
            if slot is not None and slot[0] != "pgoutput":
                raise IngestConfigError(
                    f"replication slot {self.slot} uses plugin {slot[0]}, not pgoutput; pick another slot name"
                )
            if slot is not None and staged:
                return
            if slot is None and staged:
                raise SourceDataGone(
                    f"replication slot {self.slot} was dropped after the ingestion started: the changes "
                    "since its position are lost; rebuild the collection in a new rendition (new "
                    "ingestion name) to snapshot again"
                )
            if slot is not None:
                # created by an instance that died before staging its snapshot: start over
                if slot[2]:
                    raise SourceUnavailable(f"replication slot {self.slot} is in use by another session")
                c.execute("SELECT pg_drop_replication_slot(%s)", (self.slot,))
            if not self.create:
                raise IngestConfigError(f"replication slot {self.slot} does not exist and create=False")
            self._create_slot_and_stage()
        finally:
            c.execute("SELECT pg_advisory_unlock(hashtext(%s))", (f"persist-cdc:{self.slot}",))

    def _create_slot_and_stage(self) -> None:
        from psycopg import sql

        assert self.slot is not None  # bound by bind() before any slot is created
        rc = _connect(self.dsn, replication="database")
        try:
            opt = sql.SQL("(SNAPSHOT 'export')" if self.snapshot else "(SNAPSHOT 'nothing')")
            row = rc.execute(
                sql.SQL("CREATE_REPLICATION_SLOT {} LOGICAL pgoutput {}").format(
                    sql.Identifier(self.slot), opt
                )
            ).fetchone()
            lsn = lsn_to_int(row[1])
            snap_name = row[2]
            if not self.snapshot:
                self._stage(lsn, [], [])
                return
            with _connect(self.dsn) as c2:
                c2.autocommit = False
                c2.execute("BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY")
                c2.execute(sql.SQL("SET TRANSACTION SNAPSHOT {}").format(sql.Literal(snap_name)))
                columns = [
                    r[0]
                    for r in c2.execute(
                        "SELECT attname FROM pg_attribute WHERE attrelid = %s::regclass AND attnum > 0 "
                        "AND NOT attisdropped ORDER BY attnum",
                        (f"{self._schema}.{self._relname}",),
                    ).fetchall()
                ]
                # Each value as its type's output function writes it -- what pgoutput sends
                # -- not a ::text cast (which trims char(n), spells booleans out, and
                # shows an inet's netmask): every type is loaded as the raw text.
                for (toid,) in c2.execute("SELECT oid FROM pg_type").fetchall():
                    c2.adapters.register_loader(toid, _RawText)
                q = sql.SQL("SELECT {} FROM {}").format(
                    sql.SQL(", ").join(sql.Identifier(col) for col in columns),
                    sql.Identifier(self._schema, self._relname),
                )
                # A server-side (named) cursor: the table is fetched and staged in chunks.
                with c2.cursor(name="persist_cdc_snapshot") as cur:
                    cur.execute(q)
                    self._stage(lsn, columns, _fetch_chunks(cur, SNAPSHOT_FETCH_ROWS))
                c2.rollback()
        finally:
            rc.close()

    def _stage(self, lsn: int, columns: list[str], chunks: Iterable[list[tuple[str | None, ...]]]) -> None:
        """Writes the snapshot to the staging shard as one batch at time 0: a header row
        (``i = -1``: the LSN and the columns), then row ``i`` = the JSON list of the
        ``i``-th row's text values, chunk by chunk through a bounded-memory builder."""
        w = self._client.open_writer(self._snapshot_shard(), SNAPSHOT_KEY, SNAPSHOT_VAL, purpose="ingest:cdc-snapshot")
        try:
            builder = w.builder(0)
            try:
                header = json.dumps({"lsn": lsn, "columns": columns})
                builder.add(w.normalize(_staged_rows(-1, [header])))
                i = 0
                for rows in chunks:
                    builder.add(w.normalize(_staged_rows(i, [json.dumps(list(r)) for r in rows])))
                    i += len(rows)
                batch = builder.finish(1)
            except BaseException:
                builder.abort()
                raise
            w.compare_and_append_batch(batch, 0, 1)
        finally:
            w.expire()

    def load_snapshot(self) -> _Snapshot:
        r = self._client.open_leased_reader(self._snapshot_shard(), SNAPSHOT_KEY, SNAPSHOT_VAL, purpose="ingest:cdc-snapshot")
        try:
            t = r.snapshot(0).sort_by("i")
        finally:
            r.expire()
        vals = t.column("values").to_pylist()
        header = json.loads(vals[0])
        return _Snapshot(int(header["lsn"]), list(header["columns"]), [json.loads(v) for v in vals[1:]])

    # ----- reading --------------------------------------------------------------------

    def open_reader(self, frontier: Frontier, notes: list[Note]) -> PgCdcReader:
        return PgCdcReader(self, int(frontier.get(PARTITION, (0,))[0]))

    def slot_position(self) -> int:
        row = self.conn().execute(
            "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s", (self.slot,)
        ).fetchone()
        if row is None or row[0] is None:
            raise SourceDataGone(
                f"replication slot {self.slot} does not exist any more: changes since the last ingested "
                "position are lost; rebuild in a new rendition (new ingestion name)"
            )
        return lsn_to_int(row[0])

    def peek(self, upto_lsn: int | None, upto_nchanges: int | None) -> list[bytes]:
        import psycopg

        delay = 0.05
        deadline = time.monotonic() + 30
        while True:
            try:
                rows = self.conn().execute(
                    "SELECT data FROM pg_logical_slot_peek_binary_changes(%s, %s::pg_lsn, %s, "
                    "'proto_version', '1', 'publication_names', %s)",
                    (self.slot, int_to_lsn(upto_lsn) if upto_lsn is not None else None, upto_nchanges, self.publication),
                ).fetchall()
                return [bytes(r[0]) for r in rows]
            except psycopg.errors.ObjectInUse as e:
                # another instance is decoding from the slot right now
                if time.monotonic() > deadline:
                    raise SourceUnavailable(f"replication slot {self.slot} stayed busy: {e}") from e
                time.sleep(delay)
                delay = min(delay * 2, 0.5)
            except psycopg.OperationalError as e:
                self._conn = None
                raise SourceUnavailable(f"reading replication slot {self.slot} failed: {e}") from e

    def release(self, frontier: Frontier) -> None:
        lsn = int(frontier.get(PARTITION, (0,))[0])
        if lsn <= 0:
            return
        import psycopg

        try:
            pos = self.slot_position()
            if lsn > pos:
                self.conn().execute("SELECT pg_replication_slot_advance(%s, %s::pg_lsn)", (self.slot, int_to_lsn(lsn)))
        except psycopg.errors.ObjectInUse:
            pass  # busy: the next release advances it
        except psycopg.OperationalError as e:
            self._conn = None
            raise SourceUnavailable(f"advancing replication slot {self.slot} failed: {e}") from e

    def current_lsn(self) -> int:
        return lsn_to_int(self.conn().execute("SELECT pg_current_wal_flush_lsn()::text").fetchone()[0])

    # ----- decoding -------------------------------------------------------------------

    def _decode(self, chunk: CdcChunk, spec: DecodeSpec) -> Decoded:
        names = spec.key_names + spec.val_names
        keys = spec.key_names
        recs: list[dict[str, TupleValue]] = []
        deletes: list[bool] = []
        truncs: list[bool] = []
        unchanged: list[list[str] | None] = []
        addrs: list[Address] = []
        raws: list[bytes] = []
        errors: list[ErrorRecord] = []

        def add(addr: Address, values: dict[str, TupleValue], *, delete: bool = False, truncate: bool = False) -> None:
            unch = [n for n in spec.val_names if values.get(n) is UNCHANGED]
            recs.append({n: (None if values.get(n) is UNCHANGED else values.get(n)) for n in names})
            deletes.append(delete)
            truncs.append(truncate)
            unchanged.append(unch or None)
            addrs.append(addr)
            raws.append(
                json.dumps(
                    {
                        "values": {k: (None if v is UNCHANGED else v) for k, v in values.items()},
                        "delete": delete, "truncate": truncate, "unchanged": unch,
                    }
                ).encode()
            )

        if chunk.snapshot is not None:
            cols = chunk.snapshot.columns
            for i, row in enumerate(chunk.snapshot.rows):
                add((0, i), dict(zip(cols, row, strict=True)))
        for txn in chunk.txns:
            for i, ch in enumerate(txn.changes):
                addr = (txn.commit_lsn, i)
                if ch.op == "T":
                    if any(rel is not None and self._is_ours(rel) for rel in ch.truncate_relations):
                        add(addr, {}, truncate=True)
                    continue
                rel = ch.relation
                if rel is None:
                    errors.append(ErrorRecord(PARTITION, addr, "unknown_relation", f"change for relation {ch.relid} before its Relation message"))
                    continue
                if not self._is_ours(rel):
                    continue
                colnames = [c.name for c in rel.columns]
                new = dict(zip(colnames, ch.new, strict=True)) if ch.new is not None else None
                old = dict(zip(colnames, ch.old, strict=True)) if ch.old is not None else None
                if ch.op == "I" and new is not None:
                    add(addr, new)
                elif ch.op == "U" and new is not None:
                    if old is not None and any(old.get(k) != new.get(k) for k in keys if old.get(k) is not None):
                        add(addr, old, delete=True)  # the key changed: delete the old row
                    add(addr, new)
                elif ch.op == "D" and old is not None:
                    if any(old.get(k) is None for k in keys):
                        errors.append(
                            ErrorRecord(
                                PARTITION, addr, "delete_without_key",
                                f"a delete on {rel.qualified} carried no value for key column(s) {keys} "
                                f"(REPLICA IDENTITY {rel.replica_identity!r}): it can't be applied",
                            )
                        )
                        continue
                    add(addr, old, delete=True)
        rows, bad = decode_change_records(spec, recs, deletes, truncs, unchanged)
        for i, kind, reason in bad:
            errors.append(ErrorRecord(PARTITION, addrs[i], kind, reason, raws[i]))
        raw = None
        if spec.keep_raw:
            raw = raw_table(PARTITION, addrs, "pgoutput-json", raws)
        errors.sort(key=lambda e: tuple(e.address))
        return Decoded(rows, errors, raw)

    def _is_ours(self, rel: Relation) -> bool:
        return rel.namespace == self._schema and rel.name == self._relname


class PgCdcReader:
    """Reads whole transactions from the slot, from a commit LSN on."""

    def __init__(self, src: PgCdcSource, lsn: int) -> None:
        self.src = src
        self._pos = lsn
        self.asm = TxnAssembler()

    @property
    def position(self) -> Frontier:
        return {PARTITION: (self._pos,)}

    def add_notes(self, notes: Any) -> None:
        return None

    def observe(self) -> list[Note]:
        return []

    def _chunk(self, start: int, end: int, txns: list[Txn], snap: _Snapshot | None = None) -> CdcChunk:
        return CdcChunk(self.src, (start,), (end,), txns, snap)

    def read(self, upto: Frontier | None, max_records: int) -> list[Chunk]:
        limit = None if upto is None else int(upto[PARTITION][0])
        if self._pos == 0:
            snap = self.src.load_snapshot()
            self._pos = snap.lsn
            return [self._chunk(0, snap.lsn, [], snap)]
        self._check_slot_not_past()
        if limit is not None:
            # replay a binding: exactly the transactions that committed before it
            txns = self._fetch(limit, None)
            self._check_slot_not_past()
            txns = [t for t in txns if self._pos <= t.commit_lsn < limit]
            start, self._pos = self._pos, limit
            return [self._chunk(start, limit, txns)] if txns or limit > start else []
        w = self.src.current_lsn()
        n = max(max_records, 1) + 2
        while True:
            msgs = self.src.peek(w, n)
            self._check_slot_not_past()
            txns = self._parse(msgs)
            new = [t for t in txns if t.commit_lsn >= self._pos]
            truncated = len(msgs) >= n
            if new or not truncated:
                break
            n *= 4  # everything returned was before our position: look further
        if truncated:
            end = max([self._pos] + [t.end_lsn for t in new])
        else:
            end = max([self._pos, w] + [t.end_lsn for t in new])
        start, self._pos = self._pos, end
        if not new and end == start:
            return []
        return [self._chunk(start, end, new)]

    def _check_slot_not_past(self) -> None:
        """Raises ``SourceDataGone`` if the slot is past this reader's position.

        Checked before *and after* every peek: another instance may advance the slot
        between the first check and the peek (a peek starts at the slot's position, so it
        would silently miss the transactions in between). The slot can't move during a
        peek (it is active) and only moves forward, so a slot still at or before the
        position after the peek means the peek saw everything from the position on."""
        slot = self.src.slot_position()
        if slot > self._pos:
            raise SourceDataGone(
                f"replication slot {self.src.slot} is at {int_to_lsn(slot)}, past {int_to_lsn(self._pos)} "
                "where this instance needs to read"
            )

    def _fetch(self, upto: int, n: int | None) -> list[Txn]:
        return self._parse(self.src.peek(upto, n))

    def _parse(self, msgs: list[bytes]) -> list[Txn]:
        self.asm.reset_partial()
        txns = self.asm.feed(msgs)
        self.asm.reset_partial()
        return txns

    def lag(self) -> Lag:
        try:
            return Lag(bytes_behind=max(0, self.src.current_lsn() - self._pos))
        except Exception:  # noqa: BLE001 - lag is informational
            return Lag()

    def close(self) -> None:
        return None
