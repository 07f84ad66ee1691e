"""Hostile-input corpus (issue 26): generated malformed records mixed with valid ones,
in every landing-zone format (JSON lines, CSV, Parquet) and for Kafka keys and values
(JSON and text). Each record lands exactly once, in the data or in the errors
collection (with the kind it must get), the ingestion never stops, and every output
collection stays readable from start to end: snapshot, listen, compaction, SQL
(``persist_lib.sql.engine``), a rebuild from the raw collection, and Spark.

Random bytes, truncated and overlong UTF-8, CESU-style surrogates, escaped lone
surrogates, code points past U+10FFFF, NUL (raw and escaped), very long lines, deeply
nested JSON, numbers out of range, wrong types, CSV quoting errors. Fixed seed; the
tally by error kind is printed (``pytest -s``).

Records that are errors of a whole *file* (an unreadable Parquet file: one
``unreadable_file`` error) count as one record; an unterminated CSV quote swallows the
rest of its file (CSV can't tell where the field would end), so the corpus puts it in
the last record of a file only.
"""

from __future__ import annotations

import csv
import io
import json
import random
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from persist_lib import PersistClient, PersistConfig
from persist_lib.ingest import IngestConfig, Ingestion, LandingZoneSource
from persist_lib.ingest.decode import ERRORS_KEY, ERRORS_VAL, RAW_KEY, RAW_VAL
from persist_lib.ingest.outputs import ShardOutputs, shard_id_for

pytest_plugins = ["tests.spark_fixtures"]

SEED = 26
KEY = pa.schema([("id", pa.int64())])
VAL = pa.schema([("name", pa.string()), ("qty", pa.float64()), ("n", pa.int32())])
ROLES = {"data": (KEY, VAL), "errors": (ERRORS_KEY, ERRORS_VAL), "raw": (RAW_KEY, RAW_VAL)}

# Byte sequences that are not UTF-8, each with what it is.
NOT_UTF8 = [
    b"caf\xe9",  # Latin-1
    b"\xc3",  # truncated 2-byte sequence
    b"ab\xe2\x82",  # truncated 3-byte sequence
    b"\xf0\x9f\x98",  # truncated 4-byte sequence
    b"\xc0\xaf",  # overlong '/'
    b"\xe0\x80\xaf",  # overlong '/', 3 bytes
    b"\xc0\x80",  # overlong NUL (modified UTF-8)
    b"\xed\xa0\x80",  # CESU-style high surrogate
    b"\xed\xa0\xbd\xed\xb8\x80",  # CESU-style surrogate pair
    b"\xed\xbf\xbf",  # low surrogate
    b"\xf4\x90\x80\x80",  # past U+10FFFF
    b"\xf8\x88\x80\x80\x80",  # 5-byte form
    b"\x80\x80",  # stray continuation bytes
    b"\xfe\xff",
]
TEXT = ["plain", "café", "naïve", "日本語", "emoji 😀", "a,b", 'quo"te', "tab\tbed", "nul\x00inside", "", " spaced "]


@dataclass
class Rec:
    """One record sent: where it is, its id (unique) and what must become of it."""

    source: str
    address: tuple[Any, ...]
    id: int | None
    expect: str  # "good" | "bad" | "either"
    kinds: frozenset[str] = frozenset()  # the error kinds it may get (when bad)


@dataclass
class Corpus:
    recs: list[Rec] = field(default_factory=list)

    def add(self, source: str, address: tuple[Any, ...], rid: int | None, expect: str, *kinds: str) -> None:
        self.recs.append(Rec(source, address, rid, expect, frozenset(kinds)))


def _junk(rng: random.Random, n: int, drop: bytes = b"\n") -> bytes:
    """Random bytes, starting with a continuation byte (so never UTF-8 nor a BOM)."""
    return b"\x80" + bytes(b for b in rng.randbytes(n) if b not in drop)


def _text(rng: random.Random) -> str:
    return rng.choice(TEXT) + str(rng.randrange(1000))


# ----- JSON lines ------------------------------------------------------------------------


def json_record(rng: random.Random, rid: int, with_id: bool = True) -> tuple[bytes, str, tuple[str, ...]]:
    """One JSON record: (line, expect, kinds). ``with_id=False``: the id is elsewhere
    (a Kafka key); the record then has no "id"."""
    head = f'"id":{rid},' if with_id else ""

    def obj(rest: str) -> bytes:
        return ("{" + head + rest + "}").encode()

    r = rng.random()
    if r < 0.45:
        rec = {"name": _text(rng), "qty": rng.randrange(10_000) / 8, "n": rng.randrange(-1000, 1000)}
        if with_id:
            rec = {"id": rid, **rec}
        return json.dumps(rec, ensure_ascii=rng.random() < 0.5).encode(), "good", ()
    choice = rng.randrange(20)
    if choice == 0:
        return _junk(rng, rng.randrange(1, 200)), "bad", ("invalid_utf8",)
    if choice in (1, 2, 3):
        bad = rng.choice(NOT_UTF8)
        return b"{" + head.encode() + b'"name":"pre' + bad + b'post","qty":1}', "bad", ("invalid_utf8",)
    if choice == 4:
        return obj('"name":"' + rng.choice(["\\ud800", "\\udce9", "\\udfff", "a\\ud83d"]) + '"'), "bad", ("invalid_utf8",)
    if choice == 5:
        return obj('"name":"raw\x00nul"'), "bad", ("invalid_json",)
    if choice == 6:
        return obj('"name":"escaped\\u0000nul","qty":2'), "good", ()
    if choice == 7:
        return obj('"name":"' + "L" * rng.randrange(10_000, 100_000) + '"'), "good", ()
    if choice == 8:
        d = rng.randrange(1000, 20_000)
        return b"[" * d + b"]" * d, "bad", ("invalid_json", "not_an_object")
    if choice == 9:
        d = rng.randrange(1000, 20_000)
        return obj('"name":' + "[" * d + "]" * d), "bad", ("invalid_json", "type_mismatch")
    if choice == 10:
        return obj(rng.choice(['"qty":1e400', '"qty":-1e999', '"n":2147483648', '"n":-2147483649'])), "bad", ("type_mismatch",)
    if choice == 11 and with_id:
        return rng.choice([b'{"id":9223372036854775808}', b'{"id":-9223372036854775809}', b'{"id":1e30}']), "bad", ("type_mismatch",)
    if choice == 12:
        return obj(rng.choice(['"name":5', '"qty":"x"', '"n":1.5', '"name":{"a":1}', '"n":true', '"qty":[1]'])), "bad", ("type_mismatch",)
    if choice == 13:
        return rng.choice([b"[1,2]", b'"str"', b"42", b"null", b"true"]), "bad", ("not_an_object",)
    if choice == 14:
        return (b"{" + head.encode() + b'"name":"trunc')[: rng.randrange(1, 12 + len(head))], "bad", ("invalid_json",)
    if choice == 15 and with_id:
        return rng.choice([b'{"name":"no id"}', b'{"id":null,"qty":1}']), "bad", ("missing_key",)
    if choice == 16:
        return obj('"name":"x"') + b"\x00", "bad", ("invalid_json",)
    if choice == 17:
        return obj('"qty":1') + b"\xff", "bad", ("invalid_utf8", "invalid_json")
    if choice == 18:
        return b"{" + head.encode() + b'"na\xffme":"ignored field"}', "either", ("invalid_utf8",)
    rec2 = {"name": _text(rng)}
    if with_id:
        rec2 = {"id": rid, **rec2}
    return json.dumps(rec2).encode(), "good", ()


def _jsonl_file(rng: random.Random, corpus: Corpus, path: Path, ids: Callable[[], int], n: int) -> None:
    lines = []
    for row in range(n):
        rid = ids()
        line, expect, kinds = json_record(rng, rid)
        lines.append(line)
        corpus.add("jsonl", (path.name, row), rid, expect, *kinds)
    path.write_bytes(b"\n".join(lines) + b"\n")


# ----- CSV -------------------------------------------------------------------------------


def _csv_file(rng: random.Random, corpus: Corpus, path: Path, ids: Callable[[], int], n: int) -> None:
    out = [b"id,name,qty,n"]
    for row in range(n):
        rid = ids()
        r = rng.random()
        if row == n - 1 and rng.random() < 0.5:
            out.append(f'{rid},"never closed,1,1'.encode())
            corpus.add("csv", (path.name, row), rid, "bad", "invalid_csv")
            break
        if r < 0.5:
            buf = io.StringIO()
            name = _text(rng) + ("\nsecond line" if rng.random() < 0.1 else "")
            csv.writer(buf, lineterminator="\n").writerow([rid, name, rng.randrange(100) / 4, rng.randrange(100)])
            out.append(buf.getvalue()[:-1].encode())
            corpus.add("csv", (path.name, row), rid, "good")
            continue
        c = rng.randrange(10)
        if c in (0, 1, 2):
            bad = rng.choice(NOT_UTF8) if c else _junk(rng, 50, b'\n\r,"')
            out.append(f"{rid},pre".encode() + bad + b"post,1,1")
            corpus.add("csv", (path.name, row), rid, "bad", "invalid_utf8")
        elif c == 3:
            out.append(f'{rid},"ab"cd,1,1'.encode())
            corpus.add("csv", (path.name, row), rid, "bad", "invalid_csv")
        elif c == 4:
            out.append(f"{rid},x".encode())
            corpus.add("csv", (path.name, row), rid, "bad", "wrong_field_count")
        elif c == 5:
            out.append(f"{rid},x,1,{rng.choice(['3000000000', '1.5', 'x', '2e3'])}".encode())
            corpus.add("csv", (path.name, row), rid, "bad", "type_mismatch")
        elif c == 6:
            out.append(rng.choice([b"99999999999999999999,x,1,1", b"seven,x,1,1"]))
            corpus.add("csv", (path.name, row), None, "bad", "type_mismatch")
        elif c == 7:
            out.append(b",no id,1,1")
            corpus.add("csv", (path.name, row), None, "bad", "missing_key")
        elif c == 8:
            size = rng.randrange(20_000, 140_000)
            out.append(f"{rid},{'W' * size},1,1".encode())
            if size <= csv.field_size_limit():
                corpus.add("csv", (path.name, row), rid, "good")
            else:  # Python's csv module refuses such a field (the record only)
                corpus.add("csv", (path.name, row), rid, "bad", "invalid_csv")
        else:
            out.append(f"{rid},nul\x00in field,1e400,2".encode())  # (1e400 is inf for a text double)
            corpus.add("csv", (path.name, row), rid, "good")
    path.write_bytes(b"\n".join(out) + b"\n")


# ----- Parquet ---------------------------------------------------------------------------


def _parquet_file(rng: random.Random, corpus: Corpus, path: Path, ids: Callable[[], int], n: int) -> None:
    idc: list[int | None] = []
    names: list[bytes | None] = []
    qty: list[float | None] = []
    ns: list[int | None] = []
    for row in range(n):
        rid = ids()
        c = rng.randrange(10)
        idc.append(rid)
        names.append(_text(rng).encode())
        qty.append(rng.randrange(100) / 2)
        ns.append(rng.randrange(100))
        if c in (0, 1):
            names[-1] = rng.choice(NOT_UTF8) if c else _junk(rng, 80)
            corpus.add("parquet", (path.name, row), rid, "bad", "invalid_utf8")
        elif c == 2:
            ns[-1] = rng.choice([2**31, -(2**31) - 1, 2**62])
            corpus.add("parquet", (path.name, row), rid, "bad", "type_mismatch")
        elif c == 3:
            idc[-1] = None
            corpus.add("parquet", (path.name, row), None, "bad", "missing_key")
        elif c == 4:
            names[-1] = ("N" * rng.randrange(5_000, 50_000)).encode() + b"\x00"
            corpus.add("parquet", (path.name, row), rid, "good")
        else:
            corpus.add("parquet", (path.name, row), rid, "good")
    t = pa.table({
        "id": pa.array(idc, pa.int64()),
        "name": pa.array(names, pa.binary()).cast(pa.string(), safe=False),  # not checked
        "qty": pa.array(qty, pa.float64()),
        "n": pa.array(ns, pa.int64()),
    })
    pq.write_table(t, path)


def make_zone(root: Path, corpus: Corpus, ids: Callable[[], int]) -> None:
    rng = random.Random(SEED)
    root.mkdir()
    for i in range(7):
        _jsonl_file(rng, corpus, root / f"j{i}.jsonl", ids, 700)
    for i in range(4):
        _csv_file(rng, corpus, root / f"c{i}.csv", ids, 700)
    for i in range(5):
        _parquet_file(rng, corpus, root / f"p{i}.parquet", ids, 500)
    (root / "p9.parquet").write_bytes(b"PAR1" + rng.randbytes(300))
    corpus.add("parquet", ("p9.parquet", 0), None, "bad", "unreadable_file")


# ----- checks ----------------------------------------------------------------------------


def check_landed(
    corpus: Corpus, data_ids: list[int], errors: list[dict[str, Any]], source_of: Callable[[dict[str, Any]], str]
) -> Counter[str]:
    """Every record exactly once in data or errors; returns the tally by error kind."""
    assert len(data_ids) == len(set(data_ids)), "a record landed twice in data"
    err_at: dict[tuple[str, tuple[Any, ...]], dict[str, Any]] = {}
    for e in errors:
        k = (source_of(e), tuple(json.loads(e["address"])))
        assert k not in err_at, f"two errors at {k}"
        err_at[k] = e
    data = set(data_ids)
    by_source: Counter[str] = Counter()
    for r in corpus.recs:
        by_source[r.source] += 1
        e = err_at.pop((r.source, r.address), None)
        in_data = r.id is not None and r.id in data
        assert in_data != (e is not None), f"{r} landed {'twice' if in_data else 'nowhere'} (error: {e})"
        if r.expect == "good":
            assert in_data, f"{r}: a valid record is not in data (error {e and (e['kind'], e['reason'][:200])})"
        elif r.expect == "bad":
            assert e is not None, f"{r}: a malformed record is in data"
            assert e["kind"] in r.kinds, f"{r}: kind {e['kind']} ({e['reason'][:200]})"
        if in_data:
            data.discard(r.id)
    assert not err_at, f"errors for records never sent: {list(err_at)[:3]}"
    assert not data, f"data rows for records never sent: {sorted(data)[:3]}"
    tally: Counter[str] = Counter(e["kind"] for e in errors)
    sent = sum(by_source.values())
    assert len(data_ids) + len(errors) == sent, (len(data_ids), len(errors), sent)
    print(f"\nhostile corpus: {sent} records {dict(by_source)}; {len(data_ids)} in data, {len(errors)} in errors")
    print("errors by kind: " + ", ".join(f"{k}={v}" for k, v in sorted(tally.items())))
    return tally


def read_everything(client: PersistClient, name: str, roles: dict[str, tuple[pa.Schema, pa.Schema]]) -> dict[str, int]:
    """Every output collection, from its since to its upper: snapshot, listen, SQL,
    then compaction and a snapshot again. Returns the row count per role."""
    from persist_lib.sql.engine import SqlSession

    counts = {}
    for role, (k, v) in roles.items():
        sid = shard_id_for(name, role)
        r = client.open_leased_reader(sid, k, v)
        try:
            upper = client.inspect(sid)["upper"][0]
            since = client.inspect(sid)["since"][0]
            snap = r.snapshot(upper - 1).to_pylist()  # every string decoded as Python text
            assert all(x["diff"] > 0 for x in snap)
            tail = r.listen(since).read_until(upper).to_pylist()
            assert len(tail) >= 0
            client.compact(sid, raise_on_failure=True)
            assert len(r.snapshot(upper - 1).to_pylist()) == len(snap)
            counts[role] = len(snap)
        finally:
            r.expire()
        with SqlSession(client) as s:
            got = s.sql(f'SELECT * FROM "{sid}"').fetchall()  # noqa: S608 - our own shard id
            assert len(got) == len(snap), role
    return counts


def ingest_zone(tmp_path: Path, client: PersistClient) -> tuple[Corpus, int]:
    """Makes the landing-zone corpus and ingests it to the end; returns it and the upper."""
    nxt = iter(range(1, 10**9))
    corpus = Corpus()
    make_zone(tmp_path / "zone", corpus, lambda: next(nxt))
    assert len(corpus.recs) >= 10_000
    ing = Ingestion(client, "hostile", LandingZoneSource(str(tmp_path / "zone")), KEY, VAL,
                    envelope="append_only", config=IngestConfig(max_records_per_binding=1500, keep_raw=True))
    with ing:
        s = ing.run_once()
        while s["records"]:
            s = ing.run_once()
        assert ing.run_once()["records"] == 0  # it went through to the end
    return corpus, s["upper"]


def _zone_source(e: dict[str, Any]) -> str:
    f = json.loads(e["address"])[0]
    return {"jsonl": "jsonl", "csv": "csv", "parquet": "parquet"}[f.rsplit(".", 1)[1]]


def test_hostile_corpus_in_landing_zone_files(tmp_path: Path) -> None:
    tag = uuid.uuid4().hex
    client = PersistClient.open(f"mem://b-{tag}", f"mem://c-{tag}", PersistConfig.for_tests())
    corpus, upper = ingest_zone(tmp_path, client)
    counts = read_everything(client, "hostile", ROLES)
    r = client.open_leased_reader(shard_id_for("hostile", "data"), KEY, VAL)
    data = r.snapshot(upper - 1).to_pylist()
    r.expire()
    r = client.open_leased_reader(shard_id_for("hostile", "errors"), ERRORS_KEY, ERRORS_VAL)
    errors = r.snapshot(upper - 1).to_pylist()
    r.expire()
    assert counts["data"] == len(data) and counts["errors"] == len(errors)
    tally = check_landed(corpus, [d["id"] for d in data], errors, _zone_source)
    assert tally["invalid_utf8"] >= 500 and tally["invalid_csv"] >= 20
    # the raw collection rebuilds the same data and errors
    from persist_lib.ingest.rebuild import rebuild_from_raw

    rebuild_from_raw(client, "hostile", KEY, VAL, outputs=ShardOutputs(client, "again"))
    again = read_everything(client, "again", {"data": ROLES["data"], "errors": ROLES["errors"]})
    # (a file-level error has no raw record: the unreadable Parquet file)
    assert again == {"data": counts["data"], "errors": counts["errors"] - tally["unreadable_file"]}
    r = client.open_leased_reader(shard_id_for("again", "errors"), ERRORS_KEY, ERRORS_VAL)
    rebuilt = {(e["address"], e["kind"]) for e in r.snapshot(upper - 1).to_pylist()}
    r.expire()
    assert rebuilt == {(e["address"], e["kind"]) for e in errors if e["kind"] != "unreadable_file"}
    client.close()


@pytest.mark.spark
@pytest.mark.slow  # (a Spark session: ~25 s to start, ~30 s for its first jobs)
def test_hostile_corpus_read_by_spark(tmp_path: Path, spark: Any) -> None:
    """The landing-zone corpus's outputs, read on Spark executors (every string of the
    data, errors and raw collections goes through Spark's Arrow conversion)."""
    from persist_lib.spark.read import read_snapshot
    from tests.test_ingest_support import file_location

    blob, consensus = file_location(tmp_path, "s")
    client = PersistClient.open(blob, consensus, PersistConfig.for_tests())
    corpus, upper = ingest_zone(tmp_path, client)
    got: dict[str, list[Any]] = {}
    for role, (k, v) in ROLES.items():
        r = client.open_leased_reader(shard_id_for("hostile", role), k, v)
        want = r.snapshot(upper - 1).to_pylist()
        got[role] = read_snapshot(spark, r, upper - 1, num_splits=2).collect()
        assert len(got[role]) == len(want), role
        r.expire()
    errors = [row.asDict() for row in got["errors"]]
    check_landed(corpus, [row["id"] for row in got["data"]], errors, _zone_source)
    client.close()


# ----- Kafka keys and values ---------------------------------------------------------------


KKEY = pa.schema([("k", pa.string())])
TVAL = pa.schema([("v", pa.string())])
HOSTILE_JSON_KEYS: list[tuple[bytes, tuple[str, ...]]] = [
    (b'"k\xe9"', ("invalid_utf8",)),
    (b'"\xed\xa0\x80"', ("invalid_utf8",)),
    (b'"\\ud800"', ("invalid_utf8",)),
    (b"{oops", ("invalid_json",)),
    (b"null", ("missing_key",)),
    (b"5", ("type_mismatch",)),
    (b"[1]", ("type_mismatch",)),
]


def kafka_json_messages(rng: random.Random, corpus: Corpus, n: int) -> list[tuple[int, bytes, bytes, int, None]]:
    """Upsert with JSON keys (one message per key) and hostile JSON keys and values."""
    out = []
    for off in range(n):
        value, expect, kinds = json_record(rng, off, with_id=False)
        key = json.dumps(f"k{off}").encode()
        if rng.random() < 0.15:  # (a bad value may be the one reported)
            key, key_kinds = rng.choice(HOSTILE_JSON_KEYS + [(_junk(rng, 30), ("invalid_utf8",))])
            kinds, expect = key_kinds + (kinds if expect != "good" else ()), "bad"
        elif expect == "good" and rng.random() < 0.03:
            key = b'"k' + str(off).encode() + b'\\u0000"'  # a NUL in the key: valid text
        out.append((0, key, value, 1_700_000_000_000 + off, None))
        corpus.add("kafka-json", (off,), off if expect != "bad" else None, expect, *kinds)
    return out


def kafka_text_messages(rng: random.Random, corpus: Corpus, n: int) -> list[tuple[int, bytes, bytes, int, None]]:
    """Upsert with text keys and values: random text, NUL, long values, bytes that are
    not UTF-8 in either."""
    out = []
    for off in range(n):
        key, value, expect = f"t{off}".encode(), _text(rng).encode(), "good"
        r = rng.random()
        if r < 0.1:
            key, expect = rng.choice([*NOT_UTF8, _junk(rng, 20)]), "bad"
        elif r < 0.25:
            value, expect = b"pre" + rng.choice([*NOT_UTF8, _junk(rng, 100, b"")]), "bad"
        elif r < 0.3:
            value = b"V" * rng.randrange(10_000, 100_000) + b"\x00\n\r\t"
        out.append((0, key, value, 1_700_000_000_000 + off, None))
        corpus.add("kafka-text", (off,), off if expect == "good" else None, expect, "invalid_utf8")
    return out


@pytest.mark.kafka
def test_hostile_corpus_in_kafka_keys_and_values(kafka_broker: Any) -> None:
    from persist_lib.ingest.kafka import KafkaSource

    rng = random.Random(SEED + 1)
    tag = uuid.uuid4().hex
    client = PersistClient.open(f"mem://b-{tag}", f"mem://c-{tag}", PersistConfig.for_tests())
    total = Counter[str]()
    for name, make, key_format, value_format, val, n in (
        ("hk", kafka_json_messages, "json", "json", VAL, 1500),
        ("ht", kafka_text_messages, "text", "text", TVAL, 1000),
    ):
        corpus = Corpus()
        t0 = time.perf_counter()
        topic = f"t{uuid.uuid4().hex[:10]}"
        kafka_broker.create_topic(topic, 1)
        kafka_broker.produce(topic, make(rng, corpus, n))
        src = KafkaSource(kafka_broker.bootstrap, topic, key_format=key_format, value_format=value_format,
                          key_field="k", poll_s=0.1)
        with Ingestion(client, name, src, KKEY, val, envelope="upsert",
                       config=IngestConfig(max_records_per_binding=400, keep_raw=True)) as ing:
            s = ing.run_once()
            while s["frontier"].get("0") != [n]:
                assert s["records"], f"{name}: the ingestion stopped at {s['frontier']}"
                s = ing.run_once()
        print(f"{name}: produced and ingested in {time.perf_counter() - t0:.1f} s")
        t0 = time.perf_counter()
        roles = {"data": (KKEY, val), "errors": ROLES["errors"], "state": (KKEY, val), "raw": ROLES["raw"]}
        counts = read_everything(client, name, roles)
        print(f"{name}: snapshot, listen, compaction, SQL in {time.perf_counter() - t0:.1f} s")
        out: dict[str, list[dict[str, Any]]] = {}
        for role in ("data", "errors"):
            r = client.open_leased_reader(shard_id_for(name, role), *roles[role])
            out[role] = r.snapshot(s["upper"] - 1).to_pylist()
            assert len(out[role]) == counts[role]
            r.expire()
        ids = [int(d["k"][1:].split("\x00")[0]) for d in out["data"]]
        for e in out["errors"]:
            e["address"] = json.dumps(json.loads(e["address"]))
        total.update(check_landed(corpus, ids, out["errors"], lambda e, n=name: f"kafka-{'json' if n == 'hk' else 'text'}"))
    assert total["invalid_utf8"] >= 300
    client.close()


def test_a_json_null_line_is_an_error_record_not_a_crash(tmp_path: Path) -> None:
    """pyarrow's JSON reader segfaults on a block that starts with ``null``
    (apache/arrow#47409): such lines (any line that is not an object) never reach it."""
    from persist_lib.ingest.decode import DecodeSpec, decode_json_lines

    lines = [b"null", b'{"id":1,"name":"a"}', b"  null", b"\tnull  ", b'{"id":2}', b"[null]", b"nul"]
    table, bad = decode_json_lines(DecodeSpec(KEY, VAL), lines)
    assert table.column("id").to_pylist() == [1, 2]
    assert [(i, k) for i, k, _ in bad] == [
        (0, "not_an_object"), (2, "not_an_object"), (3, "not_an_object"), (5, "not_an_object"), (6, "invalid_json")
    ]
    zone = tmp_path / "z"
    zone.mkdir()
    (zone / "a.jsonl").write_bytes(b"null\n" + b'{"id":7,"name":"x"}\n')
    tag = uuid.uuid4().hex
    client = PersistClient.open(f"mem://b-{tag}", f"mem://c-{tag}", PersistConfig.for_tests())
    with Ingestion(client, "nl", LandingZoneSource(str(zone)), KEY, VAL, envelope="append_only") as ing:
        s = ing.run_once()
    assert s["records"] == 2 and s["errors"] == 1
    client.close()


def test_a_csv_quoting_error_costs_only_its_record(tmp_path: Path) -> None:
    zone = tmp_path / "z"
    zone.mkdir()
    (zone / "a.csv").write_bytes(b'id,name,qty,n\n1,a,1,1\n2,"b"c,2,2\n3,"multi\nline",3,3\n4,d,4,4\n5,"open,5,5\n6,e,6,6\n')
    tag = uuid.uuid4().hex
    client = PersistClient.open(f"mem://b-{tag}", f"mem://c-{tag}", PersistConfig.for_tests())
    with Ingestion(client, "q", LandingZoneSource(str(zone)), KEY, VAL, envelope="append_only",
                   config=IngestConfig(keep_raw=True)) as ing:
        s = ing.run_once()
    r = client.open_leased_reader(shard_id_for("q", "data"), KEY, VAL)
    assert sorted((d["id"], d["name"]) for d in r.snapshot(s["upper"] - 1).to_pylist()) == [
        (1, "a"), (3, "multi\nline"), (4, "d")
    ]
    r.expire()
    r = client.open_leased_reader(shard_id_for("q", "errors"), ERRORS_KEY, ERRORS_VAL)
    errs = sorted((json.loads(e["address"])[1], e["kind"], e["raw"]) for e in r.snapshot(s["upper"] - 1).to_pylist())
    r.expire()
    # the unterminated quote at record 4 runs to the end of the file (record 5 is in it)
    assert errs == [(1, "invalid_csv", b'2,"b"c,2,2'), (4, "invalid_csv", b'5,"open,5,5\n6,e,6,6')]
    client.close()
