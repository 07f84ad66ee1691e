"""Planted bugs: deliberately broken variants the reliability checks must catch.

These exist to prove the checkers can fail (research/reliability.md, R12). Each one
is activated explicitly by a test (``activate(names)``, a context manager that
monkeypatches module attributes and undoes it on exit) or by the history runner's
config (``HistoryConfig.planted``), and by nothing else: no library code imports this
module, and ``persist_lib.testing`` is a test-only package.

==========================  =================================================  ===============================
name                        what is broken                                     caught by
==========================  =================================================  ===============================
sqlite_cas_race             SQLite CAS as check-then-insert (two statements,   history checker (forked seqnos,
                            no primary key; the window widened by a 2 ms       lost acknowledged writes,
                            sleep) instead of one INSERT...SELECT on a PK      corruption seen by clients)
pg_cas_not_exists           Postgres CAS ``NOT EXISTS(seqno > expected)``      history checker on Postgres
                            under READ COMMITTED without a primary key (the
                            query that forks; 10 ms window)
gc_ignores_holds            GC deletes garbage without waiting for readers'    history checker (delete audit,
                            seqno holds                                        BlobNotFound under a live lease)
caa_no_idempotency_token    compare_and_append forgets its idempotency token,  stateful test (indeterminate
                            so a retry after an applied-then-timed-out CAS     CAS rule), history checker
                            reports a definite failure for a committed write   (failed write committed)
compaction_drops_part       the compactor merges all inputs but the last part  stateful test, history checker
                                                                               (trace != model)
skipped_checksum            parts are decoded without verifying SHA-256/size   corruption test
truncate_deletes_head       consensus truncate also deletes the head entry     stateful test (head regressed),
                                                                               history checker (audit)
lease_expiry_ignores_hb     lease expiry ignores heartbeats (expires every     stateful test, history checker
                            lease holder)                                      (lease expired early)
since_regress               downgrade_since accepts a backward since and the   stateful test, history checker
                            shard since is recomputed without its floor        (since regressed)
delete_on_any_exception     a write deletes its batch's blobs on any exception stateful test (interrupt after the
                            but Indeterminate (interrupts, failures after a    CAS landed), history checker
                            CAS that landed): the pre-issue-13 behaviour       (interrupts: deleted reachable blob)
sweeper_no_inflight_guard   the leaked-blob sweeper ignores registered writers history checker (long writes and
                            and unlinked rollups: only its (skewed) clock      Spark-style part writers vs sweeps
                            and grace protect writes in flight                 with the clock hours ahead)
heartbeat_thread_dies       the heartbeat loop catches only location and      history checker (heartbeat faults:
                            usage errors, dies on anything else, is never      the thread found dead with handles)
                            restarted
immediate_retry             a failed background merge is resubmitted at once,  background-compaction control
                            never backs off, never quarantined                 (a corrupt input part)
sqlite_first_open_no_retry  SQLite initialisation (WAL pragma, table) tried    first-open control (a rival
                            once: a fresh file's busy answer fails the open    holds the write lock)
verified_append_skips       a verified append skips ranges whose start the     history checker (divergent
                            since has passed and counts them "unverifiable"    verified appends from below
                            (the pre-issue-26 behaviour): accepts unchecked    the since return normally)
txn_apply_without_commit    a transaction's batches are applied to their data  txn control (a committer killed
                            shards before the commit CAS on the txn log (no    between applies: a mix of
                            check that the log holds the commit)               writers, shards disagreeing);
                                                                               txn history (failed txns
                                                                               committed, parts deleted)
txn_tidy_before_apply       tidy retracts log entries without checking they    txn control (committer killed
                            are applied                                        after the commit CAS, then a
                                                                               tidy: the commit is lost);
                                                                               txn history (half a txn)
txn_reader_skips_apply      a collection reader reads a transactional          txn control (committer killed
                            collection's shards without applying the           after the commit CAS: the
                            committed transactions first                       reader never sees it);
                                                                               txn history (a read at a
                                                                               committed time stuck)
==========================  =================================================  ===============================
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

from persist_lib.errors import Determinate, Indeterminate, InvalidUsage
from persist_lib.location.base import CaSResult, Consensus, VersionedData
from persist_lib.location.redaction import SensitiveUrl

PLANTED_BUGS: tuple[str, ...] = (
    "sqlite_cas_race",
    "pg_cas_not_exists",
    "gc_ignores_holds",
    "caa_no_idempotency_token",
    "compaction_drops_part",
    "skipped_checksum",
    "truncate_deletes_head",
    "lease_expiry_ignores_hb",
    "since_regress",
    "delete_on_any_exception",
    "sweeper_no_inflight_guard",
    "heartbeat_thread_dies",
    "immediate_retry",
    "sqlite_first_open_no_retry",
    "verified_append_skips",
    "txn_apply_without_commit",
    "txn_tidy_before_apply",
    "txn_reader_skips_apply",
)

# Which check catches each bug in the default run (the figures report it).
CAUGHT_BY: dict[str, str] = {
    "sqlite_cas_race": "history (sqlite)",
    "pg_cas_not_exists": "history (postgres)",
    "gc_ignores_holds": "history (delete audit)",
    "caa_no_idempotency_token": "stateful",
    "compaction_drops_part": "stateful",
    "skipped_checksum": "corruption",
    "truncate_deletes_head": "stateful",
    "lease_expiry_ignores_hb": "stateful",
    "since_regress": "stateful",
    "delete_on_any_exception": "stateful",
    "sweeper_no_inflight_guard": "history (skewed sweeps vs long writes)",
    "heartbeat_thread_dies": "history (heartbeat faults)",
    "immediate_retry": "background-compaction control",
    "sqlite_first_open_no_retry": "first-open control",
    "verified_append_skips": "history (divergent verified appends)",
    "txn_apply_without_commit": "txn control (killed between applies), txn history",
    "txn_tidy_before_apply": "txn control (killed after the commit, then tidy), txn history",
    "txn_reader_skips_apply": "txn control (killed after the commit, then read), txn history (read stuck)",
}

# Bugs that live in the consensus backend (the runner opens consensus through
# ``open_consensus`` below); the others are monkeypatches of library functions.
CONSENSUS_BUGS = ("sqlite_cas_race", "pg_cas_not_exists", "truncate_deletes_head")


# ----- monkeypatching ---------------------------------------------------------------------


@contextlib.contextmanager
def _patched(obj: Any, name: str, value: Any) -> Iterator[None]:
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def _gc_ignores_holds() -> contextlib.AbstractContextManager[Any]:
    from persist_lib.shard import gc as gcmod
    from persist_lib.shard import state as st

    def eligible(state: st.ShardState) -> dict[str, st.GarbageEntry]:
        latest = state.latest_rollup()
        top = latest[0] if latest else -1
        return {k: e for k, e in state.garbage.items() if e.seqno <= top}  # no hold check

    stack = contextlib.ExitStack()
    stack.enter_context(_patched(gcmod, "eligible_garbage", eligible))
    return stack


def _caa_no_token() -> contextlib.AbstractContextManager[Any]:
    from persist_lib.shard import transitions as tr

    orig = tr.compare_and_append

    def broken(state: Any, now_ms: int, *, token: str, **kw: Any) -> Any:
        # A fresh token per attempt: a retry never recognises its own committed write.
        return orig(state, now_ms, token=f"{token}-{uuid.uuid4().hex}", **kw)

    return _patched(tr, "compare_and_append", broken)


def _compaction_drops_part() -> contextlib.AbstractContextManager[Any]:
    from persist_lib.shard import compactor

    orig = compactor.merge_batches

    def broken(blob: Any, schemas: Any, *, inputs: Any, **kw: Any) -> Any:
        ins = list(inputs)
        for i in range(len(ins) - 1, -1, -1):
            if ins[i].parts:
                ins[i] = replace(ins[i], parts=ins[i].parts[:-1])
                break
        return orig(blob, schemas, inputs=tuple(ins), **kw)

    return _patched(compactor, "merge_batches", broken)


def _skipped_checksum() -> contextlib.AbstractContextManager[Any]:
    from persist_lib.shard import part_fetch, part_index, parts

    def no_verify(data: bytes, **kw: Any) -> None:
        return None

    stack = contextlib.ExitStack()
    stack.enter_context(_patched(parts, "verify_part_bytes", no_verify))
    stack.enter_context(_patched(part_fetch, "verify_part_bytes", no_verify))
    # (ranged reads of indexed parts: the footer's and each row group's checksum)
    stack.enter_context(_patched(part_index, "verify_range_bytes", no_verify))
    return stack


def _lease_expiry_ignores_hb() -> contextlib.AbstractContextManager[Any]:
    from persist_lib.shard import transitions as tr
    from persist_lib.shard.state import ShardState

    def broken(state: ShardState, now_ms: int) -> Any:
        if not state.exists or state.tombstone:
            return None, tr.ExpiredLeases((), ())
        # Judges every lease from time 0, i.e. ignores the recorded heartbeats.
        dead_r = tuple(r for r, v in state.leased_readers.items() if v.lease_duration_ms < now_ms)
        dead_w = tuple(w for w, v in state.writers.items() if v.lease_duration_ms < now_ms)
        if not dead_r and not dead_w:
            return None, tr.ExpiredLeases((), ())
        readers = {k: v for k, v in state.leased_readers.items() if k not in dead_r}
        writers = {k: v for k, v in state.writers.items() if k not in dead_w}
        new = replace(state, leased_readers=readers, writers=writers)
        return replace(new, since=tr.recompute_since(new)), tr.ExpiredLeases(dead_r, dead_w)

    return _patched(tr, "expire_leases", broken)


def _since_regress() -> contextlib.AbstractContextManager[Any]:
    from persist_lib.frontier import Antichain
    from persist_lib.shard import transitions as tr
    from persist_lib.shard.state import ShardState

    def recompute(state: ShardState) -> Antichain:
        sinces = [r.since for r in state.leased_readers.values()]
        sinces += [r.since for r in state.critical_readers.values()]
        return min(sinces) if sinces else state.since  # no floor at the old since

    def downgrade(state: ShardState, now_ms: int, *, reader_id: str, new_since: Antichain, seqno_hold: int) -> Any:
        r = tr._require_reader(state, reader_id)  # no "never backwards" check
        readers = dict(state.leased_readers)
        readers[reader_id] = replace(
            r,
            since=new_since,
            seqno=max(r.seqno, min(seqno_hold, state.seqno + 1)),
            last_heartbeat_ms=max(r.last_heartbeat_ms, now_ms),
        )
        new = replace(state, leased_readers=readers)
        return replace(new, since=recompute(new)), None

    stack = contextlib.ExitStack()
    stack.enter_context(_patched(tr, "recompute_since", recompute))
    stack.enter_context(_patched(tr, "downgrade_since", downgrade))
    return stack


def _delete_on_any_exception() -> contextlib.AbstractContextManager[Any]:
    from persist_lib.errors import Indeterminate as Ind
    from persist_lib.handles import write as wmod
    from persist_lib.shard.batch_builder import delete_batch_blobs
    from persist_lib.shard.machine import ApplyProgress

    def old(self: Any, batch: Any, expected: Any, new: Any, release: Any = None) -> None:
        try:
            self._commit(batch, expected, new, ApplyProgress(), [], release)
        except Ind:
            raise
        except BaseException:
            delete_batch_blobs(self._client.blob, batch)
            raise

    return _patched(wmod.WriteHandle, "_commit_or_delete", old)


def _sweeper_no_inflight_guard() -> contextlib.AbstractContextManager[Any]:
    from persist_lib.shard import gc as gcmod

    return _patched(gcmod, "in_flight_reason", lambda key, head: None)


def _heartbeat_thread_dies() -> contextlib.AbstractContextManager[Any]:
    from persist_lib.errors import ExternalError, InvalidUsage, LeaseExpired
    from persist_lib.handles import client as cmod

    def loop(self: Any) -> None:
        while not self._hb_stop.wait(self.config.heartbeat_tick_s):
            for h in list(self._handles):
                if time.monotonic() - h.last_heartbeat_monotonic < self._lease_ms(h) / 4000.0:
                    continue
                try:
                    h.heartbeat()
                    h.last_heartbeat_monotonic = time.monotonic()
                except LeaseExpired:
                    self._handles.discard(h)
                except (ExternalError, InvalidUsage):
                    pass  # anything else ends the thread

    def ensure(self: Any) -> None:
        if self.config.background_heartbeats and self._hb_thread is None:
            self._hb_thread = threading.Thread(
                target=self._heartbeat_loop, name="persist-heartbeat", daemon=True
            )
            self._hb_thread.start()

    stack = contextlib.ExitStack()
    stack.enter_context(_patched(cmod.PersistClient, "_heartbeat_loop", loop))
    stack.enter_context(_patched(cmod.PersistClient, "ensure_heartbeats", ensure))
    return stack


def _immediate_retry() -> contextlib.AbstractContextManager[Any]:
    from persist_lib.handles import maintenance

    def record(self: Any, m: Any, req: Any, key: Any, e: BaseException) -> None:
        with self._lock:
            self.failed += 1  # no backoff, no quarantine: _run's finally offers it again

    return _patched(maintenance.BackgroundCompactor, "_record_failure", record)


def _sqlite_first_open_no_retry() -> contextlib.AbstractContextManager[Any]:
    from persist_lib.location import sqlite_consensus as sc

    def once(self: Any) -> sqlite3.Connection:
        conn = self._connect(self.busy_timeout_ms / 1000.0)
        try:
            conn.execute("PRAGMA journal_mode=WAL")  # SQLITE_BUSY at once on a fresh, locked file
            conn.execute(sc._SYNCHRONOUS[self.synchronous])
            conn.execute(sc._CREATE)
        except sqlite3.Error as e:
            conn.close()
            raise self._open_error(e, 1, 0.0) from None
        return conn

    return _patched(sc.SqliteConsensus, "_open_connection", once)


def _verified_append_skips() -> contextlib.AbstractContextManager[Any]:
    from persist_lib.ingest import outputs

    real = outputs.ShardOutput._verify

    def skipping(self: Any, ours: Any, lo: int, hi: int) -> None:
        since = self._r.since.time or 0
        if hi > lo and not since < lo:
            # History before the since was compacted: "can't verify", count and go on.
            self.unverifiable = getattr(self, "unverifiable", 0) + 1
            return
        real(self, ours, lo, hi)

    return _patched(outputs.ShardOutput, "_verify", skipping)


def _txn_apply_without_commit() -> contextlib.AbstractContextManager[Any]:
    from persist_lib.txn import apply as ap
    from persist_lib.txn.txns import Txns

    real = Txns._publish

    def apply_first(self: Any, entries: Any, writes: Any, view: Any, *follow: Any) -> Any:
        for e in entries:  # linked before the log says the transaction committed
            ap.apply_entry(self.client.machine(e.shard), e)
        return real(self, entries, writes, view, *follow)

    return _patched(Txns, "_publish", apply_first)


def _txn_tidy_before_apply() -> contextlib.AbstractContextManager[Any]:
    from persist_lib.txn.txns import Txns

    return _patched(Txns, "_is_applied", lambda self, p: True)


def _txn_reader_skips_apply() -> contextlib.AbstractContextManager[Any]:
    from persist_lib.storage.controller import StorageController

    return _patched(StorageController, "_txn_prepare_read", lambda self, name, shards: None)


_PATCHES: dict[str, Callable[[], contextlib.AbstractContextManager[Any]]] = {
    "gc_ignores_holds": _gc_ignores_holds,
    "caa_no_idempotency_token": _caa_no_token,
    "compaction_drops_part": _compaction_drops_part,
    "skipped_checksum": _skipped_checksum,
    "lease_expiry_ignores_hb": _lease_expiry_ignores_hb,
    "since_regress": _since_regress,
    "delete_on_any_exception": _delete_on_any_exception,
    "sweeper_no_inflight_guard": _sweeper_no_inflight_guard,
    "heartbeat_thread_dies": _heartbeat_thread_dies,
    "immediate_retry": _immediate_retry,
    "sqlite_first_open_no_retry": _sqlite_first_open_no_retry,
    "verified_append_skips": _verified_append_skips,
    "txn_apply_without_commit": _txn_apply_without_commit,
    "txn_tidy_before_apply": _txn_tidy_before_apply,
    "txn_reader_skips_apply": _txn_reader_skips_apply,
}


@contextlib.contextmanager
def activate(names: list[str] | tuple[str, ...]) -> Iterator[None]:
    """Monkeypatches the library with the named planted bugs for the ``with`` block.

    Consensus-level bugs are not patches: open consensus with ``open_consensus`` below.
    """
    unknown = [n for n in names if n not in PLANTED_BUGS]
    if unknown:
        raise InvalidUsage(f"unknown planted bugs {unknown}; known: {PLANTED_BUGS}")
    with contextlib.ExitStack() as stack:
        for n in names:
            if n in _PATCHES:
                stack.enter_context(_PATCHES[n]())
        yield


# ----- broken consensus backends -----------------------------------------------------------


class NoPkSqliteConsensus(Consensus):
    """SQLite consensus without a primary key whose CAS is check-then-insert (planted)."""

    def __init__(self, path: str, window_s: float = 0.002) -> None:
        self.path = path
        self.window_s = window_s
        self._local = threading.local()
        self._c().execute(
            "CREATE TABLE IF NOT EXISTS consensus_nopk (shard TEXT, seqno INTEGER, data BLOB)"
        )

    def _c(self) -> sqlite3.Connection:
        c = getattr(self._local, "c", None)
        if c is None:
            c = sqlite3.connect(self.path, timeout=10, isolation_level=None, check_same_thread=False)
            c.execute("PRAGMA journal_mode=WAL")
            self._local.c = c
        return c

    def _do(self, fn: Callable[[sqlite3.Connection], Any], write: bool) -> Any:
        try:
            return fn(self._c())
        except sqlite3.OperationalError as e:
            raise (Indeterminate if write else Determinate)(f"planted sqlite: {e}") from None

    def head(self, key: str) -> VersionedData | None:
        row = self._do(
            lambda c: c.execute(
                "SELECT seqno, data FROM consensus_nopk WHERE shard=? ORDER BY seqno DESC LIMIT 1",
                (key,),
            ).fetchone(),
            False,
        )
        return None if row is None else VersionedData(int(row[0]), bytes(row[1]))

    def compare_and_set(self, key: str, expected: int | None, new: VersionedData) -> CaSResult:
        h = self.head(key)
        if (h.seqno if h else None) != expected:
            return CaSResult.EXPECTATION_MISMATCH
        time.sleep(self.window_s)  # the race window between the check and the insert
        self._do(
            lambda c: c.execute(
                "INSERT INTO consensus_nopk (shard, seqno, data) VALUES (?, ?, ?)",
                (key, new.seqno, bytes(new.data)),
            ),
            True,
        )
        return CaSResult.COMMITTED

    def scan(self, key: str, from_seqno: int, limit: int) -> list[VersionedData]:
        rows = self._do(
            lambda c: c.execute(
                "SELECT seqno, data FROM consensus_nopk WHERE shard=? AND seqno>=? ORDER BY seqno LIMIT ?",
                (key, from_seqno, limit),
            ).fetchall(),
            False,
        )
        return [VersionedData(int(s), bytes(d)) for s, d in rows]

    def truncate(self, key: str, seqno: int) -> int:
        return int(
            self._do(
                lambda c: c.execute(
                    "DELETE FROM consensus_nopk WHERE shard=? AND seqno<? AND EXISTS "
                    "(SELECT 1 FROM consensus_nopk WHERE shard=? AND seqno>=?)",
                    (key, seqno, key, seqno),
                ).rowcount,
                True,
            )
        )

    def list_keys(self) -> Iterator[str]:
        rows = self._do(lambda c: c.execute("SELECT DISTINCT shard FROM consensus_nopk").fetchall(), False)
        yield from sorted(str(r[0]) for r in rows)

    def describe(self) -> str:
        return f"planted-sqlite://{self.path}"


class NotExistsPostgresConsensus(Consensus):
    """Postgres consensus without a primary key, CAS by ``NOT EXISTS`` (planted: forks)."""

    def __init__(self, url: str, window_s: float = 0.01) -> None:
        import psycopg

        self._psycopg = psycopg
        self.url = SensitiveUrl(url)
        self.window_s = window_s
        self._local = threading.local()
        self._do(
            lambda c: c.execute(
                "CREATE TABLE IF NOT EXISTS consensus_nopk (shard text, seqno bigint, data bytea)"
            ),
            False,
        )

    def describe(self) -> str:
        return f"planted-postgres {self.url}"

    def __repr__(self) -> str:
        return f"NotExistsPostgresConsensus({self.describe()!r})"

    def _c(self) -> Any:
        c = getattr(self._local, "c", None)
        if c is None or c.closed:
            c = self._psycopg.connect(self.url.raw, autocommit=True)
            self._local.c = c
        return c

    def _do(self, fn: Callable[[Any], Any], write: bool) -> Any:
        try:
            return fn(self._c())
        except self._psycopg.Error as e:
            self._local.c = None
            raise (Indeterminate if write else Determinate)(f"planted postgres: {type(e).__name__}") from None

    def head(self, key: str) -> VersionedData | None:
        row = self._do(
            lambda c: c.execute(
                "SELECT seqno, data FROM consensus_nopk WHERE shard=%s ORDER BY seqno DESC LIMIT 1",
                (key,),
            ).fetchone(),
            False,
        )
        return None if row is None else VersionedData(int(row[0]), bytes(row[1]))

    def compare_and_set(self, key: str, expected: int | None, new: VersionedData) -> CaSResult:
        # The snapshot of the NOT EXISTS is taken at statement start: rival inserts that
        # commit during the sleep are invisible to it, and nothing else arbitrates.
        q = (
            "INSERT INTO consensus_nopk (shard, seqno, data) "
            "SELECT %(k)s, %(n)s, %(d)s FROM (SELECT pg_sleep(%(w)s)) AS w "
            "WHERE (%(e)s::bigint IS NULL OR EXISTS (SELECT 1 FROM consensus_nopk WHERE shard=%(k)s AND seqno=%(e)s)) "
            "AND NOT EXISTS (SELECT 1 FROM consensus_nopk WHERE shard=%(k)s AND seqno > COALESCE(%(e)s::bigint, -1))"
        )
        params = {"k": key, "n": new.seqno, "d": bytes(new.data), "e": expected, "w": self.window_s}
        n = self._do(lambda c: c.execute(q, params).rowcount, True)
        return CaSResult.COMMITTED if n == 1 else CaSResult.EXPECTATION_MISMATCH

    def scan(self, key: str, from_seqno: int, limit: int) -> list[VersionedData]:
        rows = self._do(
            lambda c: c.execute(
                "SELECT seqno, data FROM consensus_nopk WHERE shard=%s AND seqno>=%s ORDER BY seqno LIMIT %s",
                (key, from_seqno, limit),
            ).fetchall(),
            False,
        )
        return [VersionedData(int(s), bytes(d)) for s, d in rows]

    def truncate(self, key: str, seqno: int) -> int:
        return int(
            self._do(
                lambda c: c.execute(
                    "DELETE FROM consensus_nopk WHERE shard=%s AND seqno<%s AND EXISTS "
                    "(SELECT 1 FROM consensus_nopk WHERE shard=%s AND seqno>=%s)",
                    (key, seqno, key, seqno),
                ).rowcount,
                True,
            )
        )

    def list_keys(self) -> Iterator[str]:
        rows = self._do(lambda c: c.execute("SELECT DISTINCT shard FROM consensus_nopk").fetchall(), False)
        yield from sorted(str(r[0]) for r in rows)

    def close(self) -> None:
        c = getattr(self._local, "c", None)
        if c is not None:
            c.close()


class HeadDeletingConsensus(Consensus):
    """Wraps a consensus; its ``truncate`` also deletes the head entry (planted)."""

    def __init__(self, inner: Consensus) -> None:
        self.inner = inner

    def head(self, key: str) -> VersionedData | None:
        return self.inner.head(key)

    def compare_and_set(self, key: str, expected: int | None, new: VersionedData) -> CaSResult:
        return self.inner.compare_and_set(key, expected, new)

    def scan(self, key: str, from_seqno: int, limit: int) -> list[VersionedData]:
        return self.inner.scan(key, from_seqno, limit)

    def truncate(self, key: str, seqno: int) -> int:
        n = self.inner.truncate(key, seqno)
        h = self.inner.head(key)
        if h is not None:
            _delete_entry(self.inner, key, h.seqno)
            n += 1
        return n

    def list_keys(self) -> Iterator[str]:
        return self.inner.list_keys()

    def wait_for_change(self, key: str, seqno: int | None, timeout_s: float) -> None:
        self.inner.wait_for_change(key, seqno, timeout_s)

    def close(self) -> None:
        self.inner.close()

    def describe(self) -> str:
        return self.inner.describe()


def _delete_entry(c: Consensus, key: str, seqno: int) -> None:
    """Deletes one entry behind the backend's back (for the planted truncate)."""
    from persist_lib.location.mem import MemConsensus
    from persist_lib.location.sqlite_consensus import SqliteConsensus

    if isinstance(c, MemConsensus):
        with c._d.lock:
            c._d.data[key] = [e for e in c._d.data.get(key, []) if e.seqno != seqno]
    elif isinstance(c, SqliteConsensus):
        c._conn().execute("DELETE FROM consensus WHERE shard=? AND seqno=?", (key, seqno))
    else:
        from persist_lib.location.postgres_consensus import PostgresConsensus

        if not isinstance(c, PostgresConsensus):
            raise InvalidUsage(f"planted truncate_deletes_head: unsupported backend {c!r}")
        c._conn().execute(
            c._q_delete_one if hasattr(c, "_q_delete_one") else _pg_delete_one(c), (key, seqno)
        )


def _pg_delete_one(c: Any) -> Any:
    from psycopg import sql

    return sql.SQL("DELETE FROM {} WHERE shard = %s AND seqno = %s").format(c._table)


def open_consensus(uri: str, planted: list[str] | tuple[str, ...] = ()) -> Consensus:
    """Opens ``uri`` as the normal backend, or as the planted broken one if asked."""
    from persist_lib.location.uri import open_consensus as real_open

    if "sqlite_cas_race" in planted:
        if not uri.startswith("sqlite:///"):
            raise InvalidUsage("planted sqlite_cas_race needs a sqlite:/// consensus")
        from urllib.parse import unquote

        base: Consensus = NoPkSqliteConsensus(unquote(uri[len("sqlite:///") :]))
    elif "pg_cas_not_exists" in planted:
        if not uri.startswith(("postgres://", "postgresql://")):
            raise InvalidUsage("planted pg_cas_not_exists needs a postgresql:// consensus")
        base = NotExistsPostgresConsensus(uri)
    else:
        base = real_open(uri)
    if "truncate_deletes_head" in planted:
        base = HeadDeletingConsensus(base)
    return base
