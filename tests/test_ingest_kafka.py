"""Kafka source against a real Kafka-protocol broker (Tansu, see tests/support/kafka_server.py):
at every bound time the collection equals what the produced messages below the bound
offsets must give (exactly once), two racing instances and a ``kill -9``'d one write
identical, complete outputs, the consumer group's offsets are never ahead of what is
durable, and each fault gets its typed error naming topic, partition and offset."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from persist_lib import PersistClient, PersistConfig
from persist_lib.ingest import IngestConfig, Ingestion
from persist_lib.ingest.decode import ERRORS_KEY, ERRORS_VAL
from persist_lib.ingest.errors import (
    IngestConfigError,
    KafkaOffsetOutOfRange,
    KafkaTopicGone,
    SourceTimeout,
    SourceUnavailable,
)
from persist_lib.ingest.kafka import KafkaSource
from persist_lib.ingest.outputs import shard_id_for
from persist_lib.ingest.remap import RemapShard
from tests.support.kafka_server import KafkaBroker, Record, free_port
from tests.test_ingest_support import file_location, worker_env

pytestmark = pytest.mark.kafka

# append-only: one row per message, keyed by where it came from
AKEY = pa.schema([("kafka_partition", pa.int64()), ("kafka_offset", pa.int64())])
AVAL = pa.schema([("id", pa.int64()), ("name", pa.string()), ("qty", pa.float64())])
# upsert: keyed by the message key (a JSON number)
UKEY = pa.schema([("id", pa.int64())])
UVAL = pa.schema([("name", pa.string()), ("qty", pa.float64())])


def _client() -> PersistClient:
    tag = uuid.uuid4().hex
    return PersistClient.open(f"mem://b-{tag}", f"mem://c-{tag}", PersistConfig.for_tests())


def _topic(broker: KafkaBroker, partitions: int) -> str:
    name = f"t{uuid.uuid4().hex[:10]}"
    broker.create_topic(name, partitions)
    return name


def _good(rng: random.Random, i: int) -> bytes:
    return json.dumps({"id": i, "name": f"n{i}", "qty": rng.randrange(1000) / 4}).encode()


BAD = [b'{"id": 1, "name": ', b'{"id": "seven", "name": "x"}', b"[1, 2, 3]", b'{"name": "no id"}', b"\xff\xfe"]


def _append_batch(rng: random.Random, partitions: int, n: int, start: int, bad_rate: float = 0.05) -> list[Record]:
    out: list[Record] = []
    for i in range(start, start + n):
        v = rng.choice(BAD) if rng.random() < bad_rate else _good(rng, i)
        out.append((rng.randrange(partitions), None, v, None, None))
    return out


def _upsert_batch(rng: random.Random, partitions: int, n: int, keys: int = 40) -> list[Record]:
    """Keys live in one partition each (id % partitions); ~15% tombstones, some bad values."""
    out: list[Record] = []
    for _ in range(n):
        k = rng.randrange(keys)
        r = rng.random()
        if r < 0.15:
            v: bytes | None = None
        elif r < 0.18:
            v = b"{oops"
        else:
            v = json.dumps({"name": f"v{rng.randrange(10**6)}", "qty": rng.randrange(100) / 2}).encode()
        out.append((k % partitions, json.dumps(k).encode(), v, None, None))
    return out


def _decode_append(v: bytes | None) -> tuple[Any, ...] | None:
    try:
        o = json.loads(v) if v is not None else None
    except ValueError:
        return None
    if not isinstance(o, dict) or not isinstance(o.get("id", 0), int) or not isinstance(o.get("name", ""), str):
        return None  # (the key is where the message came from: every field may be absent)
    return (o.get("id"), o.get("name"), float(o["qty"]) if o.get("qty") is not None else None)


def _expected_append(truth: dict[int, list[Record]], f: dict[int, int]) -> tuple[Counter[Any], set[tuple[int, int]]]:
    rows: Counter[Any] = Counter()
    bad: set[tuple[int, int]] = set()
    for p, recs in truth.items():
        for off, _k, v, _ts, _h in recs:
            if off >= f.get(p, 0):
                break
            d = _decode_append(v)
            if d is None:
                bad.add((p, off))
            else:
                rows[(p, off, *d)] += 1
    return rows, bad


def _expected_upsert(truth: dict[int, list[Record]], f: dict[int, int]) -> tuple[dict[int, Any], set[tuple[int, int]]]:
    state: dict[int, Any] = {}
    bad: set[tuple[int, int]] = set()
    for p, recs in sorted(truth.items()):
        for off, k, v, _ts, _h in recs:
            if off >= f.get(p, 0):
                break
            key = json.loads(k) if k is not None else None
            if v is None:
                state.pop(key, None)
                continue
            try:
                o = json.loads(v)
            except ValueError:
                bad.add((p, off))
                continue
            state[key] = (o["name"], float(o["qty"]))
    return state, bad


def _bindings(client: PersistClient, name: str) -> tuple[int, list[tuple[int, dict[int, int]]]]:
    """(remap upper, [(time, {partition: offset})]) of every readable binding."""
    shard = shard_id_for(name, "remap")
    since = client.inspect(shard)["since"][0]
    remap = RemapShard(client, shard, {}, label="check")
    try:
        remap.load(since)
        out = [(since, {int(p): int(a[0]) for p, a in remap.frontier_at(since).items()})]
        out += [(b.time, {int(p): int(a[0]) for p, a in b.frontier.items()}) for b in remap.bindings_between(since + 1, remap.upper)]
        return remap.upper, out
    finally:
        remap.close()


def _snap(client: PersistClient, name: str, role: str, key: pa.Schema, val: pa.Schema, t: int) -> list[dict[str, Any]]:
    r = client.open_leased_reader(shard_id_for(name, role), key, val)
    try:
        rows = r.snapshot(t).to_pylist()
    finally:
        r.expire()
    assert all(x["diff"] == 1 for x in rows), f"{role} at {t}: a row with multiplicity != 1 (duplicated or retracted twice)"
    return rows


def _check_exactly_once(client: PersistClient, name: str, truth: dict[int, list[Record]], envelope: str) -> int:
    """At every bound time the data (and state) equal the ground truth below the bound
    offsets, and the errors collection holds exactly the bad messages; returns how many
    times were checked."""
    _, bindings = _bindings(client, name)
    checked = 0
    for t, f in bindings:
        if t == 0 and not f:
            continue
        errs = {(int(e["partition"]), json.loads(e["address"])[0]) for e in _snap(client, name, "errors", ERRORS_KEY, ERRORS_VAL, t)}
        if envelope == "upsert":
            want, bad = _expected_upsert(truth, f)
            for role in ("data", "state"):
                got = {x["id"]: (x["name"], x["qty"]) for x in _snap(client, name, role, UKEY, UVAL, t)}
                assert got == want, f"{role} at {t} (frontier {f})"
        else:
            want_rows, bad = _expected_append(truth, f)
            got_rows = Counter(
                (x["kafka_partition"], x["kafka_offset"], x["id"], x["name"], x["qty"])
                for x in _snap(client, name, "data", AKEY, AVAL, t)
            )
            assert got_rows == want_rows, f"data at {t} (frontier {f}): missing {list(want_rows - got_rows)[:3]}, extra {list(got_rows - want_rows)[:3]}"
        assert errs == bad, f"errors at {t} (frontier {f})"
        checked += 1
    return checked


def _source(broker: KafkaBroker, topic: str, envelope: str, **kw: Any) -> KafkaSource:
    if envelope == "upsert":
        return KafkaSource(broker.bootstrap, topic, key_format="json", poll_s=0.1, **kw)
    return KafkaSource(broker.bootstrap, topic, include="partition,offset", poll_s=0.1, **kw)


def _ingestion(client: PersistClient, name: str, src: KafkaSource, envelope: str, n: int, **kw: Any) -> Ingestion:
    k, v = (UKEY, UVAL) if envelope == "upsert" else (AKEY, AVAL)
    return Ingestion(client, name, src, k, v, envelope=envelope, config=IngestConfig(max_records_per_binding=n), **kw)


# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "prefetch,reader",
    [
        (200_000, "thread"),
        # (the default suite's time: the other readers' variants run in the slow tier)
        pytest.param(0, "thread", marks=pytest.mark.slow),
        pytest.param(200_000, "process", marks=pytest.mark.slow),
    ],
    ids=["prefetch", "no_prefetch", "process"],
)
@pytest.mark.parametrize("envelope", ["append_only", "upsert"])
def test_exactly_once_at_every_bound_time(kafka_broker: KafkaBroker, envelope: str, prefetch: int, reader: str) -> None:
    """Rounds of produce + run_once (several bindings each, over 3 partitions); upsert
    carries tombstones (null values) that delete their key. Messages are decoded as they
    are fetched: on the prefetch thread, (``prefetch=0``) on the reader's, or in the
    reader process (``reader="process"``), which ships them decoded."""
    rng = random.Random(3 if envelope == "upsert" else 4)
    topic = _topic(kafka_broker, 3)
    client = _client()
    ing = _ingestion(client, "ex1", _source(kafka_broker, topic, envelope, prefetch=prefetch, reader=reader), envelope, 37)
    total = 0
    try:
        for rnd in range(5):
            batch = _upsert_batch(rng, 3, 150) if envelope == "upsert" else _append_batch(rng, 3, 150, rnd * 1000)
            kafka_broker.produce(topic, batch)
            total += len(batch)
            s = ing.run_once()
            assert s["records"] == len(batch), s
        truth = kafka_broker.consume_all(topic, 3)
        assert sum(len(v) for v in truth.values()) == total
        assert s["frontier"] == {str(p): [len(v)] for p, v in truth.items() if v}
        checked = _check_exactly_once(client, "ex1", truth, envelope)
        assert checked >= 5 * 4
        if envelope == "upsert":
            assert any(v is None for recs in truth.values() for _o, _k, v, _t, _h in recs)  # tombstones were there
        # the group offsets are the durable frontier
        assert kafka_broker.group_offsets("persist_ex1", topic, 3) == {p: len(v) for p, v in truth.items() if v}
        again = ing.run_once()
        assert again["records"] == 0
    finally:
        ing.close()
        client.close()


def test_decoding_formats_metadata_and_bad_messages(kafka_broker: KafkaBroker) -> None:
    topic = _topic(kafka_broker, 1)
    kafka_broker.produce(topic, [
        (0, b"k1", b"hello", 1_700_000_000_123, [("trace", b"abc"), ("bin", b"\xff")]),
        (0, b"k2", "héllo wörld".encode(), 1_700_000_000_124, None),
        (0, b"k3", b"\xff\xfe not utf-8", 1_700_000_000_125, None),
        (0, b"\xc3\x28", b"bad key", 1_700_000_000_126, None),
    ])
    client = _client()
    key = pa.schema([("k", pa.string())])
    val = pa.schema([
        ("v", pa.string()), ("kafka_offset", pa.int64()), ("kafka_partition", pa.int32()),
        ("at", pa.timestamp("ms", tz="UTC")), ("kafka_headers", pa.string()), ("kafka_topic", pa.string()),
    ])
    src = KafkaSource(kafka_broker.bootstrap, topic, key_format="text", value_format="text",
                      include="offset,partition,timestamp=at,headers,topic", poll_s=0.1)
    with Ingestion(client, "fmt", src, key, val, config=IngestConfig(keep_raw=True)) as ing:
        s = ing.run_once()
    assert s["records"] == 4 and s["errors"] == 2
    rows = sorted(_snap(client, "fmt", "data", key, val, s["upper"] - 1), key=lambda r: r["kafka_offset"])
    assert [(r["k"], r["v"], r["kafka_offset"], r["kafka_partition"], r["kafka_topic"]) for r in rows] == [
        ("k1", "hello", 0, 0, topic), ("k2", "héllo wörld", 1, 0, topic)
    ]
    assert int(rows[0]["at"].timestamp() * 1000) == 1_700_000_000_123
    assert json.loads(rows[0]["kafka_headers"]) == [["trace", "abc"], ["bin", "b64:/w=="]]
    errs = sorted(_snap(client, "fmt", "errors", ERRORS_KEY, ERRORS_VAL, s["upper"] - 1), key=lambda r: r["address"])
    assert [(e["partition"], e["address"], e["kind"]) for e in errs] == [("0", "[2]", "invalid_utf8"), ("0", "[3]", "invalid_utf8")]
    assert "message value" in errs[0]["reason"] and "message key" in errs[1]["reason"]
    raw = json.loads(errs[0]["raw"])
    assert raw["key"] == "azM=" and raw["timestamp"] == 1_700_000_000_125  # base64 of b"k3"
    from persist_lib.ingest.decode import RAW_KEY, RAW_VAL

    raws = _snap(client, "fmt", "raw", RAW_KEY, RAW_VAL, s["upper"] - 1)
    assert sorted(r["address"] for r in raws) == ["[0]", "[1]", "[2]", "[3]"] and {r["format"] for r in raws} == {"kafka"}
    # bytes: the value as is
    client2 = _client()
    bsrc = KafkaSource(kafka_broker.bootstrap, topic, value_format="bytes", include="offset", poll_s=0.1)
    with Ingestion(client2, "raw", bsrc, pa.schema([("kafka_offset", pa.int64())]), pa.schema([("payload", pa.binary())])) as ing2:
        s2 = ing2.run_once()
    got = {r["kafka_offset"]: r["payload"] for r in _snap(client2, "raw", "data", pa.schema([("kafka_offset", pa.int64())]), pa.schema([("payload", pa.binary())]), s2["upper"] - 1)}
    assert got[2] == b"\xff\xfe not utf-8" and len(got) == 4
    client.close()
    client2.close()


def test_rebuild_from_the_raw_collection_matches_the_ingested_outputs(kafka_broker: KafkaBroker) -> None:
    """With ``keep_raw`` the raw collection is a reclocked copy of the topic: a rebuild
    (``rebuild_from_raw``) decodes each time again, tombstones included, and writes the
    same data, state and errors at every time."""
    from persist_lib.ingest.outputs import ShardOutputs
    from persist_lib.ingest.rebuild import rebuild_from_raw
    from tests.test_ingest_support import shard_history

    topic = _topic(kafka_broker, 2)
    rng = random.Random(12)
    client = _client()
    src = KafkaSource(kafka_broker.bootstrap, topic, key_format="json", poll_s=0.1)
    with Ingestion(client, "live", src, UKEY, UVAL, envelope="upsert", clock=lambda: 1,  # times 1, 2, ...
                   config=IngestConfig(max_records_per_binding=25, keep_raw=True)) as ing:
        for _ in range(3):
            kafka_broker.produce(topic, _upsert_batch(rng, 2, 60, keys=15))
            s = ing.run_once()
    out = rebuild_from_raw(client, "live", UKEY, UVAL, outputs=ShardOutputs(client, "again"), envelope="upsert")
    assert out["upper"] == s["upper"]
    import tests.test_ingest_support as sup

    saved = dict(sup.ROLE_SCHEMAS)
    sup.ROLE_SCHEMAS.update({"data": (UKEY, UVAL), "state": (UKEY, UVAL)})
    try:
        for role in ("data", "state", "errors"):
            a, b = shard_history(client, "live", role), shard_history(client, "again", role)
            assert a.at == b.at and len(a.at) >= 9, role
    finally:
        sup.ROLE_SCHEMAS.clear()
        sup.ROLE_SCHEMAS.update(saved)
    client.close()


def test_configuration_errors_name_the_fix(kafka_broker: KafkaBroker) -> None:
    client = _client()
    with pytest.raises(IngestConfigError, match="upsert envelope needs the message key"):
        Ingestion(client, "c1", KafkaSource(kafka_broker.bootstrap, "x"), UKEY, UVAL, envelope="upsert").run_once()
    with pytest.raises(IngestConfigError, match="does not exist: create it"):
        Ingestion(client, "c2", KafkaSource(kafka_broker.bootstrap, "no-such-topic", include="partition,offset"), AKEY, AVAL).run_once()
    with pytest.raises(IngestConfigError, match="include names column 'kafka_timestamp'"):
        Ingestion(client, "c3", KafkaSource(kafka_broker.bootstrap, "x", include="timestamp"), UKEY, UVAL).run_once()
    with pytest.raises(IngestConfigError, match="key_format 'avro' is not supported"):
        KafkaSource(kafka_broker.bootstrap, "x", key_format="avro")
    client.close()


def test_repr_and_describe_redact_the_sasl_password() -> None:
    src = KafkaSource("kafka://alice:s3cr3t%21pw@broker1:9093?security_protocol=SASL_SSL&sasl_mechanism=SCRAM-SHA-512", "orders")
    for text in (repr(src), str(src), json.dumps(src.describe())):
        assert "s3cr3t" not in text and "alice" in text
    assert src._conf["sasl.password"] == "s3cr3t!pw" and src._conf["sasl.mechanism"] == "SCRAM-SHA-512"
    assert src._servers == "broker1:9093"


@pytest.mark.parametrize("reader", ["thread", pytest.param("process", marks=pytest.mark.slow)])
def test_out_of_range_offsets_are_a_typed_error(kafka_broker: KafkaBroker, reader: str) -> None:
    """Tansu can't delete records (DeleteRecords panics in its memory engine) or enforce
    retention, so the bound offsets are made unavailable by recreating the topic with
    fewer messages: the log now ends before the frontier."""
    topic = _topic(kafka_broker, 1)
    kafka_broker.produce(topic, _append_batch(random.Random(1), 1, 20, 0, bad_rate=0))
    client = _client()
    with _ingestion(client, "oor", _source(kafka_broker, topic, "append_only", reader=reader), "append_only", 7) as ing:
        assert ing.run_once()["frontier"] == {"0": [20]}
    kafka_broker.delete_topic(topic)
    kafka_broker.create_topic(topic, 1)
    kafka_broker.produce(topic, _append_batch(random.Random(2), 1, 5, 0, bad_rate=0))
    with pytest.raises(KafkaOffsetOutOfRange) as ei:
        src = _source(kafka_broker, topic, "append_only", timeout_s=5, reader=reader)
        with _ingestion(client, "oor", src, "append_only", 7) as ing:
            ing.run_once()
    e = ei.value
    assert (e.topic, e.partition, e.offset) == (topic, 0, 20)
    msg = str(e)
    assert f"kafka topic {topic!r} partition 0: offset 20 is out of range" in msg
    assert "retention" in msg and "new rendition" in msg
    client.close()


def test_topic_deleted_or_partitions_reduced(kafka_broker: KafkaBroker) -> None:
    topic = _topic(kafka_broker, 3)
    kafka_broker.produce(topic, _append_batch(random.Random(5), 3, 60, 0, bad_rate=0))
    client = _client()
    with _ingestion(client, "gone", _source(kafka_broker, topic, "append_only"), "append_only", 50) as ing:
        ing.run_once()
    truth = kafka_broker.consume_all(topic, 3)
    # partitions reduced: recreated with 1 partition holding the same partition 0
    kafka_broker.delete_topic(topic)
    kafka_broker.create_topic(topic, 1)
    kafka_broker.produce(topic, [(0, k, v, ts, h) for _, k, v, ts, h in truth[0]])
    with pytest.raises(KafkaTopicGone, match=r"has 1 partitions now.*partition\(s\) \[1, 2\]") as ei:
        with _ingestion(client, "gone", _source(kafka_broker, topic, "append_only"), "append_only", 50) as ing:
            ing.run_once()
    assert ei.value.partition == 1 and ei.value.topic == topic
    kafka_broker.delete_topic(topic)
    with pytest.raises(KafkaTopicGone, match="no longer exists"):
        with _ingestion(client, "gone", _source(kafka_broker, topic, "append_only"), "append_only", 50) as ing:
            ing.run_once()
    client.close()


def test_unreachable_broker_times_out_after_retries() -> None:
    client = _client()
    src = KafkaSource(f"127.0.0.1:{free_port()}", "t", include="partition,offset", timeout_s=2.0)
    t0 = time.monotonic()
    with pytest.raises(SourceTimeout, match=r"no answer from the broker\(s\) within 2s .*retrying later is safe"):
        with Ingestion(client, "down", src, AKEY, AVAL) as ing:
            ing.run_once()
    assert 1.5 < time.monotonic() - t0 < 30
    client.close()


def test_sasl_password_never_shows_in_failures(caplog: pytest.LogCaptureFixture) -> None:
    import logging
    import traceback

    caplog.set_level(logging.DEBUG)
    pw = "S3cr3t-canary-pw"
    client = _client()
    src = KafkaSource(f"kafka://alice:{pw}@127.0.0.1:{free_port()}?security_protocol=SASL_PLAINTEXT",
                      "t", include="partition,offset", timeout_s=1.5)
    with pytest.raises(SourceTimeout) as ei:
        with Ingestion(client, "sasl", src, AKEY, AVAL) as ing:
            ing.run_once()
    texts = [str(ei.value), repr(ei.value), "".join(traceback.format_exception(ei.value)), caplog.text, repr(src)]
    assert not [t for t in texts if pw in t]
    assert "alice:****@" in str(ei.value)
    client.close()


def test_broker_going_away_mid_run_times_out() -> None:
    """A private broker is stopped under a running instance: the next run retries with
    backoff for ``timeout_s`` and raises ``SourceTimeout``; nothing was bound from it.
    Which request notices first (metadata or watermarks) depends on timing; both say a
    retry is safe."""
    broker = KafkaBroker().start()
    client = _client()
    try:
        broker.create_topic("t", 1)
        broker.produce("t", _append_batch(random.Random(3), 1, 30, 0, bad_rate=0))
        src = _source(broker, "t", "append_only", timeout_s=2.0, metadata_interval_s=0.1)
        with _ingestion(client, "away", src, "append_only", 10) as ing:
            assert ing.run_once()["records"] == 30
            broker.stop()
            with pytest.raises(SourceTimeout, match=r"retrying (later )?is safe"):
                ing.run_once()
            assert ing.remap.frontier == {"0": (30,)}
    finally:
        broker.stop()
        client.close()


def test_partition_added_while_running_is_picked_up(kafka_broker: KafkaBroker) -> None:
    """One Ingestion instance keeps ingesting while the topic grows from 2 to 4
    partitions. Tansu has no CreatePartitions: the topic is recreated with 4 partitions
    and the same messages at the same offsets in partitions 0-1, between two
    ``run_once`` calls of the instance. A librdkafka client that lives across a topic
    delete + recreate on Tansu segfaults (librdkafka's metadata cache, strcmp in
    rd_kafka_metadata_cache_find), so the instance's consumer is closed for the swap and
    its reader reopened at the durable frontier, which discovers the new partitions."""
    rng = random.Random(8)
    topic = _topic(kafka_broker, 2)
    client = _client()
    ing = _ingestion(client, "grow", _source(kafka_broker, topic, "append_only", metadata_interval_s=0.2), "append_only", 40)
    try:
        kafka_broker.produce(topic, _append_batch(rng, 2, 100, 0))
        s1 = ing.run_once()
        assert set(s1["frontier"]) == {"0", "1"}
        ing.reader.close()  # (see the docstring: Tansu workaround)
        ing.source.close()
        kafka_broker.add_partitions(topic, 2, 4)
        ing._reopen_reader()
        kafka_broker.produce(topic, _append_batch(rng, 4, 200, 1000))
        s2 = ing.run_once()
        assert set(s2["frontier"]) == {"0", "1", "2", "3"}
        truth = kafka_broker.consume_all(topic, 4)
        assert s1["records"] + s2["records"] == 300
        assert _check_exactly_once(client, "grow", truth, "append_only") >= 8
        assert kafka_broker.group_offsets("persist_grow", topic, 4) == {p: len(v) for p, v in truth.items()}
    finally:
        ing.close()
        client.close()


def test_a_dead_reader_process_is_a_clear_error_and_a_restart_resumes(kafka_broker: KafkaBroker) -> None:
    """The reader process of a running instance is killed: the next read raises
    ``SourceUnavailable`` naming it and how it died (nothing hangs, nothing is bound from
    it), and a restarted instance resumes at the durable frontier: every bound time is
    exact and the group offsets equal the frontier."""
    rng = random.Random(12)
    topic = _topic(kafka_broker, 3)
    client = _client()
    src = _source(kafka_broker, topic, "append_only", reader="process")
    ing = _ingestion(client, "dead", src, "append_only", 40)
    try:
        kafka_broker.produce(topic, _append_batch(rng, 3, 150, 0))
        assert ing.run_once()["records"] == 150
        pid = ing.reader._prefetch.pid  # type: ignore[attr-defined]
        os.kill(pid, 9)
        kafka_broker.produce(topic, _append_batch(rng, 3, 150, 1000))
        t0 = time.monotonic()
        with pytest.raises(SourceUnavailable, match=rf"reader process \(pid {pid}\) was killed by signal SIGKILL.*restart"):
            ing.run_once()
        assert time.monotonic() - t0 < 20
    finally:
        ing.close()
    with _ingestion(client, "dead", _source(kafka_broker, topic, "append_only", reader="process"), "append_only", 40) as ing2:
        s = ing2.run_once()
    truth = kafka_broker.consume_all(topic, 3)
    assert s["frontier"] == {str(p): [len(v)] for p, v in truth.items()}
    assert _check_exactly_once(client, "dead", truth, "append_only") >= 8
    assert kafka_broker.group_offsets("persist_dead", topic, 3) == {p: len(v) for p, v in truth.items()}
    client.close()


# ----- processes: two instances racing, kill -9 ------------------------------------------

WORKER = r"""
import json, sys, logging
import pyarrow as pa
from persist_lib import PersistClient, PersistConfig
from persist_lib.ingest import IngestConfig, Ingestion
from persist_lib.ingest.kafka import KafkaSource
logging.basicConfig(level=logging.WARNING)
p = json.loads(sys.argv[1])
client = PersistClient.open(p["blob"], p["consensus"], PersistConfig.for_tests())
if p["envelope"] == "upsert":
    K = pa.schema([("id", pa.int64())]); V = pa.schema([("name", pa.string()), ("qty", pa.float64())])
    src = KafkaSource(p["bootstrap"], p["topic"], key_format="json", poll_s=0.1, reader=p.get("reader", "thread"))
else:
    K = pa.schema([("kafka_partition", pa.int64()), ("kafka_offset", pa.int64())])
    V = pa.schema([("id", pa.int64()), ("name", pa.string()), ("qty", pa.float64())])
    src = KafkaSource(p["bootstrap"], p["topic"], include="partition,offset", poll_s=0.1,
                      reader=p.get("reader", "thread"))
ing = Ingestion(client, p["name"], src, K, V, envelope=p["envelope"],
                config=IngestConfig(max_records_per_binding=p["n"], poll_interval_s=0.1))
print("started", flush=True)
if p.get("barrier"):
    import os, time
    while not os.path.exists(p["barrier"]):
        time.sleep(0.005)
s = ing.run(max_duration_s=p["seconds"]) if p.get("seconds") else ing.run_once()
s["applied"] = [[t, {k: list(v) for k, v in f.items()}] for t, f in ing.applied]
ing.close()
client.close()
print(json.dumps(s, default=str))
"""


def _worker(params: dict[str, Any]) -> list[str]:
    return [sys.executable, "-c", WORKER, json.dumps(params)]


def _run_worker(params: dict[str, Any]) -> dict[str, Any]:
    out = subprocess.run(_worker(params), capture_output=True, text=True, timeout=300, env=worker_env())
    assert out.returncode == 0, out.stderr[-4000:]
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def _durable_frontier(client: PersistClient, name: str, roles: list[str]) -> dict[int, int]:
    """The frontier bound at (min output upper) - 1: what every output has made durable."""
    uppers = [client.machine(shard_id_for(name, r)).fetch_latest().upper.time or 0 for r in roles]
    t = min(uppers)
    if t == 0:
        return {}
    remap = RemapShard(client, shard_id_for(name, "remap"), {}, label="check")
    try:
        remap.load(t - 1)
        return {int(p): int(a[0]) for p, a in remap.frontier_at(t - 1).items()}
    finally:
        remap.close()


def test_two_concurrent_instances_write_one_definite_output(kafka_broker: KafkaBroker, tmp_path: Path) -> None:
    rng = random.Random(21)
    topic = _topic(kafka_broker, 3)
    kafka_broker.produce(topic, _upsert_batch(rng, 3, 1200, keys=80))
    loc = file_location(tmp_path, "twin")
    barrier = tmp_path / "go"
    params = {"blob": loc[0], "consensus": loc[1], "bootstrap": kafka_broker.bootstrap, "topic": topic,
              "name": "twin", "n": 40, "envelope": "upsert", "barrier": str(barrier)}
    procs = [subprocess.Popen(_worker(params), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=worker_env()) for _ in range(2)]
    for p in procs:
        assert p.stdout is not None and p.stdout.readline().strip() == "started"
    barrier.write_text("go")
    summaries = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-4000:]
        summaries.append(json.loads(out.strip().splitlines()[-1]))
    client = PersistClient.open(loc[0], loc[1], PersistConfig.for_tests())
    try:
        truth = kafka_broker.consume_all(topic, 3)
        _, bindings = _bindings(client, "twin")
        committed = {t: {str(p): [o] for p, o in f.items()} for t, f in bindings}
        for s in summaries:
            for t, fr in s["applied"]:
                assert committed[t] == fr, f"an instance applied {fr} at {t}; the remap shard has {committed[t]}"
            assert s["frontier"] == {str(p): [len(v)] for p, v in truth.items()}
        assert _check_exactly_once(client, "twin", truth, "upsert") >= 25
        contention = sum(s["lost_races"] + s["appends_verified"] + s["bindings_adopted"] for s in summaries)
        assert contention > 0, summaries
        assert kafka_broker.group_offsets("persist_twin", topic, 3) == {p: len(v) for p, v in truth.items()}
    finally:
        client.close()


@pytest.mark.parametrize(
    "kills,messages,reader",
    [
        (4, 2400, "thread"),
        pytest.param(12, 9000, "thread", marks=pytest.mark.slow),
        pytest.param(6, 3600, "process", marks=pytest.mark.slow),
    ],
)
def test_kill9_mid_run_nothing_lost_or_duplicated(
    kafka_broker: KafkaBroker, tmp_path: Path, kills: int, messages: int, reader: str
) -> None:
    """An ingestion process following the topic while a producer writes is killed with
    SIGKILL at random points and restarted. After every kill the consumer group's
    committed offsets are at or below the durable frontier; at the end every bound time
    holds exactly the produced messages below its offsets. (``process``: its reader
    processes go with it, see ``test_kill9_leaves_no_reader_process_behind``.)"""
    rng = random.Random(kills)
    topic = _topic(kafka_broker, 3)
    loc = file_location(tmp_path, "kill")
    params = {"blob": loc[0], "consensus": loc[1], "bootstrap": kafka_broker.bootstrap, "topic": topic,
              "name": "killme", "n": 60, "envelope": "append_only", "seconds": 120.0, "reader": reader}
    done = threading.Event()
    errors: list[BaseException] = []

    def produce() -> None:
        try:
            prng = random.Random(99)
            sent = 0
            while sent < messages:
                kafka_broker.produce(topic, _append_batch(prng, 3, 60, sent))
                sent += 60
                time.sleep(prng.uniform(0.05, 0.25))  # spread over the kills
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
        finally:
            done.set()

    th = threading.Thread(target=produce)
    th.start()
    client = PersistClient.open(loc[0], loc[1], PersistConfig.for_tests())
    hits = 0
    checks = 0
    rounds = 0
    misses = 0  # rounds in a row that ended before the worker's first group commit
    try:
        # (on a loaded machine a worker may be killed before its first group commit: more
        # rounds, bounded, until the offsets were checked at least twice, each such round
        # letting the next worker run half a second longer before the kill; in a
        # SEEDS=30 soak beside a test run, 26 rounds of 0.3-1.5 s checked nothing)
        while (hits < kills or not done.is_set() or checks < 2) and rounds < kills + 20:
            rounds += 1
            proc = subprocess.Popen(_worker(params), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=worker_env())
            assert proc.stdout is not None
            proc.stdout.readline()  # "started"
            time.sleep(rng.uniform(0.3, 1.5) + 0.5 * min(misses, 10))
            if proc.poll() is None:
                os.kill(proc.pid, 9)
                hits += 1
            proc.wait()
            proc.stdout.close()
            # nothing moves now: the group offsets must not be ahead of the durable frontier
            group = kafka_broker.group_offsets("persist_killme", topic, 3)
            misses = 0 if group else misses + 1
            if group:
                durable = _durable_frontier(client, "killme", ["data", "errors"])
                for p, o in group.items():
                    assert o <= durable.get(p, 0), f"partition {p}: committed {o} ahead of durable {durable}"
                checks += 1
        th.join(60)
        assert not errors, errors
        final = _run_worker(dict(params, seconds=None))
        truth = kafka_broker.consume_all(topic, 3)
        assert sum(len(v) for v in truth.values()) == messages
        assert final["frontier"] == {str(p): [len(v)] for p, v in truth.items()}
        checked = _check_exactly_once(client, "killme", truth, "append_only")
        print(f"kill -9: {hits} kills hit a running ingestion, {checks} offset checks, {checked} bound times checked")
        assert checked >= 10
        assert _durable_frontier(client, "killme", ["data", "errors"]) == {p: len(v) for p, v in truth.items()}
        assert kafka_broker.group_offsets("persist_killme", topic, 3) == {p: len(v) for p, v in truth.items()}
    finally:
        client.close()
    assert hits >= kills and checks >= 2, (hits, checks)


def _children(pid: int) -> list[int]:
    """Live (not zombie) processes whose parent is ``pid``."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == pid and state != "Z":
            out.append(int(d))
    return out


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_kill9_leaves_no_reader_process_behind(kafka_broker: KafkaBroker, tmp_path: Path) -> None:
    """``kill -9`` of an ingestion process whose reader is a process: the reader process
    notices (its socket's end, its parent gone) and exits within moments, and a restarted
    instance ingests everything exactly once."""
    topic = _topic(kafka_broker, 2)
    kafka_broker.produce(topic, _append_batch(random.Random(13), 2, 400, 0))
    loc = file_location(tmp_path, "orphan")
    params = {"blob": loc[0], "consensus": loc[1], "bootstrap": kafka_broker.bootstrap, "topic": topic,
              "name": "orphan", "n": 50, "envelope": "append_only", "seconds": 60.0, "reader": "process"}
    proc = subprocess.Popen(_worker(params), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=worker_env())
    assert proc.stdout is not None
    try:
        assert proc.stdout.readline().strip() == b"started"
        deadline = time.monotonic() + 30
        kids: list[int] = []
        while not kids and time.monotonic() < deadline:
            kids = [c for c in _children(proc.pid) if b"kafka.reader_child" in Path(f"/proc/{c}/cmdline").read_bytes()]
            time.sleep(0.05)
        assert kids, "the ingestion process started no reader process"
        time.sleep(0.3)  # (reading and appending)
        os.kill(proc.pid, 9)
        proc.wait()
        deadline = time.monotonic() + 10
        while any(map(_alive, kids)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(map(_alive, kids)), f"reader process(es) {kids} outlived the killed ingestion"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
    final = _run_worker(dict(params, seconds=None))
    truth = kafka_broker.consume_all(topic, 2)
    assert final["frontier"] == {str(p): [len(v)] for p, v in truth.items()}
    client = PersistClient.open(loc[0], loc[1], PersistConfig.for_tests())
    try:
        assert _check_exactly_once(client, "orphan", truth, "append_only") >= 4
    finally:
        client.close()


def test_cli_ingest_kafka(kafka_broker: KafkaBroker, tmp_path: Path) -> None:
    topic = _topic(kafka_broker, 2)
    kafka_broker.produce(topic, _upsert_batch(random.Random(6), 2, 200))
    env = {**os.environ, "PERSIST_HOME": str(tmp_path / "home"), "PYTHONPATH": worker_env()["PYTHONPATH"]}
    env.pop("PERSIST_BLOB_URI", None)
    env.pop("PERSIST_CONSENSUS_URI", None)
    args = [sys.executable, "-m", "persist_lib.cli.main", "ingest", "kafka", "orders", kafka_broker.bootstrap, topic,
            "--key", "id:int64", "--value", "name:string,qty:float64", "--key-format", "json",
            "--envelope", "upsert", "--records-per-binding", "50"]
    out = subprocess.run([*args, "--json"], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    s = json.loads(out.stdout)
    truth = kafka_broker.consume_all(topic, 2)
    assert s["records"] == 200 and s["source"]["kind"] == "kafka" and s["source"]["topic"] == topic
    assert s["frontier"] == {str(p): [len(v)] for p, v in truth.items()}
    human = subprocess.run([*args, "--reader", "process"], env=env, capture_output=True, text=True, timeout=120)
    assert human.returncode == 0 and "orders" in human.stdout, human.stderr[-3000:]
    bad = subprocess.run([*args[:-6], "--envelope", "upsert"], env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "upsert envelope needs the message key" in bad.stderr
