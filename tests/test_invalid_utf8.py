"""Invalid UTF-8 never reaches a part (issue 26, defect 1).

Writers get ``InvalidUtf8`` naming the column and row, with nothing written; ingestion
sends each record holding an invalid string to its errors collection (``invalid_utf8``)
and goes on, in every file format and for Kafka keys and values; a part that holds
invalid bytes anyway (written by older code) is ``InvalidUtf8InPart`` naming shard and
part, and a rebuild from the raw collection is the way out."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from persist_lib import PersistClient, PersistConfig
from persist_lib.errors import InvalidUtf8, InvalidUtf8InPart
from persist_lib.ingest import IngestConfig, Ingestion, LandingZoneSource
from persist_lib.ingest.decode import ERRORS_KEY, ERRORS_VAL
from persist_lib.ingest.outputs import shard_id_for
from persist_lib.shard import codec as codec_mod

KEY = pa.schema([("id", pa.int64())])
VAL = pa.schema([("name", pa.string()), ("qty", pa.float64())])
ISSUE_JSONL = b'{"id":1,"name":"tea","qty":1.0}\n{"id":2,"name":"caf\xe9","qty":2.0}\n{"id":3,"name":"cake","qty":3.0}\n'


def sid(n: int) -> str:
    return f"s{uuid.UUID(int=n)}"


def _client() -> PersistClient:
    tag = uuid.uuid4().hex
    return PersistClient.open(f"mem://b-{tag}", f"mem://c-{tag}", PersistConfig.for_tests())


def bad_strings(values: list[bytes | None]) -> pa.Array:
    """A string array holding these bytes as they are (an unsafe cast does not check)."""
    arr = pa.array(values, pa.binary()).cast(pa.string(), safe=False)
    if any(v is not None and not _utf8(v) for v in values):
        with pytest.raises(pa.ArrowInvalid):
            arr.validate(full=True)
    return arr


def _utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def snap(client: PersistClient, name: str, role: str, key: pa.Schema, val: pa.Schema, t: int) -> list[dict[str, Any]]:
    r = client.open_leased_reader(shard_id_for(name, role), key, val)
    try:
        return r.snapshot(t).to_pylist()  # (to_pylist: every string decoded as Python text)
    finally:
        r.expire()


# ----- writers ---------------------------------------------------------------------------


def test_compare_and_append_rejects_invalid_utf8_naming_column_and_row() -> None:
    client = _client()
    w = client.open_writer(sid(1), KEY, VAL)
    t = pa.table({
        "id": pa.array([1, 2, 3], pa.int64()),
        "name": bad_strings([b"ok", b"fine", b"caf\xe9"]),
        "qty": pa.array([1.0, 2.0, 3.0]),
        "ts": pa.array([0, 0, 0], pa.int64()),
        "diff": pa.array([1, 1, 1], pa.int64()),
    })
    with pytest.raises(InvalidUtf8, match=r"column 'name' row 2 is not valid UTF-8 \(bytes b'caf\\xe9'\); nothing was written") as ei:
        w.compare_and_append(t, [0], [1])
    assert (ei.value.column, ei.value.row, ei.value.shard) == ("name", 2, sid(1))
    assert client.inspect(sid(1))["upper"] == [0]
    # a key column, in a struct, and in a list: the error names the top-level field
    key = pa.schema([("k", pa.string())])
    val = pa.schema([("s", pa.struct([("a", pa.string())])), ("l", pa.list_(pa.string()))])
    w2 = client.open_writer(sid(2), key, val)
    good = pa.array(["a", "b"])
    for col, arr in (
        ("k", bad_strings([b"a", b"\xed\xa0\x80"])),
        ("s", pa.StructArray.from_arrays([bad_strings([b"x", b"\xc0\x80"])], names=["a"])),
        ("l", pa.ListArray.from_arrays(pa.array([0, 1, 3]), bad_strings([b"x", b"y", b"\xff"]))),
    ):
        cols = {
            "k": good, "s": pa.StructArray.from_arrays([good], names=["a"]),
            "l": pa.ListArray.from_arrays(pa.array([0, 1, 2]), good), "ts": [0, 0], "diff": [1, 1],
        }
        cols[col] = arr
        with pytest.raises(InvalidUtf8, match=rf"column '{col}' row 1 "):
            w2.compare_and_append(pa.table(cols), [0], [1])
    assert client.inspect(sid(2))["upper"] == [0]
    client.close()


def test_batch_builder_rejects_invalid_utf8_and_writes_nothing() -> None:
    client = _client()
    w = client.open_writer(sid(3), KEY, VAL)
    b = w.builder([0])
    internal = pa.table({  # the internal layout: check_update_table's fast path
        "k.id": pa.array([5, 6], pa.int64()),
        "v.name": bad_strings([b"\xe2\x82", b"ok"]),  # truncated UTF-8
        "v.qty": pa.array([1.0, 2.0]),
        "t": pa.array([0, 0], pa.int64()),
        "d": pa.array([1, 1], pa.int64()),
    })
    with pytest.raises(InvalidUtf8, match=r"column 'name' row 0 "):
        b.add(internal)
    assert b.num_updates_added == 0
    b.add(internal.slice(1))  # the builder stays usable
    w.compare_and_append_batch(b.finish([1]), [0], [1])
    r = client.open_leased_reader(sid(3), KEY, VAL)
    assert r.snapshot(0).to_pylist() == [{"id": 6, "name": "ok", "qty": 2.0, "ts": 0, "diff": 1}]
    client.close()


def test_the_ascii_fast_path_finds_one_invalid_byte_wherever_it_is() -> None:
    """The check's fast path (all bytes ASCII: every string valid) reads the data buffer
    eight bytes at a time plus a tail: one bad byte in any position, in a string of any
    length, of a sliced or large_string array, is still found and named by its row."""
    from persist_lib import utf8

    words = [b"val_" + str(i).encode() for i in range(40)]  # 5-6 bytes each: words straddle strings
    total = sum(map(len, words))
    for at in range(total):  # every byte of the data buffer, the last (tail) bytes included
        raw = bytearray(b"".join(words))
        raw[at] = 0xFF
        row, pos = 0, at
        while pos >= len(words[row]):
            pos -= len(words[row])
            row += 1
        buf = bytes(raw)
        offsets = [0]
        for w_ in words:
            offsets.append(offsets[-1] + len(w_))
        for typ, width in ((pa.string(), "i"), (pa.large_string(), "q")):
            off = pa.py_buffer(pa.array(offsets, pa.int32() if width == "i" else pa.int64()).buffers()[1])
            arr = pa.Array.from_buffers(typ, len(words), [None, off, pa.py_buffer(buf)])
            assert not utf8._ascii_ok(arr)
            assert utf8.invalid_rows(arr) == [row]
            assert utf8.first_invalid(arr.slice(row)) == 0
            # a slice that leaves the bad row out is valid, and the fast path says so
            others = arr.slice(row + 1) if row + 1 < len(words) else arr.slice(0, row)
            assert utf8._ascii_ok(others) and utf8.invalid_rows(others) == []
    good = pa.array(["a", None, "", "ascii only"] * 5)
    assert utf8._ascii_ok(good) and utf8.invalid_rows(good) == []
    accented = pa.array(["caf\u00e9", "na\u00efve", None])  # valid UTF-8, not ASCII: the full check
    assert not utf8._ascii_ok(accented) and utf8.invalid_rows(accented) == []
    chunked = pa.chunked_array([good, bad_strings([b"x", b"\xc3"])])
    assert utf8.invalid_rows(chunked) == [len(good) + 1]
    # offsets that go backwards are left to Arrow's full validation (which refuses them)
    back = pa.Array.from_buffers(pa.string(), 2, [None, pa.py_buffer(pa.array([0, 3, 1], pa.int32()).buffers()[1]), pa.py_buffer(b"abc")])
    assert not utf8._ascii_ok(back)


# ----- a part written by older code ------------------------------------------------------


def test_a_part_holding_invalid_bytes_is_a_typed_error_naming_shard_and_part(monkeypatch: pytest.MonkeyPatch) -> None:
    client = _client()
    w = client.open_writer(sid(4), KEY, VAL)
    w.compare_and_append([(((1,), ("tea", 1.0)), 0, 1)], [0], [1])
    # "old code": the write path without the UTF-8 check
    monkeypatch.setattr(codec_mod.utf8, "check_table", lambda *a, **k: None)
    poisoned = pa.table({
        "id": pa.array([2], pa.int64()), "name": bad_strings([b"caf\xe9"]), "qty": [2.0], "ts": [1], "diff": [1],
    })
    w.compare_and_append(poisoned, [1], [2])
    monkeypatch.undo()
    r = client.open_leased_reader(sid(4), KEY, VAL)
    with pytest.raises(InvalidUtf8InPart, match=rf"shard {sid(4)}: part .+: column 'name' row 0 is not valid UTF-8") as ei:
        r.snapshot(1)
    assert ei.value.shard == sid(4) and ei.value.column == "name" and ei.value.part
    assert "rebuild" in str(ei.value) and "new rendition" in str(ei.value)
    # the part before it still reads
    assert r.snapshot(0).to_pylist() == [{"id": 1, "name": "tea", "qty": 1.0, "ts": 0, "diff": 1}]
    with pytest.raises(InvalidUtf8InPart, match=r"column 'name'"):
        r.listen(0).read_until(2)
    # compaction never merges the bad bytes into a new part: the merge fails, typed
    r.downgrade_since([2])
    w.compare_and_append([(((3,), ("cake", 3.0)), 2, 1)], [2], [3])
    with pytest.raises(InvalidUtf8InPart):
        client.compact(sid(4))
    client.close()


def test_rebuilding_from_raw_is_the_way_out_of_a_poisoned_collection(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An ingestion by "old code" (no check in decoding nor on write) poisoned its data
    shard; ``rebuild_from_raw`` with today's code puts the record in errors instead."""
    from persist_lib.ingest import decode as decode_mod
    from persist_lib.ingest.outputs import ShardOutputs
    from persist_lib.ingest.rebuild import rebuild_from_raw

    zone = tmp_path / "z"
    zone.mkdir()
    (zone / "a.jsonl").write_bytes(ISSUE_JSONL)
    client = _client()
    monkeypatch.setattr(codec_mod.utf8, "check_table", lambda *a, **k: None)
    monkeypatch.setattr(decode_mod, "invalid_rows", lambda col: [])
    with Ingestion(client, "old", LandingZoneSource(str(zone)), KEY, VAL, envelope="append_only",
                   config=IngestConfig(keep_raw=True)) as ing:
        s = ing.run_once()
    monkeypatch.undo()
    assert s["records"] == 3 and s["errors"] == 0  # what the old code did
    with pytest.raises(InvalidUtf8InPart, match=rf"shard {shard_id_for('old', 'data')}: part .+: column 'name'"):
        snap(client, "old", "data", KEY, VAL, s["upper"] - 1)
    outs = ShardOutputs(client, "new")
    rebuild_from_raw(client, "old", KEY, VAL, outputs=outs)
    rows = snap(client, "new", "data", KEY, VAL, s["upper"] - 1)
    assert sorted((r["id"], r["name"]) for r in rows) == [(1, "tea"), (3, "cake")]
    errs = snap(client, "new", "errors", ERRORS_KEY, ERRORS_VAL, s["upper"] - 1)
    assert [(json.loads(e["address"]), e["kind"]) for e in errs] == [(["a.jsonl", 1], "invalid_utf8")]
    client.close()


# ----- landing zones ---------------------------------------------------------------------


def _zone_ingest(zone: Path, envelope: str, **kw: Any) -> tuple[PersistClient, dict[str, Any]]:
    client = _client()
    with Ingestion(client, "lz", LandingZoneSource(str(zone)), KEY, VAL, envelope=envelope, **kw) as ing:
        s = ing.run_once()
        again = ing.run_once()  # and it goes on
        assert again["records"] == 0
    return client, s


def _errors(client: PersistClient, s: dict[str, Any]) -> dict[tuple[str, int], dict[str, Any]]:
    return {tuple(json.loads(e["address"])): e for e in snap(client, "lz", "errors", ERRORS_KEY, ERRORS_VAL, s["upper"] - 1)}  # type: ignore[misc]


@pytest.mark.parametrize("envelope", ["append_only", "upsert"])
def test_landing_zone_jsonl_record_with_invalid_utf8_goes_to_errors(tmp_path: Path, envelope: str) -> None:
    zone = tmp_path / "z"
    zone.mkdir()
    (zone / "a.jsonl").write_bytes(ISSUE_JSONL)
    client, s = _zone_ingest(zone, envelope)
    assert s["records"] == 3 and s["errors"] == 1
    rows = snap(client, "lz", "data", KEY, VAL, s["upper"] - 1)
    assert sorted((r["id"], r["name"], r["qty"]) for r in rows) == [(1, "tea", 1.0), (3, "cake", 3.0)]
    e = _errors(client, s)[("a.jsonl", 1)]
    assert e["kind"] == "invalid_utf8" and "'name'" in e["reason"] and e["raw"] == ISSUE_JSONL.split(b"\n")[1]
    if envelope == "upsert":
        assert len(snap(client, "lz", "state", KEY, VAL, s["upper"] - 1)) == 2
    client.close()


def test_landing_zone_csv_record_with_invalid_utf8_goes_to_errors(tmp_path: Path) -> None:
    zone = tmp_path / "z"
    zone.mkdir()
    lines = [b"id,name,qty", b"1,tea,1.0", b'2,"caf\xe9",2.0', b"3,\xed\xa0\x80,3", b"4,cake,4.0"]
    (zone / "a.csv").write_bytes(b"\n".join(lines) + b"\n")
    client, s = _zone_ingest(zone, "append_only", config=IngestConfig(keep_raw=True))
    assert s["records"] == 4 and s["errors"] == 2
    rows = snap(client, "lz", "data", KEY, VAL, s["upper"] - 1)
    assert sorted((r["id"], r["name"]) for r in rows) == [(1, "tea"), (4, "cake")]
    errs = _errors(client, s)
    assert {a: e["kind"] for a, e in errs.items()} == {("a.csv", 1): "invalid_utf8", ("a.csv", 2): "invalid_utf8"}
    assert "'name'" in errs[("a.csv", 1)]["reason"] and errs[("a.csv", 1)]["raw"] == b"2,caf\xe9,2.0"
    assert errs[("a.csv", 2)]["raw"] == b"3,\xed\xa0\x80,3"
    client.close()


def test_landing_zone_parquet_string_column_with_invalid_bytes(tmp_path: Path) -> None:
    zone = tmp_path / "z"
    zone.mkdir()
    t = pa.table({
        "id": pa.array([1, 2, 3], pa.int64()),
        "name": bad_strings([b"tea", b"caf\xe9", b"cake"]),
        "qty": pa.array([1.0, 2.0, 3.0]),
    })
    pq.write_table(t, zone / "a.parquet")
    with pytest.raises(pa.ArrowInvalid):
        pq.read_table(zone / "a.parquet").validate(full=True)  # the file really holds them
    client, s = _zone_ingest(zone, "upsert", config=IngestConfig(keep_raw=True))
    assert s["records"] == 3 and s["errors"] == 1
    rows = snap(client, "lz", "data", KEY, VAL, s["upper"] - 1)
    assert sorted((r["id"], r["name"]) for r in rows) == [(1, "tea"), (3, "cake")]
    assert _errors(client, s)[("a.parquet", 1)]["kind"] == "invalid_utf8"
    client.close()


# ----- Kafka -----------------------------------------------------------------------------


@pytest.mark.kafka
def test_kafka_keys_and_values_with_invalid_utf8_go_to_errors(kafka_broker: Any) -> None:
    """The issue's topic: upsert with JSON keys and values, a few values (and keys)
    holding invalid bytes inside strings; every other message is ingested."""
    topic = f"t{uuid.uuid4().hex[:10]}"
    kafka_broker.create_topic(topic, 1)
    skey = pa.schema([("k", pa.string())])
    msgs: list[Any] = []
    bad = set()
    for i in range(60):
        k = json.dumps(f"k{i}").encode()
        v = json.dumps({"name": f"n{i}", "qty": float(i)}).encode()
        if i % 10 == 3:
            v = b'{"name":"caf\xe9","qty":1.0}'
            bad.add(i)
        elif i % 10 == 7:
            k = b'"k\xc3\x28"'
            bad.add(i)
        msgs.append((0, k, v, 1_700_000_000_000 + i, None))
    kafka_broker.produce(topic, msgs)
    from persist_lib.ingest.kafka import KafkaSource

    client = _client()
    src = KafkaSource(kafka_broker.bootstrap, topic, key_format="json", key_field="k", poll_s=0.1)
    with Ingestion(client, "kf", src, skey, VAL, envelope="upsert", config=IngestConfig(max_records_per_binding=25)) as ing:
        s = ing.run_once()
        while s["records"] and s["frontier"].get("0") != [60]:
            s = ing.run_once()
        assert s["frontier"] == {"0": [60]}
    rows = snap(client, "kf", "data", skey, VAL, s["upper"] - 1)
    assert sorted(r["k"] for r in rows) == sorted(f"k{i}" for i in range(60) if i not in bad)
    errs = snap(client, "kf", "errors", ERRORS_KEY, ERRORS_VAL, s["upper"] - 1)
    assert sorted(json.loads(e["address"])[0] for e in errs) == sorted(bad)
    assert {e["kind"] for e in errs} == {"invalid_utf8"}
    client.close()
