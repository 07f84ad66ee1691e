"""The streaming read's merge with parts decoded ahead on the fetch pool and large steps
merged as two key halves at once (``kway_merge.Run.start_ahead``, ``step_split``): its
output equals the whole read's and the plain stream's, over random overlapping sorted
runs; checksums are still verified on every part decoded ahead."""

from __future__ import annotations

import random
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hs

from persist_lib import PersistClient, PersistConfig, ShardId
from persist_lib.errors import CorruptionError
from persist_lib.handles import maintenance as mn
from persist_lib.shard import kway_merge
from persist_lib.shard.batch_meta import PartMeta
from persist_lib.shard.consolidate import consolidate, is_consolidated
from persist_lib.shard.memory_plan import MergeStats
from persist_lib.shard.parts import fetch_part
from persist_lib.shard.read_merge import stream_merge
from persist_lib.shard.runs import batch_runs
from persist_lib.shard.step_split import split_segments
from persist_lib.shard.time_filters import forward_and_filter

KEY = pa.schema([pa.field("k", pa.int64(), nullable=True)])
VAL = pa.schema([("v", pa.string())])
MiB = 1 << 20


class CountingPool(ThreadPoolExecutor):
    """A real thread pool that counts the tasks it was given."""

    def __init__(self) -> None:
        super().__init__(max_workers=2, thread_name_prefix="test-prefetch")
        self.submitted = 0

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
        self.submitted += 1
        return super().submit(fn, *args, **kwargs)


@pytest.fixture
def pool() -> Iterator[CountingPool]:
    p = CountingPool()
    yield p
    p.shutdown(wait=True)


class Shard:
    """``n_runs`` overlapping sorted runs of random updates (null keys, strings,
    retractions of earlier inserts, multiplicities): each is two batches at times
    ``2i`` and ``2i + 1`` of a shard of its own, compacted into one run of many parts
    (all in one blob: the merge reads parts by key)."""

    def __init__(self, seed: int, n_runs: int, rows: int, part_bytes: int = 8 << 10) -> None:
        name = uuid.uuid4().hex
        cfg = PersistConfig.for_tests(blob_target_size=part_bytes, inline_threshold=0, compaction_enabled=False)
        self.client = PersistClient.open(f"mem://{name}", f"mem://{name}", cfg)
        rng = random.Random(seed)
        log: list[tuple[int | None, str, int, int]] = []
        self.runs: list[list[PartMeta]] = []
        for i in range(n_runs):
            shard = ShardId.new()
            w, self.r = self.client.open(shard, KEY, VAL)
            for t in (2 * i, 2 * i + 1):
                ups = []
                for _ in range(rows):
                    if log and rng.random() < 0.2:
                        k, v, _, d = rng.choice(log)
                        ups.append((k, v, t, -d))
                    else:
                        k = None if rng.random() < 0.03 else rng.randint(-50, 3000)
                        ups.append((k, f"v{rng.randint(0, 40)}", t, rng.choice([1, 1, 2, 3])))
                w.compare_and_append([(((k,), (v,)), tt, d) for k, v, tt, d in ups], 0 if t == 2 * i else t, t + 1)
                log += ups
            mn.compact(self.client, shard)
            state = self.client.machine(shard).fetch_latest()
            self.runs += [run for _, b in state.trace_batches() for run in batch_runs(b) if run]
        self.upper = 2 * n_runs
        self.everything = pa.concat_tables(
            [fetch_part(self.client.blob, p, self.r.schemas, "s") for run in self.runs for p in run]
        )

    def stream(self, **kw: Any) -> pa.Table:
        tables = list(
            stream_merge(self.client.blob, self.r.schemas, shard="s", runs=self.runs, **kw)
        )
        return pa.concat_tables(tables) if tables else self.everything.schema.empty_table()


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=hs.integers(0, 10_000),
    n_runs=hs.integers(2, 4),
    rows=hs.sampled_from([30, 300, 1000]),
    since_frac=hs.floats(0, 1),
    range_read=hs.booleans(),
)
def test_prefetched_split_stream_equals_whole_read_and_plain_stream(
    pool: CountingPool, monkeypatch: pytest.MonkeyPatch, seed: int, n_runs: int, rows: int, since_frac: float,
    range_read: bool,
) -> None:
    s = Shard(seed, n_runs, rows)
    if range_read:  # a time range, nothing forwarded
        lower = int(since_frac * (s.upper - 1))
        kw: dict[str, Any] = {"lower": lower, "upper": min(s.upper, lower + 3)}
        want = consolidate(forward_and_filter(s.everything, lower=kw["lower"], upper=kw["upper"]))
    else:  # a snapshot as of a time at or below the upper's predecessor, forwarded to it
        as_of = int(since_frac * (s.upper - 1))
        kw = {"since": as_of, "upper": as_of + 1}
        want = consolidate(forward_and_filter(s.everything, upper=as_of + 1, since=as_of))
    monkeypatch.setattr(kway_merge, "PARALLEL_STEP_ROWS", 1 << 40)
    plain_stats = MergeStats()
    plain = s.stream(memory_budget=1 * MiB, stats=plain_stats, **kw)
    monkeypatch.setattr(kway_merge, "PARALLEL_STEP_ROWS", 2)
    st = MergeStats()
    got = s.stream(memory_budget=1 * MiB, stats=st, prefetch=pool, **kw)
    assert is_consolidated(got)
    assert got.equals(want)
    assert got.equals(plain)
    assert plain_stats.split_steps == 0 and plain_stats.parts_decoded_ahead == 0
    parts = sum(len(run) for run in s.runs)
    if st.passes == 1 and st.steps:  # (a k-way merge, not a fold of tiny runs in memory)
        # Every run's first part is decoded ahead; later ones as the plan has room.
        assert len(s.runs) <= st.parts_decoded_ahead <= parts, (st, parts)
        assert st.bytes_read == sum(p.size for run in s.runs for p in run)


def test_large_steps_are_split_and_parts_decoded_ahead(pool: CountingPool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A read of a few runs of many parts, with room in its plan, decodes every part
    ahead and splits steps of at least ``PARALLEL_STEP_ROWS`` rows (lowered: steps
    here are a few thousand rows); the output equals the whole read's. Without room
    (a 1 MiB budget) a run's first part is decoded ahead (the plan counts one part per
    run), most others only when their run needs them."""
    monkeypatch.setattr(kway_merge, "PARALLEL_STEP_ROWS", 1024)
    s = Shard(7, n_runs=4, rows=6000, part_bytes=32 << 10)
    as_of = s.upper - 1
    want = consolidate(forward_and_filter(s.everything, upper=as_of + 1, since=as_of))
    st = MergeStats()
    got = s.stream(memory_budget=64 * MiB, stats=st, prefetch=pool, since=as_of, upper=as_of + 1)
    assert got.equals(want)
    parts = sum(len(run) for run in s.runs)
    assert parts > len(s.runs)  # (several parts a run: some decoded ahead mid-merge)
    assert st.parts_decoded_ahead == parts == pool.submitted
    assert st.split_steps > 0
    tight = MergeStats()
    got = s.stream(memory_budget=1 * MiB, stats=tight, prefetch=pool, since=as_of, upper=as_of + 1)
    assert got.equals(want)
    assert tight.parts_decoded_ahead < parts, tight


def test_split_keeps_equal_rows_on_one_side() -> None:
    """Rows equal to the pivot go to the upper half in every segment (the halves are
    merged apart: equal rows split across them would not be summed)."""
    a = pa.table({"k": [1, 2, 5, 5, 9], "v": ["a"] * 5, "t": [0, 0, 0, 1, 0]})
    b = pa.table({"k": [5, 5, 6], "v": ["a", "a", "a"], "t": [0, 1, 0]})
    halves = split_segments([a, b], ["k", "v", "t"])
    assert halves is not None
    lo, hi = halves
    assert pa.concat_tables(lo).column("k").to_pylist() == [1, 2]
    assert [x.column("k").to_pylist() for x in hi] == [[5, 5, 9], [5, 5, 6]]


@pytest.mark.parametrize("which", ["first", "last"])
def test_a_corrupt_part_decoded_ahead_fails_typed(pool: CountingPool, which: str) -> None:
    """A part decoded ahead is verified against its checksum like any other: a flipped
    byte in the first part of a run (decoded before the merge starts) or in its last
    (decoded ahead mid-merge) raises ``CorruptionError`` from the stream."""
    s = Shard(3, n_runs=2, rows=3000)
    run = max(s.runs, key=len)
    assert len(run) > 2
    key = run[0 if which == "first" else -1].key
    assert key is not None
    data = bytearray(s.client.blob.get(key) or b"")
    data[len(data) // 2] ^= 0x10
    s.client.raw_blob.delete(key)
    s.client.raw_blob.set(key, bytes(data))
    with pytest.raises(CorruptionError):
        s.stream(memory_budget=1 * MiB, prefetch=pool, since=s.upper - 1, upper=s.upper)
