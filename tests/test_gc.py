"""Garbage collection by exact reachability, and the leaked-blob sweeper."""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter

import pyarrow as pa
import pytest

from persist_lib import PersistClient, PersistConfig, ShardId
from persist_lib.errors import BlobNotFound
from persist_lib.handles import maintenance as mn
from persist_lib.shard import gc as gcmod
from persist_lib.shard import state as st
from persist_lib.shard.machine import SCAN_LIMIT, clear_state_cache, unframe

KEY = pa.schema([("k", pa.int64())])
VAL = pa.schema([("v", pa.string())])


def mem_client(**cfg: object) -> PersistClient:
    name = uuid.uuid4().hex
    base: dict[str, object] = {"blob_target_size": 4096, "inline_threshold": 0, "rollup_interval": 8}
    base.update(cfg)
    return PersistClient.open(f"mem://{name}", f"mem://{name}", PersistConfig.for_tests(**base))


def contents(table: pa.Table) -> dict:
    c: Counter = Counter()
    for r in table.to_pylist():
        c[(r["k"], r["v"])] += r["diff"]
    return {k: v for k, v in c.items() if v}


def append_batches(w, lo: int, n: int, rows: int = 300) -> int:  # type: ignore[no-untyped-def]
    for t in range(lo, lo + n):
        w.compare_and_append([(((i,), (f"v{t % 3}",)), t, 1 if t % 2 == 0 else -1) for i in range(rows)], t, t + 1)
    return lo + n


def versions_from(client: PersistClient, shard: str, from_seqno: int) -> list[st.ShardState]:
    """Every state version ``>= from_seqno`` that consensus + rollups can rebuild."""
    head = client.machine(shard).fetch_latest()
    base: st.ShardState | None = None
    for s in sorted(head.rollups, reverse=True):
        if s <= from_seqno:
            data = client.blob.get(head.rollups[s].key)
            assert data is not None, "the rollup GC kept must exist"
            base = st.ShardState.decode_rollup(unframe(data, shard=shard, what="r"), shard=shard, key="r")
            break
    if base is None:  # nothing truncated yet: replay from the very first version
        assert client.consensus.scan(shard, 0, 1)[0].seqno == 1, "versions >= seqno_since are lost"
        base = st.ShardState(shard)
    out = [base] if base.seqno >= from_seqno else []
    cur = base
    while True:
        entries = client.consensus.scan(shard, cur.seqno + 1, SCAN_LIMIT)
        for e in entries:
            cur = st.apply_diff(cur, unframe(e.data, shard=shard, what="e"), e.seqno)
            if cur.seqno >= from_seqno:
                out.append(cur)
        if len(entries) < SCAN_LIMIT:
            return out


def assert_reachable_blobs_exist(client: PersistClient, shard: str) -> None:
    head = client.machine(shard).fetch_latest()
    for s in versions_from(client, shard, head.seqno_since()):
        for b in s.batches.values():
            for k in b.blob_keys():
                assert client.blob.get(k) is not None, f"GC deleted {k}, reachable from seqno {s.seqno}"
    latest = head.latest_rollup()
    assert latest is not None and client.blob.get(latest[1].key) is not None


def test_reader_holding_old_seqno_keeps_reading_while_compaction_and_gc_run() -> None:
    client = mem_client()
    shard = ShardId.new()
    w, r = client.open(shard, KEY, VAL)
    upper = append_batches(w, 0, 8)
    as_of = 5
    expected = contents(r.snapshot(as_of))
    # A slow reader: splits taken now keep a seqno hold until released.
    splits = r.snapshot_splits(as_of, 3)
    replaced: set[str] = {k for b in client.machine(shard).fetch_latest().batches.values() for k in b.blob_keys()}
    errors: list[BaseException] = []
    reads = [0]
    stop = threading.Event()

    def reader() -> None:
        try:
            while not stop.is_set():
                got = pa.concat_tables([sp.fetch(client.blob) for sp in splits])
                assert contents(got) == expected
                assert contents(r.snapshot(as_of)) == expected
                r.heartbeat()  # moves the hold up to the oldest outstanding read (the splits)
                reads[0] += 1
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    gc_summaries: list[dict] = []

    def maintenance() -> None:
        nonlocal upper
        try:
            for _ in range(6):
                upper = append_batches(w, upper, 3)
                mn.compact(client, shard)
                gc_summaries.append(mn.gc(client, shard))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
        finally:
            stop.set()

    threads = [threading.Thread(target=reader), threading.Thread(target=maintenance)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert reads[0] > 0
    assert not any(isinstance(e, BlobNotFound) for e in errors)
    s = client.machine(shard).fetch_latest()
    assert replaced <= set(s.garbage), "the blobs the splits read are garbage but kept"
    assert all(client.blob.get(k) is not None for k in replaced)
    assert sum(g["blobs_deleted"] for g in gc_summaries) == 0  # all garbage is behind the hold
    assert_reachable_blobs_exist(client, str(shard))
    # Release: the hold moves on, GC deletes the replaced blobs and truncates consensus.
    r.release_splits()
    r.heartbeat()
    w.heartbeat()
    res = mn.gc(client, shard)
    assert res["blobs_deleted"] >= len(replaced) and res["bytes_deleted"] > 0
    assert res["consensus_entries_truncated"] > 0
    assert all(client.blob.get(k) is None for k in replaced)
    assert_reachable_blobs_exist(client, str(shard))
    assert contents(r.snapshot(as_of)) == expected
    # Phase 2: no old hold; GC now deletes while snapshots (and heartbeats) go on.
    errors.clear()
    gc_summaries.clear()
    stop.clear()
    reads[0] = 0
    final: dict = {}

    def reader2() -> None:
        try:
            while not stop.is_set():
                now_upper = (r.upper.time or 1) - 1
                final[now_upper] = contents(r.snapshot(now_upper))
                r.heartbeat()
                reads[0] += 1
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=reader2), threading.Thread(target=maintenance)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert reads[0] > 0 and sum(g["blobs_deleted"] for g in gc_summaries) > 0
    assert_reachable_blobs_exist(client, str(shard))
    # A cold open (new process) still loads the shard from the kept rollup.
    clear_state_cache()
    c2 = PersistClient(client.raw_blob, client.raw_consensus, client.config)
    r2 = c2.open_leased_reader(shard, KEY, VAL)
    assert contents(r2.snapshot(upper - 1)) == contents(r.snapshot(upper - 1))


def test_gc_waits_for_every_seqno_hold() -> None:
    client = mem_client()
    shard = ShardId.new()
    w, r_old = client.open(shard, KEY, VAL)
    append_batches(w, 0, 4)
    r_new = client.open_leased_reader(shard, KEY, VAL)
    mn.compact(client, shard)
    s = client.machine(shard).fetch_latest()
    assert s.garbage
    r_new.heartbeat()
    res = mn.gc(client, shard)
    assert res["blobs_deleted"] == 0 and res["garbage_pending"] == len(s.garbage)
    r_old.expire()
    res = mn.gc(client, shard)
    assert res["blobs_deleted"] == len(s.garbage)
    assert_reachable_blobs_exist(client, str(shard))


def test_gc_is_idempotent() -> None:
    client = mem_client()
    shard = ShardId.new()
    w, r = client.open(shard, KEY, VAL)
    append_batches(w, 0, 20)
    mn.compact(client, shard)
    r.downgrade_since(10)
    mn.compact(client, shard)
    first = mn.gc(client, shard)
    assert first["blobs_deleted"] > 0 and first["consensus_entries_truncated"] > 0
    s1 = client.machine(shard).fetch_latest()
    keys1 = {m.key for m in client.blob.list_keys_and_metadata(f"{shard}/")}
    second = mn.gc(client, shard)
    s2 = client.machine(shard).fetch_latest()
    assert s2.seqno == s1.seqno, "a second GC run commits nothing"
    assert {m.key for m in client.blob.list_keys_and_metadata(f"{shard}/")} == keys1
    assert not gcmod.GcSummary(**second).changed_anything
    assert_reachable_blobs_exist(client, str(shard))


def test_gc_keeps_latest_rollup_and_truncates_below_the_needed_one() -> None:
    client = mem_client(rollup_interval=4)
    shard = ShardId.new()
    w, r = client.open(shard, KEY, VAL)
    append_batches(w, 0, 30, rows=5)
    r.heartbeat()
    res = mn.gc(client, shard)
    s = client.machine(shard).fetch_latest()
    latest = s.latest_rollup()
    assert latest is not None
    assert res["truncated_below"] == gcmod.oldest_needed_rollup(s)
    assert all(seqno >= res["truncated_below"] for seqno in s.rollups)
    first = client.consensus.scan(str(shard), 0, 1)[0].seqno
    assert first == res["truncated_below"]
    assert client.blob.get(latest[1].key) is not None
    assert res["rollups_deleted"] == res["rollups_removed"] > 0


def test_sweeper_finds_leaked_blobs_only() -> None:
    client = mem_client()
    shard = ShardId.new()
    w, r = client.open(shard, KEY, VAL)
    append_batches(w, 0, 12)
    mn.compact(client, shard)  # leaves garbage (referenced: not leaked)
    leaked = f"{shard}/w{uuid.uuid4()}/p{uuid.uuid4()}"
    client.blob.set(leaked, b"orphan")
    other = ShardId.new()
    client.blob.set(f"{other}/x/p1", b"someone else's")
    assert mn.unreferenced_blobs(client, shard) == []  # younger than the 1 h grace period
    found = mn.unreferenced_blobs(client, shard, 0)
    assert [f["key"] for f in found] == [leaked]
    found = mn.unreferenced_blobs(client, shard, 0, delete=True)
    assert found[0]["deleted"] and client.blob.get(leaked) is None
    assert client.blob.get(f"{other}/x/p1") is not None
    assert mn.unreferenced_blobs(client, shard, 0) == []
    # After GC truncated consensus, replay starts from the oldest needed rollup.
    r.heartbeat()
    w.heartbeat()
    assert mn.gc(client, shard)["consensus_entries_truncated"] > 0
    assert mn.unreferenced_blobs(client, shard, 0) == []
    assert_reachable_blobs_exist(client, str(shard))


@pytest.mark.parametrize("grace_ms", [0, 3_600_000])
def test_sweeper_respects_grace(grace_ms: int) -> None:
    client = mem_client()
    shard = ShardId.new()
    w, _ = client.open(shard, KEY, VAL)
    append_batches(w, 0, 1)
    client.blob.set(f"{shard}/w/p-leak", b"x")
    time.sleep(0.01)
    found = mn.unreferenced_blobs(client, shard, grace_ms)
    assert len(found) == (1 if grace_ms == 0 else 0)


def test_a_wide_schema_shard_is_not_rolled_up_early_forever() -> None:
    """Issue 26 defect 8: a 1,500-column shard's schemas are most of its rollup (~110 KB).
    The size estimate used to leave them out, so the state always looked like it had
    shrunk to a fifth of its latest rollup and the rollup was replaced every
    ``interval // 8`` commits: 60 rollups per 1,024 commits instead of 8."""
    interval = 128
    commits = 1024
    wide = pa.schema([(f"c{i}", pa.int64()) for i in range(1500)])
    clock = iter(range(1_700_000_000_000, 1_800_000_000_000, 1000))
    client = mem_client(rollup_interval=interval, now_ms=lambda: next(clock))
    shard = ShardId.new()
    w = client.open_writer(shard, KEY, wide)
    m = client.machine(shard)
    start = m.fetch_latest().seqno
    for _ in range(commits):
        w.heartbeat()  # one commit each (the clock moves), nothing else changes
    s = m.fetch_latest()
    latest = s.latest_rollup()
    assert latest is not None and latest[1].size >= 100_000  # the schemas dominate it
    # One rollup per ``interval`` seqnos (each rollup's link is a seqno too).
    due = (s.seqno - start) // interval
    assert due - 1 <= m.metrics.rollups_written <= due + 1, (m.metrics.rollups_written, due)
    client.close()


def test_rollup_is_replaced_early_after_a_large_state_shrinks() -> None:
    """A rollup written while many inline parts were pending is replaced soon after a
    merge shrinks the state (cold opens would otherwise decode the large one)."""
    interval = 64
    client = mem_client(
        rollup_interval=interval, inline_threshold=1, inline_append_threshold=64 << 10,
        inline_max_total=8 << 20,
    )
    shard = ShardId.new()
    w, r = client.open(shard, KEY, VAL)
    m = client.machine(shard)
    append_batches(w, 0, interval, rows=200)  # inline parts: the rollup at 64 is large
    big = m.fetch_latest().latest_rollup()
    assert big is not None and big[1].size >= 64 << 10
    expected = contents(r.snapshot(interval - 1))
    mn.compact(client, shard)  # the merged part goes to blob: the state shrinks
    s = m.fetch_latest()
    assert s.latest_rollup() == big, "no early rollup before the shrink"
    append_batches(w, interval, interval // 8 + 1, rows=1)
    after = m.fetch_latest().latest_rollup()
    assert after is not None and after[0] > big[0], "an early rollup replaced the large one"
    assert after[0] - s.seqno <= interval // 8 + 1
    assert after[1].size < big[1].size // 2
    clear_state_cache()  # a cold open starts from the new rollup
    r2 = client.open_leased_reader(shard, KEY, VAL)
    assert contents(r2.snapshot(interval - 1)) == expected
