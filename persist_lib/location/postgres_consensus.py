"""Consensus on PostgreSQL (``postgresql://...``) with psycopg 3.

Table ``consensus(shard text, seqno bigint, data bytea, primary key (shard, seqno))``.

**CAS** (research/reliability.md section 5). ``new = expected + 1`` always, and the
primary key arbitrates, in one autocommit statement::

    WITH expected_row AS (
        SELECT seqno FROM consensus WHERE shard = $key AND seqno = $expected FOR KEY SHARE
    ), ins AS (
        INSERT INTO consensus (shard, seqno, data)
        SELECT $key, $new, $data FROM expected_row RETURNING seqno
    )
    SELECT seqno FROM ins

Seqnos are contiguous, so ``expected`` is the head exactly when row ``expected`` exists
and row ``expected + 1`` does not. Rival appenders of ``expected + 1`` collide on the
primary key, which (unlike a ``NOT EXISTS``/``max()`` check, which reads the statement's
snapshot and misses uncommitted rivals) sees uncommitted inserts and makes the loser
wait and fail: ``unique_violation`` -> ``EXPECTATION_MISMATCH``. ``FOR KEY SHARE``
stops a concurrent truncate from deleting ``expected`` (and ``expected + 1`` with it)
mid-statement. This is correct under READ COMMITTED (the default), SERIALIZABLE or a
mix; no retries of serialization failures are needed under READ COMMITTED.

**First write** (``expected=None``; the new seqno may be any value >= 0): a row at
seqno ``-1`` marks "this key has been written", and the first write inserts it in the
same statement as its data row::

    WITH marker AS (
        INSERT INTO consensus (shard, seqno, data) VALUES ($key, -1, '')
        ON CONFLICT DO NOTHING RETURNING seqno
    ), ins AS (INSERT ... SELECT $key, $new, $data FROM marker RETURNING seqno)
    SELECT seqno FROM ins

Exactly one first write can insert the marker (the primary key again arbitrates,
``ON CONFLICT DO NOTHING`` waits for an uncommitted rival and then yields nothing),
and since truncate never deletes the marker, a delayed first write can never succeed
after the log was started and truncated (which a ``NOT EXISTS (any row)`` check
would allow under READ COMMITTED, and which two first writes with different seqnos
would fork). The marker is invisible to ``head``/``scan``/``list_keys``.

**Truncate** locks the rows it deletes in ascending seqno order and only if a row at or
above the target exists (so the head is never deleted)::

    DELETE FROM consensus WHERE shard = $key AND seqno IN (
        SELECT seqno FROM consensus WHERE shard = $key AND seqno >= 0 AND seqno < $s
        AND EXISTS (SELECT 1 FROM consensus WHERE shard = $key AND seqno >= $s)
        ORDER BY seqno FOR UPDATE)

The ascending lock order avoids a deadlock with a stale CAS holding ``FOR KEY SHARE``
on ``expected`` while waiting for ``expected + 1``.

**Errors**: a failure to connect is ``Determinate``; an error reported by the server
means the autocommit statement rolled back (``Determinate``; 40001/40P01 included);
a connection lost while a write was in flight is ``Indeterminate``. The URL's password
never appears in any message or repr (messages are redacted, and no psycopg exception
is chained to ours).

**Push notifications**: after a CAS has committed, the same connection sends
``pg_notify('persist_consensus', key)`` in a transaction of its own, best effort::

    SELECT pg_notify($channel, $payload), set_config('synchronous_commit', 'off', true)

Not inside the CAS transaction (as it used to be): a notifying transaction takes
Postgres's cluster-wide notify lock at pre-commit and holds it until its commit is over,
so a CAS that notified held that lock across its commit fsync, serializing every CAS of
every shard in the cluster through one fsync at a time (measured with
``bench/pg_cas_concurrency.py``); and a failing notification (a queue filled by a
listener that never consumes, a role without EXECUTE on ``pg_notify``) failed the CAS. The separate notification commits asynchronously (it
needs no durability: listeners read its commit status, not the disk), so it holds the
lock only briefly. Its failure never fails a CAS that committed (nor makes it
indeterminate): it is logged (a warning the first time, then at debug level) and
counted in ``notify_failures``; listeners miss the wake-up and notice the change at
their next re-check (see below). A notification is never sent for a CAS that did not
commit; one can be lost (a crash or error between the two transactions).

``wait_for_change`` uses one lazily started LISTEN connection per instance (a daemon
thread) that wakes waiters through a ``threading.Condition``; waiters re-check the head
once a second even while it is up (a lost notification costs at most that), and while
it is down they fall back to polling with backoff.

**Connections**: psycopg_pool is not installed, so each thread gets its own autocommit
connection (cached thread-locally, re-created when broken or after ``fork``); ``close()``
closes them all and stops the listener.

**Bounded waits** (``op_timeout_s``, URI parameter ``persist_op_timeout_s``, default
15 s). No call may wait on a connection forever: the caller (``Machine.apply``) holds the
shard's apply lock across a CAS, and a CAS stuck on a dead connection used to stall every
change of that shard in the process, heartbeats included. Three layers, each for a
different failure:

* a *client-side* bound on every wait for the server (``_BoundedConnection.wait``,
  psycopg's own wait timeout): a statement that has not been answered within
  ``op_timeout_s`` is abandoned and its connection closed. This is the one that holds
  whatever the network does (a silent peer, a proxy or NAT that stopped forwarding but
  still acknowledges TCP, a stopped server process), where the kernel sees nothing wrong.
  A write abandoned this way is ``Indeterminate`` (it may have committed: the machine
  re-reads the head and its transition recognises its own effect); a read is
  ``Determinate``;
* ``statement_timeout`` at 3/4 of the bound (sent as a startup ``options``), so that a
  statement the server is merely slow with (waiting on a lock, an overloaded disk) is
  cancelled by the server first: a definite "it did not happen" (``Determinate``);
* TCP keepalives (idle 10 s, interval 5 s, 3 probes) and ``tcp_user_timeout`` (the
  bound): a dead host or network is noticed by the kernel, also on the idle LISTEN
  connection, which has no statement in flight.

libpq options in the URI win over these defaults (``?keepalives_idle=60``,
``?options=-c%20statement_timeout%3D0``...). Connecting has its own bound,
``connect_timeout`` (10 s).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import psycopg
from psycopg import sql

from persist_lib.errors import Determinate, Indeterminate, InvalidUri, InvalidUsage
from persist_lib.location.base import CaSResult, Consensus, VersionedData
from persist_lib.location.mem import _check_cas_args
from persist_lib.location.redaction import SensitiveUrl, redact

__all__ = ["NOTIFY_CHANNEL", "PostgresConsensus"]

log = logging.getLogger(__name__)

T = TypeVar("T")

NOTIFY_CHANNEL = "persist_consensus"
_MAX_PAYLOAD = 7900  # NOTIFY payloads must be < 8000 bytes
_MARKER = -1


# Connection parameters that do not change which server/database/role is reached.
_NOT_TARGET = frozenset({"password", "sslpassword", "passfile"})


def _target(conninfo: str) -> dict[str, str] | None:
    """What a URL/conninfo connects to, by libpq's own parser, without secrets."""
    try:
        params = psycopg.conninfo.conninfo_to_dict(conninfo)
    except Exception:  # noqa: BLE001 - unparsable (e.g. over-redacted): no identity
        return None
    return {k: str(v) for k, v in params.items() if k not in _NOT_TARGET}


_TARGET_NUMBERS: dict[tuple[tuple[str, str], ...], int] = {}
_TARGET_NUMBERS_LOCK = threading.Lock()


def _target_number(ident: dict[str, str]) -> int:
    """A number per distinct connection target, stable for the life of the process."""
    key = tuple(sorted(ident.items()))
    with _TARGET_NUMBERS_LOCK:
        return _TARGET_NUMBERS.setdefault(key, len(_TARGET_NUMBERS) + 1)


# Defaults for libpq's TCP liveness settings; the URI's own values win.
_KEEPALIVE_DEFAULTS = {
    "keepalives": "1",
    "keepalives_idle": "10",
    "keepalives_interval": "5",
    "keepalives_count": "3",
}
DEFAULT_OP_TIMEOUT_S = 15.0


class _BoundedConnection(psycopg.Connection[Any]):
    """A psycopg connection whose every wait for the server is bounded.

    psycopg runs each statement as a generator that ``wait`` drives over the socket;
    ``wait`` takes a timeout (``notifies(timeout=...)`` uses it), and a wait without
    one here gets ``op_timeout_s``. A wait that ran out leaves the protocol mid-way, so
    the connection is closed (``timed_out`` says why) and the error re-raised."""

    op_timeout_s: float | None = None
    timed_out: bool = False

    def wait(self, gen: Any, interval: float = 0.1, timeout: float | None = None) -> Any:
        bound = self.op_timeout_s
        if timeout is not None or bound is None:
            return super().wait(gen, interval, timeout)
        start = time.monotonic()
        try:
            return super().wait(gen, interval, bound)
        except psycopg.OperationalError:
            if time.monotonic() - start >= bound:
                self.timed_out = True
                try:
                    self.close()
                except Exception:  # noqa: BLE001 - closing a dead connection
                    pass
            raise


class _Listener:
    """One LISTEN connection in a daemon thread; bumps generations and wakes waiters."""

    def __init__(self, owner: PostgresConsensus) -> None:
        # A weak reference, so an unclosed PostgresConsensus can still be collected
        # (its finalizer then stops this thread).
        self._owner = weakref.ref(owner)
        self.cond = threading.Condition()
        self.healthy = False
        self.gen_all = 0  # bumped on (re)connect and on payload-less notifications
        self.gens: dict[str, int] = {}  # only for keys somebody waits on
        self.waiting: dict[str, int] = {}
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()

    def ensure_started(self, wait_s: float = 2.0) -> None:
        with self.cond:
            if self._stop.is_set():
                return
            if self._thread is None or not self._thread.is_alive() or self._pid != os.getpid():
                self._pid = os.getpid()
                self._ready.clear()
                self._thread = threading.Thread(
                    target=self._run, name="persist-pg-listen", daemon=True
                )
                self._thread.start()
        self._ready.wait(wait_s)

    def stop_soon(self) -> None:
        """Tells the thread to exit without waiting for it (safe from a finalizer)."""
        self._stop.set()

    def stop(self) -> None:
        self._stop.set()
        with self.cond:
            self.cond.notify_all()
        t = self._thread
        if t is not None and t.is_alive() and t is not threading.current_thread():
            t.join(timeout=5)

    def _bump(self, payload: str | None) -> None:
        with self.cond:
            if payload:
                if payload in self.waiting:
                    self.gens[payload] = self.gens.get(payload, 0) + 1
            else:
                self.gen_all += 1
            self.cond.notify_all()

    def _run(self) -> None:
        backoff = 0.05
        while not self._stop.is_set():
            conn: psycopg.Connection[Any] | None = None
            try:
                owner = self._owner()
                if owner is None:
                    return
                try:
                    conn = owner._connect()
                finally:
                    del owner
                conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(NOTIFY_CHANNEL)))
                with self.cond:
                    self.healthy = True
                self._bump(None)  # changes may have been missed while disconnected
                self._ready.set()
                backoff = 0.05
                while not self._stop.is_set():
                    for n in conn.notifies(timeout=0.2):
                        self._bump(n.payload)
            except Exception as e:  # noqa: BLE001 - reconnect on anything
                owner = self._owner()
                text = owner._redact(str(e)) if owner is not None else redact(str(e))
                del owner
                log.debug("persist consensus listener: %s", text)
            finally:
                with self.cond:
                    self.healthy = False
                    self.cond.notify_all()
                self._ready.set()
                if conn is not None:
                    try:
                        conn.close()
                    except Exception:  # noqa: BLE001
                        pass
            if self._stop.wait(backoff):
                return
            backoff = min(backoff * 2, 2.0)


class PostgresConsensus(Consensus):
    """Consensus in a Postgres table. Thread-safe; safe across processes and hosts."""

    def __init__(
        self,
        url: str | SensitiveUrl,
        *,
        table: str = "consensus",
        schema: str | None = None,
        connect_timeout_s: int = 10,
        op_timeout_s: float | None = DEFAULT_OP_TIMEOUT_S,
        notify: bool = True,
        application_name: str = "persist",
    ) -> None:
        self.url = SensitiveUrl(url)
        if self.url.problem:  # refused before libpq, whose errors would quote a piece of it
            raise InvalidUri(f"postgres consensus URL {self.url}: {self.url.problem}")
        if not table or (schema is not None and not schema):
            raise InvalidUsage("postgres consensus: table and schema names must be non-empty")
        self.table = table
        self.schema = schema
        self.notify = notify
        self.connect_timeout_s = connect_timeout_s
        if op_timeout_s is not None and not op_timeout_s > 0:
            raise InvalidUsage(
                f"postgres consensus: op_timeout_s (persist_op_timeout_s) must be a positive "
                f"number of seconds, got {op_timeout_s!r}"
            )
        self.op_timeout_s = op_timeout_s
        self.application_name = application_name
        self._table = sql.Identifier(schema, table) if schema else sql.Identifier(table)
        self._secrets = self._find_secrets(self.url.raw)
        self._local = threading.local()
        self._lock = threading.Lock()
        # (pid, owning thread, connection): closed when their thread ends (on the next
        # connect) or at close(); never closed from a forked child, which would end the
        # parent's session (psycopg itself never finalizes a parent's connection).
        self._conns: list[tuple[int, threading.Thread, psycopg.Connection[Any]]] = []
        self._setup_done = False
        self._closed = False
        self.notify_failures = 0  # notifications that failed after their CAS committed
        self._listener = _Listener(self)
        weakref.finalize(self, self._listener.stop_soon)
        self._description = self._describe_log()
        self._build_queries()

    # -- description / redaction ---------------------------------------------------

    def describe(self) -> str:
        """The redacted URL and the table: ``postgresql://u:****@h:5432/db (table
        "consensus")``. It identifies the log (the per-process state cache is keyed by
        it): instances on one database with other ``table``/``schema`` arguments differ,
        and when redaction hid more than secrets (a later ``@`` in the URL makes it
        over-redact the host), a per-process number of the connection target is
        appended (``[target #2]``; a number, not a hash: a malformed URL can put
        password fragments into the parsed host), so two databases never share a
        description."""
        return self._description

    def _describe_log(self) -> str:
        shown = str(self.url)
        ident = _target(self.url.raw)
        if ident is not None and _target(shown) != ident:
            shown += f" [target #{_target_number(ident)}]"
        return f"{shown} (table {self._quoted_table()})"

    def _quoted_table(self) -> str:
        """``"schema"."table"`` (``"table"``: found on the search path), quoted as SQL
        identifiers, so every (schema, table) pair reads differently."""
        names = [self.schema, self.table] if self.schema else [self.table]
        return ".".join('"' + n.replace('"', '""') + '"' for n in names)

    def __repr__(self) -> str:
        return f"PostgresConsensus({self.describe()!r})"

    @staticmethod
    def _find_secrets(raw: str) -> list[str]:
        # every spelling of every secret libpq or a URL parser could read from it
        return list(SensitiveUrl(raw).secrets)

    def _redact(self, text: str) -> str:
        text = redact(text)
        for s in self._secrets:
            text = text.replace(s, "****")
        return text

    # -- SQL -----------------------------------------------------------------------

    def _build_queries(self) -> None:
        t = self._table
        self._q_create = sql.SQL(
            "CREATE TABLE IF NOT EXISTS {} ("
            "shard text NOT NULL, seqno bigint NOT NULL, data bytea NOT NULL, "
            "PRIMARY KEY (shard, seqno))"
        ).format(t)
        tail = sql.SQL("SELECT seqno FROM ins")  # no pg_notify here: see the module docstring
        self._q_cas = sql.SQL(
            "WITH expected_row AS ("
            " SELECT seqno FROM {t} WHERE shard = %(shard)s AND seqno = %(expected)s"
            " FOR KEY SHARE"
            "), ins AS ("
            " INSERT INTO {t} (shard, seqno, data)"
            " SELECT %(shard)s, %(new)s, %(data)s FROM expected_row RETURNING seqno"
            ") {tail}"
        ).format(t=t, tail=tail)
        self._q_cas_first = sql.SQL(
            "WITH marker AS ("
            " INSERT INTO {t} (shard, seqno, data) VALUES (%(shard)s, %(marker)s, ''::bytea)"
            " ON CONFLICT DO NOTHING RETURNING seqno"
            "), ins AS ("
            " INSERT INTO {t} (shard, seqno, data)"
            " SELECT %(shard)s, %(new)s, %(data)s FROM marker RETURNING seqno"
            ") {tail}"
        ).format(t=t, tail=tail)
        # Its own (autocommit) transaction, after the CAS committed; asynchronous commit:
        # the notification needs no fsync, and the notify lock is held until it is over.
        self._q_notify = sql.SQL(
            "SELECT pg_notify(%s, %s), set_config('synchronous_commit', 'off', true)"
        )
        self._q_head = sql.SQL(
            "SELECT seqno, data FROM {} WHERE shard = %s AND seqno >= 0 ORDER BY seqno DESC LIMIT 1"
        ).format(t)
        self._q_scan = sql.SQL(
            "SELECT seqno, data FROM {} WHERE shard = %s AND seqno >= %s ORDER BY seqno LIMIT %s"
        ).format(t)
        self._q_truncate = sql.SQL(
            "DELETE FROM {t} WHERE shard = %(shard)s AND seqno IN ("
            " SELECT seqno FROM {t} WHERE shard = %(shard)s AND seqno >= 0 AND seqno < %(s)s"
            " AND EXISTS (SELECT 1 FROM {t} WHERE shard = %(shard)s AND seqno >= %(s)s)"
            " ORDER BY seqno FOR UPDATE)"
        ).format(t=t)
        self._q_list = sql.SQL(
            "SELECT DISTINCT shard FROM {} WHERE seqno >= 0 ORDER BY shard"
        ).format(t)

    # -- connections ---------------------------------------------------------------

    def _connect(self) -> psycopg.Connection[Any]:
        """A new autocommit connection; raises ``Determinate`` (redacted) on failure."""
        err: Exception | None = None
        try:
            conninfo = psycopg.conninfo.make_conninfo(self.url.raw, **self._liveness_params())
            conn = _BoundedConnection.connect(
                conninfo,
                autocommit=True,
                connect_timeout=self.connect_timeout_s,
                application_name=self.application_name,
            )
            conn.op_timeout_s = self.op_timeout_s
            return conn
        except Exception as e:  # noqa: BLE001 - psycopg.Error and bad conninfo alike
            err = Determinate(
                self._redact(
                    f"postgres consensus {self.describe()}: cannot connect: "
                    f"{type(e).__name__}: {e}; nothing was sent; check the URL and that the "
                    "server is up"
                )
            )
        raise err

    def _liveness_params(self) -> dict[str, str]:
        """Keepalives, ``tcp_user_timeout`` and ``statement_timeout`` (module docstring:
        bounded waits), each unless the URI sets it."""
        given = _target(self.url.raw) or {}
        out = {k: v for k, v in _KEEPALIVE_DEFAULTS.items() if k not in given}
        bound = self.op_timeout_s
        if bound is None:
            return out
        if "tcp_user_timeout" not in given:
            out["tcp_user_timeout"] = str(int(bound * 1000))
        options = given.get("options", "")
        if "statement_timeout" not in options:
            stmt = f"-c statement_timeout={max(1, int(bound * 750))}"
            out["options"] = f"{options} {stmt}".strip()
        return out

    def _conn(self) -> psycopg.Connection[Any]:
        if self._closed:
            raise InvalidUsage(f"{self.describe()} is closed")
        conn: psycopg.Connection[Any] | None = getattr(self._local, "conn", None)
        if conn is not None and not conn.closed and self._local.pid == os.getpid():
            return conn
        conn = self._connect()
        self._local.conn = conn
        self._local.pid = os.getpid()
        pid = os.getpid()
        with self._lock:
            keep: list[tuple[int, threading.Thread, psycopg.Connection[Any]]] = []
            dead: list[tuple[int, threading.Thread, psycopg.Connection[Any]]] = []
            for entry in self._conns:
                p, thread, c = entry
                if c.closed or p != pid:
                    continue
                (keep if thread.is_alive() else dead).append(entry)
            keep.append((pid, threading.current_thread(), conn))
            self._conns = keep
        for _, _, c in dead:
            try:
                c.close()
            except Exception:  # noqa: BLE001
                pass
        if not self._setup_done:
            self._setup(conn)
        return conn

    def _drop_conn(self) -> None:
        conn = getattr(self._local, "conn", None)
        self._local.conn = None
        if conn is not None:
            try:
                conn.close()
            except Exception:  # noqa: BLE001
                pass

    def _setup(self, conn: psycopg.Connection[Any]) -> None:
        """Creates schema and table idempotently; concurrent creators are serialized by
        an advisory lock (CREATE ... IF NOT EXISTS alone can race on the catalog)."""
        err: Exception | None = None
        try:
            with conn.transaction():
                conn.execute(
                    "SELECT pg_advisory_xact_lock(hashtext(%s))", ("persist_consensus_setup",)
                )
                if self.schema:
                    conn.execute(
                        sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(
                            sql.Identifier(self.schema)
                        )
                    )
                conn.execute(self._q_create)
        except (
            psycopg.errors.UniqueViolation,
            psycopg.errors.DuplicateTable,
            psycopg.errors.DuplicateObject,
            psycopg.errors.DuplicateSchema,
        ):
            pass  # created concurrently by someone without the lock: fine
        except psycopg.Error as e:
            if conn.broken or conn.closed:
                self._drop_conn()
            err = Determinate(
                self._redact(
                    f"postgres consensus {self.describe()}: cannot create table "
                    f"{self._table_name()}: {type(e).__name__}: {e}; check the role's privileges"
                )
            )
        if err is not None:
            raise err
        self._setup_done = True

    def _table_name(self) -> str:
        return f"{self.schema}.{self.table}" if self.schema else self.table

    def close(self) -> None:
        self._closed = True
        self._listener.stop()
        with self._lock:
            conns, self._conns = self._conns, []
        for pid, _, c in conns:
            if pid != os.getpid():
                continue
            try:
                c.close()
            except Exception:  # noqa: BLE001
                pass

    # -- running statements --------------------------------------------------------

    def _run(
        self,
        op: str,
        key: str | None,
        write: bool,
        fn: Callable[[psycopg.Connection[Any]], T],
    ) -> T:
        conn = self._conn()
        err: Exception | None = None
        try:
            return fn(conn)
        except psycopg.Error as e:
            err = self._translate(op, key, write, conn, e)
        raise err

    def _translate(
        self,
        op: str,
        key: str | None,
        write: bool,
        conn: psycopg.Connection[Any],
        e: psycopg.Error,
    ) -> Exception:
        state = getattr(e, "sqlstate", None)
        broken = conn.broken or conn.closed
        if broken:
            self._drop_conn()
        where = f"postgres consensus {self.describe()}: {op}" + (
            f" of key {key!r}" if key is not None else ""
        )
        detail = f"{type(e).__name__}: {e}"
        if getattr(conn, "timed_out", False):
            bound = f"{self.op_timeout_s:g}s (persist_op_timeout_s)"
            if write:
                msg = (
                    f"{where} failed: no answer from the server within {bound}; the "
                    "connection was closed while the write was in flight: it may or may not "
                    "have been applied; re-read the head"
                )
                return Indeterminate(self._redact(msg))
            msg = f"{where} failed: no answer from the server within {bound}; retry"
            return Determinate(self._redact(msg))
        if state == "57014" and "statement timeout" in str(e):
            msg = (
                f"{where} failed: the server cancelled it after statement_timeout "
                f"(3/4 of persist_op_timeout_s); it did not happen; retry"
            )
            return Determinate(self._redact(msg))
        if state in ("40001", "40P01"):
            msg = f"{where} failed: {detail} (serialization failure/deadlock); it did not happen; retry"
            return Determinate(self._redact(msg))
        if state is not None and not state.startswith("08"):
            # The server answered with an error: the autocommit statement rolled back.
            msg = f"{where} failed: {detail} (SQLSTATE {state}); it did not happen"
            return Determinate(self._redact(msg))
        if write:
            msg = (
                f"{where} failed: {detail}; the connection was lost while the write was in "
                "flight: it may or may not have been applied; re-read the head"
            )
            return Indeterminate(self._redact(msg))
        return Determinate(self._redact(f"{where} failed: {detail}; retry"))

    # -- Consensus -----------------------------------------------------------------

    def head(self, key: str) -> VersionedData | None:
        def run(c: psycopg.Connection[Any]) -> VersionedData | None:
            row = c.execute(self._q_head, (key,)).fetchone()
            return None if row is None else VersionedData(int(row[0]), bytes(row[1]))

        return self._run("head", key, False, run)

    def compare_and_set(self, key: str, expected: int | None, new: VersionedData) -> CaSResult:
        _check_cas_args(key, expected, new)
        if expected is not None and expected < 0:
            return CaSResult.EXPECTATION_MISMATCH  # a head is never negative
        params: dict[str, Any] = {
            "shard": key,
            "expected": expected,
            "new": new.seqno,
            "data": bytes(new.data),
            "marker": _MARKER,
        }
        query = self._q_cas_first if expected is None else self._q_cas

        def run(c: psycopg.Connection[Any]) -> CaSResult:
            try:
                rows = c.execute(query, params).fetchall()
            except psycopg.errors.UniqueViolation:
                return CaSResult.EXPECTATION_MISMATCH
            return CaSResult.COMMITTED if len(rows) == 1 else CaSResult.EXPECTATION_MISMATCH

        result = self._run("compare_and_set", key, True, run)
        if result is CaSResult.COMMITTED and self.notify:
            self._notify_committed(key)
        return result

    def _notify_committed(self, key: str) -> None:
        """Wakes listeners of ``key`` after its CAS committed. Best effort: never raises
        (a failure is logged and counted; listeners then notice at their next re-check)."""
        payload = key if len(key.encode("utf-8")) <= _MAX_PAYLOAD else ""
        conn: psycopg.Connection[Any] | None = None
        try:
            conn = self._conn()
            conn.execute(self._q_notify, (NOTIFY_CHANNEL, payload))
        except Exception as e:  # noqa: BLE001 - the CAS committed: nothing may fail it now
            if conn is not None and (conn.broken or conn.closed):
                self._drop_conn()
            with self._lock:
                self.notify_failures += 1
                first = self.notify_failures == 1
            log.log(
                logging.WARNING if first else logging.DEBUG,
                "%s",
                self._redact(
                    f"postgres consensus {self.describe()}: the CAS of key {key!r} committed "
                    f"but its notification failed: {type(e).__name__}: {e}; listeners will "
                    "notice the change at their next re-check (at most about 1 s later)"
                    + ("; further failures are logged at debug level" if first else "")
                ),
            )

    def scan(self, key: str, from_seqno: int, limit: int) -> list[VersionedData]:
        if limit <= 0:
            raise InvalidUsage(f"consensus key {key!r}: scan limit must be positive, got {limit}")
        lo = max(from_seqno, 0)

        def run(c: psycopg.Connection[Any]) -> list[VersionedData]:
            rows = c.execute(self._q_scan, (key, lo, limit)).fetchall()
            return [VersionedData(int(s), bytes(d)) for s, d in rows]

        return self._run("scan", key, False, run)

    def truncate(self, key: str, seqno: int) -> int:
        def run(c: psycopg.Connection[Any]) -> int:
            return int(c.execute(self._q_truncate, {"shard": key, "s": seqno}).rowcount)

        n = self._run("truncate", key, True, run)
        if n > 0:
            return n
        head = self.head(key)
        if head is None:
            raise InvalidUsage(f"consensus key {key!r}: cannot truncate an empty log")
        if seqno > head.seqno:
            raise InvalidUsage(
                f"consensus key {key!r}: cannot truncate to {seqno}, beyond the head {head.seqno}"
            )
        return 0

    def list_keys(self) -> Iterator[str]:
        keys = self._run(
            "list_keys", None, False, lambda c: [str(r[0]) for r in c.execute(self._q_list)]
        )
        yield from keys

    def _changed_pred(self, key: str, gen: tuple[int, int]) -> Callable[[], bool]:
        lst = self._listener
        return lambda: (lst.gens.get(key, 0), lst.gen_all) != gen or self._closed

    def wait_for_change(self, key: str, seqno: int | None, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        lst = self._listener
        if self.notify and not self._closed:
            lst.ensure_started(wait_s=min(2.0, max(timeout_s, 0.0)))
        poll = 0.005
        with lst.cond:
            lst.waiting[key] = lst.waiting.get(key, 0) + 1
        try:
            while True:
                with lst.cond:
                    gen = (lst.gens.get(key, 0), lst.gen_all)
                try:
                    h = self.head(key)
                except (Determinate, Indeterminate):
                    return  # a hint only: the caller re-reads the head and sees the error
                if (h.seqno if h is not None else None) != seqno:
                    return
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._closed:
                    return
                with lst.cond:
                    # With a healthy listener a notification wakes us; re-check once a
                    # second anyway (belt and braces). Without one, poll with backoff.
                    wait = min(remaining, 1.0 if lst.healthy else poll)
                    lst.cond.wait_for(self._changed_pred(key, gen), timeout=wait)
                poll = min(poll * 2, 0.25)
        finally:
            with lst.cond:
                left = lst.waiting.get(key, 1) - 1
                if left <= 0:
                    lst.waiting.pop(key, None)
                    lst.gens.pop(key, None)
                else:
                    lst.waiting[key] = left
