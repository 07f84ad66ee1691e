"""SQL time travel (``persist_lib.sql.engine``, ``persist sql``): DuckDB relations and polars
frames of collections and shards as of any time in ``[since, upper)``, streamed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from persist_lib import PersistClient, PersistConfig, ShardId
from persist_lib.errors import InvalidUsage, Timeout
from persist_lib.sql.engine import SqlSession
from persist_lib.sql.rewrite import TableRef, rewrite_sql
from persist_lib.sql.times import format_time, parse_time
from persist_lib.storage import StorageController

pytest.importorskip("duckdb")
pytest.importorskip("polars")

REPO = Path(__file__).resolve().parents[1]
PERSIST = [sys.executable, "-m", "persist_lib.cli.main"]
K = pa.schema([("order_id", pa.int64())])
V = pa.schema([("status", pa.string()), ("amount", pa.float64())])
T0 = 1714564800000  # 2024-05-01T12:00:00Z: ingested times are ms since the epoch
HANDOVER = T0 + 4000


def _status(i: int, t: int) -> str:
    return ["new", "paid", "shipped"][(i + t) % 3]


def orders_like(client: PersistClient) -> StorageController:
    """The demo's shape: ``orders`` ingested at several times into 2 shards (r0), rebuilt
    as a 3-shard rendition (r1, a different decoding: amounts x10) and handed over at
    ``HANDOVER``; later writes go to r1. Each second, orders 0..19 change status."""
    ctl = StorageController(client)
    ctl.create_collection("orders", K, V, num_shards=2)
    ctl.create_collection("orders.raw", K, pa.schema([("line", pa.string())]), num_shards=1)

    def batch(t: int, scale: float) -> list[Any]:
        ups = []
        for i in range(20):
            if t > 0:
                ups.append((((i,), (_status(i, t - 1), float(i) * scale)), T0 + t * 1000, -1))
            ups.append((((i,), (_status(i, t), float(i) * scale)), T0 + t * 1000, 1))
        return ups

    w0 = ctl.open_writer("orders")
    raw = ctl.open_writer("orders.raw")
    lo = 0
    for t in range(4):  # T0, T0+1s, T0+2s, T0+3s
        w0.append(batch(t, 1.0), lo, T0 + t * 1000 + 1)
        raw.append([(((t,), (f"line {t}",)), T0 + t * 1000, 1)], lo, T0 + t * 1000 + 1)
        lo = T0 + t * 1000 + 1
    w0.append([], lo, HANDOVER)  # r0 complete up to the handover
    ctl.create_rendition("orders", "r1", 3)
    w1 = ctl.open_writer("orders", "r1")
    lo = 0
    for t in range(6):  # the rebuild, caught up past the handover
        w1.append(batch(t, 10.0), lo, T0 + t * 1000 + 1)
        lo = T0 + t * 1000 + 1
    ctl.handover("orders", to="r1", at=HANDOVER)
    for t in range(6, 8):  # later writes go to r1 (and advance the metadata)
        w1.append(batch(t, 10.0), lo, T0 + t * 1000 + 1)
        lo = T0 + t * 1000 + 1
    for w in (w0, w1, raw):
        w.expire()
    return ctl


def rows(table: pa.Table) -> Counter:
    return Counter(tuple(r.values()) for r in table.to_pylist())


def run(args: list[str], home: Path, **kw: Any) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PERSIST_")}
    env.update(PERSIST_HOME=str(home), PYTHONPATH=str(REPO))
    return subprocess.run(PERSIST + args, env=env, capture_output=True, text=True, timeout=120, **kw)


def registrations(client: PersistClient) -> dict[str, tuple[list[str], list[str]]]:
    out = {}
    for s in client.list_shards():
        st = client.inspect(s)
        out[s] = (sorted(st["leased_readers"]), sorted(st["writers"]))
    return out


@pytest.fixture()
def home(tmp_path: Path) -> Path:
    h = tmp_path / "home"
    client = PersistClient.default(h, PersistConfig.for_tests())
    ctl = orders_like(client)
    ctl.close()
    client.close()
    return h


def test_persist_sql_time_travel_across_a_handover_equals_the_snapshots(home: Path) -> None:
    client = PersistClient.default(home, PersistConfig.for_tests())
    ctl = StorageController(client, read_only=True)
    reader = ctl.acquire_read_handle("orders")
    reader.snapshot(T0), reader.snapshot(T0 + 7000)  # registers its readers of r0 and r1
    before = registrations(client)
    # before the handover (r0), at it and after it (r1): the same rows as the snapshot
    for at, literal in [
        (T0 + 2000, "'2024-05-01T12:00:02Z'"),
        (HANDOVER - 1, str(HANDOVER - 1)),
        (HANDOVER, "TIMESTAMP '2024-05-01 12:00:04'"),
        (T0 + 7000, "'2024-05-01T12:00:07+00:00'"),
    ]:
        out = run(["sql", "--json", f"SELECT * FROM orders AS OF {literal}"], home)
        assert out.returncode == 0, out.stderr
        got = Counter(tuple(r.values()) for r in json.loads(out.stdout))
        assert got == rows(reader.snapshot(at)), f"as of {at}"
        assert got and all(r[-2] == at for r in got)
    # an aggregate as a data engineer writes it: r0 amounts before, r1 (x10) after
    q = (
        "SELECT a.status, sum(a.diff) AS n, sum(a.amount * a.diff) AS amount "
        "FROM orders AS OF {t} a GROUP BY a.status ORDER BY a.status"
    )
    out = run(["sql", "--json", q.format(t=T0 + 3000)], home)
    early = {r["status"]: r for r in json.loads(out.stdout)}
    out = run(["sql", "--json", q.format(t=T0 + 5000)], home)
    late = {r["status"]: r for r in json.loads(out.stdout)}
    assert sum(r["n"] for r in early.values()) == sum(r["n"] for r in late.values()) == 20
    assert sum(r["amount"] for r in late.values()) == pytest.approx(10 * sum(r["amount"] for r in early.values()))
    # two times in one query, and --as-of for the tables written without AS OF
    out = run(
        ["sql", "--as-of", str(T0 + 1000), "--json",
         f"SELECT count(*) AS n FROM orders o JOIN orders AS OF {T0 + 6000} p USING (order_id) "
         "WHERE o.status <> p.status"],
        home,
    )
    assert out.returncode == 0, out.stderr
    s1, s6 = reader.snapshot(T0 + 1000).to_pylist(), reader.snapshot(T0 + 6000).to_pylist()
    st6 = {r["order_id"]: r["status"] for r in s6}
    assert json.loads(out.stdout) == [{"n": sum(1 for r in s1 if r["status"] != st6[r["order_id"]])}]
    # the changes between two times: snapshot(t1) + changes(t1, t2) == snapshot(t2), across the handover
    t1, t2 = T0 + 2000, T0 + 6000
    out = run(["sql", "--json", f"SELECT * FROM changes(orders, {t1}, {t2})"], home)
    assert out.returncode == 0, out.stderr
    changes = json.loads(out.stdout)
    assert changes and all(t1 < r["ts"] <= t2 for r in changes)
    acc: Counter = Counter()
    for r in reader.snapshot(t1).to_pylist() + changes:
        acc[(r["order_id"], r["status"], r["amount"])] += r["diff"]
    want: Counter = Counter()
    for r in reader.snapshot(t2).to_pylist():
        want[(r["order_id"], r["status"], r["amount"])] += r["diff"]
    assert +acc == want
    # the default (no AS OF, no --as-of) is the latest readable time; the table is readable
    out = run(["sql", "SELECT count(*) AS n, max(ts) AS t FROM orders"], home)
    assert out.returncode == 0, out.stderr
    assert "20" in out.stdout and str(T0 + 7000) in out.stdout and "(1 row)" in out.stdout
    out = run(["sql", "--tables"], home)
    assert "orders.raw" in out.stdout and "2024-05-01T12:00:07.001Z" in out.stdout
    # every reader the command registered was expired
    assert registrations(client) == before
    reader.expire()
    ctl.close()
    client.close()


def test_persist_sql_bad_as_of_is_a_clear_error(home: Path) -> None:
    client = PersistClient.default(home, PersistConfig.for_tests())
    ctl = StorageController(client)
    ctl.allow_compaction("orders", T0 + 3000)  # history before it may now be forwarded
    since = client.inspect(ctl.describe("orders")["metadata_shard"])["since"]
    assert since == [T0 + 3000]
    before = registrations(client)
    out = run(["sql", f"SELECT * FROM orders AS OF {T0 + 1000}"], home)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "before this reader's since" in out.stderr and "readable times: [1714564803000 (2024-05-01T12:00:03Z)" in out.stderr
    out = run(["sql", "SELECT * FROM orders AS OF '2024-05-01T13:00:00Z'"], home)
    assert out.returncode == 1 and "Timeout" in out.stderr and "isn't complete yet" in out.stderr
    assert "1714564807001 (2024-05-01T12:00:07.001Z))" in out.stderr
    out = run(["sql", "--as-of", "yesterday", "SELECT * FROM orders"], home)
    assert out.returncode == 2 and "is not a time" in out.stderr
    out = run(["sql", "SELECT * FROM orders AS OF now()"], home)
    assert out.returncode == 2 and "expected a time" in out.stderr
    out = run(["sql", f"SELECT * FROM changes(orders, {T0 + 6000}, {T0 + 5000})"], home)
    assert out.returncode == 2 and "t2 is before t1" in out.stderr
    out = run(["sql", "SELECT * FROM ordrs"], home)
    assert out.returncode == 2 and "tables are collections: orders, orders.raw" in out.stderr
    assert registrations(client) == before
    ctl.close()
    client.close()


def test_persist_sql_never_creates_a_location(tmp_path: Path) -> None:
    out = run(["sql", "SELECT 1"], tmp_path / "nowhere")
    assert out.returncode == 2 and "LocationNotFound" in out.stderr
    assert not (tmp_path / "nowhere").exists()


def test_python_helpers_duckdb_and_polars_on_a_shard_and_a_collection() -> None:
    n = uuid.uuid4().hex
    client = PersistClient.open(f"mem://{n}", f"mem://{n}", PersistConfig.for_tests(inline_threshold=0))
    ctl = orders_like(client)
    reader = ctl.acquire_read_handle("orders")
    sid = ShardId.new()
    w, r = client.open(sid, pa.schema([("k", pa.int64())]), pa.schema([("v", pa.string())]))
    for t in range(4):
        w.compare_and_append([(((i,), (f"v{t}",)), t, 1) for i in range(4000)], t, t + 1)
    reader.snapshot(T0), reader.snapshot(T0 + 7000)  # registers its readers of r0 and r1
    before = registrations(client)
    import polars as pl

    with SqlSession(client, memory_budget=1 << 20) as s:
        # a shard by id: the streaming read goes through the bounded k-way merge
        src = s.snapshot(str(sid), as_of=2)
        with src.open_stream() as stream:
            assert sum(b.num_rows for b in stream) == 12000
            assert stream.stats.passes > 0  # streamed, not decoded whole
        rel = s.relation(str(sid), 2)
        assert rel.aggregate("count(*)").fetchall() == [(12000,)]
        assert rel.aggregate("count(*)").fetchall() == [(12000,)]  # each evaluation reads again
        assert rows(rel.to_arrow_table()) == rows(r.snapshot(2))
        lf = s.lazy_frame(str(sid), 1)
        assert lf.filter(pl.col("k") < 10).select("v").collect().height == 20
        assert rows(lf.collect().to_arrow()) == rows(r.snapshot(1))
        assert s.sql(f"SELECT count(*) FROM {sid} AS OF 0 x LIMIT 1").fetchall() == [(4000,)]
        # a collection across the handover: relation, frame and changes
        for at in (T0 + 3000, HANDOVER, T0 + 7000):
            assert rows(s.relation("orders", at).to_arrow_table()) == rows(reader.snapshot(at))
            assert rows(s.lazy_frame("orders", at).collect().to_arrow()) == rows(reader.snapshot(at))
        ch = s.changes_relation("orders", T0 + 3000, T0 + 5000).to_arrow_table().to_pylist()
        assert {r["ts"] for r in ch} == {T0 + 4000, T0 + 5000}
        assert s.changes_lazy_frame("orders", T0 + 3000, T0 + 3000).collect().height == 0
        assert s.readable("orders") == (reader.since, reader.upper)
        # errors: the reads' own types, with the readable range
        with SqlSession(client, timeout_s=0) as s0, pytest.raises(
            Timeout, match=r"readable times: \[0, 1714564807001"
        ):
            s0.snapshot("orders", T0 + 7001)
        with pytest.raises(InvalidUsage, match="no collection or shard named 'nope'"):
            s.snapshot("nope")
    assert registrations(client) == before  # the session expired what it registered
    with pytest.raises(InvalidUsage, match="closed"):
        s.snapshot("orders")
    reader.expire()


def test_rewrite_finds_table_references_only() -> None:
    seen: list[TableRef] = []

    def view(ref: TableRef) -> str | None:
        seen.append(ref)
        return None if ref.name in ("x", "read_parquet") else f"V_{ref.name}"

    q = (
        "WITH x AS (SELECT 1) SELECT orders.status, extract(year FROM ts) "
        "FROM orders JOIN orders.raw AS OF '2024-05-01T12:00:00Z' r ON true, changes('orders', 1, 2), x "
        "WHERE order_id IN (SELECT order_id FROM \"orders\" o) -- FROM orders\n"
        "UNION ALL SELECT 'FROM orders' FROM orders AS OF 5 AS y; DESCRIBE orders"
    )
    out = rewrite_sql(q, view)
    assert out == (
        "WITH x AS (SELECT 1) SELECT orders.status, extract(year FROM ts) "
        'FROM "V_orders" AS "orders" JOIN "V_orders.raw" r ON true, "V_orders" AS changes, x '
        'WHERE order_id IN (SELECT order_id FROM "V_orders" o) -- FROM orders\n'
        "UNION ALL SELECT 'FROM orders' FROM \"V_orders\" AS y; DESCRIBE \"V_orders\""
    )
    kinds = [(r.kind, r.name, r.as_of, r.t1, r.t2) for r in seen]
    assert ("snapshot", "orders.raw", T0, None, None) in kinds
    assert ("changes", "orders", None, 1, 2) in kinds
    assert ("snapshot", "orders", 5, None, None) in kinds
    assert all(r.name != "x" for r in seen)  # a CTE shadows, and is never looked up
    # AS OF after the alias too
    assert rewrite_sql("SELECT * FROM orders o AS OF 5 JOIN orders AS p AS OF 6 ON true", view) == (
        'SELECT * FROM "V_orders" o  JOIN "V_orders" AS p  ON true'
    )
    assert [r.as_of for r in seen[-2:]] == [5, 6]
    with pytest.raises(InvalidUsage, match="expected a time"):
        rewrite_sql("SELECT * FROM orders AS OF x", view)
    with pytest.raises(InvalidUsage, match=r"expected changes\(NAME, T1, T2\)"):
        rewrite_sql("SELECT * FROM changes(orders)", view)


def test_times() -> None:
    assert parse_time(5) == 5 and parse_time("17") == 17
    assert parse_time("2024-05-01T12:00:00Z") == T0 == parse_time("2024-05-01 12:00:00")
    assert parse_time("2024-05-01T14:00:00.123+02:00") == T0 + 123
    assert format_time(T0 + 7) == "1714564800007 (2024-05-01T12:00:00.007Z)" and format_time(3) == "3"
    for bad in ("soon", -1, 1.5, True):
        with pytest.raises(InvalidUsage):
            parse_time(bad)


@pytest.mark.parametrize(
    ("query", "near"),
    [
        ("SELECT id FROM orders AS OF 1714564800000 WHERE", "WHERE"),  # after a rewritten table
        ("SELECT id\nFROM orders AS OF '2024-05-01T12:00:00Z' o,\n  orders.raw GROUP", "GROUP"),  # line 3
        ("SELECT sum(id FROM orders", "FROM"),  # before it
        ("SELECT * FROM orders x AS OF 1714564800000 ORDER", "ORDER"),  # a late AS OF (removed)
    ],
)
def test_a_duckdb_error_points_at_the_users_query(query: str, near: str) -> None:
    """DuckDB's error about the rewritten query, told about the user's: no internal view
    name, the LINE excerpt is the user's line and the caret is under the user's text."""
    import duckdb

    from persist_lib.sql.rewrite import Span, explain_error

    spans: list[Span] = []
    refs: dict[str, str] = {}

    def view_for(ref: TableRef) -> str:
        view = f"__persist_{len(refs)}"
        refs[view] = ref.text
        return view

    text = rewrite_sql(query, view_for, spans)
    con = duckdb.connect()
    for view in refs:
        con.execute(f'CREATE TABLE "{view}" (id BIGINT)')
    with pytest.raises(duckdb.Error) as raised:
        con.sql(text)
    assert "__persist_" in str(raised.value)  # what DuckDB said about the rewritten text
    told = explain_error(str(raised.value), query, text, spans, refs)
    assert "__persist" not in told, told
    lines = told.splitlines()
    (i,) = [k for k, x in enumerate(lines) if x.startswith("LINE ")]
    pos = query.index(near)
    line_no = query.count("\n", 0, pos) + 1
    user_line = query.splitlines()[line_no - 1]
    prefix = f"LINE {line_no}: "
    assert lines[i] == prefix + user_line
    assert lines[i + 1].index("^") == len(prefix) + pos - (query.rfind("\n", 0, pos) + 1), told
