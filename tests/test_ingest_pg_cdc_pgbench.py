"""Postgres CDC of ``pgbench_accounts`` and ``pgbench_tellers`` under ``pgbench -c 4 -j 2``,
the ingestion processes killed with ``kill -9`` while pgbench runs.

How the table "as of a bound LSN" is known: before the ingesters start, the test creates
two slots of its own: one with ``pgoutput`` (only its Begin messages are read, to learn
each transaction's commit LSN, as the project's frontier uses it) and one with the
built-in ``test_decoding`` plugin created with an exported snapshot. The tables are read
in that snapshot with plain psycopg (the base state at the slot's consistent point);
``test_decoding``'s text output (parsed here, independently of the project's pgoutput
decoder) gives every change after it. The table as of LSN ``L`` is the base plus every
transaction whose commit LSN is below ``L``; the ingesters' slots are created later, so
every frontier they bind is at or past the test slots' consistent point. At every time
the remap shard binds (at or past the collection's since), the collection, replayed
from its own updates, equals that state; at the end it equals ``SELECT *``."""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys
import time
from collections import Counter
from typing import Any

import psycopg
import pytest

from persist_lib import PersistClient, PersistConfig
from persist_lib.ingest.outputs import shard_id_for
from persist_lib.ingest.pgoutput import int_to_lsn

pytestmark = pytest.mark.postgres

WORKER = r"""
import json, sys
import pyarrow as pa
from persist_lib import PersistClient, PersistConfig
from persist_lib.ingest import IngestConfig, Ingestion, PgCdcSource
p = json.loads(sys.argv[1])
client = PersistClient.open(p["blob"], p["consensus"], PersistConfig.for_tests())
K = pa.schema([(p["key"], pa.int32())])
V = pa.schema([("bid", pa.int32()), (p["bal"], pa.int32()), ("filler", pa.string())])
ing = Ingestion(client, p["name"], PgCdcSource(p["dsn"], p["table"]), K, V, envelope="upsert",
                config=IngestConfig(max_records_per_binding=200, poll_interval_s=0.05))
print("started", flush=True)
s = ing.run_once()  # what is there already, then follow (seconds=0: stop there)
if p["seconds"] > 0:
    s = ing.run(max_duration_s=p["seconds"])
ing.close()
client.close()
print(json.dumps(s, default=str))
"""

TABLES = {
    "acc": ("pgbench_accounts", "aid", "abalance"),
    "tel": ("pgbench_tellers", "tid", "tbalance"),
}
_FIELD = re.compile(r"(\w+)\[[^\]]+\]:('(?:[^']|'')*'|\S+)")


def _pgbench() -> str:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pgbench"), reverse=True)
    if not found:
        pytest.fail("pgbench not found under /usr/lib/postgresql/*/bin", pytrace=False)
    return found[0]


def _worker(params: dict[str, Any], name: str, seconds: float) -> list[str]:
    table, key, bal = TABLES[name]
    p = dict(params, name=name, table=table, key=key, bal=bal, seconds=seconds)
    return [sys.executable, "-c", WORKER, json.dumps(p)]


def _env() -> dict[str, str]:
    from tests.test_ingest_support import worker_env

    return worker_env()


def _parse_value(v: str) -> Any:
    if v == "null":
        return None
    if v.startswith("'"):
        return v[1:-1].replace("''", "'")
    return int(v)


def _changes(conn: Any) -> tuple[dict[int, int], list[tuple[int, str, str, tuple[Any, ...]]]]:
    """(xid -> commit LSN, [(xid, table, op, row)] in stream order) from the test slots."""
    commit_of: dict[int, int] = {}
    for (data,) in conn.execute(
        "SELECT data FROM pg_logical_slot_peek_binary_changes('verify_lsn', NULL, NULL, "
        "'proto_version', '1', 'publication_names', 'verify_pub')"
    ).fetchall():
        b = bytes(data)
        if b[:1] == b"B":
            commit_of[int.from_bytes(b[17:21], "big")] = int.from_bytes(b[1:9], "big")
    out: list[tuple[int, str, str, tuple[Any, ...]]] = []
    for xid, data in conn.execute(
        "SELECT xid::text::bigint, data FROM pg_logical_slot_peek_changes('verify_rows', NULL, NULL, "
        "'skip-empty-xacts', '1')"
    ).fetchall():
        m = re.match(r"table public\.(\w+): (INSERT|UPDATE|DELETE): (.*)", data)
        if m is None or m[1] not in ("pgbench_accounts", "pgbench_tellers"):
            continue
        fields = dict((k, _parse_value(v)) for k, v in _FIELD.findall(m[3]))
        key, bal = ("aid", "abalance") if m[1] == "pgbench_accounts" else ("tid", "tbalance")
        out.append((int(xid), m[1], m[2], (fields[key], fields["bid"], fields[bal], fields["filler"])))
    return commit_of, out


def _bindings(client: PersistClient, name: str) -> tuple[int, int, dict[int, int]]:
    from persist_lib.ingest.remap import RemapShard

    shard = shard_id_for(name, "remap")
    since = client.inspect(shard)["since"][0]
    remap = RemapShard(client, shard, {}, label="check")
    try:
        remap.load(since)
        bound = {b.time: b.frontier.get("wal", (0,))[0] for b in remap.bindings_between(since, remap.upper)}
        return since, remap.upper, bound
    finally:
        remap.close()


def _check_every_binding(
    client: PersistClient, name: str, base: dict[int, tuple[Any, ...]],
    txns: list[tuple[int, list[tuple[str, tuple[Any, ...]]]]],
) -> int:
    """Replays the data collection's updates time by time and the table's transactions
    LSN by LSN; at every bound time the two agree. Returns the number of times checked."""
    since, upper, bound = _bindings(client, name)
    print(f"{name}: since {since}, upper {upper}, {len(bound)} bindings readable", flush=True)
    sid = shard_id_for(name, "data")
    r = client.open_leased_reader(sid, *client_schemas(name))
    try:
        start = r.snapshot(since).to_pylist()
        later = r.updates_between(since + 1, upper).to_pylist() if upper > since + 1 else []
    finally:
        r.expire()
    table, key, bal = TABLES[name]
    coll: Counter[tuple[Any, ...]] = Counter()
    for x in start:
        coll[(x[key], x["bid"], x[bal], x["filler"])] += x["diff"]
    truth_rows = dict(base)
    truth: Counter[tuple[Any, ...]] = Counter(truth_rows.values())
    ti = ui = 0
    checked = 0
    for t in sorted(bound):
        if t < since:
            continue
        while ui < len(later) and later[ui]["ts"] <= t:
            x = later[ui]
            row = (x[key], x["bid"], x[bal], x["filler"])
            coll[row] += x["diff"]
            if coll[row] == 0:
                del coll[row]
            ui += 1
        while ti < len(txns) and txns[ti][0] < bound[t]:
            for op, row in txns[ti][1]:
                old = truth_rows.pop(row[0], None)
                if old is not None:
                    truth[old] -= 1
                    if truth[old] == 0:
                        del truth[old]
                if op != "DELETE":
                    truth_rows[row[0]] = row
                    truth[row] += 1
            ti += 1
        assert coll == truth, (
            f"{table} at time {t} (bound {int_to_lsn(bound[t])}): the collection differs from the "
            f"table in {len(coll - truth) + len(truth - coll)} rows, e.g. collection-only "
            f"{list((coll - truth).items())[:2]}, table-only {list((truth - coll).items())[:2]}"
        )
        checked += 1
    return checked


def client_schemas(name: str) -> tuple[Any, Any]:
    import pyarrow as pa

    _, key, bal = TABLES[name]
    return (
        pa.schema([(key, pa.int32())]),
        pa.schema([("bid", pa.int32()), (bal, pa.int32()), ("filler", pa.string())]),
    )


def _read(conn: Any, name: str) -> dict[int, tuple[Any, ...]]:
    table, key, bal = TABLES[name]
    rows = conn.execute(f"SELECT {key}, bid, {bal}, filler FROM {table}").fetchall()  # noqa: S608
    return {r[0]: tuple(r) for r in rows}


# The short variant (-T 5, one kill) runs in ~17-20 s on a quiet 2-core machine (most of it
# staging the 100,000-row snapshot and starting processes); -T 20 with 3 kills is `slow`.
@pytest.mark.parametrize(
    "seconds,kills,min_checked", [(5, 1, 3), pytest.param(20, 3, 5, marks=pytest.mark.slow)]
)
def test_pgbench_cdc_with_kill9_equals_the_tables_at_every_bound_lsn(
    pg_server: Any, tmp_path: Any, seconds: int, kills: int, min_checked: int
) -> None:
    from tests.test_ingest_pg_cdc_types import drop_slots

    src = pg_server.create_database("pgb")
    try:
        _pgbench_run(src, tmp_path, seconds, kills, min_checked)
    finally:
        drop_slots(src)  # (the test server has a fixed number for the session)


def _pgbench_run(src: str, tmp_path: Any, seconds: int, kills: int, min_checked: int) -> None:
    import random

    bench = _pgbench()
    out = subprocess.run([bench, "-i", "-s", "1", "-q", src], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    conn = psycopg.connect(src, autocommit=True)
    # the test's own slots, before the ingesters': see the module docstring
    conn.execute("CREATE PUBLICATION verify_pub FOR TABLE pgbench_accounts, pgbench_tellers")
    conn.execute("SELECT pg_create_logical_replication_slot('verify_lsn', 'pgoutput')")
    rc = psycopg.connect(src, autocommit=True, replication="database")
    snap = rc.execute("CREATE_REPLICATION_SLOT verify_rows LOGICAL test_decoding (SNAPSHOT 'export')").fetchone()[2]
    with psycopg.connect(src, autocommit=True) as c2:
        c2.execute("BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        c2.execute(psycopg.sql.SQL("SET TRANSACTION SNAPSHOT {}").format(psycopg.sql.Literal(snap)))
        base = {n: _read(c2, n) for n in TABLES}
        c2.execute("ROLLBACK")
    rc.close()
    assert len(base["acc"]) == 100_000 and all(len(r[3]) == 84 for r in base["acc"].values())
    (tmp_path / "blob").mkdir()
    params = {"blob": f"file://{tmp_path / 'blob'}", "consensus": f"sqlite:///{tmp_path / 'c.db'}", "dsn": src}
    env = _env()
    t0 = time.monotonic()
    # first lives: create the slots and stage the snapshots
    firsts = [subprocess.Popen(_worker(params, n, 0), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for n in TABLES]
    for p in firsts:
        o, e = p.communicate(timeout=300)
        assert p.returncode == 0, e[-3000:]
    print(f"first lives {time.monotonic() - t0:.1f}s", flush=True)
    rng = random.Random(seconds)
    hits = 0
    bench_proc: subprocess.Popen[str] | None = None
    # Kills while pgbench runs, and after it (during the catch-up) until `kills` landed.
    while bench_proc is None or bench_proc.poll() is None or hits < kills:
        procs = [subprocess.Popen(_worker(params, n, 120.0), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env) for n in TABLES]
        for p in procs:
            assert p.stdout is not None
            p.stdout.readline()  # "started"
        if bench_proc is None:  # pgbench starts once the first killable lives run
            bench_proc = subprocess.Popen(
                [bench, "-c", "4", "-j", "2", "-T", str(seconds), "-n", src],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            )
        deadline = time.monotonic() + rng.uniform(1.5, 4.0)
        while time.monotonic() < deadline and (bench_proc.poll() is None or hits < kills):
            time.sleep(0.05)  # (pacing the kills, not synchronisation)
        if all(p.poll() is None for p in procs) and time.monotonic() >= deadline:
            for p in procs:
                os.kill(p.pid, 9)
            hits += 1
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, 9)
            p.wait()
            assert p.stdout is not None
            p.stdout.close()
    bo, be = bench_proc.communicate()
    assert bench_proc.returncode == 0, be[-2000:]
    assert hits >= kills
    commit_of, changes = _changes(conn)
    by_xid: dict[int, list[tuple[str, str, tuple[Any, ...]]]] = {}
    for xid, table, op, row in changes:
        by_xid.setdefault(xid, []).append((table, op, row))
    assert all(x in commit_of for x in by_xid)
    n_txns = len(by_xid)
    assert n_txns > 50, f"pgbench committed only {n_txns} transactions"
    # last lives, until each ingestion's bound frontier is past the last transaction
    target = max(commit_of[x] for x in by_xid)
    give_up = time.monotonic() + 300
    behind = list(TABLES)
    while behind:  # (both tables' lives in parallel; each one run_once)
        lives = {n: subprocess.Popen(_worker(params, n, 0), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for n in behind}
        for n, p in lives.items():
            o, e = p.communicate(timeout=300)
            assert p.returncode == 0, e[-3000:]
            if json.loads(o.strip().splitlines()[-1])["frontier"].get("wal", [0])[0] > target:
                behind.remove(n)
        assert time.monotonic() < give_up, f"{behind} did not catch up with {int_to_lsn(target)}"
    print(f"to last lives done {time.monotonic() - t0:.1f}s", flush=True)
    client = PersistClient.open(params["blob"], params["consensus"], PersistConfig.for_tests())
    try:
        checked = {}
        for n, (table, _, _) in TABLES.items():
            txns = sorted(
                (commit_of[x], [(op, row) for t, op, row in ch if t == table]) for x, ch in by_xid.items()
            )
            checked[n] = _check_every_binding(client, n, base[n], txns)
            _, upper, _ = _bindings(client, n)
            r = client.open_leased_reader(shard_id_for(n, "data"), *client_schemas(n))
            try:
                final = r.snapshot(upper - 1).to_pylist()
            finally:
                r.expire()
            _, key, bal = TABLES[n]
            got = {x[key]: (x[key], x["bid"], x[bal], x["filler"]) for x in final}
            assert len(got) == len(final) and all(x["diff"] == 1 for x in final)
            assert got == _read(conn, n), f"{table}: the final collection differs from SELECT *"
        assert all(c >= min_checked for c in checked.values()), checked
    finally:
        client.close()
    conn.close()
    print(f"pgbench {seconds} s: {n_txns} transactions, {hits} kills, bindings checked {checked}")
