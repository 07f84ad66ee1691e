"""A Postgres connection that goes silent mid-CAS (issue 26, defect 7).

Between the client and the throwaway Postgres sits a loopback TCP proxy
(``tests/support/tcp_proxy.py``). Just before one writer's compare-and-set is sent, the
proxy is told to drop the server's answers on that thread's connection: the statement
reaches the server and commits, the answer never comes back, and the connection stays
open (a dead path behind a live TCP peer, which no kernel timeout notices).

Required: the stalled CAS fails with a typed error (``Indeterminate``: it may have
landed) within the configured bound (``persist_op_timeout_s``); meanwhile another writer
of the same shard in the same process commits and a reader's heartbeat lands (the apply
lock the stalled thread holds does not stall them); afterwards the stalled write has been
resolved by re-reading (its effect recognised, not applied twice) and every acknowledged
write is in the shard exactly once.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pyarrow as pa
import pytest

from persist_lib import PersistClient, PersistConfig, ShardId
from persist_lib.errors import Determinate, Indeterminate, InvalidUri
from persist_lib.location.base import CaSResult, Consensus, VersionedData
from persist_lib.location.postgres_consensus import PostgresConsensus
from persist_lib.location.uri import open_blob, open_consensus
from tests.support.pg_server import PgServer
from tests.support.tcp_proxy import TcpProxy

KEY = pa.schema([("k", pa.string())])
VAL = pa.schema([("v", pa.int64())])
BOUND_S = 3.0


def _via(url: str, port: int, query: str) -> str:
    parts = urlsplit(url)
    userinfo = parts.netloc.rpartition("@")[0]
    netloc = f"{userinfo}@127.0.0.1:{port}" if userinfo else f"127.0.0.1:{port}"
    q = "&".join(x for x in (parts.query, query) if x)
    return urlunsplit((parts.scheme, netloc, parts.path, q, ""))


def _local_port(conn: Any) -> int:
    s = socket.socket(fileno=os.dup(conn.pgconn.socket))
    try:
        return int(s.getsockname()[1])
    finally:
        s.close()


class StallOneCas(Consensus):
    """Passes everything to a ``PostgresConsensus``; the first CAS of the armed thread
    is sent on a connection whose answers the proxy drops. Records how that call ended."""

    def __init__(self, inner: PostgresConsensus, proxy: TcpProxy) -> None:
        self.inner = inner
        self.proxy = proxy
        self.armed: threading.Thread | None = None
        self.answered = threading.Event()  # the server answered the stalled CAS (dropped)
        self.started_at = 0.0
        self.ended_at = 0.0
        self.outcome: BaseException | CaSResult | None = None

    def describe(self) -> str:
        return self.inner.describe()

    def head(self, key: str) -> VersionedData | None:
        return self.inner.head(key)

    def compare_and_set(self, key: str, expected: int | None, new: VersionedData) -> CaSResult:
        if self.armed is not threading.current_thread():
            return self.inner.compare_and_set(key, expected, new)
        self.armed = None
        swallowed = self.proxy.blackhole(_local_port(self.inner._conn()))
        threading.Thread(
            target=lambda: swallowed.wait(30) and self.answered.set(), daemon=True
        ).start()
        self.started_at = time.monotonic()
        try:
            res = self.inner.compare_and_set(key, expected, new)
            self.outcome = res
            return res
        except BaseException as e:
            self.outcome = e
            raise
        finally:
            self.ended_at = time.monotonic()

    def scan(self, key: str, from_seqno: int, limit: int) -> list[VersionedData]:
        return self.inner.scan(key, from_seqno, limit)

    def truncate(self, key: str, seqno: int) -> int:
        return self.inner.truncate(key, seqno)

    def list_keys(self) -> Iterator[str]:
        return self.inner.list_keys()

    def wait_for_change(self, key: str, seqno: int | None, timeout_s: float) -> None:
        self.inner.wait_for_change(key, seqno, timeout_s)

    def close(self) -> None:
        self.inner.close()


def test_a_cas_on_a_silent_connection_fails_in_bound_and_the_shard_goes_on(
    pg_server: PgServer, tmp_path: Path
) -> None:
    url = pg_server.create_database("stall")
    shard = ShardId.new()
    with TcpProxy(pg_server.host, pg_server.port) as proxy:
        raw = open_consensus(_via(url, proxy.port, f"persist_op_timeout_s={BOUND_S:g}"))
        assert isinstance(raw, PostgresConsensus) and raw.op_timeout_s == BOUND_S
        stall = StallOneCas(raw, proxy)
        cfg = PersistConfig.for_tests(apply_lock_wait_s=0.2, retry_deadline_s=30.0)
        client = PersistClient(open_blob(f"file://{tmp_path}/blob"), stall, cfg)
        try:
            w1 = client.open_writer(shard, KEY, VAL)
            w2 = client.open_writer(shard, KEY, VAL)
            r = client.open_leased_reader(shard, KEY, VAL)
            w1.compare_and_append([((("a0",), (1,)), 0, 1)], 0, 1)
            hb_before = client.machine(shard).fetch_latest().leased_readers[r.reader_id]

            errors: list[BaseException] = []

            def stalled_writer() -> None:
                try:
                    w1.compare_and_append([((("a1",), (1,)), 1, 1)], 1, 2)
                except BaseException as e:  # noqa: BLE001 - reported below
                    errors.append(e)

            a = threading.Thread(target=stalled_writer, name="stalled-writer", daemon=True)
            stall.armed = a
            a.start()
            # The server has run the CAS (and committed it); its answer was dropped.
            assert stall.answered.wait(15), "the stalled CAS never reached the server"

            # Meanwhile, on this thread: another writer of the shard and a heartbeat.
            assert w2.fetch_recent_upper().elements == [2]  # the stalled CAS landed
            w2.compare_and_append([((("b2",), (1,)), 2, 1)], 2, 3)
            r.heartbeat()
            progress_done = time.monotonic()

            a.join(BOUND_S + 10)
            assert not a.is_alive(), f"the stalled CAS did not fail within {BOUND_S}s + 10s"
        finally:
            proxy.close()  # frees a thread still stuck (old code) before the client closes
            a_thread = locals().get("a")
            if a_thread is not None:
                a_thread.join(10)
            client.close()

    # The stalled call failed with the typed "may or may not have happened" error,
    # within the bound, and only after the others had made progress.
    assert isinstance(stall.outcome, Indeterminate), stall.outcome
    assert "persist_op_timeout_s" in str(stall.outcome)
    assert stall.ended_at - stall.started_at < BOUND_S + 10
    assert progress_done < stall.ended_at, "the others only went on after the stall ended"
    # The machine resolved it by re-reading: w1's write returned normally.
    assert errors == []

    # Every acknowledged write exactly once; the heartbeat landed.
    check = PersistClient.open(f"file://{tmp_path}/blob", url, PersistConfig.for_tests())
    try:
        state = check.machine(shard).fetch_latest()
        assert state.leased_readers[r.reader_id].last_heartbeat_ms > hb_before.last_heartbeat_ms
        reader = check.open_leased_reader(shard, KEY, VAL)
        got = sorted((x["k"], x["ts"], x["diff"]) for x in reader.snapshot(2).to_pylist())
        assert got == [("a0", 2, 1), ("a1", 2, 1), ("b2", 2, 1)]
        assert state.upper.elements == [3]
    finally:
        check.close()


def _with(url: str, query: str) -> str:
    return url + ("&" if "?" in url else "?") + query


def test_a_cas_the_server_holds_up_is_cancelled_there(pg_consensus_url: str) -> None:
    """The server-side layer: a CAS waiting on a rival's uncommitted row (the primary key
    makes it wait) is cancelled by ``statement_timeout`` (3/4 of the bound): a definite
    "it did not happen" (``Determinate``), after which the CAS can simply be sent again."""
    c = PostgresConsensus(pg_consensus_url, op_timeout_s=2.0)
    rival = psycopg.connect(pg_consensus_url, autocommit=False)
    safety = threading.Timer(20, rival.close)  # old code: never wait forever
    try:
        assert c.compare_and_set("k", None, VersionedData(1, b"one")) is CaSResult.COMMITTED
        rival.execute("INSERT INTO consensus (shard, seqno, data) VALUES ('k', 2, 'x')")
        safety.start()
        start = time.monotonic()
        with pytest.raises(Determinate, match="statement_timeout") as err:
            c.compare_and_set("k", 1, VersionedData(2, b"two"))
        assert time.monotonic() - start < 2.0 + 10
        assert not isinstance(err.value, Indeterminate)
        rival.rollback()
        # It did not happen: the same CAS now lands, and the head is ours.
        assert c.compare_and_set("k", 1, VersionedData(2, b"two")) is CaSResult.COMMITTED
        head = c.head("k")
        assert head is not None and (head.seqno, head.data) == (2, b"two")
    finally:
        safety.cancel()
        rival.close()
        c.close()


def test_the_bounds_reach_the_connection_and_the_uri_wins(pg_consensus_url: str) -> None:
    c = open_consensus(_with(pg_consensus_url, "persist_op_timeout_s=4&keepalives_idle=42"))
    try:
        assert isinstance(c, PostgresConsensus) and c.op_timeout_s == 4.0
        assert "persist_op_timeout_s" not in c.describe()
        conn = c._conn()
        row = conn.execute("SHOW statement_timeout").fetchone()
        assert row is not None and row[0] == "3s"
        params = conn.info.get_parameters()
        assert params.get("keepalives_idle") == "42"  # the URI's own value
        assert params.get("keepalives_count") == "3"
        assert params.get("tcp_user_timeout") == "4000"
    finally:
        c.close()
    own = open_consensus(_with(pg_consensus_url, "options=-c%20statement_timeout%3D0"))
    try:
        row = own._conn().execute("SHOW statement_timeout").fetchone()  # type: ignore[attr-defined]
        assert row is not None and row[0] == "0"
    finally:
        own.close()


@pytest.mark.parametrize("value", ["0", "-1", "abc", "inf", "nan", ""])
def test_a_bad_op_timeout_is_refused(value: str) -> None:
    with pytest.raises(InvalidUri, match="persist_op_timeout_s"):
        open_consensus(f"postgresql://u:longer-secret@localhost:5432/db?persist_op_timeout_s={value}")
    with pytest.raises(InvalidUri, match="given twice"):
        open_consensus(
            "postgresql://u:longer-secret@localhost/db?persist_op_timeout_s=1&persist_op_timeout_s=2"
        )
