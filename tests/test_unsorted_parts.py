"""Bulk writes store large parts unsorted (issue 14): the writer's path is an encode;
reads consolidate across parts; the compactor sorts such parts when it loads them."""

from __future__ import annotations

import random
import uuid
from collections import Counter

import pyarrow as pa

from persist_lib import PersistClient, PersistConfig, ShardId
from persist_lib.shard.batch_meta import PartMeta

KEY = pa.schema([("k", pa.int64())])
VAL = pa.schema([("v", pa.string())])


def client(**cfg: object) -> PersistClient:
    name = uuid.uuid4().hex
    base: dict[str, object] = {"inline_threshold": 0, "unsorted_min_bytes": 1024, "blob_target_size": 64 << 10}
    base.update(cfg)
    return PersistClient.open(f"mem://{name}", f"mem://{name}", PersistConfig.for_tests(**base))


def rows(rng: random.Random, t0: int, t1: int, n: int) -> list:
    # Duplicates, retractions and zero-sum pairs, all shuffled: nothing is sorted.
    out = []
    for _ in range(n):
        k = rng.randrange(200)
        v = f"v{rng.randrange(5)}"
        t = rng.randrange(t0, t1)
        d = rng.choice([1, 1, 2, -1])
        out.append((((k,), (v,)), t, d))
    rng.shuffle(out)
    return out


def model(ups: list, as_of: int) -> dict:
    c: Counter = Counter()
    for ((k,), (v,)), t, d in ups:
        if t <= as_of:
            c[(k, v)] += d
    return {kv: d for kv, d in c.items() if d}


def contents(t: pa.Table) -> dict:
    c: Counter = Counter()
    for r in t.to_pylist():
        c[(r["k"], r["v"])] += r["diff"]
    return {kv: d for kv, d in c.items() if d}


def test_bulk_parts_are_unsorted_and_reads_and_compaction_agree_with_the_model() -> None:
    rng = random.Random(7)
    c = client()
    shard = ShardId.new()
    w, r = c.open(shard, KEY, VAL)
    all_ups: list = []
    for t in range(0, 12, 3):
        ups = rows(rng, t, t + 3, 4000)
        all_ups += ups
        w.compare_and_append(ups, t, t + 3)
    s = c.machine(shard).fetch_latest()
    parts = [p for b in s.batches.values() for p in b.parts]
    assert any(not p.sorted for p in parts), "bulk parts should be stored unsorted"
    for as_of in (2, 5, 11):
        assert contents(r.snapshot(as_of)) == model(all_ups, as_of)
        with r.snapshot_batches(as_of, memory_budget=1 << 20) as it:
            got = pa.Table.from_batches(list(it))
        assert contents(got) == model(all_ups, as_of)
    r.downgrade_since(5)
    res = c.compact(shard)
    assert res["merges_applied"] >= 1
    s = c.machine(shard).fetch_latest()
    assert all(p.sorted for b in s.batches.values() for p in b.parts)  # compaction sorted them
    for as_of in (5, 11):
        assert contents(r.snapshot(as_of)) == model(all_ups, as_of)


def test_small_parts_stay_sorted_and_the_flag_round_trips() -> None:
    c = client(unsorted_min_bytes=1 << 30)
    shard = ShardId.new()
    w, _ = c.open(shard, KEY, VAL)
    w.compare_and_append(rows(random.Random(1), 0, 1, 500), 0, 1)
    s = c.machine(shard).fetch_latest()
    assert all(p.sorted for b in s.batches.values() for p in b.parts)
    p = PartMeta(key="s/w/p1", size=1, count=1, sha256="x", tmin=0, tmax=0, sorted=False)
    assert PartMeta.from_json(p.to_json()) == p
    assert "unsorted" not in PartMeta.from_json({**p.to_json(), "unsorted": False}).to_json()


def test_a_lone_bulk_batch_is_sorted_by_compaction_so_reads_stop_sorting_it() -> None:
    """One bulk write and nothing after it: no level rule would ever merge the batch, so
    the spine asks for a "sort" rewrite of it; afterwards every part is sorted and the
    contents are unchanged (consolidated at once)."""
    from persist_lib.shard.spine import compaction_requests

    rng = random.Random(11)
    c = client()
    shard = ShardId.new()
    w, r = c.open(shard, KEY, VAL)
    ups = rows(rng, 0, 3, 6000)
    w.compare_and_append(ups, 0, 3)
    s = c.machine(shard).fetch_latest()
    assert len(s.batches) == 1 and any(not p.sorted for b in s.batches.values() for p in b.parts)
    assert [q.kind for q in compaction_requests(s)] == ["sort"]
    res = c.compact(shard)
    assert res["merges_applied"] == 1
    s = c.machine(shard).fetch_latest()
    assert all(p.sorted for b in s.batches.values() for p in b.parts)
    assert compaction_requests(s) == []
    assert contents(r.snapshot(2)) == model(ups, 2)
