"""Postgres CDC: every value arrives identically through the initial snapshot, a
streaming insert, an update, and an update that leaves a TOASTed value unchanged, and
equals what the table holds; a column type the Arrow field can't represent exactly is
refused up front (``UnsupportedColumnType``), naming the column and what to use.

The canonical comparison: each collection value is checked against what psycopg reads
from the table (its own typed loaders, in a session whose settings differ from the
ingester's pinned ones). A field mapped to ``pa.string()`` holds the Postgres text form;
it is parsed with psycopg's loader for the column's type and compared with psycopg's
value. Typed fields compare directly (float4 as ``numpy.float32`` of psycopg's float;
timestamptz as instants). NaN equals NaN and the sign of a zero counts."""

from __future__ import annotations

import datetime as dt
import decimal
import math
import random
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import psycopg
import pyarrow as pa
import pytest
from psycopg.pq import Format

from persist_lib import PersistClient, PersistConfig
from persist_lib.ingest import IngestConfig, Ingestion, PgCdcSource, UnsupportedColumnType

pytestmark = pytest.mark.postgres


def _client() -> PersistClient:
    tag = uuid.uuid4().hex
    return PersistClient.open(f"mem://b-{tag}", f"mem://c-{tag}", PersistConfig.for_tests())


@pytest.fixture
def src(pg_server: Any) -> Iterator[str]:
    """A fresh database; its replication slots are dropped afterwards (the test server
    has a fixed number for the whole session)."""
    dsn = pg_server.create_database()
    yield dsn
    drop_slots(dsn)


def drop_slots(dsn: str) -> None:
    """Drops every replication slot of the database (ending the sessions still on one)."""
    import time

    with psycopg.connect(dsn, autocommit=True) as conn:
        deadline = time.monotonic() + 30
        while True:
            conn.execute(
                "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots "
                "WHERE database = current_database() AND active"
            )
            conn.execute(
                "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots "
                "WHERE database = current_database() AND NOT active"
            )
            left = conn.execute(
                "SELECT count(*) FROM pg_replication_slots WHERE database = current_database()"
            ).fetchone()[0]
            if left == 0 or time.monotonic() > deadline:
                return
            time.sleep(0.05)  # a terminated session releases its slot as it exits


def _rows(ing: Ingestion, role: str, t: int) -> list[dict[str, Any]]:
    rows = ing._outs[role].snapshot(t).to_pylist()
    assert all(r["diff"] == 1 for r in rows)
    return rows


def test_ingest_package_exports_pg_cdc_source() -> None:
    import persist_lib.ingest as ingest
    from persist_lib.ingest import pg_cdc

    assert ingest.PgCdcSource is pg_cdc.PgCdcSource
    assert {"PgCdcSource", "LandingZoneSource", "KafkaSource"} <= set(ingest.__all__)


def test_char_n_padding_bool_and_inet_same_through_snapshot_and_stream(src: str) -> None:
    """Regression: the snapshot read ``col::text``, which trims char(n), spells booleans
    ``true`` and shows an inet's /32, while pgoutput sends the output function's text."""
    conn = psycopg.connect(src, autocommit=True)
    conn.execute("CREATE TABLE t (id int PRIMARY KEY, c char(5), b bool, ip inet)")
    conn.execute("INSERT INTO t VALUES (1, 'a', true, '10.0.0.1')")
    k = pa.schema([("id", pa.int32())])
    v = pa.schema([("c", pa.string()), ("b", pa.string()), ("ip", pa.string())])
    with Ingestion(_client(), "chr", PgCdcSource(src, "t"), k, v, envelope="upsert") as ing:
        ing.run_once()  # row 1 through the snapshot
        conn.execute("INSERT INTO t VALUES (2, 'a', true, '10.0.0.1')")
        s = ing.run_once()  # row 2 through pgoutput
        got = {r["id"]: (r["c"], r["b"], r["ip"]) for r in _rows(ing, "data", s["upper"] - 1)}
    held = conn.execute("SELECT c FROM t WHERE id = 1").fetchone()[0]
    assert held == "a    "
    assert got == {1: ("a    ", "t", "10.0.0.1"), 2: ("a    ", "t", "10.0.0.1")}
    conn.close()


# --------------------------------------------------------------------------------------
# The type matrix

# column -> (Postgres type, Arrow field type)
COLUMNS: dict[str, tuple[str, pa.DataType]] = {
    "b": ("bool", pa.bool_()),
    "i2": ("int2", pa.int16()),
    "i4": ("int4", pa.int32()),
    "i8": ("int8", pa.int64()),
    "n": ("numeric", pa.string()),
    "n102": ("numeric(10,2)", pa.decimal128(10, 2)),
    "n102f": ("numeric(10,2)", pa.float64()),
    "f4": ("float4", pa.float32()),
    "f8": ("float8", pa.float64()),
    "ch": ("char(5)", pa.string()),
    "vc": ("varchar(10)", pa.string()),
    "tx": ("text", pa.string()),
    "by": ("bytea", pa.binary()),
    "d": ("date", pa.date32()),
    "ds": ("date", pa.string()),
    "tm": ("time", pa.time64("us")),
    "ttz": ("timetz", pa.string()),
    "tsn": ("timestamp", pa.timestamp("us")),
    "tss": ("timestamp", pa.string()),
    "tz": ("timestamptz", pa.timestamp("us", tz="UTC")),
    "tzs": ("timestamptz", pa.string()),
    "iv": ("interval", pa.string()),
    "u": ("uuid", pa.string()),
    "j": ("json", pa.string()),
    "jb": ("jsonb", pa.string()),
    "ai": ("int4[]", pa.string()),
    "at": ("text[]", pa.string()),
    "en": ("mood", pa.string()),
    "dm": ("posint", pa.int32()),
    "ip": ("inet", pa.string()),
    "cd": ("cidr", pa.string()),
    "mo": ("money", pa.string()),
    "big": ("text", pa.string()),
}

# Each variant: column -> SQL expression (absent: NULL). Written in several session time
# zones (the "tz" key of the variant), so literals without an offset mean different instants.
_BIG = "'" + random.Random(7).randbytes(12000).hex() + "'"  # incompressible: TOASTed out of line
VARIANTS: list[dict[str, str]] = [
    {
        "_zone": "UTC",
        "b": "true", "i2": "-32768", "i4": "2147483647", "i8": "-9223372036854775808",
        "n": "'12345678901234567890.000000000000000000001'", "n102": "'-12345678.90'",
        "n102f": "'0.10'", "f4": "'0.1'", "f8": "'0.1'", "ch": "'a'", "vc": "'x y  '",
        "tx": "E'tab\\there ünï ☃ \\\\ \"q\"'", "by": "'\\x00ff10'", "d": "'2024-02-29'",
        "ds": "'2024-02-29'", "tm": "'23:59:59.999999'", "ttz": "'12:34:56.5+05:30'",
        "tsn": "'2024-01-01 12:34:56.123456'", "tss": "'2024-01-01 12:34:56.123456'",
        "tz": "'2024-03-31 01:30:00'", "tzs": "'2024-03-31 01:30:00'",
        "iv": "'1 year 2 mons 3 days 04:05:06.789'", "u": "'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11'",
        "j": "'{\"b\": 1,  \"a\": [1, 2.50]}'", "jb": "'{\"b\": 1,  \"a\": [1, 2.50]}'",
        "ai": "'{1,NULL,-3}'", "at": "ARRAY['a b', NULL, '\"', '']", "en": "'happy'", "dm": "7",
        "ip": "'192.168.1.5'", "cd": "'10.1.0.0/16'", "mo": "'1234567.89'", "big": _BIG,
    },
    {
        "_zone": "America/St_Johns",
        "b": "false", "i2": "0", "i4": "-1", "i8": "0", "n": "'NaN'", "n102": "'0.00'",
        "n102f": "'-99999999.99'", "f4": "'NaN'", "f8": "'-0'", "ch": "'abcde'", "vc": "''",
        "tx": "''", "by": "''", "d": "'0001-01-01'", "ds": "'infinity'", "tm": "'00:00:00'",
        "ttz": "'00:00:00-12:00'", "tsn": "'1970-01-01 00:00:00'", "tss": "'infinity'",
        "tz": "'2024-11-03 01:30:00'", "tzs": "'-infinity'", "iv": "'-1 days +02:03:00'",
        "u": "'00000000-0000-0000-0000-000000000000'", "j": "'[]'", "jb": "'null'",
        "ai": "'{}'", "at": "'{}'", "en": "'sad'", "dm": "1", "ip": "'2001:db8::1/64'",
        "cd": "'2001:db8::/32'", "mo": "'-0.01'", "big": _BIG,
    },
    {
        "_zone": "Asia/Kathmandu",
        "b": "true", "i2": "32767", "i4": "0", "i8": "9223372036854775807", "n": "'Infinity'",
        "n102": "'99999999.99'", "n102f": "'NaN'", "f4": "'-Infinity'", "f8": "'Infinity'",
        "ch": "' '", "vc": "'é'", "tx": "'\\x'", "by": "'\\x5c78'", "d": "'9999-12-31'",
        "ds": "'-infinity'", "tm": "'12:00:00.000001'", "ttz": "'23:59:59.999999+14:59'",
        "tsn": "'1899-12-31 23:59:59.999999'", "tss": "'-infinity'",
        "tz": "'1900-01-01 00:00:00'", "tzs": "'infinity'", "iv": "'00:00:00'",
        "u": "'ffffffff-ffff-ffff-ffff-ffffffffffff'", "j": "'\"\\\\u00e9\"'", "jb": "'{\"k\": [true, false]}'",
        "ai": "'{{1,2},{3,4}}'", "at": "ARRAY['NULL', 'null']", "en": "'ok'", "dm": "2147483647",
        "ip": "'0.0.0.0/0'", "cd": "'0.0.0.0/0'", "big": _BIG,
    },
    {
        "_zone": "Pacific/Chatham",
        "n": "'-Infinity'", "f4": "'-0'", "f8": "'NaN'", "n102f": "'-0.00'",
        "tz": "'2000-01-01 00:00:00+00'", "tzs": "'2000-01-01 00:00:00+00'", "big": _BIG,
        "iv": "'-1 year -2 mons +3 days -04:05:06'", "tss": "'4713-01-01 00:00:00 BC'", "ds": "'0044-03-15 BC'",
    },  # the rest NULL
]
# Values an Arrow type can't hold: each is an error record (never a changed value).
BAD: list[tuple[str, str]] = [
    ("d", "'infinity'"), ("tsn", "'-infinity'"), ("tz", "'infinity'"), ("n102", "'NaN'"),
    ("tm", "'24:00:00'"), ("d", "'0044-03-15 BC'"),
]
PATHS = ("snapshot", "insert", "update", "update_toast")


def _set(conn: Any, zone: str) -> None:
    conn.execute(psycopg.sql.SQL("SET TimeZone = {}").format(psycopg.sql.Literal(zone)))


def _insert(conn: Any, id_: int, values: dict[str, str]) -> None:
    cols = [c for c in values if c in COLUMNS]
    conn.execute(f"INSERT INTO m ({', '.join(['id', *cols])}) VALUES ({', '.join([str(id_)] + [values[c] for c in cols])})")  # noqa: S608


def _update(conn: Any, id_: int, values: dict[str, str], skip: tuple[str, ...] = ()) -> None:
    sets = ", ".join(f"{c} = {values[c] if c in values else 'NULL'}" for c in COLUMNS if c not in skip)
    conn.execute(f"UPDATE m SET {sets} WHERE id = {id_}")  # noqa: S608


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        if math.isnan(a) or math.isnan(b):
            return math.isnan(a) and math.isnan(b)
        return a == b and math.copysign(1, a) == math.copysign(1, b)
    if isinstance(a, decimal.Decimal) and isinstance(b, decimal.Decimal):
        if a.is_nan() or b.is_nan():
            return a.is_nan() and b.is_nan()
        return a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(type(a) is type(b) and a == b) or (
        isinstance(a, dt.datetime) and isinstance(b, dt.datetime) and a == b
    )


def _canonical(conn: Any, col: str, held: Any, got: Any) -> bool:
    """Whether the collection's ``got`` represents the table's ``held`` (psycopg's value)
    exactly under the mapping of ``COLUMNS[col]``."""
    pgtype, atype = COLUMNS[col]
    if held is None or got is None:
        if pgtype == "jsonb" and got == "null":
            return held is None  # psycopg reads JSON null as None
        return held is None and got is None
    if pa.types.is_string(atype):
        oid = conn.execute(f"SELECT '{pgtype}'::regtype::oid").fetchone()[0]
        loader = conn.adapters.get_loader(oid, Format.TEXT)
        parsed = loader(oid, conn).load(got.encode()) if loader is not None else got
        return _same(parsed, held)
    if pa.types.is_float32(atype):
        return _same(float(np.float32(held)), got)
    if pgtype.startswith("numeric") and pa.types.is_float64(atype):
        return _same(float(held), got)
    return _same(held, got)


def _python_less_loaders(conn: Any) -> None:
    """Dates and timestamps Python has no value for (+-infinity, BC) read as their text;
    the rest as psycopg reads them."""
    from psycopg.types.datetime import DateLoader, TimestampLoader, TimestamptzLoader

    for name, base in (("date", DateLoader), ("timestamp", TimestampLoader), ("timestamptz", TimestamptzLoader)):

        class _L(base):  # type: ignore[misc, valid-type]
            def load(self, data: Any) -> Any:
                text = bytes(data).decode()
                if text in ("infinity", "-infinity") or text.endswith(" BC"):
                    return text
                return super().load(data)

        conn.adapters.register_loader(name, _L)


def _setup(conn: Any) -> None:
    conn.execute("CREATE TYPE mood AS ENUM ('sad', 'ok', 'happy')")
    conn.execute("CREATE DOMAIN posint AS int4 CHECK (VALUE > 0)")
    cols = ", ".join(f"{c} {t}" for c, (t, _) in COLUMNS.items())
    conn.execute(f"CREATE TABLE m (id int PRIMARY KEY, {cols})")
    # the ingester's sessions pin their settings: the database's defaults differ
    db = conn.execute("SELECT current_database()").fetchone()[0]
    conn.execute(
        f'ALTER DATABASE "{db}" SET TimeZone = \'Pacific/Chatham\'; '
        f'ALTER DATABASE "{db}" SET DateStyle = \'SQL, DMY\'; '
        f'ALTER DATABASE "{db}" SET IntervalStyle = \'sql_standard\'; '
        f'ALTER DATABASE "{db}" SET extra_float_digits = -3; '
        f'ALTER DATABASE "{db}" SET bytea_output = \'escape\''
    )


def test_type_matrix_identical_through_every_path_and_equal_to_the_table(src: str) -> None:
    conn = psycopg.connect(src, autocommit=True)
    _setup(conn)
    conn.close()
    conn = psycopg.connect(src, autocommit=True)  # with the database's odd defaults
    nv = len(VARIANTS)

    def ident(path: int, v: int) -> int:
        return 1 + path * 100 + v

    def bad_ident(path: int, j: int) -> int:
        return 1 + path * 100 + 50 + j

    bad_vals = [{c: e, "_zone": "UTC"} for c, e in BAD]
    for v, vals in enumerate(VARIANTS):  # path 0: through the snapshot
        _set(conn, vals["_zone"])
        _insert(conn, ident(0, v), vals)
        _insert(conn, ident(3, v), {"big": _BIG})  # path 3's rows: big set before the snapshot
    for j, vals in enumerate(bad_vals):
        _insert(conn, bad_ident(0, j), vals)
        _insert(conn, bad_ident(3, j), {"big": _BIG})
    key = pa.schema([("id", pa.int32())])
    val = pa.schema([(c, t) for c, (_, t) in COLUMNS.items()])
    cfg = IngestConfig(keep_raw=True)
    with Ingestion(_client(), "types", PgCdcSource(src, "m"), key, val, envelope="upsert", config=cfg) as ing:
        ing.run_once()
        for v, vals in enumerate(VARIANTS + bad_vals):
            i1, i2, i3 = (ident(p, v) if v < nv else bad_ident(p, v - nv) for p in (1, 2, 3))
            _set(conn, vals["_zone"])
            _insert(conn, i1, vals)  # path 1: a streaming insert
            _insert(conn, i2, {})  # path 2: an update of every column
            _update(conn, i2, vals)
            _update(conn, i3, vals, skip=("big",))  # path 3: big is left unchanged (TOAST)
        s = ing.run_once()
        data = {r["id"]: r for r in _rows(ing, "data", s["upper"] - 1)}
        errors = _rows(ing, "errors", s["upper"] - 1)
        raw = _rows(ing, "raw", s["upper"] - 1)
    # path 3's updates really left big unsent (pgoutput's 'u'), so the state supplied it
    import json

    unch = [json.loads(r["raw"])["unchanged"] for r in raw if json.loads(r["raw"])["values"].get("id") == str(ident(3, 0))]
    assert ["big"] in unch, unch
    conn.close()
    # the table as psycopg reads it (and parses text with), in yet another time zone
    conn = psycopg.connect(
        src, autocommit=True,
        options="-c TimeZone=Asia/Tokyo -c DateStyle=ISO -c IntervalStyle=postgres -c extra_float_digits=1",
    )
    _python_less_loaders(conn)
    good = [ident(p, v) for p in range(4) for v in range(nv)]  # (psycopg can't read 24:00:00)
    cur = conn.execute(f"SELECT id, {', '.join(COLUMNS)} FROM m WHERE id = ANY(%s)", (good,))  # noqa: S608
    held = {r[0]: dict(zip(COLUMNS, r[1:], strict=True)) for r in cur.fetchall()}
    for v in range(nv):
        base = {c: data[ident(0, v)][c] for c in COLUMNS}
        for p in range(4):
            row = data[ident(p, v)]
            for c in COLUMNS:
                assert _same(row[c], base[c]), f"variant {v}, {c}: {PATHS[p]} gave {row[c]!r}, snapshot {base[c]!r}"
                assert _canonical(conn, c, held[ident(p, v)][c], row[c]), (
                    f"variant {v}, {c} ({COLUMNS[c][0]} as {COLUMNS[c][1]}) via {PATHS[p]}: the table holds "
                    f"{held[ident(p, v)][c]!r}, the collection {row[c]!r}"
                )
    # the values no Arrow type of theirs holds: an error record naming the field, every path
    by_addr: dict[int, list[str]] = {}
    for r in raw:
        rid = json.loads(r["raw"])["values"].get("id")
        if rid is not None:
            by_addr.setdefault(int(rid), []).append(r["address"])
    reasons = {e["address"]: e["reason"] for e in errors}
    for j, (c, expr) in enumerate(BAD):
        for p in range(4):
            i = bad_ident(p, j)
            if p in (0, 1):
                assert i not in data, (c, expr, PATHS[p], data.get(i))
            hits = [reasons[a] for a in by_addr[i] if a in reasons]
            assert len(hits) == 1 and f"field {c!r}" in hits[0], (c, expr, PATHS[p], hits)
    conn.close()


REFUSED: list[tuple[str, pa.DataType, str]] = [
    ("numeric", pa.decimal128(38, 10), r"pa.string\(\)"),
    ("numeric", pa.float64(), r"pa.string\(\)"),
    ("numeric(20,2)", pa.float64(), r"pa.decimal128\(20, 2\)"),
    ("numeric(10,2)", pa.decimal128(10, 3), r"pa.decimal128\(10, 2\)"),
    ("float4", pa.float64(), r"pa.float32\(\)"),
    ("float8", pa.float32(), r"pa.float64\(\)"),
    ("timetz", pa.time64("us"), r"pa.string\(\)"),
    ("time", pa.time32("ms"), r"pa.time64\('us'\)"),
    ("interval", pa.duration("us"), r"pa.string\(\)"),
    ("timestamptz", pa.timestamp("us"), "tz='UTC'"),
    ("timestamp", pa.timestamp("ms"), r"pa.timestamp\('us'\)"),
    ("timestamp", pa.timestamp("us", tz="UTC"), r"pa.timestamp\('us'\)"),
    ("int8", pa.int32(), r"pa.int64\(\)"),
    ("char(3)", pa.int32(), r"pa.string\(\)"),
    ("uuid", pa.binary(), r"pa.string\(\)"),
    ("int4[]", pa.list_(pa.int32()), r"pa.string\(\)"),
    ("jsonb", pa.struct([("a", pa.int64())]), r"pa.string\(\)"),
    ("mood", pa.int32(), r"pa.string\(\)"),
    ("posint", pa.int16(), r"pa.int32\(\)"),
    ("text", pa.list_(pa.string()), r"pa.string\(\)"),
]


def test_unrepresentable_column_types_are_refused_up_front(src: str) -> None:
    conn = psycopg.connect(src, autocommit=True)
    conn.execute("CREATE TYPE mood AS ENUM ('sad', 'ok', 'happy')")
    conn.execute("CREATE DOMAIN posint AS int4 CHECK (VALUE > 0)")
    cols = ", ".join(f"x{i} {t}" for i, (t, _, _) in enumerate(REFUSED))
    conn.execute(f"CREATE TABLE r (id int PRIMARY KEY, {cols})")
    conn.execute("INSERT INTO r (id) VALUES (1)")
    client = _client()
    key = pa.schema([("id", pa.int32())])
    for i, (_pgtype, atype, suggest) in enumerate(REFUSED):
        ing = Ingestion(client, f"refuse{i}", PgCdcSource(src, "r"), key, pa.schema([(f"x{i}", atype)]), envelope="upsert")
        with pytest.raises(UnsupportedColumnType, match=f"column 'x{i}' of public.r is .*use .*{suggest}"):
            ing.run_once()
        ing.close()
    # refused before anything was created: no slot, no publication
    assert conn.execute("SELECT count(*) FROM pg_replication_slots WHERE database = current_database()").fetchone()[0] == 0
    assert conn.execute("SELECT count(*) FROM pg_publication").fetchone()[0] == 0
    # and the same columns as their text form are accepted
    val = pa.schema([(f"x{i}", pa.string()) for i in range(len(REFUSED))])
    with Ingestion(client, "text_form", PgCdcSource(src, "r"), key, val, envelope="upsert") as ing:
        s = ing.run_once()
    assert s["records"] == 1
    conn.close()


def test_pinned_settings_win_over_the_dsn_and_the_database(src: str) -> None:
    """A DSN's own ``options`` are kept, but the settings that shape values are pinned:
    a timestamptz arrives in UTC through the snapshot and the stream alike."""
    from urllib.parse import quote

    conn = psycopg.connect(src, autocommit=True)
    conn.execute("CREATE TABLE z (id int PRIMARY KEY, at timestamptz)")
    conn.execute("INSERT INTO z VALUES (1, '2024-06-01 12:00:00+00')")
    dsn = f"{src}?options={quote('-c TimeZone=Asia/Tokyo -c application_name=cdc_opts')}"
    k = pa.schema([("id", pa.int32())])
    v = pa.schema([("at", pa.string())])
    with Ingestion(_client(), "opts", PgCdcSource(dsn, "z"), k, v, envelope="upsert") as ing:
        ing.run_once()
        conn.execute("INSERT INTO z VALUES (2, '2024-06-01 12:00:00+00')")
        s = ing.run_once()
        got = {r["id"]: r["at"] for r in _rows(ing, "data", s["upper"] - 1)}
        names = {r[0] for r in conn.execute("SELECT application_name FROM pg_stat_activity").fetchall()}
    assert got == {1: "2024-06-01 12:00:00+00", 2: "2024-06-01 12:00:00+00"}
    assert "cdc_opts" in names  # the DSN's own option was applied
    conn.close()
