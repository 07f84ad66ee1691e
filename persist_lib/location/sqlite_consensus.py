"""Consensus on a SQLite file (``sqlite:///PATH``): the embedded default.

Why it looks the way it does (research/reliability.md section 5):

- WAL mode, so readers never block the writer, plus a busy timeout.
- ``isolation_level=None`` (autocommit) and **one statement per CAS**: an ``INSERT``
  takes SQLite's write lock *before* it evaluates its ``SELECT``, so the
  "head is expected" check and the insert are atomic across threads and processes.
  (``BEGIN DEFERRED; SELECT; INSERT`` would fail with SQLITE_BUSY_SNAPSHOT under
  contention, which the busy timeout does not retry.) Writers are serialized by SQLite,
  so no marker row is needed for the first write (unlike Postgres).
- ``synchronous=FULL`` by default. In WAL mode ``NORMAL`` skips the fsync at each
  commit: a commit acknowledged to the caller can be lost on power failure (not on a
  process crash), which breaks persist's durability promise, so it is opt-in
  (``?synchronous=NORMAL``). Measured on the dev VM (500 sequential 1 KB CAS, one
  process): FULL 1-2.4 ms per CAS, NORMAL 0.04-0.09 ms. NORMAL is ~25x faster, but a
  few ms per state change is small next to the blob writes that precede it, so the
  default stays durable.
- **Writes of one process take turns on a lock per database file** before SQLite's
  own write lock. Without it, threads of one process (a writer, background merges,
  GC, rollups, other shards in the same file) contend on SQLite's lock, whose busy
  handler *sleeps* (1, 2, 5, 10 ms...) before retrying: a commit behind one fsync
  of another thread would wait milliseconds more than that fsync. The in-process
  lock hands over as soon as the holder is done; other processes still meet SQLite's
  lock and busy timeout as before. Reads never take it (WAL readers don't block).
- One connection per thread (created lazily, re-created after ``fork``), all closed
  by ``close()``. A forked child gets fresh write locks (``os.register_at_fork``): one
  held by another thread of the parent at the fork would never be released. "database is locked" after the busy timeout is ``Determinate``
  (the single statement did not run); an I/O error while writing is ``Indeterminate``.
- **Opening** runs ``PRAGMA journal_mode=WAL``, ``PRAGMA synchronous`` and ``CREATE
  TABLE IF NOT EXISTS`` on each new connection. On a brand-new file, switching to WAL
  upgrades a read transaction to a write one, and SQLite answers SQLITE_BUSY at once
  (it does not call the busy handler there, which could deadlock) when another
  connection holds the write lock, e.g. a rival doing the same switch: concurrent
  first opens failed within a millisecond. So the whole initialisation is retried on
  SQLITE_BUSY/SQLITE_LOCKED, on a new connection, with jittered exponential backoff
  (1 ms doubling to 50 ms) until ``busy_timeout_ms`` has passed since the first
  attempt (a retry's statements wait at most what is left); the error then says how
  long and how many attempts it tried.
- **Closing keeps a few connections idle for reuse** (``_IdlePool``). Closing the last
  connection of a WAL database checkpoints the WAL into the file (an fsync under
  ``synchronous=FULL``) and deletes the WAL and its shared-memory index, which the next
  open creates again: a client that opens, reads or writes once and closes (a cold
  read, a CLI command) paid that every time (docs/benchmarks.md, issue 28). ``close()``
  hands this process's idle connections (no transaction open) to a small process-wide
  pool instead (at most ``IDLE_MAX`` in all, the oldest closed first); the next
  ``SqliteConsensus`` of the same file and settings takes one instead of connecting. A
  pooled connection is reused only by the process that opened it and only while the
  path is still the same file (device and inode checked): a database deleted and
  created again under the same name is connected afresh. An idle connection holds no
  transaction, so it blocks no reader, writer or checkpoint of any process; it only
  defers the last-close checkpoint, which happens at process exit (``atexit``) or when
  the pool evicts it, and any process that opens the file recovers a WAL left behind.
- Never put the file on a network filesystem (WAL needs shared memory).
"""

from __future__ import annotations

import atexit
import os
import random
import sqlite3
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import TypeVar

from persist_lib.errors import Determinate, Indeterminate, InvalidUsage
from persist_lib.location.base import CaSResult, Consensus, VersionedData
from persist_lib.location.mem import _check_cas_args

__all__ = ["SqliteConsensus"]

T = TypeVar("T")

# PRAGMAs can't take parameters: map the allowed values to fixed statements.
_SYNCHRONOUS = {
    "FULL": "PRAGMA synchronous=FULL",
    "NORMAL": "PRAGMA synchronous=NORMAL",
    "EXTRA": "PRAGMA synchronous=EXTRA",
}

_CREATE = (
    "CREATE TABLE IF NOT EXISTS consensus ("
    " shard TEXT NOT NULL,"
    " seqno INTEGER NOT NULL,"
    " data BLOB NOT NULL,"
    " PRIMARY KEY (shard, seqno))"
)
_HEAD = "SELECT seqno, data FROM consensus WHERE shard = ? ORDER BY seqno DESC LIMIT 1"
_CAS = (
    "INSERT INTO consensus (shard, seqno, data) SELECT ?, ?, ? "
    "WHERE (SELECT seqno FROM consensus WHERE shard = ? ORDER BY seqno DESC LIMIT 1) IS ?"
)
_SCAN = "SELECT seqno, data FROM consensus WHERE shard = ? AND seqno >= ? ORDER BY seqno LIMIT ?"
_TRUNCATE = (
    "DELETE FROM consensus WHERE shard = ? AND seqno < ? "
    "AND EXISTS (SELECT 1 FROM consensus WHERE shard = ? AND seqno >= ?)"
)
_LIST_KEYS = "SELECT DISTINCT shard FROM consensus ORDER BY shard"

_SQLITE_BUSY = 5
_SQLITE_LOCKED = 6
_SQLITE_IOERR = 10
_SQLITE_FULL = 13


# One in-process write lock per database file (see the module docstring).
_WRITE_LOCKS: dict[str, threading.Lock] = {}
_WRITE_LOCKS_GUARD = threading.Lock()


def _write_lock(path: str) -> threading.Lock:
    with _WRITE_LOCKS_GUARD:
        lock = _WRITE_LOCKS.get(path)
        if lock is None:
            lock = _WRITE_LOCKS[path] = threading.Lock()
        return lock


_INSTANCES: weakref.WeakSet[SqliteConsensus] = weakref.WeakSet()

#: Idle connections kept for reuse by later instances, process-wide (module docstring).
IDLE_MAX = 8


class _IdlePool:
    """Idle, initialised connections of closed instances, newest last, keyed by
    ``(path, synchronous, busy_timeout_ms)`` and the file's ``(st_dev, st_ino)``."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.entries: list[tuple[tuple[str, str, int], tuple[int, int], int, sqlite3.Connection]] = []
        # Connections a forked child inherited: never used nor closed there (closing
        # one would run the parent's last-close logic on a file the parent still uses).
        self.inherited: list[sqlite3.Connection] = []

    def put(self, key: tuple[str, str, int], conn: sqlite3.Connection) -> None:
        ident = _file_identity(key[0])
        if ident is None or conn.in_transaction:
            _close_quietly(conn)
            return
        with self.lock:
            self.entries.append((key, ident, os.getpid(), conn))
            evicted = self.entries[:-IDLE_MAX] if len(self.entries) > IDLE_MAX else []
            del self.entries[: len(evicted)]
        for _, _, _, c in evicted:
            _close_quietly(c)

    def take(self, key: tuple[str, str, int]) -> sqlite3.Connection | None:
        ident = _file_identity(key[0])
        stale: list[sqlite3.Connection] = []
        found: sqlite3.Connection | None = None
        with self.lock:
            for i in range(len(self.entries) - 1, -1, -1):
                k, fid, pid, c = self.entries[i]
                if k != key or pid != os.getpid():
                    continue
                del self.entries[i]
                if fid == ident:
                    found = c
                    break
                stale.append(c)  # the name now points at another file
        for c in stale:
            _close_quietly(c)
        return found

    def close_all(self) -> None:
        with self.lock:
            entries, self.entries = self.entries, []
        for _, _, pid, c in entries:
            if pid == os.getpid():
                _close_quietly(c)

    def reset_in_child(self) -> None:
        self.lock = threading.Lock()
        self.inherited.extend(c for _, _, _, c in self.entries)
        self.entries = []


def _file_identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _close_quietly(conn: sqlite3.Connection) -> None:
    try:
        conn.close()
    except sqlite3.Error:
        pass


_IDLE = _IdlePool()
atexit.register(_IDLE.close_all)


def _reset_locks_in_child() -> None:
    """After ``fork``, in the child: a write lock (or an instance's connection-list lock)
    held by another thread of the parent at the fork would never be released (that thread
    does not exist here), and every write of the child would fail after the busy timeout.
    Fresh locks for everything; the child opens its own connections anyway."""
    global _WRITE_LOCKS, _WRITE_LOCKS_GUARD
    _WRITE_LOCKS = {}
    _WRITE_LOCKS_GUARD = threading.Lock()
    _IDLE.reset_in_child()
    for c in list(_INSTANCES):
        c._lock = threading.Lock()
        c._write = _write_lock(c.path)


os.register_at_fork(after_in_child=_reset_locks_in_child)


class SqliteConsensus(Consensus):
    """Consensus in a SQLite database file; safe across threads and local processes."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        synchronous: str = "FULL",
        busy_timeout_ms: int = 10_000,
    ) -> None:
        sync = synchronous.upper()
        if sync not in _SYNCHRONOUS:
            raise InvalidUsage(
                f"sqlite synchronous must be one of {sorted(_SYNCHRONOUS)}, got {synchronous!r}"
            )
        if busy_timeout_ms < 0:
            raise InvalidUsage(f"sqlite busy_timeout_ms must be >= 0, got {busy_timeout_ms}")
        self.path = os.path.abspath(os.fspath(path))
        self.synchronous = sync
        self.busy_timeout_ms = busy_timeout_ms
        self._local = threading.local()
        self._lock = threading.Lock()
        # (pid, owning thread, connection): closed when their thread ends (on the next
        # connect) or at close(); connections inherited over fork are left alone.
        self._conns: list[tuple[int, threading.Thread, sqlite3.Connection]] = []
        self._closed = False
        self._write = _write_lock(self.path)
        _INSTANCES.add(self)
        try:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        except OSError as e:
            raise Determinate(
                f"sqlite consensus {self.path!r}: cannot create the parent directory: "
                f"{e.strerror}; check the path and permissions"
            ) from None
        self._conn()  # fail fast on a bad path; creates the table

    def describe(self) -> str:
        return f"sqlite:///{self.path}"  # absolute path: sqlite:////abs/path

    def __repr__(self) -> str:
        return f"SqliteConsensus({self.path!r})"

    # -- connections ---------------------------------------------------------------

    def _conn(self) -> sqlite3.Connection:
        if self._closed:
            raise InvalidUsage(f"{self.describe()} is closed")
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is not None and getattr(self._local, "pid", None) == os.getpid():
            return conn
        conn = self._open_connection()
        self._local.conn = conn
        self._local.pid = os.getpid()
        pid = os.getpid()
        with self._lock:
            keep: list[tuple[int, threading.Thread, sqlite3.Connection]] = []
            dead: list[tuple[int, threading.Thread, sqlite3.Connection]] = []
            for entry in self._conns:
                if entry[0] != pid:
                    continue
                (keep if entry[1].is_alive() else dead).append(entry)
            keep.append((pid, threading.current_thread(), conn))
            self._conns = keep
        for _, _, c in dead:
            try:
                c.close()
            except sqlite3.Error:
                pass
        return conn

    def _open_connection(self) -> sqlite3.Connection:
        """A new, initialised connection; the initialisation is retried while the file
        is busy, for up to ``busy_timeout_ms`` in all (see the module docstring)."""
        pooled = _IDLE.take(self._pool_key())
        if pooled is not None:
            return pooled
        start = time.monotonic()
        budget_s = self.busy_timeout_ms / 1000.0
        timeout_s = budget_s  # the busy wait of each statement of this attempt
        backoff_s = 0.001
        attempts = 0
        err: Exception | None = None
        while err is None:
            attempts += 1
            conn: sqlite3.Connection | None = None
            try:
                conn = self._connect(timeout_s)
                conn.execute("PRAGMA journal_mode=WAL")
                conn.execute(_SYNCHRONOUS[self.synchronous])
                conn.execute(_CREATE)
                if timeout_s < budget_s:
                    # A retry waited at most what was left: reconnect with the full busy
                    # timeout for the life of the connection (WAL mode and the table are in
                    # the file now; `synchronous` is per connection).
                    conn.close()
                    conn = self._connect(budget_s)
                    conn.execute(_SYNCHRONOUS[self.synchronous])
                return conn
            except sqlite3.Error as e:
                if conn is not None:
                    conn.close()
                elapsed_s = time.monotonic() - start
                left_s = budget_s - elapsed_s
                if not _is_busy(e) or left_s <= 0:
                    err = self._open_error(e, attempts, elapsed_s)
                    continue
            except BaseException:
                if conn is not None:
                    conn.close()
                raise
            pause_s = min(left_s, backoff_s * (0.5 + 0.5 * random.random()))
            time.sleep(pause_s)
            backoff_s = min(backoff_s * 2, 0.05)
            timeout_s = max(0.0, left_s - pause_s)
        raise err

    def _connect(self, timeout_s: float) -> sqlite3.Connection:
        return sqlite3.connect(
            self.path, timeout=timeout_s, isolation_level=None, check_same_thread=False
        )

    def _open_error(self, e: sqlite3.Error, attempts: int, elapsed_s: float) -> Exception:
        if not _is_busy(e):
            return self._error("open", None, e, write=False)
        name = getattr(e, "sqlite_errorname", type(e).__name__)
        return Determinate(
            f"sqlite consensus {self.path!r}: open failed: {e} ({name}): the file was still "
            f"busy after {attempts} attempt(s) over {elapsed_s * 1000:.0f} ms (busy timeout "
            f"{self.busy_timeout_ms} ms); it was not opened; retry (another connection "
            "holds the write lock)"
        )

    def _pool_key(self) -> tuple[str, str, int]:
        return self.path, self.synchronous, self.busy_timeout_ms

    def close(self) -> None:
        """Releases this instance's connections: idle ones go to the process's pool for
        the next instance on this file (module docstring), the rest are closed."""
        with self._lock:
            conns, self._conns = self._conns, []
            self._closed = True
        for pid, _, c in conns:
            if pid != os.getpid():
                continue
            _IDLE.put(self._pool_key(), c)

    def _error(
        self,
        op: str,
        key: str | None,
        e: sqlite3.Error,
        *,
        write: bool,
        elapsed_s: float | None = None,
    ) -> Exception:
        code = getattr(e, "sqlite_errorcode", None)
        primary = code & 0xFF if isinstance(code, int) else None
        name = getattr(e, "sqlite_errorname", type(e).__name__)
        where = f"sqlite consensus {self.path!r}: {op}" + (f" of key {key!r}" if key else "")
        if _is_busy(e):
            # SQLite does not always wait (e.g. a lock upgrade that could deadlock), so
            # say how long this call took rather than claim the busy timeout ran out.
            took = "" if elapsed_s is None else f" after {elapsed_s * 1000:.0f} ms"
            return Determinate(
                f"{where} failed: {e} ({name}){took} (busy timeout {self.busy_timeout_ms} "
                "ms); it did not happen; retry (another connection holds the write lock)"
            )
        if primary == _SQLITE_FULL:
            return Determinate(f"{where} failed: {e} ({name}); it did not happen; free disk space")
        if write and (
            primary == _SQLITE_IOERR
            or primary is None
            or not isinstance(e, sqlite3.OperationalError | sqlite3.IntegrityError)
        ):
            return Indeterminate(f"{where} failed: {e} ({name}); it may have been applied")
        return Determinate(f"{where} failed: {e} ({name}); it did not happen")

    def _run(
        self, op: str, key: str | None, write: bool, fn: Callable[[sqlite3.Connection], T]
    ) -> T:
        conn = self._conn()
        err: Exception | None = None
        start = time.monotonic()
        if write and not self._write.acquire(timeout=self.busy_timeout_ms / 1000.0):
            raise Determinate(
                f"sqlite consensus {self.path!r}: {op}" + (f" of key {key!r}" if key else "")
                + f" did not start: other threads of this process kept writing for "
                f"{self.busy_timeout_ms} ms (busy timeout); it did not happen; retry"
            )
        try:
            return fn(conn)
        except sqlite3.Error as e:
            err = self._error(op, key, e, write=write, elapsed_s=time.monotonic() - start)
        finally:
            if write:
                self._write.release()
        raise err

    # -- Consensus -----------------------------------------------------------------

    def head(self, key: str) -> VersionedData | None:
        def run(c: sqlite3.Connection) -> VersionedData | None:
            row = c.execute(_HEAD, (key,)).fetchone()
            return None if row is None else VersionedData(int(row[0]), bytes(row[1]))

        return self._run("head", key, False, run)

    def compare_and_set(self, key: str, expected: int | None, new: VersionedData) -> CaSResult:
        _check_cas_args(key, expected, new)
        if expected is not None and expected < 0:
            return CaSResult.EXPECTATION_MISMATCH  # a head is never negative

        def run(c: sqlite3.Connection) -> CaSResult:
            try:
                cur = c.execute(_CAS, (key, new.seqno, bytes(new.data), key, expected))
            except sqlite3.IntegrityError:
                return CaSResult.EXPECTATION_MISMATCH
            return CaSResult.COMMITTED if cur.rowcount == 1 else CaSResult.EXPECTATION_MISMATCH

        return self._run("compare_and_set", key, True, run)

    def scan(self, key: str, from_seqno: int, limit: int) -> list[VersionedData]:
        if limit <= 0:
            raise InvalidUsage(f"consensus key {key!r}: scan limit must be positive, got {limit}")

        def run(c: sqlite3.Connection) -> list[VersionedData]:
            rows = c.execute(_SCAN, (key, from_seqno, limit)).fetchall()
            return [VersionedData(int(s), bytes(d)) for s, d in rows]

        return self._run("scan", key, False, run)

    def truncate(self, key: str, seqno: int) -> int:
        def run(c: sqlite3.Connection) -> int:
            return int(c.execute(_TRUNCATE, (key, seqno, key, seqno)).rowcount)

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
            "list_keys", None, False, lambda c: [str(r[0]) for r in c.execute(_LIST_KEYS)]
        )
        yield from keys


def _is_busy(e: sqlite3.Error) -> bool:
    """SQLITE_BUSY/SQLITE_LOCKED (any extended code): another connection holds a lock."""
    code = getattr(e, "sqlite_errorcode", None)
    primary = code & 0xFF if isinstance(code, int) else None
    return primary in (_SQLITE_BUSY, _SQLITE_LOCKED) or "locked" in str(e)
