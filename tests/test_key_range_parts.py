"""Bulk writes as sorted key-range parts (issue 28): a large chunk is cut at sampled
leading-key quantiles into sorted, consolidated parts of disjoint key ranges, and a
snapshot reads them as one sorted run (no sort, no merge).

The property: whatever the data (random keys with duplicates, null keys, retractions,
several key types), a shard written this way reads back, at every as-of, what the same
updates written the old way (unsorted bulk parts) read back — and what a model says.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections import Counter
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from persist_lib import PersistClient, PersistConfig, ShardId
from persist_lib.errors import CorruptionError
from persist_lib.frontier import Antichain
from persist_lib.shard.batch_meta import HollowBatch
from persist_lib.shard.codec import Schemas
from persist_lib.shard.consolidate import RangeConsolidation, consolidate, split_key_ranges
from persist_lib.shard.disjoint_runs import chain_disjoint_runs
from persist_lib.shard.runs import batch_runs
from persist_lib.testing.corruption import flip_bit

VAL = pa.schema([("v", pa.string()), ("n", pa.int64())])
# Leading key types: integer, string, binary, timestamp (chainable by their recorded
# bounds), float (sorted key ranges, not chained), and a composite key led by a string.
KEY_TYPES: dict[str, pa.Schema] = {
    "int": pa.schema([("k", pa.int64())]),
    "str": pa.schema([("k", pa.string())]),
    "bin": pa.schema([("k", pa.binary())]),
    "ts": pa.schema([("k", pa.timestamp("us"))]),
    "float": pa.schema([("k", pa.float64())]),
    "composite": pa.schema([("k", pa.string()), ("k2", pa.int32())]),
}


def client(*, key_ranges: bool, budget: int = 256 << 20, target: int = 16 << 10) -> PersistClient:
    name = uuid.uuid4().hex
    cfg = PersistConfig.for_tests(
        inline_threshold=0,
        inline_append_threshold=0,
        blob_target_size=target,  # many small key ranges
        # The old way: every bulk part unsorted; the new: every chunk cut by key ranges.
        unsorted_min_bytes=None if key_ranges else 0,
        key_range_min_bytes=0 if key_ranges else None,
        read_memory_budget=budget,
        compaction_enabled=False,
    )
    return PersistClient.open(f"mem://{name}", f"mem://{name}", cfg)


def key_value(kind: str, x: int | None) -> dict[str, Any]:
    if x is None:
        return {"k": None} if kind != "composite" else {"k": None, "k2": 1}
    if kind == "int":
        return {"k": x - 50}
    if kind == "str":
        return {"k": f"key{x:03d}" if x % 3 else f"k{x}"}
    if kind == "bin":
        return {"k": bytes([x % 7, x])}
    if kind == "ts":
        return {"k": x * 1_000_003}
    if kind == "float":
        return {"k": float(x) / 8 - 3.0 if x % 11 else -0.0 if x % 2 else 0.0}
    return {"k": f"c{x % 40:02d}", "k2": x % 3}


def table_of(kind: str, rows: list[tuple[int | None, int, int, int]]) -> pa.Table:
    """``(key number or None, value number, time, diff)`` rows as a user-layout table."""
    schema = pa.schema(list(KEY_TYPES[kind]) + list(VAL) + [("ts", pa.int64()), ("diff", pa.int64())])
    recs = [
        {**key_value(kind, x), "v": f"v{v % 5}", "n": v % 3, "ts": t, "diff": d} for x, v, t, d in rows
    ]
    return pa.Table.from_pylist(recs, schema=schema)


def model(tables: list[pa.Table], as_of: int) -> Counter[tuple[Any, ...]]:
    c: Counter[tuple[Any, ...]] = Counter()
    for t in tables:
        for r in t.to_pylist():
            if r["ts"] <= as_of:
                c[tuple((k, repr(v)) for k, v in r.items() if k not in ("ts", "diff"))] += r["diff"]
    return Counter({k: d for k, d in c.items() if d})


def as_counter(t: pa.Table) -> Counter[tuple[Any, ...]]:
    c: Counter[tuple[Any, ...]] = Counter()
    for r in t.to_pylist():
        key = tuple((k, repr(v)) for k, v in r.items() if k not in ("ts", "diff"))
        assert key not in c, f"{key} twice in a snapshot"
        c[key] = r["diff"]
    return c


def bulk(keys: Any, *, v: Any = None, diff: Any = None, seed: int = 0) -> pa.Table:
    """A user-layout table at time 0 of these keys: value ``v`` (default "v"), a random
    ``n`` in 0..2 and diffs ``diff`` (default 1)."""
    n = len(keys)
    return pa.table({
        "k": pa.array(keys),
        "v": pa.array(["v"] * n if v is None else v),
        "n": pa.array(np.random.default_rng(seed).integers(0, 3, n)),
        "ts": pa.array(np.zeros(n, dtype=np.int64)),
        "diff": pa.array(np.ones(n, dtype=np.int64) if diff is None else diff),
    })


def write_batches(c: PersistClient, kind: str, tables: list[pa.Table]) -> tuple[Any, Any, list[HollowBatch]]:
    shard = ShardId.new()
    w, r = c.open(shard, KEY_TYPES[kind], VAL)
    for i, t in enumerate(tables):
        w.compare_and_append(t, 2 * i, 2 * i + 2)
    state = c.machine(shard).fetch_latest()
    return w, r, [b for _, b in state.trace_batches()]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=st.sampled_from(list(KEY_TYPES)),
    sizes=st.lists(st.integers(0, 600), min_size=1, max_size=3),
    distinct=st.sampled_from([1, 3, 40, 120]),  # few keys: many duplicates
    null_rate=st.sampled_from([0.0, 0.0, 0.05, 0.5]),
    cancel=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_key_range_writes_read_back_as_the_old_path_at_every_as_of(
    kind: str, sizes: list[int], distinct: int, null_rate: float, cancel: bool, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    tables = []
    for i, n in enumerate(sizes):
        keys = rng.integers(0, distinct, n)
        rows: list[tuple[int | None, int, int, int]] = [
            (None if rng.random() < null_rate else int(x), int(rng.integers(0, 10)), 2 * i + int(rng.integers(0, 2)),
             int(rng.choice([1, 1, 2, -1, -2])))
            for x in keys
        ]
        if cancel:  # retractions of half the rows: updates that cancel out
            rows += [(x, v, t, -d) for x, v, t, d in rows[: n // 2]]
        tables.append(table_of(kind, rows))
    new, old = client(key_ranges=True, target=2 << 10), client(key_ranges=False, target=2 << 10)
    _, r_new, b_new = write_batches(new, kind, tables)
    _, r_old, _ = write_batches(old, kind, tables)
    schemas = Schemas(KEY_TYPES[kind], VAL)
    for b in b_new:
        assert all(p.sorted for p in b.parts)
        t = next(t for i, t in enumerate(tables) if b.lower == Antichain([2 * i]))
        leading = t.column("k")
        if len(set(leading.to_pylist())) >= 20 and sum(p.count for p in b.parts) >= 100:
            assert len(b.parts) >= 2  # (the chunk was cut into key ranges)
        if len(b.parts) > 1 and kind != "float":
            # One batch's key ranges chain into one run (string bounds are short here).
            assert len(chain_disjoint_runs(batch_runs(b), schemas)) == 1
    for as_of in range(2 * len(tables)):
        want = model(tables, as_of)
        got_old = as_counter(r_old.snapshot(as_of))
        got_new = as_counter(r_new.snapshot(as_of))
        assert got_old == want
        assert got_new == got_old
        with r_new.snapshot_batches(as_of, memory_budget=1 << 20) as s:
            assert as_counter(pa.Table.from_batches(list(s), schema=s.schema)) == got_old


def test_a_bulk_chunk_becomes_disjoint_sorted_parts_read_as_one_run() -> None:
    c = client(key_ranges=True)
    rng = np.random.default_rng(4)
    n = 20_000
    t = bulk(rng.integers(0, 5_000, n), v=[f"v{i % 13}" for i in range(n)])
    w, r, (b,) = write_batches(c, "int", [t])
    assert_disjoint_parts_read_as_one_run(b, r, t, min_parts=8)


def assert_disjoint_parts_read_as_one_run(b: HollowBatch, r: Any, t: pa.Table, *, min_parts: int) -> None:
    """``b`` (the batch of ``t``, int keys) is at least ``min_parts`` sorted parts of
    disjoint key ranges, which a snapshot reads as one run, correctly."""
    assert len(b.parts) >= min_parts and all(p.sorted for p in b.parts)
    bounds = sorted((s[1], s[2]) for p in b.parts for s in p.stats or () if s[0] == "k.k")
    assert len(bounds) == len(b.parts)
    assert all(hi < lo for (_, hi), (lo, _) in zip(bounds, bounds[1:], strict=False))
    with r.snapshot_batches(0) as s:
        got = pa.Table.from_batches(list(s), schema=s.schema)
        assert s.stats.runs == 1
    assert as_counter(got) == model([t], 0)


def test_a_streamed_read_takes_the_key_ranges_one_after_another() -> None:
    """Beyond the read budget the key-range parts are streamed part by part as one run
    (the linear path), not merged."""
    c = client(key_ranges=True, budget=1 << 20)
    rng = np.random.default_rng(5)
    n = 120_000
    t = bulk([f"user{x:07d}" for x in rng.integers(0, 10**6, n)], v=["x"] * n)
    w, r, (b,) = write_batches(c, "str", [t])
    assert len(b.parts) > 10
    with r.snapshot_batches(0) as s:
        got = pa.Table.from_batches(list(s), schema=s.schema)
        assert s.stats.runs == 1 and s.stats.passes == 0 and not s.stats.restarted_per_part
    keys = got.column("k").to_pylist()
    assert keys == sorted(keys)
    expected = Counter(zip(t.column("k").to_pylist(), t.column("n").to_pylist(), strict=True))
    assert Counter({(k, m): d for k, m, d in zip(keys, got.column("n").to_pylist(), got.column("diff").to_pylist(), strict=True)}) == expected


def _swap_bounds(b: HollowBatch) -> HollowBatch:
    """``b`` with the recorded leading-key bounds of its first and last parts swapped:
    a chain in the wrong order."""
    parts = list(b.parts)
    first, last = parts[0], parts[-1]
    parts[0] = dataclasses.replace(first, stats=last.stats)
    parts[-1] = dataclasses.replace(last, stats=first.stats)
    return dataclasses.replace(b, parts=tuple(parts))


def test_lying_key_ranges_fall_back_to_the_merge() -> None:
    c = client(key_ranges=True)
    rng = np.random.default_rng(6)
    n = 5_000
    t = bulk(rng.integers(0, 1_000, n), v=["a"] * n, diff=rng.choice([1, -1, 2], n))
    w, r = c.open(ShardId.new(), KEY_TYPES["int"], VAL)
    b = w.builder(0)
    b.add(w.normalize(t))
    batch = _swap_bounds(b.finish(1))
    assert len(batch.parts) >= 3
    w.compare_and_append_batch(batch, 0, 1)
    # The statistics chain the parts in the wrong key order: the linear path sees rows
    # out of order and the read merges the parts instead, with the right rows.
    schemas = Schemas(KEY_TYPES["int"], VAL)
    assert len(chain_disjoint_runs(batch_runs(batch), schemas)) == 1
    want = model([t], 0)
    assert as_counter(r.snapshot(0)) == want
    with r.snapshot_batches(0) as s:
        got = pa.Table.from_batches(list(s), schema=s.schema)
        assert s.stats.runs == len(batch.parts)
    assert as_counter(got) == want
    keys = got.column("k").to_pylist()
    assert keys == sorted(keys)
    # A second batch retracting half of those rows whose parts claim keys above all of
    # them: trusted, the read would return both the rows and their retractions.
    half = t.slice(0, n // 2)
    retract = half.set_column(4, "diff", pa.compute.negate(half.column("diff")))
    retract = retract.set_column(3, "ts", pa.array(np.ones(n // 2, dtype=np.int64)))
    b2 = w.builder(1)
    b2.add(w.normalize(retract))
    batch2 = b2.finish(2)
    lying = tuple(
        dataclasses.replace(p, stats=tuple(
            (c, lo + 10_000, hi + 10_000, nulls) if c == "k.k" else (c, lo, hi, nulls) for c, lo, hi, nulls in p.stats or ()
        ))
        for p in batch2.parts
    )
    w.compare_and_append_batch(dataclasses.replace(batch2, parts=lying), 1, 2)
    want = model([t, retract], 1)
    assert as_counter(r.snapshot(1)) == want
    with r.snapshot_batches(1) as s:
        assert as_counter(pa.Table.from_batches(list(s), schema=s.schema)) == want


@pytest.mark.parametrize("indexed", [True, False])
def test_lying_key_ranges_in_a_streamed_read_never_return_wrong_rows(indexed: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Streamed part by part (beyond the read budget), a chain whose recorded ranges lie:
    with indexed parts the verified footers' row-group statistics contradict it before
    any row is handed out, and the read merges the parts instead. Without footers the
    lie is found at the first part boundary: merged if no row was handed out yet, else
    the read stops with a ``CorruptionError``; never wrong rows."""
    from persist_lib.shard import part_index

    if indexed:
        monkeypatch.setattr(part_index, "INDEXED_ROW_GROUP_ROWS", 512)
    c = client(key_ranges=True, budget=1 << 20, target=64 << 10)
    rng = np.random.default_rng(9)
    n = 60_000
    t = bulk(rng.integers(0, 10**6, n))
    w, r = c.open(ShardId.new(), KEY_TYPES["int"], VAL)
    b = w.builder(0)
    b.add(w.normalize(t))
    batch = _swap_bounds(b.finish(1))
    assert all((p.footer is not None) == indexed for p in batch.parts)
    w.compare_and_append_batch(batch, 0, 1)
    want = model([t], 0)
    with r.snapshot_batches(0) as s:
        try:
            got: pa.Table | None = pa.Table.from_batches(list(s), schema=s.schema)
        except CorruptionError as e:
            assert not indexed and "not in order" in str(e)
            got = None
        if indexed:
            assert s.stats.runs == len(batch.parts)  # merged, part by part
    if got is not None:
        assert as_counter(got) == want
        keys = got.column("k").to_pylist()
        assert keys == sorted(keys)


@pytest.mark.parametrize("budget", [256 << 20, 1 << 20])
def test_corrupt_key_range_part_is_detected(budget: int) -> None:
    """The linear path verifies every part's checksum before using a byte of it."""
    c = client(key_ranges=True, budget=budget)
    n = 60_000
    rng = np.random.default_rng(8)
    t = bulk(rng.integers(0, 10**6, n))
    w, r, (b,) = write_batches(c, "int", [t])
    victim = b.parts[len(b.parts) // 2]
    assert victim.key is not None
    c.blob.set(victim.key, flip_bit(12_345)(c.blob.get(victim.key)))
    with pytest.raises(CorruptionError):
        r.snapshot(0)
    with pytest.raises(CorruptionError), r.snapshot_batches(0) as s:
        list(s)


@pytest.mark.parametrize(
    "col",
    [
        pa.array(np.random.default_rng(1).integers(0, 50, 3000)),
        pa.array([None if i % 9 == 0 else f"s{i % 70}" for i in range(3000)]),
        pa.array([None if i % 5 == 0 else i % 40 for i in range(3000)], pa.int32()),
        pa.array([float(i % 30) - 15.0 for i in range(3000)]),
        pa.array(["same"] * 3000),
        pa.array([None] * 3000, pa.string()),
    ],
    ids=["int", "str_nulls", "int_nulls", "float", "one_value", "all_null"],
)
def test_split_key_ranges_partitions_by_leading_key(col: pa.Array) -> None:
    """Every row in exactly one range; ranges in key order with no leading value (and no
    null) in two of them; concatenated range consolidations equal ``consolidate``."""
    for k in (1, 2, 5, 16):
        kr = split_key_ranges(col, k)
        assert kr is not None and 1 <= len(kr.rows) <= k
        assert np.array_equal(np.sort(np.concatenate(kr.rows)), np.arange(len(col)))
        vals = [[col[int(i)].as_py() for i in rows] for rows in kr.rows]
        for a, b in zip(vals, vals[1:], strict=False):
            a_vals = [x for x in a if x is not None]
            assert None not in b  # nulls only in the first range
            assert not a_vals or min(x for x in b) > max(a_vals)
    table = pa.table({"k.x": col, "v.y": pa.array(np.arange(len(col)) % 7), "t": pa.array(np.zeros(len(col), np.int64)), "d": pa.array(np.ones(len(col), np.int64))})
    split = RangeConsolidation.split(table, 4)
    assert split is not None
    got = pa.concat_tables([split.table(i) for i in range(len(split))])
    assert got.equals(consolidate(table))
