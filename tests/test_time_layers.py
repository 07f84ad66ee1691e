"""Compaction in time layers (``shard.time_layers``): retained history kept as one sorted
run per time range, so a read as of an old time skips the later layers' parts.

Real components throughout: the in-memory blob and consensus of ``mem://`` clients
and a file-blob client for the skipped-parts check.
"""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from persist_lib import Antichain, PersistClient, PersistConfig, ShardId
from persist_lib.handles import maintenance as mn
from persist_lib.shard.batch_meta import HollowBatch, PartMeta
from persist_lib.shard.compactor import forward_time
from persist_lib.shard.consolidate import is_consolidated
from persist_lib.shard.parts import fetch_part
from persist_lib.shard.runs import LAYERED_WRITER_PREFIX, batch_runs
from persist_lib.shard.time_layers import layer_bounds
from tests.support.time_layers import Row, assert_kv_layers, mem_client, model, rows

KEY = pa.schema([("k", pa.int64())])
VAL = pa.schema([("v", pa.string())])



def _client(**cfg: Any) -> PersistClient:
    return mem_client(**cfg)


def _part(tmin: int, tmax: int, count: int) -> PartMeta:
    return PartMeta(key="s/w/p", size=1, count=count, sha256="", tmin=tmin, tmax=tmax)


# ----- planning ---------------------------------------------------------------------


def test_layer_bounds_are_geometric_from_the_newest_end() -> None:
    # 16 commits of 1,000 updates at times 0..15: with 4 layers the bounds sit where
    # 1/8, 1/4 and 1/2 of the updates lie before them.
    parts = [_part(t, t, 1000) for t in range(16)]
    assert layer_bounds(parts, 0, max_layers=4, min_rows=1) == (2, 4, 8)
    assert layer_bounds(parts, 0, max_layers=2, min_rows=1) == (8,)
    # Layers below min_rows are not split off; one layer means no bounds.
    assert layer_bounds(parts, 0, max_layers=4, min_rows=3000) == (4, 8)
    assert layer_bounds(parts, 0, max_layers=1, min_rows=1) == ()
    assert layer_bounds(parts, 0, max_layers=4, min_rows=16_000) == ()


def test_a_layer_spans_two_times_at_least() -> None:
    # Four equal commits: the first layer is the first two (a read as of time 1 reads
    # one run), not one run per commit.
    assert layer_bounds([_part(t, t, 1000) for t in range(4)], 0, max_layers=4, min_rows=1) == (2,)
    # Two times only: nothing to split.
    assert layer_bounds([_part(0, 0, 1000), _part(0, 0, 1000), _part(1, 1, 10)], 0, max_layers=3, min_rows=1) == ()


def test_no_layers_when_the_first_would_hold_too_much() -> None:
    # Four equal commits: the first layer (two commits) would hold half the updates; a
    # read at the latest time would merge two runs to let an old read skip only half.
    four = [_part(t, t, 1000) for t in range(4)]
    assert layer_bounds(four, 0, max_layers=4, min_rows=1, max_first_share=0.25) == ()
    assert layer_bounds(four, 0, max_layers=4, min_rows=1, max_first_share=0.5) == (2,)
    many = [_part(t, t, 1000) for t in range(16)]
    assert layer_bounds(many, 0, max_layers=4, min_rows=1, max_first_share=0.25) == (2, 4, 8)


def test_layer_bounds_collapse_history_below_the_since() -> None:
    parts = [_part(t, t, 1000) for t in range(16)]
    # Everything at or below the since is one time: one layer.
    assert layer_bounds(parts, 15, max_layers=4, min_rows=1) == ()
    # The forwarded history (times 0..11 -> 11: 12,000 updates) is one time: the bounds
    # can't split it, only the 4 newer times are layered after it (2 times a layer).
    assert layer_bounds(parts, 11, max_layers=4, min_rows=1) == (13, 15)
    assert layer_bounds(parts, 11, max_layers=4, min_rows=4096) == ()


def test_layer_bounds_spread_a_one_run_part_evenly() -> None:
    # An older one-run output over times 0..99 is split by its even estimate.
    assert layer_bounds([_part(0, 99, 100_000)], 0, max_layers=3, min_rows=1) == (25, 50)


# ----- the property: every as-of equals the model -----------------------------------


@st.composite
def _histories(draw: Any) -> dict[str, Any]:
    ops = draw(st.lists(st.sampled_from(["append", "append", "append", "since", "compact"]), min_size=4, max_size=24))
    return {
        "ops": ops,
        "layers": draw(st.integers(2, 5)),
        "min_rows": draw(st.integers(1, 40)),
        "in_memory": draw(st.booleans()),
        "first_share": draw(st.sampled_from([0.25, 1.0])),
        "kv_whole": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**32 - 1)),
    }


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_histories())
def test_snapshot_at_every_as_of_equals_the_model(h: dict[str, Any]) -> None:
    """Random appends at many times (keys colliding, retractions), since downgrades and
    compactions that retain history in time layers: the snapshot at every as-of from
    the since to the upper equals the model, every run of every batch is consolidated,
    and a layered batch's runs hold increasing, disjoint time ranges at or above the
    time its history was forwarded to."""
    rng = random.Random(h["seed"])
    client = _client(
        compaction_time_layers=h["layers"], compaction_layer_min_rows=h["min_rows"],
        compaction_in_memory=h["in_memory"], compaction_layer_max_first_share=h["first_share"],
        compaction_layer_kv_whole=h["kv_whole"],
    )
    shard = ShardId.new()
    w, r = client.open(shard, KEY, VAL)
    log: list[Row] = []
    upper = since = 0
    for op in h["ops"] + ["append", "compact"]:
        if op == "append":
            width = rng.choice([1, 1, 3])
            n = rng.randint(1, 60)
            ups = [(rng.randrange(40), f"v{rng.randrange(3)}", upper + rng.randrange(width), rng.choice([1, 1, -1]))
                   for _ in range(n)]
            w.compare_and_append([(((k,), (v,)), t, d) for k, v, t, d in ups], upper, upper + width)
            log += ups
            upper += width
        elif op == "since" and upper > since:
            since = rng.randint(since, upper - 1)
            r.downgrade_since(since)
        elif op == "compact":
            mn.compact(client, shard)
    state = client.machine(shard).fetch_latest()
    for _, b in state.trace_batches():
        prev_tmax = -1
        for run in batch_runs(b):
            t = pa.concat_tables([fetch_part(client.blob, p, w.schemas, str(shard)) for p in run])
            assert is_consolidated(t), (b, run)
            if b.run_splits is not None and not b.kv_disjoint:
                # Layers by row time: each run's times after the previous run's, none below the
                # time the merge forwarded history to.
                times = t.column("t").to_pylist()
                floor = forward_time(b.since, b.upper)
                assert min(times) > prev_tmax and (floor is None or min(times) >= floor), b
                prev_tmax = max(times)
    for as_of in range(since, upper):
        assert rows(r.snapshot(as_of)) == model(log, as_of), as_of
    w.expire()
    r.expire()


# ----- what a layered batch buys, and what older code sees ---------------------------


def _layered_shard(client: PersistClient, commits: int = 16, rows: int = 300) -> tuple[ShardId, Any, Any, list[Row]]:
    shard = ShardId.new()
    w, r = client.open(shard, KEY, VAL)
    rng = random.Random(7)
    log: list[Row] = []
    for t in range(commits):
        ups = [(rng.randrange(2000), f"v{rng.randrange(5)}", t, 1) for _ in range(rows)]
        w.compare_and_append([(((k,), (v,)), tt, d) for k, v, tt, d in ups], t, t + 1)
        log += ups
    mn.compact(client, shard)
    return shard, w, r, log


def test_an_old_as_of_never_fetches_the_later_layers(tmp_path: Path) -> None:
    """The parts of the layers after the as-of are deleted from the blob store, and the
    snapshot as of it still reads (nothing of them is fetched) and equals the model."""
    client = PersistClient.open(
        f"file://{tmp_path}/blob", f"sqlite:///{tmp_path}/c.db",
        PersistConfig.for_tests(compaction_layer_min_rows=1, inline_threshold=0, blob_target_size=4 << 10),
    )
    shard, w, r, log = _layered_shard(client)
    (b,) = [b for _, b in client.machine(shard).fetch_latest().trace_batches()]
    assert b.run_splits and len(batch_runs(b)) >= 3
    as_of = 1
    later = [p for p in b.parts if p.tmin > as_of]
    assert sum(p.count for p in later) > 0.75 * b.len  # most of the batch is after the as-of
    for p in later:
        assert p.key is not None
        client.blob.delete(p.key)
    assert rows(r.snapshot(as_of)) == model(log, as_of)
    w.expire()
    r.expire()
    client.close()


def test_run_splits_round_trip_and_older_states_read() -> None:
    client = _client()
    shard, w, r, log = _layered_shard(client)
    (b,) = [b for _, b in client.machine(shard).fetch_latest().trace_batches()]
    assert b.run_splits and all(k.split("/")[1].startswith(LAYERED_WRITER_PREFIX) for k in b.blob_keys())
    assert HollowBatch.from_json(b.to_json()) == b
    # A state written before run_splits existed has no such key: the batch reads as before.
    old = b.to_json()
    del old["run_splits"]
    assert HollowBatch.from_json(old).run_splits is None
    # Splits that don't fit the parts are dropped (a read hint, never trusted blindly).
    bad = {**b.to_json(), "run_splits": [len(b.parts) + 3]}
    assert HollowBatch.from_json(bad).run_splits is None
    # Without the splits (as code that predates them reads the batch) a layered batch is
    # one run per part, never one run: its writer is not a one-run compactor's.
    stripped = replace(b, run_splits=None)
    assert batch_runs(stripped) == [[p] for p in b.parts]
    w.expire()
    r.expire()


def test_an_empty_batch_merged_into_a_layered_one_keeps_its_runs() -> None:
    from persist_lib.shard.compactor import _metadata_only_output
    from persist_lib.shard.spine import CompactionRequest

    client = _client()
    shard, w, r, log = _layered_shard(client)
    (b,) = [b for _, b in client.machine(shard).fetch_latest().trace_batches()]
    # The compactor's free merge of an empty neighbour (no data rewritten).
    empty = HollowBatch(Antichain([16]), Antichain([20]), Antichain([0]))
    req = CompactionRequest((1, 2), b.lower, empty.upper, Antichain([0]), (b, empty), kind="empty")
    widened = _metadata_only_output(req)
    assert widened.parts == b.parts and widened.run_splits == b.run_splits and widened.upper == Antichain([20])
    assert b.kv_disjoint and widened.kv_disjoint  # (the (k, v)-disjoint mark goes with the runs)
    # An empty append widens the batch in place.
    w.compare_and_append([], 16, 17)
    mn.compact(client, shard)
    (b2,) = [b for _, b in client.machine(shard).fetch_latest().trace_batches()]
    assert b2.upper == Antichain([17]) and b2.parts == b.parts and b2.run_splits == b.run_splits and b2.kv_disjoint
    for as_of in (0, 5, 16):
        assert rows(r.snapshot(as_of)) == model(log, as_of)
    w.expire()
    r.expire()


@pytest.mark.parametrize("in_memory", [True, False])
def test_history_below_the_since_collapses_into_one_layer(in_memory: bool) -> None:
    """Once the since passes every time of a layered batch, the next rewrite forwards
    them to one time: one run again."""
    client = _client(compaction_in_memory=in_memory)
    shard, w, r, log = _layered_shard(client)
    r.downgrade_since(15)
    w.compare_and_append([], 16, 17)
    mn.compact(client, shard)
    (b,) = [b for _, b in client.machine(shard).fetch_latest().trace_batches()]
    assert len(batch_runs(b)) == 1 and {(p.tmin, p.tmax) for p in b.parts} == {(15, 15)}
    assert rows(r.snapshot(15)) == model(log, 15)
    w.expire()
    r.expire()


@pytest.mark.parametrize("kv_whole", [False, True])
def test_a_key_range_merge_writes_time_layers(monkeypatch: pytest.MonkeyPatch, kv_whole: bool) -> None:
    """The key-range merge (``range_merge``, two threads) routes its key-ordered output
    into the layers: the batch is layered, each run consolidated and in its own time
    range (row-time layers) or holding its own (k, v) whole ((k, v)-whole layers), and
    the snapshot at every as-of equals the model."""
    from persist_lib.shard import compactor, range_merge

    monkeypatch.setattr(range_merge, "RANGE_BYTES", 16 << 10)
    monkeypatch.setattr(range_merge, "MIN_RANGE_MERGE_ROWS", 1_000)
    calls: list[int] = []
    plan = compactor.plan_by_ranges

    def counted(*args: Any, **kwargs: Any) -> Any:
        out = plan(*args, **kwargs)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(compactor, "plan_by_ranges", counted)
    client = _client(compaction_layer_kv_whole=kv_whole)
    shard = ShardId.new()
    w, r = client.open(shard, KEY, VAL)
    rng = random.Random(11)
    log: list[Row] = []
    for t in range(16):  # unsorted-looking key order, repeats and retractions across times
        ups = [(rng.randrange(500), f"v{rng.randrange(3)}", t, rng.choice([1, 1, -1])) for _ in range(400)]
        w.compare_and_append([(((k,), (v,)), tt, d) for k, v, tt, d in ups], t, t + 1)
        log += ups
    mn.compact(client, shard)
    assert any(calls), "the key-range merge was not taken"
    (b,) = [b for _, b in client.machine(shard).fetch_latest().trace_batches()]
    assert b.run_splits and len(batch_runs(b)) >= 2 and b.kv_disjoint == kv_whole
    if kv_whole:
        assert_kv_layers(b, client.blob, w.schemas, str(shard))
    prev = -1
    for run in batch_runs(b) if not kv_whole else []:
        t = pa.concat_tables([fetch_part(client.blob, p, w.schemas, str(shard)) for p in run])
        assert is_consolidated(t)
        times = t.column("t").to_pylist()
        assert min(times) > prev
        prev = max(times)
    for as_of in range(16):
        assert rows(r.snapshot(as_of)) == model(log, as_of), as_of
    w.expire()
    r.expire()
