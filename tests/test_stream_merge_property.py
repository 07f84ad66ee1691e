"""The streaming read's merge (``read_merge.stream_merge``) over random overlapping
sorted runs of many parts each: its output equals the whole read's (every part decoded,
filtered, forwarded and consolidated at once) under a budget small enough for many
merge steps, and a corrupt part of a run fails the stream typed (``CorruptionError``)."""

from __future__ import annotations

import random
import uuid
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

from persist_lib import PersistClient, PersistConfig, ShardId
from persist_lib.errors import CorruptionError
from persist_lib.handles import maintenance as mn
from persist_lib.shard.batch_meta import PartMeta
from persist_lib.shard.consolidate import consolidate, is_consolidated
from persist_lib.shard.memory_plan import MergeStats
from persist_lib.shard.parts import fetch_part
from persist_lib.shard.read_merge import stream_merge
from persist_lib.shard.runs import batch_runs
from persist_lib.shard.time_filters import forward_and_filter

KEY = pa.schema([pa.field("k", pa.int64(), nullable=True)])
VAL = pa.schema([("v", pa.string())])
MiB = 1 << 20


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


@settings(max_examples=10, deadline=None)
@given(
    seed=hs.integers(0, 10_000),
    n_runs=hs.integers(2, 4),
    rows=hs.sampled_from([30, 300, 1000]),
    time_frac=hs.floats(0, 1),
    range_read=hs.booleans(),
)
def test_stream_equals_whole_read(seed: int, n_runs: int, rows: int, time_frac: float, range_read: bool) -> None:
    s = Shard(seed, n_runs, rows)
    if range_read:  # a time range, nothing forwarded
        lower = int(time_frac * (s.upper - 1))
        kw: dict[str, Any] = {"lower": lower, "upper": min(s.upper, lower + 3)}
        want = consolidate(forward_and_filter(s.everything, lower=kw["lower"], upper=kw["upper"]))
    else:  # a snapshot as of a time below the upper, forwarded to it
        as_of = int(time_frac * (s.upper - 1))
        kw = {"since": as_of, "upper": as_of + 1}
        want = consolidate(forward_and_filter(s.everything, upper=as_of + 1, since=as_of))
    st = MergeStats()
    got = s.stream(memory_budget=1 * MiB, stats=st, **kw)
    assert is_consolidated(got)
    assert got.equals(want)
    assert st.bytes_read == sum(p.size for run in s.runs for p in run)


@pytest.mark.parametrize("which", ["first", "last"])
def test_a_corrupt_part_fails_the_stream_typed(which: str) -> None:
    """Every part is verified against its checksum: a flipped byte in the first part of
    a run (read as the merge starts) or in its last (read mid-merge) raises
    ``CorruptionError`` from the stream."""
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
        s.stream(memory_budget=1 * MiB, since=s.upper - 1, upper=s.upper)
