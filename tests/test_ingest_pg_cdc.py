"""Postgres CDC through pgoutput: at every ingested time the collection equals the
source table as of the bound LSN, transactions are never half applied, and restarts
resume from the slot without loss or duplication."""

from __future__ import annotations

import random
import time
import uuid
from typing import Any

import psycopg
import pyarrow as pa
import pytest

from persist_lib import PersistClient, PersistConfig
from persist_lib.ingest import IngestConfig, IngestConfigError, Ingestion
from persist_lib.ingest.outputs import shard_id_for
from persist_lib.ingest.pg_cdc import PgCdcSource
from persist_lib.ingest.pgoutput import TxnAssembler, decode_message, int_to_lsn, lsn_to_int

pytestmark = pytest.mark.postgres

KEY = pa.schema([("id", pa.int64())])
VAL = pa.schema([("name", pa.string()), ("qty", pa.int64()), ("price", pa.float64()), ("big", pa.string())])


def _client() -> PersistClient:
    tag = uuid.uuid4().hex
    return PersistClient.open(f"mem://b-{tag}", f"mem://c-{tag}", PersistConfig.for_tests())


def _table(conn: Any) -> dict[int, tuple[Any, ...]]:
    rows = conn.execute("SELECT id, name, qty, price::float8, big FROM items").fetchall()
    return {r[0]: (r[1], r[2], r[3], r[4]) for r in rows}


def _snap(client: PersistClient, name: str, role: str, t: int) -> dict[int, tuple[Any, ...]]:
    r = client.open_leased_reader(shard_id_for(name, role), KEY, VAL)
    try:
        rows = r.snapshot(t).to_pylist()
    finally:
        r.expire()
    assert all(x["diff"] == 1 for x in rows), "a key with multiplicity != 1: half-applied or duplicated"
    out = {x["id"]: (x["name"], x["qty"], x["price"], x["big"]) for x in rows}
    assert len(out) == len(rows)
    return out


def _commit_lsns(conn: Any, slot: str, publication: str) -> dict[int, int]:
    """xid -> commit LSN of every transaction, from a test-only slot (Begin messages)."""
    rows = conn.execute(
        "SELECT data FROM pg_logical_slot_peek_binary_changes(%s, NULL, NULL, 'proto_version', '1', "
        "'publication_names', %s)",
        (slot, publication),
    ).fetchall()
    out = {}
    for (data,) in rows:
        b = bytes(data)
        if b[:1] == b"B":
            final_lsn = int.from_bytes(b[1:9], "big")
            xid = int.from_bytes(b[17:21], "big")
            out[xid] = final_lsn
    return out


def _workload_txn(conn: Any, rng: random.Random, next_id: list[int], live: list[int], i: int) -> int:
    """One random transaction; returns its (32-bit) xid."""
    with conn.transaction():
        xid = conn.execute("SELECT txid_current()").fetchone()[0] & 0xFFFFFFFF
        if i == 20:
            # one big transaction: 10,000 inserts and an update of every row
            base = next_id[0]
            conn.execute(
                "INSERT INTO items SELECT g, 'bulk' || g, g %% 97, (g %% 1000) / 4.0, NULL "
                "FROM generate_series(%s::bigint, %s::bigint) g",
                (base, base + 9999),
            )
            live.extend(range(base, base + 10000))
            next_id[0] += 10000
            conn.execute("UPDATE items SET qty = qty + 1")
            return xid
        for _ in range(rng.randint(1, 12)):
            op = rng.random()
            if op < 0.45 or len(live) < 5:
                k = next_id[0]
                next_id[0] += 1
                big = rng.randbytes(6000).hex() if rng.random() < 0.1 else None  # TOASTed values
                conn.execute(
                    "INSERT INTO items VALUES (%s, %s, %s, %s, %s)",
                    (k, f"n{k}", rng.randint(0, 100), rng.randint(0, 10000) / 4, big),
                )
                live.append(k)
            elif op < 0.75:
                k = rng.choice(live)  # leaves `big` unchanged: pgoutput sends it as 'u'
                conn.execute("UPDATE items SET qty = %s, name = %s WHERE id = %s", (rng.randint(0, 100), f"u{i}", k))
            elif op < 0.82:
                k = rng.choice(live)  # the key changes: delete old key, insert new
                nk = next_id[0]
                next_id[0] += 1
                conn.execute("UPDATE items SET id = %s WHERE id = %s", (nk, k))
                live.remove(k)
                live.append(nk)
            else:
                k = rng.choice(live)
                conn.execute("DELETE FROM items WHERE id = %s", (k,))
                live.remove(k)
        return xid


def test_cdc_collection_equals_table_at_every_bound_lsn(pg_server: Any) -> None:
    src = pg_server.create_database()
    conn = psycopg.connect(src, autocommit=True)
    conn.execute("CREATE TABLE items (id bigint PRIMARY KEY, name text, qty int, price numeric(10,2), big text)")
    conn.execute("INSERT INTO items SELECT g, 'init' || g, g, g / 2.0, NULL FROM generate_series(1, 300) g")
    initial = _table(conn)
    client = _client()
    name = "cdc"
    cfg = IngestConfig(max_records_per_binding=25)

    def instance() -> Ingestion:
        # a fresh instance every run: each one rehydrates and resumes from the slot
        return Ingestion(client, name, PgCdcSource(src, "items"), KEY, VAL, envelope="upsert", config=cfg)

    applied: list[tuple[int, int]] = []
    ing = instance()
    s = ing.run_once()
    applied += [(t, f["wal"][0]) for t, f in ing.applied]
    ing.close()
    assert s["records"] == 300
    # a test-only slot, created after the snapshot, tells each transaction's commit LSN
    conn.execute("SELECT pg_create_logical_replication_slot('verify', 'pgoutput')")
    rng = random.Random(42)
    next_id, live = [1000], list(range(1, 301))
    history: list[tuple[int, dict[int, tuple[Any, ...]]]] = []
    for i in range(45):
        xid = _workload_txn(conn, rng, next_id, live, i)
        history.append((xid, _table(conn)))
        if i % 10 == 9:
            ing = instance()
            ing.run_once()
            applied += [(t, f["wal"][0]) for t, f in ing.applied]
            ing.close()
    ing = instance()
    s = ing.run_once()
    applied += [(t, f["wal"][0]) for t, f in ing.applied]
    ing.close()
    commit_of = _commit_lsns(conn, "verify", "persist_cdc")
    assert all(x in commit_of for x, _ in history)
    assert len(applied) >= 15 and len({t for t, _ in applied}) == len(applied)
    for t, frontier in applied:
        done = [c for x, c in history if commit_of[x] < frontier]
        expected = done[-1] if done else initial
        assert _snap(client, name, "data", t) == expected, f"data at {t} (frontier {int_to_lsn(frontier)})"
        assert _snap(client, name, "state", t) == expected, f"state at {t}"
    assert _snap(client, name, "data", s["upper"] - 1) == history[-1][1]
    # the big transaction was bound as a whole to one time
    big_xid = history[20][0]
    big_commit = commit_of[big_xid]
    times_around = [t for t, f in applied if f > big_commit]
    assert times_around
    # the slot was advanced to what is durable, never beyond
    slot_pos = lsn_to_int(
        conn.execute("SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = 'persist_cdc'").fetchone()[0]
    )
    assert 0 < slot_pos <= applied[-1][1]
    conn.execute("SELECT pg_drop_replication_slot('verify')")
    conn.close()


def test_replica_identity_and_schema_are_checked(pg_server: Any) -> None:
    src = pg_server.create_database()
    conn = psycopg.connect(src, autocommit=True)
    conn.execute("CREATE TABLE nothing_ident (id bigint PRIMARY KEY, name text)")
    conn.execute("ALTER TABLE nothing_ident REPLICA IDENTITY NOTHING")
    conn.execute("CREATE TABLE no_pk (id bigint, name text)")
    conn.execute("CREATE TABLE ok (id bigint PRIMARY KEY, name text)")
    conn.execute("CREATE TABLE full_ident (id bigint NOT NULL UNIQUE, name text)")
    conn.execute("ALTER TABLE full_ident REPLICA IDENTITY FULL")
    k = pa.schema([("id", pa.int64())])
    v = pa.schema([("name", pa.string())])
    client = _client()

    def run(table: str, key: pa.Schema = k, val: pa.Schema = v) -> dict[str, Any]:
        with Ingestion(client, f"chk_{table}", PgCdcSource(src, table), key, val, envelope="upsert") as ing:
            return ing.run_once()

    with pytest.raises(IngestConfigError, match="REPLICA IDENTITY NOTHING.*ALTER TABLE"):
        run("nothing_ident")
    with pytest.raises(IngestConfigError, match="no primary key.*REPLICA IDENTITY FULL"):
        run("no_pk")
    with pytest.raises(IngestConfigError, match="must equal the table's primary key"):
        run("ok", pa.schema([("name", pa.string())]), pa.schema([("id", pa.int64())]))
    with pytest.raises(IngestConfigError, match="no column"):
        run("ok", k, pa.schema([("nope", pa.string())]))
    with pytest.raises(IngestConfigError, match="does not exist"):
        run("missing_table")
    with pytest.raises(IngestConfigError, match="DSN"):
        PgCdcSource("mysql://x", "t")
    # a database that is not UTF8 (SQL_ASCII holds any bytes): refused up front, nothing made
    admin = psycopg.connect(pg_server.url, autocommit=True)
    ascii_db = f"ascii_{uuid.uuid4().hex[:8]}"
    admin.execute(f"CREATE DATABASE {ascii_db} ENCODING 'SQL_ASCII' TEMPLATE template0 LC_COLLATE 'C' LC_CTYPE 'C'")
    admin.close()
    ascii_src = src.rsplit("/", 1)[0] + "/" + ascii_db
    with psycopg.connect(ascii_src, autocommit=True) as ac:
        ac.execute("CREATE TABLE ok (id bigint PRIMARY KEY, name text)")
    with pytest.raises(IngestConfigError, match="server encoding SQL_ASCII; CDC needs a UTF8 database"):
        with Ingestion(client, "chk_ascii", PgCdcSource(ascii_src, "ok"), k, v, envelope="upsert") as ing:
            ing.run_once()
    with psycopg.connect(ascii_src, autocommit=True) as ac:
        assert ac.execute("SELECT count(*) FROM pg_replication_slots").fetchone()[0] == ac.execute(
            "SELECT count(*) FROM pg_replication_slots WHERE database <> current_database()"
        ).fetchone()[0]
        assert ac.execute("SELECT count(*) FROM pg_publication").fetchone()[0] == 0
    # FULL: deletes carry the whole old row
    conn.execute("INSERT INTO full_ident VALUES (1, 'a'), (2, 'b')")
    s = run("full_ident")
    assert s["records"] == 2
    conn.execute("DELETE FROM full_ident WHERE id = 1")
    conn.execute("UPDATE full_ident SET name = 'B' WHERE id = 2")
    s = run("full_ident")
    r = client.open_leased_reader(shard_id_for("chk_full_ident", "data"), k, v)
    rows = r.snapshot(s["upper"] - 1).to_pylist()
    assert [(x["id"], x["name"]) for x in rows] == [(2, "B")]
    conn.close()


def test_truncate_and_decode_errors(pg_server: Any) -> None:
    src = pg_server.create_database()
    conn = psycopg.connect(src, autocommit=True)
    conn.execute("CREATE TABLE t (id bigint PRIMARY KEY, name text, n text)")
    conn.execute("INSERT INTO t VALUES (1, 'a', '1'), (2, 'b', '2')")
    k = pa.schema([("id", pa.int64())])
    v = pa.schema([("name", pa.string()), ("n", pa.int32())])  # n is text upstream
    client = _client()
    with Ingestion(client, "tr", PgCdcSource(src, "t"), k, v, envelope="upsert") as ing:
        ing.run_once()
        conn.execute("INSERT INTO t VALUES (3, 'c', 'not a number')")
        conn.execute("TRUNCATE t")
        conn.execute("INSERT INTO t VALUES (4, 'd', '4')")
        s = ing.run_once()
        data = ing._outs["data"].snapshot(s["upper"] - 1).to_pylist()
        assert [(x["id"], x["name"], x["n"]) for x in data] == [(4, "d", 4)]
        errs = ing._outs["errors"].snapshot(s["upper"] - 1).to_pylist()
        assert len(errs) == 1 and errs[0]["kind"] == "type_mismatch" and "'n'" in errs[0]["reason"]
    conn.close()


def test_pgoutput_decoder_roundtrip_of_a_real_stream(pg_server: Any) -> None:
    src = pg_server.create_database()
    conn = psycopg.connect(src, autocommit=True)
    conn.execute("CREATE TABLE d (id int PRIMARY KEY, s text)")
    conn.execute("CREATE PUBLICATION p FOR TABLE d")
    conn.execute("SELECT pg_create_logical_replication_slot('s', 'pgoutput')")
    conn.execute("INSERT INTO d VALUES (1, 'x'), (2, NULL)")
    conn.execute("UPDATE d SET id = 3 WHERE id = 1")
    conn.execute("DELETE FROM d WHERE id = 2")
    rows = conn.execute(
        "SELECT data FROM pg_logical_slot_get_binary_changes('s', NULL, NULL, 'proto_version', '1', 'publication_names', 'p')"
    ).fetchall()
    asm = TxnAssembler()
    txns = asm.feed([bytes(r[0]) for r in rows])
    assert len(txns) == 3
    assert all(t.commit_lsn < t.end_lsn for t in txns)
    assert [c.op for t in txns for c in t.changes] == ["I", "I", "U", "D"]
    ins = txns[0].changes
    assert ins[0].new == ("1", "x") and ins[1].new == ("2", None)
    upd = txns[1].changes[0]
    assert upd.old_kind == "K" and upd.old == ("1", None) and upd.new == ("3", "x")
    assert txns[2].changes[0].old == ("2", None)
    rel = asm.relations[ins[0].relid]
    assert rel.name == "d" and [c.name for c in rel.columns] == ["id", "s"] and rel.columns[0].is_key
    assert decode_message(b"Y\x00\x00\x00\x01pg_catalog\x00int4\x00") is None
    conn.execute("SELECT pg_drop_replication_slot('s')")
    conn.close()


def test_unchanged_toast_values_come_from_the_upsert_state(pg_server: Any) -> None:
    src = pg_server.create_database()
    conn = psycopg.connect(src, autocommit=True)
    conn.execute("CREATE TABLE toast (id bigint PRIMARY KEY, qty int, big text)")
    big = random.Random(1).randbytes(20000).hex()  # incompressible: stored out of line
    k = pa.schema([("id", pa.int64())])
    v = pa.schema([("qty", pa.int64()), ("big", pa.string())])
    client = _client()
    with Ingestion(client, "toast", PgCdcSource(src, "toast"), k, v, envelope="upsert") as ing:
        ing.run_once()
        conn.execute("INSERT INTO toast VALUES (1, 1, %s)", (big,))
        ing.run_once()
        conn.execute("UPDATE toast SET qty = 2 WHERE id = 1")  # pgoutput sends big as 'u'
        # the raw stream really omits it
        s = ing.run_once()
        data = ing._outs["data"].snapshot(s["upper"] - 1).to_pylist()
        assert [(x["id"], x["qty"], x["big"] == big) for x in data] == [(1, 2, True)]
    conn.execute("SELECT pg_create_logical_replication_slot('peek', 'pgoutput')")
    conn.execute("UPDATE toast SET qty = 3 WHERE id = 1")
    rows = conn.execute(
        "SELECT data FROM pg_logical_slot_get_binary_changes('peek', NULL, NULL, 'proto_version', '1', "
        "'publication_names', 'persist_toast')"
    ).fetchall()
    txns = TxnAssembler().feed([bytes(r[0]) for r in rows])
    from persist_lib.ingest.pgoutput import UNCHANGED

    assert txns[0].changes[0].new == ("1", "3", UNCHANGED)
    conn.execute("SELECT pg_drop_replication_slot('peek')")
    conn.close()


def test_two_cdc_instances_race_on_one_slot(pg_server: Any) -> None:
    import threading

    src = pg_server.create_database()
    conn = psycopg.connect(src, autocommit=True)
    conn.execute("CREATE TABLE items (id bigint PRIMARY KEY, name text, qty int, price numeric(10,2), big text)")
    conn.execute("INSERT INTO items SELECT g, 'init' || g, g, g / 2.0, NULL FROM generate_series(1, 50) g")
    client = _client()
    cfg = IngestConfig(max_records_per_binding=15)
    errors: list[BaseException] = []
    stop = threading.Event()

    def follower() -> None:
        try:
            with Ingestion(client, "race", PgCdcSource(src, "items"), KEY, VAL, envelope="upsert", config=cfg) as ing:
                while not stop.is_set():
                    ing.run_once()
                ing.run_once()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=follower) for _ in range(2)]
    for t in threads:
        t.start()
    rng = random.Random(7)
    next_id, live = [1000], list(range(1, 51))
    for i in range(12):
        _workload_txn(conn, rng, next_id, live, i)
        time.sleep(0.05)
    stop.set()
    for t in threads:
        t.join(120)
    assert not errors, errors
    with Ingestion(client, "race", PgCdcSource(src, "items"), KEY, VAL, envelope="upsert", config=cfg) as ing:
        s = ing.run_once()
    assert _snap(client, "race", "data", s["upper"] - 1) == _table(conn)
    assert _snap(client, "race", "state", s["upper"] - 1) == _table(conn)
    conn.close()



def test_slot_advanced_just_before_a_peek_is_reported_not_missed(pg_server: Any) -> None:
    """Another instance advances the slot between a reader's position check and its
    peek (a peek starts at the slot's position): the reader must report the data as
    gone (the driver then resynchronizes), never return a chunk without the transactions
    in between. This race made two instances disagree (NeedsNewRendition) in about half
    of the runs of ``test_two_cdc_instances_race_on_one_slot``."""
    from persist_lib.ingest import SourceDataGone
    from persist_lib.ingest.pg_cdc import PgCdcReader

    src_dsn = pg_server.create_database()
    conn = psycopg.connect(src_dsn, autocommit=True)
    conn.execute("CREATE TABLE items (id bigint PRIMARY KEY, name text, qty int, price numeric(10,2), big text)")
    conn.execute("INSERT INTO items SELECT g, 'init' || g, g, g / 2.0, NULL FROM generate_series(1, 5) g")
    client = _client()
    with Ingestion(client, "toctou", PgCdcSource(src_dsn, "items"), KEY, VAL, envelope="upsert") as ing:
        ing.run_once()  # creates the slot, binds the snapshot
    src = PgCdcSource(src_dsn, "items")
    src.attach(client, "toctou")
    real_peek = src.peek
    for live in (True, False):  # the live read, then the replay of a bound frontier
        pos = src.slot_position()
        conn.execute("UPDATE items SET qty = qty + 100 WHERE id = 1")
        conn.execute("UPDATE items SET qty = qty + 200 WHERE id = 2")
        after_both = src.current_lsn()
        armed = [True]

        def peek_after_another_instance_advanced(
            upto: Any, n: Any, target: int = after_both, armed: list[bool] = armed
        ) -> list[bytes]:
            if armed[0]:
                armed[0] = False
                conn.execute("SELECT pg_replication_slot_advance(%s, %s::pg_lsn)", (src.slot, int_to_lsn(target)))
            return real_peek(upto, n)

        src.peek = peek_after_another_instance_advanced  # type: ignore[method-assign]
        reader = PgCdcReader(src, pos)
        with pytest.raises(SourceDataGone, match="past"):
            reader.read(None if live else {"wal": (after_both + 1,)}, 100)
    src.close()
    conn.close()

CDC_WORKER = r"""
import json, sys, time
import pyarrow as pa
from persist_lib import PersistClient, PersistConfig
from persist_lib.ingest import IngestConfig, Ingestion
from persist_lib.ingest.pg_cdc import PgCdcSource
p = json.loads(sys.argv[1])
client = PersistClient.open(p["blob"], p["consensus"], PersistConfig.for_tests())
K = pa.schema([("id", pa.int64())])
V = pa.schema([("name", pa.string()), ("qty", pa.int64()), ("price", pa.float64()), ("big", pa.string())])
ing = Ingestion(client, p["name"], PgCdcSource(p["dsn"], "items"), K, V, envelope="upsert",
                config=IngestConfig(max_records_per_binding=p["n"], poll_interval_s=0.02))
print("started", flush=True)
s = ing.run(max_duration_s=p["seconds"])
ing.close()
client.close()
print(json.dumps(s, default=str))
"""


def _cdc_worker(params: dict[str, Any]) -> list[str]:
    import json
    import sys

    return [sys.executable, "-c", CDC_WORKER, json.dumps(params)]


def _cdc_history(client: PersistClient, name: str) -> tuple[int, dict[int, int]]:
    """(upper, {binding time: wal frontier bound then}) from the remap shard itself (times
    are the wall clock in ms; history below the since window is not readable)."""
    from persist_lib.ingest.remap import RemapShard

    shard = shard_id_for(name, "remap")
    since = client.inspect(shard)["since"][0]
    remap = RemapShard(client, shard, {}, label="check")
    try:
        remap.load(since)
        bound = {b.time: b.frontier.get("wal", (0,))[0] for b in remap.bindings_between(since, remap.upper)}
        return remap.upper, bound
    finally:
        remap.close()


@pytest.mark.parametrize("kills,txns", [(4, 40), pytest.param(20, 300, marks=pytest.mark.slow)])
def test_cdc_kill9_restarts_equal_the_table_at_every_bound_lsn(
    pg_server: Any, tmp_path: Any, kills: int, txns: int
) -> None:
    """An ingestion process following a table is killed with SIGKILL at random points
    while transactions commit, and restarted each time: at every time the remap shard
    binds, data and state equal the table as of the bound LSN (no transaction lost,
    duplicated or half applied), and the final collection equals the table."""
    import json
    import os
    import subprocess
    import threading

    from tests.test_ingest_support import worker_env

    src = pg_server.create_database()
    conn = psycopg.connect(src, autocommit=True)
    conn.execute("CREATE TABLE items (id bigint PRIMARY KEY, name text, qty int, price numeric(10,2), big text)")
    conn.execute("INSERT INTO items SELECT g, 'init' || g, g, g / 2.0, NULL FROM generate_series(1, 300) g")
    initial = _table(conn)
    (tmp_path / "blob").mkdir()
    params = {
        "blob": f"file://{tmp_path / 'blob'}", "consensus": f"sqlite:///{tmp_path / 'c.db'}",
        "dsn": src, "name": "cdckill", "n": 20, "seconds": 1.0,
    }
    # First life to completion: creates the slot and binds the snapshot.
    out = subprocess.run(_cdc_worker(params), capture_output=True, text=True, timeout=300, env=worker_env())
    assert out.returncode == 0, out.stderr[-3000:]
    conn.execute("SELECT pg_create_logical_replication_slot('verify', 'pgoutput')")
    history: list[tuple[int, dict[int, tuple[Any, ...]]]] = []
    wconn = psycopg.connect(src, autocommit=True)
    done = threading.Event()
    werr: list[BaseException] = []

    def workload() -> None:
        try:
            rng = random.Random(99)
            next_id, live = [1000], list(range(1, 301))
            for i in range(txns):
                xid = _workload_txn(wconn, rng, next_id, live, i)  # txn 20: 10,000 inserts + update all
                history.append((xid, _table(wconn)))
                time.sleep(rng.uniform(0.0, 0.08))
        except BaseException as e:  # noqa: BLE001 - reported below
            werr.append(e)
        finally:
            done.set()

    th = threading.Thread(target=workload)
    th.start()
    rng = random.Random(kills)
    hits = 0
    params_live = dict(params, seconds=60.0)
    while not done.is_set() or hits < kills:
        proc = subprocess.Popen(_cdc_worker(params_live), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=worker_env())
        assert proc.stdout is not None
        proc.stdout.readline()  # "started"
        time.sleep(rng.uniform(0.1, 1.2))
        if proc.poll() is None:
            os.kill(proc.pid, 9)
            hits += 1
        proc.wait()
        proc.stdout.close()
        if hits >= kills and done.is_set():
            break
    th.join(120)
    assert not werr, werr
    commit_of = _commit_lsns(conn, "verify", "persist_cdckill")
    # Last lives (~1 s each, like the restarts above), until the ingested frontier covers
    # the last transaction: one life may not catch up (the kills can leave the 10,000-row
    # transaction and more to ingest), and the final check is about what was ingested.
    target = commit_of[history[-1][0]]  # covered once the bound WAL frontier is above it
    lives: list[tuple[str, Any, int]] = []
    give_up = time.monotonic() + 300.0
    while True:
        out = subprocess.run(_cdc_worker(params), capture_output=True, text=True, timeout=300, env=worker_env())
        assert out.returncode == 0, out.stderr[-3000:]
        summary = json.loads(out.stdout.strip().splitlines()[-1])
        bound = summary["frontier"].get("wal", [0])[0]
        lives.append((int_to_lsn(bound), summary["lag_bytes"], summary["records"]))
        if bound > target:
            break
        assert time.monotonic() < give_up, (
            f"the ingestion did not catch up with the table in 300 s of last lives: the last "
            f"transaction committed at {int_to_lsn(target)}, the bound WAL frontier is still "
            f"{int_to_lsn(bound)}; (frontier, lag bytes, records) per life: {lives}"
        )
    client = PersistClient.open(params["blob"], params["consensus"], PersistConfig.for_tests())
    try:
        upper, frontier_at = _cdc_history(client, "cdckill")
        checked = 0
        for t, f in sorted(frontier_at.items()):
            done_txns = [tbl for x, tbl in history if commit_of[x] < f]
            expected = done_txns[-1] if done_txns else initial
            assert _snap(client, "cdckill", "data", t) == expected, f"data at {t} (frontier {int_to_lsn(f)})"
            assert _snap(client, "cdckill", "state", t) == expected, f"state at {t}"
            checked += 1
        assert max(frontier_at.values()) > target  # (what the loop above waited for)
        assert _snap(client, "cdckill", "data", upper - 1) == history[-1][1] == _table(conn)
    finally:
        client.close()
    assert hits >= kills and checked >= 10, (hits, checked)
    conn.execute("SELECT pg_drop_replication_slot('verify')")
    wconn.close()
    conn.close()
