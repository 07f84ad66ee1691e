"""6. Consensus: compare-and-set/s on one key vs a raw fsync'd insert loop (the limit).

- SQLite: ``SqliteConsensus`` (WAL, ``synchronous=FULL``, one statement per CAS) vs a raw
  ``sqlite3`` loop of autocommit ``INSERT``s into an identical table in another file
  with the same PRAGMAs.
- Postgres (throwaway server, ``fsync=on``, default ``synchronous_commit``):
  ``PostgresConsensus`` (CAS + ``pg_notify`` in one statement) vs a raw psycopg loop of
  autocommit ``INSERT``s into an identical table on the same server.
Payload: 600 bytes (the size of a typical state diff of an append). persist and the raw
loop alternate in 10 blocks, so a change of background load hits both.
"""

from __future__ import annotations

import os
import sqlite3
import time
from typing import Any

from bench.common import Ctx, lat_summary, row

NAME = "consensus_cas"
PAYLOAD = 600


BLOCKS = 10  # persist and the raw loop alternate in blocks, so load changes hit both


def _cas(cons: Any, i: int, data: bytes) -> None:
    from persist_lib.location.base import CaSResult, VersionedData

    res = cons.compare_and_set("sbench", None if i == 1 else i - 1, VersionedData(i, data))
    if res is not CaSResult.COMMITTED:
        raise RuntimeError(f"CAS {i} was not committed: {res}")


def _alternate(n: int, persist_op: Any, raw_op: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """Runs ``n`` persist ops and ``n`` raw ops in alternating blocks; latencies of each."""
    lp: list[float] = []
    lr: list[float] = []
    per = -(-n // BLOCKS)
    for start in range(1, n + 1, per):
        for ops, lat in ((persist_op, lp), (raw_op, lr)):
            for i in range(start, min(n, start + per - 1) + 1):
                t0 = time.perf_counter()
                ops(i)
                lat.append(time.perf_counter() - t0)
    return lat_summary(lp), lat_summary(lr)


def _sqlite(ctx: Ctx, n: int) -> tuple[dict[str, Any], dict[str, Any]]:
    from persist_lib.location.sqlite_consensus import SqliteConsensus

    d = ctx.dir("consensus_sqlite")
    cons = SqliteConsensus(d / "consensus.db")
    conn = sqlite3.connect(str(d / "raw.db"), isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    conn.execute(
        "CREATE TABLE c (shard TEXT NOT NULL, seqno INTEGER NOT NULL, data BLOB NOT NULL,"
        " PRIMARY KEY (shard, seqno))"
    )
    data = os.urandom(PAYLOAD)
    try:
        with ctx.profile("consensus_sqlite"):
            return _alternate(
                n,
                lambda i: _cas(cons, i, data),
                lambda i: conn.execute(
                    "INSERT INTO c (shard, seqno, data) VALUES (?, ?, ?)", ("sbench", i, data)
                ),
            )
    finally:
        cons.close()
        conn.close()


def _postgres(ctx: Ctx, n: int) -> tuple[dict[str, Any], dict[str, Any]]:
    import psycopg

    from persist_lib.location.postgres_consensus import PostgresConsensus

    url = ctx.pg().create_database("bench_cas")
    cons = PostgresConsensus(url)
    data = os.urandom(PAYLOAD)
    try:
        cons.head("warmup")  # connect + create the table outside the timed loop
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(
                "CREATE TABLE raw (shard text NOT NULL, seqno bigint NOT NULL,"
                " data bytea NOT NULL, PRIMARY KEY (shard, seqno))"
            )
            with ctx.profile("consensus_postgres"):
                return _alternate(
                    n,
                    lambda i: _cas(cons, i, data),
                    lambda i: conn.execute(
                        "INSERT INTO raw (shard, seqno, data) VALUES (%s, %s, %s)",
                        ("sbench", i, data),
                    ),
                )
    finally:
        cons.close()


def run(ctx: Ctx) -> dict[str, Any]:
    n = ctx.pick(300, 2000)
    det: dict[str, Any] = {"cas_per_backend": n, "payload_bytes": PAYLOAD}
    det["sqlite"], det["sqlite_raw_insert"] = _sqlite(ctx, n)
    rows = [
        row(
            NAME,
            f"SQLite CAS/s ({n} on one key)",
            det["sqlite"]["ops_per_s"],
            "ops/s",
            "raw fsync'd SQLite insert",
            det["sqlite_raw_insert"]["ops_per_s"],
        ),
        row(
            NAME,
            "SQLite CAS p95",
            det["sqlite"]["p95_ms"],
            "ms",
            "raw fsync'd SQLite insert",
            det["sqlite_raw_insert"]["p95_ms"],
        ),
    ]
    try:
        det["postgres"], det["postgres_raw_insert"] = _postgres(ctx, n)
        rows += [
            row(
                NAME,
                f"Postgres CAS/s ({n} on one key)",
                det["postgres"]["ops_per_s"],
                "ops/s",
                "raw Postgres insert, same server",
                det["postgres_raw_insert"]["ops_per_s"],
            ),
            row(
                NAME,
                "Postgres CAS p95",
                det["postgres"]["p95_ms"],
                "ms",
                "raw Postgres insert, same server",
                det["postgres_raw_insert"]["p95_ms"],
            ),
        ]
    except Exception as e:  # noqa: BLE001 - no Postgres here: report, keep SQLite's rows
        det["postgres"] = {"error": f"{type(e).__name__}: {e}"}
    return {"rows": rows, "detail": det}
