"""The streamed merge of a few sorted runs by key ranges (``range_stream``): over random
histories (retractions, multiplicities, null keys, a leading key shared by many rows,
so that equal keys straddle part boundaries and cuts) its output equals the k-way
merge's (the streamed read before it) and the whole read's, table for table in
``(k, v, t)`` order, at every as-of and over time ranges; a run that is not sorted is
read again with a run per part; a corrupt part fails the stream typed."""

from __future__ import annotations

import dataclasses
import random
import uuid
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

from persist_lib import PersistClient, PersistConfig, ShardId
from persist_lib.errors import CorruptionError
from persist_lib.handles import maintenance as mn
from persist_lib.shard import read_merge
from persist_lib.shard.batch_meta import PartMeta
from persist_lib.shard.codec import Schemas
from persist_lib.shard.consolidate import consolidate, is_consolidated
from persist_lib.shard.memory_plan import MergeStats
from persist_lib.shard.parts import fetch_part
from persist_lib.shard.range_stream import (
    merge_decoded_by_ranges,
    range_stream_applies,
    stream_by_key_ranges,
)
from persist_lib.shard.read_merge import merge_decoded_runs, stream_merge
from persist_lib.shard.runs import batch_runs
from persist_lib.shard.time_filters import forward_and_filter
from tests.test_streaming_reads import _corrupt

MiB = 1 << 20
VAL = pa.schema([("v", pa.string())])
KEYS = {
    "int": pa.schema([pa.field("k", pa.int64(), nullable=True)]),
    "int_str": pa.schema([pa.field("k", pa.int32(), nullable=True), ("s", pa.string())]),
    "str": pa.schema([("k", pa.string())]),
}


def _key(kind: str, rng: random.Random, domain: int) -> tuple[Any, ...]:
    k = None if rng.random() < 0.03 else rng.randint(-5, domain)
    if kind == "int":
        return (k,)
    if kind == "int_str":
        return (k, f"s{rng.randint(0, 3)}")
    return (f"k{k}",)


Update = tuple[tuple[Any, ...], str, int, int]


def _updates(rng: random.Random, log: list[Update], kind: str, domain: int, t: int, n: int) -> list[Update]:
    """``n`` updates at ``t``: a fifth retract an earlier update, the rest insert random
    keys with multiplicities."""
    def one() -> Update:
        if log and rng.random() < 0.2:
            k, v, _, d = rng.choice(log)
            return k, v, t, -d
        return _key(kind, rng, domain), f"v{rng.randint(0, 5)}", t, rng.choice([1, 1, 2, 3])

    return [one() for _ in range(n)]


class Runs:
    """``n_runs`` overlapping sorted runs of random updates: each is two batches (times
    ``2i`` and ``2i + 1``) of a shard of its own compacted into one run of many parts, all
    in one blob. A small key ``domain`` makes many rows share a leading key."""

    def __init__(self, seed: int, kind: str, n_runs: int, rows: int, domain: int) -> None:
        name = uuid.uuid4().hex
        cfg = PersistConfig.for_tests(blob_target_size=4 << 10, inline_threshold=0, compaction_enabled=False)
        self.client = PersistClient.open(f"mem://{name}", f"mem://{name}", cfg)
        rng = random.Random(seed)
        log: list[Update] = []
        self.runs: list[list[PartMeta]] = []
        for i in range(n_runs):
            w, r = self.client.open(ShardId.new(), KEYS[kind], VAL)
            for t in (2 * i, 2 * i + 1):
                ups = _updates(rng, log, kind, domain, t, rows)
                w.compare_and_append([((k, (v,)), tt, d) for k, v, tt, d in ups], 0 if t == 2 * i else t, t + 1)
                log += ups
            mn.compact(self.client, w.shard_id)
            state = self.client.machine(w.shard_id).fetch_latest()
            self.runs += [run for _, b in state.trace_batches() for run in batch_runs(b) if run]
            self.schemas: Schemas = r.schemas
        self.upper = 2 * n_runs
        self.everything = pa.concat_tables([fetch_part(self.client.blob, p, self.schemas, "s") for run in self.runs for p in run])

    def whole(self, **kw: Any) -> pa.Table:
        return consolidate(forward_and_filter(self.everything, **kw))

    def table(self, tables: Iterator[pa.Table]) -> pa.Table:
        got = list(tables)
        return pa.concat_tables(got) if got else self.everything.schema.empty_table()

    def kway(self, monkeypatch: pytest.MonkeyPatch, **kw: Any) -> pa.Table:
        """The k-way merge's stream (the read before ``range_stream``)."""
        with monkeypatch.context() as m:
            m.setattr(read_merge, "RANGE_STREAM_MAX_RUNS", 0)
            return self.table(stream_merge(self.client.blob, self.schemas, shard="s", runs=self.runs,
                                           memory_budget=1 * MiB, **kw))

    def by_ranges(self, range_rows: int, stats: MergeStats, **kw: Any) -> pa.Table:
        kw.setdefault("lower", None)
        kw.setdefault("upper", None)
        kw.setdefault("since", None)
        return self.table(stream_by_key_ranges(self.client.blob, self.schemas, "s", self.runs, stats=stats,
                                               purpose="test read", range_rows=range_rows, **kw))


def _decoded_runs(s: Runs, kw: dict[str, Any]) -> list[pa.Table]:
    """Each run decoded whole, filtered and forwarded (as a whole read hands them on)."""
    return [
        pa.concat_tables([forward_and_filter(fetch_part(s.client.blob, p, s.schemas, "s"), **kw) for p in run])
        for run in s.runs
    ]


def _windows(upper: int) -> list[dict[str, Any]]:
    """Every snapshot as-of below ``upper`` (times forwarded to it) and a few time ranges."""
    snaps = [{"since": a, "upper": a + 1} for a in range(upper)]
    return snaps + [{"lower": lo, "upper": min(upper, lo + 3)} for lo in range(0, upper - 1, 2)]


@settings(max_examples=8, deadline=None)
@given(
    seed=hs.integers(0, 10_000),
    kind=hs.sampled_from(["int", "int_str"]),
    n_runs=hs.integers(2, 4),
    rows=hs.sampled_from([40, 400, 1500]),
    domain=hs.sampled_from([3, 60, 5000]),
    range_rows=hs.sampled_from([1, 7, 100, 1 << 17]),
)
def test_key_ranges_equal_the_kway_merge_at_every_as_of(
    seed: int, kind: str, n_runs: int, rows: int, domain: int, range_rows: int
) -> None:
    mp = pytest.MonkeyPatch()
    s = Runs(seed, kind, n_runs, rows, domain)
    assert range_stream_applies(s.schemas, s.runs)
    for kw in _windows(s.upper):
        st = MergeStats()
        got = s.by_ranges(range_rows, st, **kw)
        want = s.kway(mp, **kw)
        assert is_consolidated(got)
        assert got.equals(want), kw
        assert got.equals(s.whole(**{k: v for k, v in kw.items()}))
        assert st.bytes_read == sum(p.size for run in s.runs for p in run)
        assert st.output_rows == got.num_rows


@settings(max_examples=6, deadline=None)
@given(
    seed=hs.integers(0, 10_000),
    kind=hs.sampled_from(["int", "int_str"]),
    domain=hs.sampled_from([3, 60, 5000]),
    range_rows=hs.sampled_from([1, 7, 100, 1 << 17]),
)
def test_decoded_runs_by_key_ranges_equal_the_kway_merge(seed: int, kind: str, domain: int, range_rows: int) -> None:
    """The whole read's merge of decoded runs (``merge_decoded_runs``) by key ranges
    equals its k-way merge at every as-of."""
    s = Runs(seed, kind, 3, 400, domain)
    for kw in _windows(s.upper):
        runs = _decoded_runs(s, kw)
        st = MergeStats()
        got = merge_decoded_by_ranges(runs, s.schemas, st, range_rows)
        with pytest.MonkeyPatch.context() as m:
            m.setattr(read_merge, "RANGE_MERGE_MIN_ROWS", 1 << 62)
            want = merge_decoded_runs(s.schemas, "s", runs, 64 * MiB, MergeStats())
        assert got is not None and want is not None
        g, w = s.table(iter(got)), s.table(iter(want))
        assert is_consolidated(g)
        assert g.equals(w), kw
        assert g.equals(s.whole(**kw))
        assert st.output_rows == g.num_rows


def test_decoded_runs_out_of_order_are_left_to_the_caller() -> None:
    s = Runs(2, "int", 2, 400, 5000)
    runs = _decoded_runs(s, {"since": s.upper - 1, "upper": s.upper})
    runs[0] = runs[0].take(pa.array(list(range(runs[0].num_rows - 1, -1, -1))))
    assert merge_decoded_by_ranges(runs, s.schemas, MergeStats()) is None
    assert merge_decoded_runs(s.schemas, "s", runs, 64 * MiB, MergeStats()) is None


@pytest.mark.parametrize("kind", ["int", "int_str"])
def test_stream_merge_takes_the_key_ranges_within_its_budget(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``stream_merge`` reads a few sorted runs by key ranges (``key_ranges`` counted, no
    merge steps of the k-way engine), with the same rows as the k-way merge."""
    s = Runs(11, kind, 3, 1500, 200)
    for kw in ({"since": 2, "upper": 3}, {"since": s.upper - 1, "upper": s.upper}):
        st = MergeStats()
        got = s.table(stream_merge(s.client.blob, s.schemas, shard="s", runs=s.runs, memory_budget=1 * MiB,
                                   stats=st, **kw))
        assert st.key_ranges > 0 and st.fan_in == len(s.runs)
        assert got.equals(s.kway(monkeypatch, **kw))
        assert got.equals(s.whole(**kw))


def test_a_string_leading_key_keeps_the_kway_merge(monkeypatch: pytest.MonkeyPatch) -> None:
    s = Runs(5, "str", 3, 400, 100)
    assert not range_stream_applies(s.schemas, s.runs)
    st = MergeStats()
    kw = {"since": s.upper - 1, "upper": s.upper}
    got = s.table(stream_merge(s.client.blob, s.schemas, shard="s", runs=s.runs, memory_budget=1 * MiB,
                               stats=st, **kw))
    assert st.key_ranges == 0
    assert got.equals(s.whole(**kw))


@pytest.mark.parametrize("swap", [(0, -1), (0, 1)])
@pytest.mark.parametrize("recorded", [True, False])
def test_a_run_out_of_order_is_read_again_or_fails_typed(swap: tuple[int, int], recorded: bool) -> None:
    """A run whose parts are not in order (a faulty writer's). With the parts' recorded
    key bounds, found before anything is read: ``stream_merge`` reads a run per part
    instead (the right rows). Without them, found when the run's next part is taken:
    then, as with the k-way merge, a run per part if nothing was yielded yet, else a
    ``CorruptionError`` (rows handed out can't be taken back). Never wrong rows."""
    s = Runs(7, "int", 2, 1500, 5000)
    run = max(s.runs, key=len)
    assert len(run) > 2
    i, j = swap
    run[i], run[j] = run[j], run[i]
    if not recorded:
        run[:] = [dataclasses.replace(p, stats=None) for p in run]
    st = MergeStats()
    kw = {"since": s.upper - 1, "upper": s.upper}
    tables: list[pa.Table] = []
    try:
        for t in stream_merge(s.client.blob, s.schemas, shard="s", runs=s.runs, memory_budget=1 * MiB,
                              stats=st, **kw):
            tables.append(t)
    except CorruptionError:
        assert tables and not st.restarted_per_part and not recorded
    else:
        assert st.restarted_per_part
        assert pa.concat_tables(tables).equals(s.whole(**kw))


@pytest.mark.parametrize("which", ["first", "last"])
def test_a_corrupt_part_fails_the_key_range_stream_typed(which: str) -> None:
    """Every part is verified: a flipped byte in a run's first part (read as the stream
    starts) or its last (decoded ahead, mid-stream) raises ``CorruptionError``."""
    s = Runs(3, "int", 2, 1500, 5000)
    part = max(s.runs, key=len)[0 if which == "first" else -1]
    assert part.key is not None
    _corrupt(s.client, part.key)
    with pytest.raises(CorruptionError):
        s.by_ranges(1000, MergeStats(), since=s.upper - 1, upper=s.upper)
