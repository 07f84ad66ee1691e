"""Bounded-memory collection reads: the streamed handover diff (``storage.handover_diff``),
the collection listen's streamed ranges and handovers (``storage.listen``), and the
collection's ``updates_between_batches`` across a handover.

Budgets are 1 MiB and parts 16 KiB, so the diffs below spill their runs to local files
and the shard reads go through the k-way merge.
"""

from __future__ import annotations

import os
import random
import tempfile
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from persist_lib import Antichain, PersistClient, PersistConfig
from persist_lib.errors import CorruptionError, InvalidUsage
from persist_lib.handles.listen import ListenProgress, ListenUpdates
from persist_lib.shard.codec import Schemas, empty_updates, normalize_updates, to_user_table
from persist_lib.shard.consolidate import consolidate
from persist_lib.shard.memory_plan import MergeStats
from persist_lib.storage import CollectionReader, StorageController
from persist_lib.storage.handover_diff import SnapshotSide, handover_diff, shard_groups

KEY = pa.schema([("k", pa.int64())])
VAL = pa.schema([("v", pa.string())])
MiB = 1 << 20
BUDGET = 1 * MiB

Row = tuple[int, str, int, int]

_POOLS: list[pa.MemoryPool] = []


def mem_client() -> PersistClient:
    name = uuid.uuid4().hex
    cfg = PersistConfig.for_tests(blob_target_size=16 << 10, inline_threshold=0)
    return PersistClient.open(f"mem://{name}", f"mem://{name}", cfg)


def rows(table: pa.Table) -> list[Row]:
    return sorted((r["k"], r["v"], r["ts"], r["diff"]) for r in table.to_pylist())


def in_memory_diff(old_snap: pa.Table, new_snap: pa.Table, t: int, schemas: Schemas) -> pa.Table:
    """The handover diff as the listener built it before it streamed: both snapshots
    whole, ``-old + new`` at time ``t``, one consolidate (the reference)."""
    neg = old_snap.set_column(old_snap.schema.get_field_index("diff"), "diff", pc.negate(old_snap["diff"]))
    both = pa.concat_tables([neg, new_snap])
    both = both.set_column(both.schema.get_field_index("ts"), "ts", pa.array([t] * both.num_rows, pa.int64()))
    return to_user_table(consolidate(normalize_updates(both, schemas, shard="handover")), schemas)


def to_updates(log: list[Row]) -> list[Any]:
    return [(((k,), (v,)), t, d) for k, v, t, d in log]


def random_updates(rng: random.Random, n: int, t: int, keys: int) -> list[Row]:
    return [(rng.randrange(keys), f"v{rng.randrange(3)}-{'x' * rng.randrange(8)}", t, rng.choice([1, 1, 2, -1]))
            for _ in range(n)]


class Handover:
    """A collection whose rendition ``r0`` (``n_old`` shards) is handed over at ``at``
    to ``r1`` (``n_new`` shards) holding mostly the same records (equal records cancel
    in the diff), some changed, some new."""

    def __init__(self, seed: int, n_old: int, n_new: int, *, rows_per_time: int, times: int = 4,
                 keys: int = 1 << 40) -> None:
        rng = random.Random(seed)
        self.client = mem_client()
        self.ctl = StorageController(self.client)
        self.ctl.create_collection("c", KEY, VAL, num_shards=n_old)
        w0 = self.ctl.open_writer("c")
        self.log0: list[Row] = []
        for t in range(times):
            ups = random_updates(rng, rows_per_time, t, keys)
            w0.append(to_updates(ups), t, t + 1)
            self.log0 += ups
        self.at = times
        # r1: r0's contents at at-1 with ~10% of the records changed, plus new ones, at 0.
        self.ctl.create_rendition("c", "r1", n_new)
        w1 = self.ctl.open_writer("c", "r1")
        contents = Counter[tuple[int, str]]()
        for k, v, _, d in self.log0:
            contents[(k, v)] += d
        self.log1: list[Row] = []
        for (k, v), d in contents.items():
            if d and rng.random() < 0.9:
                self.log1.append((k, v, 0, d))
            elif d:
                self.log1.append((k, v + "-changed", 0, d))
        self.log1 += random_updates(rng, rows_per_time // 10, 0, keys)
        w1.append(to_updates(self.log1), 0, self.at)
        w1.append([], self.at, self.at + 1)
        self.ctl.handover("c", to="r1", at=self.at)
        self.later = random_updates(rng, rows_per_time // 4, self.at + 1, keys)
        w1.append(to_updates(self.later), self.at + 1, self.at + 2)
        self.end = self.at + 2
        self.reader: CollectionReader = self.ctl.acquire_read_handle("c")
        self.schemas = self.reader.schemas

    def reference_diff(self) -> pa.Table:
        old = self.ctl.acquire_read_handle("c")
        try:
            old_snap = old._rendition_snapshot("r0", self.at - 1, None)
            new_snap = old._rendition_snapshot("r1", self.at, None)
        finally:
            old.expire()
        self.snapshot_bytes = old_snap.nbytes + new_snap.nbytes
        return in_memory_diff(old_snap, new_snap, self.at, self.schemas)

    def streamed_diff(self, budget: int, stats: MergeStats) -> pa.Table:
        r = self.reader
        batches = list(handover_diff(
            SnapshotSide(r.rendition_readers("r0"), self.at - 1, -1), SnapshotSide(r.rendition_readers("r1"), self.at, 1),
            self.at, self.schemas, memory_budget=budget, stats=stats,
        ))
        return pa.Table.from_batches(batches, schema=to_user_table(empty_updates(self.schemas), self.schemas).schema)


def test_shard_groups_pair_the_shards_a_key_can_be_in() -> None:
    assert shard_groups(4, 4) == [([0], [0]), ([1], [1]), ([2], [2]), ([3], [3])]
    assert shard_groups(2, 4) == [([0], [0, 2]), ([1], [1, 3])]
    assert shard_groups(3, 4) == [([0, 1, 2], [0, 1, 2, 3])]
    assert shard_groups(1, 5) == [([0], [0, 1, 2, 3, 4])]
    rng = random.Random(3)
    from persist_lib.storage.routing import route

    keys = pa.table({"k": pa.array([rng.randrange(1 << 50) for _ in range(2000)], pa.int64())})
    for n_old, n_new in [(4, 6), (3, 9), (8, 4), (5, 7)]:
        groups = shard_groups(n_old, n_new)
        group_of_old = {i: g for g, (olds, _) in enumerate(groups) for i in olds}
        group_of_new = {j: g for g, (_, news) in enumerate(groups) for j in news}
        for i, j in zip(route(keys, ["k"], n_old), route(keys, ["k"], n_new), strict=True):
            assert group_of_old[int(i)] == group_of_new[int(j)]


@pytest.mark.parametrize("seed", range(6))
def test_streamed_handover_diff_equals_the_in_memory_one(seed: int) -> None:
    rng = random.Random(seed)
    counts = [1, 2, 3, 4, 6]
    n_old, n_new = rng.choice(counts), rng.choice(counts)
    if seed == 0:
        n_old, n_new = 3, 4  # coprime: one group of every shard
    elif seed == 1:
        n_old, n_new = 4, 4  # equal: shard pairs
    elif seed == 2:
        n_old, n_new = 4, 6  # two groups of 2 old and 3 new shards
    big = seed % 2 == 0
    h = Handover(seed, n_old, n_new, rows_per_time=6000 if big else 400, keys=1 << 40 if big else 300)
    want = h.reference_diff()
    stats = MergeStats()
    got = h.streamed_diff(BUDGET, stats)
    assert rows(got) == rows(want), (n_old, n_new)
    assert got.num_rows < sum(1 for _ in h.log1), "equal records cancelled"
    assert all(t == h.at for t in got.column("ts").to_pylist())
    if big:
        assert stats.intermediate_bytes > 0 and stats.passes >= 1, f"the diff spilled and merged: {stats}"
        assert stats.peak_bytes_held <= 2 * BUDGET, stats
    # A handover at 0: nothing to retract.
    r = h.reader
    at0 = list(handover_diff(SnapshotSide(r.rendition_readers("r0"), None, -1),
                             SnapshotSide(r.rendition_readers("r1"), 0, 1), 0, h.schemas, memory_budget=BUDGET))
    want0 = in_memory_diff(to_user_table(empty_updates(h.schemas), h.schemas), r._rendition_snapshot("r1", 0, None),
                           0, h.schemas)
    assert rows(pa.Table.from_batches(at0, schema=want0.schema) if at0 else want0) == rows(want0)


def test_listen_across_a_handover_under_a_small_budget() -> None:
    h = Handover(11, 2, 3, rows_per_time=6000)
    big = h.reader.listen(0, memory_budget=1 << 40)
    reference = big.read_until(h.end)
    listen = h.reader.listen(0, memory_budget=BUDGET)
    got: list[pa.Table] = []
    calls = 0
    frontier = 1
    while listen.frontier.time is not None and listen.frontier.time < h.end:
        events = listen.next(2.0)
        calls += 1
        updates = [e for e in events if isinstance(e, ListenUpdates)]
        # Each call hands out about 1/8 of the budget (plus at most one chunk).
        assert sum(e.table.nbytes for e in updates) <= BUDGET // 8 + max((e.table.nbytes for e in updates), default=0)
        for e in events:
            if isinstance(e, ListenUpdates):
                assert e.lower.time == frontier
                got.append(e.table)
            else:
                assert isinstance(e, ListenProgress)
                frontier = e.upper.time
    assert calls > 3, "the handover and the ranges came over several calls"
    assert listen.stats.intermediate_bytes > 0 and listen.stats.peak_bytes_held <= 2 * BUDGET, listen.stats
    assert listen.current_rendition == "r1"
    assert rows(pa.concat_tables(got)) == rows(reference)
    # The reference, from the logs: r0's updates before the handover, the in-memory diff
    # at it, r1's updates after it.
    want = [r for r in h.log0 if r[2] > 0] + rows(h.reference_diff()) + h.later  # (listen from 0)
    assert _consolidated(rows(pa.concat_tables(got))) == _consolidated(want)
    # The streaming form gives the same rows again.
    again = h.reader.listen(0, memory_budget=BUDGET)
    assert rows(pa.Table.from_batches(list(again.batches(h.end)))) == rows(reference)
    assert all(r._held_seqnos() == {} for rend in ("r0", "r1") for r in h.reader.rendition_readers(rend))


def _consolidated(log: list[Row]) -> list[Row]:
    c: Counter[tuple[int, str, int]] = Counter()
    for k, v, t, d in log:
        c[(k, v, t)] += d
    return sorted((k, v, t, d) for (k, v, t), d in c.items() if d)


def test_listen_close_releases_a_pending_handover(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the diff spills
    h = Handover(12, 2, 2, rows_per_time=6000)
    listen = h.reader.listen(h.at - 1, memory_budget=BUDGET)
    events = listen.next(2.0)
    assert events and listen._pending is not None, "the handover diff is being handed out"
    assert os.listdir(tmp_path), "its runs spilled"
    listen.close()
    assert os.listdir(tmp_path) == []
    assert all(r._held_seqnos() == {} for rend in ("r0", "r1") for r in h.reader.rendition_readers(rend))
    with pytest.raises(InvalidUsage, match="closed"):
        listen.next(0.1)


def test_updates_between_batches_across_a_handover_is_bounded() -> None:
    """A handover of two snapshots ~5x the budget: the range across its handover streams (the diff
    spills) with the merge holding at most about the budget, and Arrow never
    holding more than a few budgets at once (its pool's peak) while it is read."""
    h = Handover(13, 3, 2, rows_per_time=20_000)
    want = h.reference_diff().num_rows
    whole = h.snapshot_bytes
    assert whole > 5 * BUDGET, whole
    n = 0
    default_pool = pa.default_memory_pool()
    pool = pa.proxy_memory_pool(default_pool)  # counts (and peaks) only what the read allocates
    _POOLS.append(pool)  # buffers it allocated (cached parts) may outlive the test: so must it
    pa.set_memory_pool(pool)
    try:
        with h.reader.updates_between_batches(h.at, h.at + 1, memory_budget=BUDGET) as stream:
            for b in stream:
                n += b.num_rows
    finally:
        pa.set_memory_pool(default_pool)
    st = stream.stats
    assert n == want
    assert st.intermediate_bytes > 0 and st.peak_bytes_held <= 2 * BUDGET, st
    peak = pool.max_memory()
    assert 0 < peak <= 3 * BUDGET, f"Arrow held {peak} bytes at once reading a {whole}-byte handover"


def _corrupt_a_part(client: PersistClient, shard: str) -> None:
    """Flips a bit in the middle of one of ``shard``'s blob parts (the read then fails
    its checksum with a ``CorruptionError``)."""
    parts = [p for _, b in client.machine(shard).fetch_latest().trace_batches() for p in b.parts if p.key]
    key = parts[len(parts) // 2].key
    assert key is not None
    data = bytearray(client.blob.get(key) or b"")
    data[len(data) // 2] ^= 0x10
    client.raw_blob.delete(key)
    client.raw_blob.set(key, bytes(data))


def test_listen_failing_in_a_handover_before_handing_anything_out_can_retry() -> None:
    h = Handover(14, 2, 2, rows_per_time=6000)
    _corrupt_a_part(h.client, h.ctl.describe("c")["renditions"]["r1"]["shards"][0])
    listen = h.reader.listen(h.at - 1, memory_budget=BUDGET)
    with pytest.raises(CorruptionError):
        listen.next(2.0)
    assert listen.frontier == Antichain([h.at]) and listen.current_rendition == "r0"
    assert all(r._held_seqnos() == {} for rend in ("r0", "r1") for r in h.reader.rendition_readers(rend))
    with pytest.raises(CorruptionError):
        listen.next(2.0)  # not dead: it reads the handover again (and meets the same part)


def test_listen_failing_after_handing_out_part_of_a_range_refuses_to_go_on() -> None:
    h = Handover(15, 2, 2, rows_per_time=6000)
    _corrupt_a_part(h.client, h.ctl.describe("c")["renditions"]["r0"]["shards"][1])
    listen = h.reader.listen(0, memory_budget=BUDGET)
    first = listen.next(2.0)
    assert any(isinstance(e, ListenUpdates) for e in first) and listen.frontier == Antichain([1])
    with pytest.raises(CorruptionError):
        for _ in range(20):
            listen.next(2.0)
    assert listen.frontier == Antichain([1])
    with pytest.raises(InvalidUsage, match="repeat"):
        listen.next(2.0)


def test_collection_snapshot_batches_adds_up_its_shard_streams() -> None:
    h = Handover(16, 3, 3, rows_per_time=6000)
    with h.reader.snapshot_batches(h.at, memory_budget=BUDGET) as stream:
        got = pa.Table.from_batches(list(stream), schema=stream.schema)
    assert rows(got) == rows(h.reader.snapshot(h.at))
    st = stream.stats
    assert st.rows_read >= got.num_rows and st.bytes_read > 0, st
    assert 0 < st.peak_bytes_held <= BUDGET, st


def test_streamed_handover_diff_with_nulls_and_nested_values() -> None:
    """Nullable string keys and list values (the merge's general, ranked path) spill
    and merge to the in-memory diff too."""
    key = pa.schema([("name", pa.string()), ("n", pa.int32())])
    val = pa.schema([("x", pa.float64()), ("tags", pa.list_(pa.int64()))])
    rng = random.Random(21)
    client = mem_client()
    ctl = StorageController(client)
    ctl.create_collection("c", key, val, num_shards=2)
    ctl.create_rendition("c", "r1", 3)
    w0, w1 = ctl.open_writer("c"), ctl.open_writer("c", "r1")

    def rec() -> tuple[Any, Any]:
        name = None if rng.random() < 0.1 else f"n{rng.randrange(5000)}"
        x = None if rng.random() < 0.2 else float(rng.randrange(4))
        return (name, rng.randrange(100)), (x, [rng.randrange(3) for _ in range(rng.randrange(3))])

    for t in range(3):
        ups = [(*rec(), t, 1) for _ in range(5000)]
        w0.append([((k, v), t, d) for k, v, t, d in ups], t, t + 1)
        # r1: the same records, a tenth of them with another value.
        w1.append([((k, v if rng.random() < 0.9 else (v[0], [9])), t, d) for k, v, t, d in ups], t, t + 1)
    w1.append([], 3, 4)
    reader = ctl.acquire_read_handle("c")
    schemas = reader.schemas
    want = in_memory_diff(reader._rendition_snapshot("r0", 2, None), reader._rendition_snapshot("r1", 3, None), 3, schemas)
    stats = MergeStats()
    got = pa.Table.from_batches(list(handover_diff(
        SnapshotSide(reader.rendition_readers("r0"), 2, -1), SnapshotSide(reader.rendition_readers("r1"), 3, 1),
        3, schemas, memory_budget=BUDGET, stats=stats,
    )), schema=want.schema)
    assert stats.intermediate_bytes > 0, stats
    assert 0 < want.num_rows < 15_000
    key_of = lambda r: (r["name"] or "", r["n"], r["x"] if r["x"] is not None else -1.0, r["tags"], r["ts"], r["diff"])  # noqa: E731
    assert sorted(map(key_of, got.to_pylist())) == sorted(map(key_of, want.to_pylist()))
