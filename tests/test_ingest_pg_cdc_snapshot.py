"""The Postgres CDC initial snapshot is fetched through a server-side cursor in chunks
and staged through a bounded-memory builder: what is staged and ingested is the table,
row for row, whatever the chunking."""

from __future__ import annotations

import json
import uuid
from typing import Any

import psycopg
import pyarrow as pa
import pytest

from persist_lib import PersistClient, PersistConfig
from persist_lib.ingest import Ingestion, pg_cdc
from persist_lib.ingest.outputs import shard_id_for
from persist_lib.ingest.pg_cdc import SNAPSHOT_KEY, SNAPSHOT_VAL, PgCdcSource

pytestmark = pytest.mark.postgres

KEY = pa.schema([("id", pa.int64())])
VAL = pa.schema([("name", pa.string()), ("qty", pa.int64())])


def test_snapshot_is_fetched_and_staged_in_chunks(pg_server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    src = pg_server.create_database()
    conn = psycopg.connect(src, autocommit=True)
    conn.execute("CREATE TABLE items (id bigint PRIMARY KEY, name text, qty int)")
    conn.execute(
        "INSERT INTO items SELECT g, CASE WHEN g % 10 = 0 THEN NULL ELSE 'n' || g END, g % 7 "
        "FROM generate_series(1, 2500) g"
    )
    table_rows = conn.execute("SELECT id::text, name, qty::text FROM items").fetchall()
    # Small chunks and small parts: the staging batch is built from many chunks and parts.
    monkeypatch.setattr(pg_cdc, "SNAPSHOT_FETCH_ROWS", 300)
    tag = uuid.uuid4().hex
    client = PersistClient.open(
        f"mem://b-{tag}", f"mem://c-{tag}", PersistConfig.for_tests(blob_target_size=16 << 10, inline_threshold=0)
    )
    source = PgCdcSource(src, "items")
    ing = Ingestion(client, "snap", source, KEY, VAL, envelope="upsert")
    summary = ing.run_once()
    assert summary["records"] == 2500
    # The staging shard: a header, then every row once, numbered in fetch order.
    r = client.open_leased_reader(shard_id_for("snap", "cdc-snapshot"), SNAPSHOT_KEY, SNAPSHOT_VAL)
    staged = r.snapshot(0).sort_by("i")
    r.expire()
    assert staged.column("i").to_pylist() == list(range(-1, 2500))
    header = json.loads(staged.column("values")[0].as_py())
    assert header["columns"] == ["id", "name", "qty"]
    got = sorted(tuple(json.loads(v)) for v in staged.column("values").to_pylist()[1:])
    assert got == sorted(tuple(x) for x in table_rows)
    s = client.machine(shard_id_for("snap", "cdc-snapshot")).fetch_latest()
    assert sum(len(b.parts) for b in s.batches.values()) > 1
    # And the collection is the table.
    data = client.open_leased_reader(shard_id_for("snap", "data"), KEY, VAL)
    rows = data.snapshot(summary["upper"] - 1).to_pylist()
    data.expire()
    assert sorted((x["id"], x["name"], x["qty"], x["diff"]) for x in rows) == sorted(
        (int(i), n, int(q), 1) for i, n, q in table_rows
    )
    ing.close()
    conn.close()
