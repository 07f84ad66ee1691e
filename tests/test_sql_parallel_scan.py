"""``persist sql`` scans a shard with key-disjoint parts in parallel (``sql.parallel_scan``,
issue 28): the same rows as the snapshot, whatever the retractions, filters, projections
and schema versions; a corrupt part fails the query."""

from __future__ import annotations

import random
import uuid
from typing import Any

import pyarrow as pa
import pytest

from persist_lib import PersistClient, PersistConfig, ShardId
from persist_lib.errors import CorruptionError
from persist_lib.shard.predicate import Predicate, Term
from persist_lib.sql.engine import SqlSession
from persist_lib.sql.parallel_scan import ScanHolds, parallel_snapshot
from persist_lib.testing.corruption import flip_bit

pytest.importorskip("duckdb")

KEY = pa.schema([("key", pa.int64())])
VAL = pa.schema([("value", pa.string())])
VAL2 = pa.schema([("value", pa.string()), ("extra", pa.int64())])
BATCHES = 6


def _client() -> PersistClient:
    name = uuid.uuid4().hex
    return PersistClient.open(f"mem://{name}", f"mem://{name}", PersistConfig.for_tests(inline_threshold=0))


def _updates(rng: random.Random, i: int, retractions: bool, extra: bool) -> pa.Table:
    """Batch ``i``: keys in [20i, 20i + 20] (its neighbours share an endpoint), times
    3i..3i+2 (the same (key, value) at several times), diffs with retractions that
    sometimes cancel exactly."""
    rows: list[tuple[int, str, int, int]] = []
    for _ in range(80):
        k = rng.choice([20 * i, 20 * i + 20]) if rng.random() < 0.2 else rng.randint(20 * i, 20 * i + 20)
        v, t = rng.choice("abc"), 3 * i + rng.randint(0, 2)
        d = rng.choice([1, 1, 2, -1]) if retractions else 1
        rows.append((k, v, t, d))
        if retractions and rng.random() < 0.3 and t < 3 * i + 2:
            rows.append((k, v, t + 1, -d))  # cancels it at later as-ofs
    cols: dict[str, Any] = {"key": [r[0] for r in rows], "value": [r[1] for r in rows]}
    if extra:
        cols["extra"] = [r[0] % 7 or None for r in rows]
    cols |= {"ts": [r[2] for r in rows], "diff": [r[3] for r in rows]}
    return pa.table(cols)


def _shard(seed: int, *, retractions: bool, evolve: bool = False) -> tuple[PersistClient, ShardId]:
    rng = random.Random(seed)
    client = _client()
    sid = ShardId.new()
    w, _ = client.open(sid, KEY, VAL)
    for i in range(BATCHES):
        if evolve and i == BATCHES // 2:
            assert client.compare_and_evolve_schema(sid, (KEY, VAL), (KEY, VAL2)).outcome.name == "APPLIED"
            w.expire()
            w, _ = client.open(sid, KEY, VAL2)
        w.compare_and_append(_updates(rng, i, retractions, evolve and i >= BATCHES // 2), 3 * i, 3 * i + 3)
    w.expire()
    return client, sid


def _rows(t: pa.Table, cols: list[str]) -> list[tuple[Any, ...]]:
    return sorted((tuple(r[c] for c in cols) for r in t.to_pylist()), key=repr)


@pytest.mark.parametrize("retractions", [False, True])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_parallel_scan_equals_the_snapshot(seed: int, retractions: bool) -> None:
    client, sid = _shard(seed, retractions=retractions)
    r = client.open_leased_reader(sid, KEY, VAL)
    for as_of in (4, 10, 3 * BATCHES - 1):
        want = r.snapshot(as_of)
        stream = parallel_snapshot(r, ScanHolds(r), as_of, memory_budget=None, timeout_s=None, filter=None,
                                   columns=None, workers=3)
        assert stream is not None  # key-disjoint parts: the parallel scan applies
        got = stream.read_all()
        assert got.schema == want.schema
        assert _rows(got, got.column_names) == _rows(want, want.column_names)
        with SqlSession(client, as_of=as_of) as s:
            q = s.sql(f"SELECT key, value, ts, diff FROM {sid}").to_arrow_table()
            assert _rows(q, q.column_names) == _rows(want, ["key", "value", "ts", "diff"])
            assert not r._held_seqnos()  # every scan released its hold
    r.expire()
    client.close()


@pytest.mark.parametrize("seed", [4, 5])
def test_parallel_scan_with_filters_and_projections(seed: int) -> None:
    client, sid = _shard(seed, retractions=True)
    r = client.open_leased_reader(sid, KEY, VAL)
    as_of = 3 * BATCHES - 1
    want = r.snapshot(as_of).to_pylist()
    with SqlSession(client) as s:
        for where, keep in (
            ("key BETWEEN 25 AND 70", lambda x: 25 <= x["key"] <= 70),
            ("key >= 40 AND value = 'b'", lambda x: x["key"] >= 40 and x["value"] == "b"),
            ("key = 60", lambda x: x["key"] == 60),  # a shared endpoint
            ("value <> 'a'", lambda x: x["value"] != "a"),
        ):
            got = s.sql(f"SELECT value, diff, key FROM {sid} WHERE {where}").fetchall()
            assert sorted(got) == sorted((x["value"], x["diff"], x["key"]) for x in want if keep(x)), where
        got = s.sql(f"SELECT sum(diff), count(*) FROM {sid}").fetchall()
        assert got == [(sum(x["diff"] for x in want), len(want))]
    stream = parallel_snapshot(r, ScanHolds(r), as_of, memory_budget=None, timeout_s=None,
                               filter=Predicate((Term("key", ">=", 50),)), columns=["value"])
    assert stream is not None
    got_t = stream.read_all()
    assert got_t.column_names == ["value", "ts", "diff"]
    assert _rows(got_t, ["value", "diff"]) == sorted(((x["value"], x["diff"]) for x in want if x["key"] >= 50), key=repr)
    r.expire()
    client.close()


def test_parallel_scan_reads_schema_evolved_parts() -> None:
    client, sid = _shard(6, retractions=True, evolve=True)
    r = client.open_leased_reader(sid, KEY, VAL2)
    as_of = 3 * BATCHES - 1
    want = r.snapshot(as_of)
    stream = parallel_snapshot(r, ScanHolds(r), as_of, memory_budget=None, timeout_s=None, filter=None, columns=None)
    assert stream is not None
    got = stream.read_all()
    cols = ["key", "value", "extra", "ts", "diff"]
    assert _rows(got, cols) == _rows(want, cols)
    assert want.column("extra").null_count > 0  # the old parts' rows have no "extra"
    with SqlSession(client) as s:
        q = s.sql(f"SELECT * FROM {sid}").to_arrow_table()
        assert _rows(q, cols) == _rows(want, cols)
    r.expire()
    client.close()


def test_overlapping_parts_stream_as_before() -> None:
    client = _client()
    sid = ShardId.new()
    w, r = client.open(sid, KEY, VAL)
    for i in range(3):  # each batch's keys overlap the next one's by a little
        keys = [10 * i + 1, 10 * i + 5, 10 * i + 13]
        w.compare_and_append(pa.table({"key": keys, "value": ["x"] * 3, "ts": [i] * 3, "diff": [1, 1, 1]}), i, i + 1)
    assert parallel_snapshot(r, ScanHolds(r), 2, memory_budget=None, timeout_s=None, filter=None,
                             columns=None) is None
    assert not r._held_seqnos()
    with SqlSession(client) as s:
        got = sorted(s.sql(f"SELECT key, diff FROM {sid}").fetchall())
        assert got == [(k, 1) for k in (1, 5, 11, 13, 15, 21, 23, 25, 33)]
    w.expire()
    r.expire()
    client.close()


def test_a_corrupt_part_fails_the_parallel_scan() -> None:
    client, sid = _shard(7, retractions=False)
    parts = [p for _, b in client.machine(sid).fetch_latest().trace_batches() for p in b.parts if p.key]
    victim = parts[len(parts) // 2]
    assert victim.key is not None
    flipped = flip_bit(4 * victim.size)(client.blob.get(victim.key) or b"")  # a bit mid-part
    client.raw_blob.delete(victim.key)
    client.raw_blob.set(victim.key, flipped)
    r = client.open_leased_reader(sid, KEY, VAL)
    stream = parallel_snapshot(r, ScanHolds(r), 3 * BATCHES - 1, memory_budget=None, timeout_s=None,
                               filter=None, columns=None)
    assert stream is not None
    with pytest.raises(CorruptionError, match="checksum mismatch"):
        stream.read_all()
    assert not r._held_seqnos()
    with SqlSession(client) as s, pytest.raises(Exception, match="checksum mismatch"):
        s.sql(f"SELECT sum(diff) FROM {sid}").fetchall()
    r.expire()
    client.close()


def test_a_scan_ended_inside_the_readers_lock_releases_later_without_deadlock() -> None:
    """A stream's finalizer may end a scan at any allocation, also in a thread that holds
    the reader's lock (``release_splits`` takes it): the release is deferred."""
    import threading

    client, sid = _shard(8, retractions=False)
    r = client.open_leased_reader(sid, KEY, VAL)
    holds = ScanHolds(r)
    stream = parallel_snapshot(r, holds, 5, memory_budget=None, timeout_s=None, filter=None, columns=None)
    assert stream is not None and r._held_seqnos()

    def finalizer_inside_the_lock() -> None:
        with r._lock:
            stream.close()  # ends the scan: holds.end() with the lock held

    t = threading.Thread(target=finalizer_inside_the_lock, daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive(), "ending a scan inside the reader's lock deadlocked"
    assert holds.deferred is not None
    holds.deferred.join(30)
    assert not r._held_seqnos()
    r.expire()
    client.close()
