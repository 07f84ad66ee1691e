"""Bounded-memory reads: ``snapshot_batches`` / ``updates_between_batches`` (streams that
hold their seqno hold while open), chunked ``Listen.next``, and the read merge
(``read_merge.stream_merge``) with its local spill files.

Budgets here are tiny (1 MiB) and parts small (16 KiB), so every read goes through the
k-way merge of many runs, with intermediate passes spilled to local files.
"""

from __future__ import annotations

import gc
import os
import random
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from persist_lib import Antichain, PersistClient, PersistConfig, ShardId
from persist_lib.errors import CorruptionError, InvalidUsage, Timeout
from persist_lib.handles import maintenance as mn
from persist_lib.handles.batch_stream import BatchStream
from persist_lib.handles.listen import ListenProgress, ListenUpdates
from persist_lib.handles.read import ReadHandle
from persist_lib.handles.read_plan import whole_read_bytes
from persist_lib.shard.consolidate import consolidate, is_consolidated
from persist_lib.shard.memory_plan import MergeStats
from persist_lib.shard.parts import fetch_part
from persist_lib.shard.read_merge import stream_merge
from persist_lib.shard.runs import batch_runs
from persist_lib.shard.time_filters import forward_and_filter
from persist_lib.storage import StorageController

KEY = pa.schema([("k", pa.int64())])
VAL = pa.schema([("v", pa.string())])
MiB = 1 << 20
BUDGET = 1 * MiB

Row = tuple[int, str, int, int]


def mem_client(**cfg: Any) -> PersistClient:
    name = uuid.uuid4().hex
    base: dict[str, Any] = {"blob_target_size": 16 << 10, "inline_threshold": 0}
    return PersistClient.open(f"mem://{name}", f"mem://{name}", PersistConfig.for_tests(**{**base, **cfg}))


def rows(table: pa.Table) -> list[Row]:
    return sorted((r["k"], r["v"], r["ts"], r["diff"]) for r in table.to_pylist())


def model_snapshot(log: list[Row], as_of: int) -> list[Row]:
    c: Counter[tuple[int, str]] = Counter()
    for k, v, t, d in log:
        if t <= as_of:
            c[(k, v)] += d
    return sorted((k, v, as_of, d) for (k, v), d in c.items() if d)


def model_range(log: list[Row], lower: int, upper: int) -> list[Row]:
    c: Counter[tuple[int, str, int]] = Counter()
    for k, v, t, d in log:
        if lower <= t < upper:
            c[(k, v, t)] += d
    return sorted((k, v, t, d) for (k, v, t), d in c.items() if d)


class Fixture:
    """A shard of many batches and parts: inserts, retractions of earlier inserts,
    duplicates across parts; compacted once with the since past half of it (so times
    below the since were forwarded), then appended to again."""

    def __init__(self, seed: int, batches: int = 24) -> None:
        # Odd seeds keep tiny parts inline in state (mixed with blob parts).
        self.client = mem_client(inline_threshold=2048 if seed % 2 else 0)
        self.shard = ShardId.new()
        self.w, self.r = self.client.open(self.shard, KEY, VAL)
        rng = random.Random(seed)
        self.log: list[Row] = []
        t = 0
        for i in range(batches):
            width = rng.randint(1, 3)
            n = rng.choice([40, 600, 2500])
            ups: list[Row] = []
            for _ in range(n):
                tt = rng.randint(t, t + width - 1)
                if self.log and rng.random() < 0.25:  # retract something inserted before
                    k, v, _, _ = rng.choice(self.log)
                    ups.append((k, v, tt, -1))
                else:
                    ups.append((rng.randint(0, 1500), f"v{rng.randint(0, 3)}", tt, rng.choice([1, 1, 2])))
            self.w.compare_and_append([(((k,), (v,)), tt, d) for k, v, tt, d in ups], t, t + width)
            self.log += ups
            t += width
            if i == batches // 2:
                self.since = t - 2
                self.r.downgrade_since(self.since)
                mn.compact(self.client, self.shard)
        self.upper = t

    def as_ofs(self) -> list[int]:
        return sorted({self.since, self.since + 1, (self.since + self.upper) // 2, self.upper - 1})


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_snapshot_batches_equal_snapshot(seed: int) -> None:
    f = Fixture(seed)
    s = f.client.machine(f.shard).fetch_latest()
    parts = [p for _, b in s.trace_batches() for p in b.parts]
    assert len(parts) > 20 and any(len(b.parts) > 1 for _, b in s.trace_batches())
    if seed % 2 == 0:
        assert any(len(batch_runs(b)) == 1 and len(b.parts) > 1 for _, b in s.trace_batches()), "a compacted run"
    else:
        assert any(p.inline is not None for p in parts) and any(p.key is not None for p in parts)
    assert whole_read_bytes(parts, f.r.schemas) > BUDGET, "the budget must force the streaming merge"
    for as_of in f.as_ofs():
        want = model_snapshot(f.log, as_of)
        whole = f.r.snapshot(as_of, memory_budget=1 << 40)  # decoded whole
        with f.r.snapshot_batches(as_of, memory_budget=BUDGET) as stream:
            batches = list(stream)
        got = pa.Table.from_batches(batches, schema=stream.schema)
        assert stream.schema == whole.schema
        st = stream.stats
        runs = [r for _, b in s.trace_batches() if b.lower.less_equal(as_of) for r in batch_runs(b)]
        if len(runs) > 1:  # the k-way merge ran (not a whole decode), within the budget
            assert st.passes >= 1 and st.steps > 1 and st.output_rows >= got.num_rows, st
        else:  # one sorted run (the compacted batch): checked linearly, never merged
            assert st.runs == 1 and st.passes == 0 and st.output_rows == got.num_rows, st
        assert st.peak_bytes_held <= BUDGET, st
        assert rows(whole) == want
        assert rows(got) == want, f"as of {as_of}"
        # Consolidated: every (k, v) once, nonzero diffs, times forwarded to as_of.
        kv = [(r["k"], r["v"]) for r in got.to_pylist()]
        assert len(kv) == len(set(kv))
        assert all(b.num_rows for b in batches)
        assert rows(f.r.snapshot(as_of, memory_budget=BUDGET)) == want  # the table built from the stream
        assert f.r._held_seqnos() == {}


@pytest.mark.parametrize("seed", [4, 5])
def test_updates_between_batches_equal_updates_between(seed: int) -> None:
    f = Fixture(seed)
    for lower, upper in [(f.since + 1, f.upper), (f.since + 1, f.since + 4), (f.upper - 3, f.upper)]:
        want = model_range(f.log, lower, upper)
        whole = f.r.updates_between(lower, upper, memory_budget=1 << 40)
        stream = f.r.updates_between_batches(lower, upper, memory_budget=BUDGET)
        batches = list(stream)
        assert stream.closed and f.r._held_seqnos() == {}
        assert rows(whole) == want
        assert rows(pa.Table.from_batches(batches, schema=stream.schema)) == want
        for b in batches:  # each record batch sorted by time, within the range
            ts = b.column("ts").to_pylist()
            assert ts == sorted(ts) and all(lower <= t < upper for t in ts)
        big = f.r.updates_between(lower, upper, memory_budget=BUDGET)
        assert rows(big) == want
        assert big.column("ts").to_pylist() == sorted(big.column("ts").to_pylist())
    assert f.r.updates_between_batches(3, 3).read_all().num_rows == 0


def _reader_hold(client: PersistClient, shard: ShardId, r: ReadHandle) -> int:
    return client.machine(shard).fetch_latest().leased_readers[r.reader_id].seqno


def test_stream_holds_its_seqno_until_exhausted_and_gc_waits() -> None:
    f = Fixture(7, batches=10)
    as_of = f.upper - 1
    want = model_snapshot(f.log, as_of)
    stream = f.r.snapshot_batches(as_of, memory_budget=BUDGET)
    first = next(stream)
    (held,) = f.r._held_seqnos()
    # Compaction replaces every batch the stream reads; GC must not delete them.
    w2 = f.client.open_writer(f.shard, KEY, VAL)
    for t in range(f.upper, f.upper + 4):
        w2.compare_and_append([(((1,), ("x",)), t, 1)], t, t + 1)
    mn.compact(f.client, f.shard)
    f.r.heartbeat()
    assert _reader_hold(f.client, f.shard, f.r) <= held
    mn.gc(f.client, f.shard)
    rest = list(stream)  # every part it planned to read is still there
    assert rows(pa.Table.from_batches([first, *rest])) == want
    assert stream.closed and f.r._held_seqnos() == {}
    before = f.client.machine(f.shard).fetch_latest().seqno
    f.r.heartbeat()
    assert _reader_hold(f.client, f.shard, f.r) >= before > held, "released: the hold moves up"
    w2.heartbeat()
    assert mn.gc(f.client, f.shard)["blobs_deleted"] > 0, "now the replaced parts go"


@pytest.mark.parametrize("how", ["close", "with", "del", "never_started", "handle_expired"])
def test_stream_released_when_stopped_early(how: str) -> None:
    f = Fixture(8, batches=10)
    as_of = f.upper - 1
    stream: BatchStream | None = f.r.snapshot_batches(as_of, memory_budget=BUDGET)
    assert stream is not None and len(f.r._held_seqnos()) == 1
    if how == "close":
        next(stream)
        stream.close()
        stream.close()  # idempotent
        assert list(stream) == []
    elif how == "with":
        with stream as s:
            for _ in s:
                break
    elif how == "del":
        next(stream)
        stream = None
        gc.collect()
    elif how == "never_started":
        stream = None
        gc.collect()
    elif how == "handle_expired":
        next(stream)
        f.r.expire()
        with pytest.raises(InvalidUsage, match="expired"):
            list(stream)
        assert stream.closed
        return
    assert f.r._held_seqnos() == {}
    f.w.compare_and_append([(((1,), ("x",)), f.upper, 1)], f.upper, f.upper + 1)
    before = f.client.machine(f.shard).fetch_latest().seqno
    f.r.heartbeat()
    assert _reader_hold(f.client, f.shard, f.r) >= before


def test_bad_arguments_raise_before_iteration() -> None:
    client = mem_client()
    shard = ShardId.new()
    w, r = client.open(shard, KEY, VAL)
    w.compare_and_append([(((1,), ("a",)), 0, 1)], 0, 5)
    r.downgrade_since(3)
    with pytest.raises(InvalidUsage, match="before this reader's since"):
        r.snapshot_batches(2)
    with pytest.raises(Timeout):
        r.snapshot_batches(7, timeout_s=0.05)
    with pytest.raises(InvalidUsage, match="memory_budget"):
        r.snapshot_batches(3, memory_budget=1000)
    with pytest.raises(InvalidUsage, match="as_of must be"):
        r.snapshot_batches(-1)
    with pytest.raises(InvalidUsage, match="backwards"):
        r.updates_between_batches(4, 3)
    with pytest.raises(InvalidUsage, match="not beyond"):
        r.updates_between_batches(3, 5)
    with pytest.raises(Timeout):
        r.updates_between_batches(4, 9, timeout_s=0.05)
    with pytest.raises(InvalidUsage, match="before this reader's since"):
        r.listen(2)
    with pytest.raises(InvalidUsage, match="memory_budget"):
        r.listen(3, memory_budget=5)
    assert r._held_seqnos() == {}, "a failed call leaves no hold behind"
    assert rows(r.snapshot_batches(3).read_all()) == [(1, "a", 3, 1)]
    r.expire()
    with pytest.raises(InvalidUsage, match="expired"):
        r.snapshot_batches(3)


def test_reads_at_the_upper_wait_instead_of_returning_incomplete_data() -> None:
    """The boundary of the upper check: with upper 5, time 5 is not complete yet, so a
    snapshot at ``as_of == 5`` (and a range reaching past 5) must wait (here: time out),
    while ``as_of == 4`` is complete and returns at once."""
    client = mem_client()
    shard = ShardId.new()
    w, r = client.open(shard, KEY, VAL)
    w.compare_and_append([(((1,), ("a",)), 0, 1), (((2,), ("b",)), 4, 1)], 0, 5)
    assert r.upper == Antichain([5])
    for read in (
        lambda: r.snapshot(5, timeout_s=0.05),
        lambda: r.snapshot_batches(5, timeout_s=0.05),
        lambda: r.updates_between(0, 6, timeout_s=0.05),
        lambda: r.updates_between_batches(0, 6, timeout_s=0.05),
    ):
        with pytest.raises(Timeout, match="upper to pass 5"):
            read()
    assert r._held_seqnos() == {}, "a timed-out read leaves no hold behind"
    assert rows(r.snapshot(4, timeout_s=0.05)) == [(1, "a", 4, 1), (2, "b", 4, 1)]
    assert rows(r.snapshot_batches(4, timeout_s=0.05).read_all()) == [(1, "a", 4, 1), (2, "b", 4, 1)]
    assert sorted(rows(r.updates_between(0, 5, timeout_s=0.05))) == [(1, "a", 0, 1), (2, "b", 4, 1)]
    # Once the upper passes 5, the snapshot at 5 sees the update at 5.
    w.compare_and_append([(((3,), ("c",)), 5, 1)], 5, 6)
    assert rows(r.snapshot(5, timeout_s=0.05)) == [(1, "a", 5, 1), (2, "b", 5, 1), (3, "c", 5, 1)]


def test_listen_hands_a_large_range_out_in_bounded_chunks() -> None:
    f = Fixture(9, batches=16)
    as_of = f.since
    listen = f.r.listen(as_of, memory_budget=BUDGET)
    reference = f.r.listen(as_of)  # default budget: the range in one event
    acc: list[Row] = []
    frontier = as_of + 1
    calls = 0
    per_range: Counter[tuple[int | None, int | None]] = Counter()
    while listen.frontier.time is not None and listen.frontier.time < f.upper:
        events = listen.next(timeout_s=1.0)
        calls += 1
        assert events, "a pending range always has events"
        assert sum(e.table.nbytes for e in events if isinstance(e, ListenUpdates)) <= BUDGET
        for e in events:
            if isinstance(e, ListenUpdates):
                assert e.lower.time == frontier
                ts = e.table.column("ts").to_pylist()
                assert ts == sorted(ts), "each chunk in time order"
                assert all(frontier <= t < (e.upper.time or 1 << 62) for t in ts), "never before progress"
                per_range[(e.lower.time, e.upper.time)] += 1
                acc += [(r["k"], r["v"], r["ts"], r["diff"]) for r in e.table.to_pylist()]
            else:
                assert isinstance(e, ListenProgress) and e.upper.time is not None
                assert e.upper.time > frontier
                frontier = e.upper.time
                got = sorted((k, v, t, d) for (k, v, t), d in _sum(acc).items() if d)
                assert got == model_range(f.log, as_of + 1, frontier), f"at progress {frontier}"
        if listen._pending is not None:
            assert f.r._held_seqnos(), "the pending range holds its seqno"
    assert frontier == f.upper
    assert calls > 1 and max(per_range.values()) > 1, "a large batch came in several chunks"
    assert f.r._held_seqnos() == {}
    ref = [e for e in reference.next(1.0) if isinstance(e, ListenUpdates)]
    assert len(ref) == 1 and rows(ref[0].table) == sorted(acc)
    # Small ranges afterwards are read as before: one update event, then progress.
    f.w.compare_and_append([(((1,), ("x",)), f.upper, 1)], f.upper, f.upper + 1)
    events = listen.next(1.0)
    assert [type(e) for e in events] == [ListenUpdates, ListenProgress]
    assert rows(events[0].table) == [(1, "x", f.upper, 1)]


def test_listen_close_releases_a_pending_range() -> None:
    f = Fixture(10, batches=12)
    with f.r.listen(f.since, memory_budget=BUDGET) as listen:
        listen.next(1.0)
        assert listen._pending is not None and f.r._held_seqnos()
    assert f.r._held_seqnos() == {}
    with pytest.raises(InvalidUsage, match="closed"):
        listen.next(1.0)


def _corrupt(client: PersistClient, key: str) -> None:
    data = bytearray(client.blob.get(key) or b"")
    data[len(data) // 2] ^= 0x10
    client.raw_blob.delete(key)
    client.raw_blob.set(key, bytes(data))


@pytest.mark.parametrize("where", ["first", "last"])
def test_listen_failing_mid_range(where: str) -> None:
    """A failure before any update of the pending range was handed out leaves the listen
    at its frontier (a retry reads the same); after some were, it refuses to go on
    (going on would repeat them)."""
    client = mem_client(compaction_time_layers=1)  # (no time layers: one run)
    shard = ShardId.new()
    w, r = client.open(shard, KEY, VAL)
    for t in range(3):
        w.compare_and_append([(((i,), (f"v{t}",)), t, 1) for i in range(7000)], t, t + 1)
    mn.compact(client, shard)  # one batch [0, 3): one sorted run of many parts
    (b,) = [b for _, b in client.machine(shard).fetch_latest().trace_batches()]
    assert len(batch_runs(b)) == 1 and len(b.parts) > 20
    key = b.parts[0 if where == "first" else -1].key
    assert key is not None
    _corrupt(client, key)
    listen = r.listen(0, memory_budget=BUDGET)
    handed = 0
    with pytest.raises(CorruptionError):
        for _ in range(100):
            handed += sum(1 for e in listen.next(1.0) if isinstance(e, ListenUpdates))
    assert listen.frontier == Antichain([1]) and r._held_seqnos() == {}
    if where == "first":
        assert handed == 0
        with pytest.raises(CorruptionError):
            listen.next(1.0)  # not dead: it tries again (and finds the same corruption)
    else:
        assert handed > 0
        with pytest.raises(InvalidUsage, match="repeat"):
            listen.next(1.0)


def _sum(acc: list[Row]) -> Counter[tuple[int, str, int]]:
    c: Counter[tuple[int, str, int]] = Counter()
    for k, v, t, d in acc:
        c[(k, v, t)] += d
    return c


def test_stream_merge_spills_intermediate_runs_to_local_files(tmp_path: Path) -> None:
    f = Fixture(11, batches=20)
    s = f.client.machine(f.shard).fetch_latest()
    runs = [run for _, b in s.trace_batches() for run in batch_runs(b)]
    everything = pa.concat_tables(
        [fetch_part(f.client.blob, p, f.r.schemas, str(f.shard)) for run in runs for p in run]
    )
    as_of = f.upper - 2
    want = consolidate(forward_and_filter(everything, upper=as_of + 1, since=as_of))
    st = MergeStats()
    got = pa.concat_tables(
        list(
            stream_merge(
                f.client.blob, f.r.schemas, shard=str(f.shard), runs=runs, memory_budget=BUDGET,
                since=as_of, upper=as_of + 1, spill_dir=str(tmp_path), stats=st,
            )
        )
    )
    assert st.intermediate_bytes > 0 and st.passes > 1, st
    assert is_consolidated(got) and got.equals(want)
    assert os.listdir(tmp_path) == [], "spill files are deleted when the stream ends"
    # Closed early: its spill directory goes too.
    it = stream_merge(
        f.client.blob, f.r.schemas, shard=str(f.shard), runs=runs, memory_budget=BUDGET,
        since=as_of, spill_dir=str(tmp_path),
    )
    next(it)
    assert os.listdir(tmp_path)
    it.close()  # type: ignore[attr-defined]
    assert os.listdir(tmp_path) == []


def test_collection_snapshot_batches() -> None:
    client = mem_client()
    ctl = StorageController(client)
    ctl.create_collection("c", KEY, VAL, num_shards=3)
    w = ctl.open_writer("c")
    rng = random.Random(12)
    log: list[Row] = []
    for t in range(8):
        ups = [(rng.randint(0, 3000), f"v{rng.randint(0, 2)}", t, rng.choice([1, 1, -1])) for _ in range(3000)]
        w.append([(((k,), (v,)), tt, d) for k, v, tt, d in ups], t, t + 1)
        log += ups
    reader = ctl.acquire_read_handle("c")
    for as_of in (3, 7):
        want = model_snapshot(log, as_of)
        stream = reader.snapshot_batches(as_of, memory_budget=BUDGET)
        assert rows(stream.read_all()) == want == rows(reader.snapshot(as_of))
    shard_readers = [r for rend in ctl.describe("c")["renditions"] for r in reader.rendition_readers(rend)]
    stream = reader.snapshot_batches(7, memory_budget=BUDGET)
    next(stream)
    assert any(r._held_seqnos() for r in shard_readers)
    stream.close()
    assert all(r._held_seqnos() == {} for r in shard_readers)
    with pytest.raises(InvalidUsage):
        reader.snapshot_batches(-1)
    with pytest.raises(Timeout):
        reader.snapshot_batches(50, timeout_s=0.05)
    assert Antichain([8]) == reader._rendition_upper(ctl.describe("c")["active_rendition"])
