"""Splits that know their parts' runs (``SnapshotSplit.runs``): a shard compacted into
(k, v)-whole time layers is one batch of runs that share no ``(k, v)``, so the parallel
SQL scan (``sql.parallel_scan``) and Spark's key-range splits (``spark.disjoint_splits``)
check key-disjointness within each run only (``split_overlap.grouped_overlaps``).

Real components: ``mem://`` clients (in-memory blob and consensus) for the property
test; a ``file://`` blob and Spark ``local[2]`` for the one Spark test.
"""

from __future__ import annotations

import pickle
import random
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from persist_lib import PersistClient, PersistConfig, ShardId
from persist_lib.errors import InvalidUsage
from persist_lib.handles import maintenance as mn
from persist_lib.handles.read import ReadHandle
from persist_lib.handles.read_plan import concatenating_batch
from persist_lib.handles.split_overlap import grouped_overlaps
from persist_lib.handles.splits import SnapshotSplit
from persist_lib.shard.runs import batch_runs
from persist_lib.spark.disjoint_splits import key_range_splits
from persist_lib.sql.parallel_scan import ScanHolds, parallel_snapshot
from tests.support.time_layers import Row, kv_of, mem_client, model, rows

pytest_plugins = ["tests.spark_fixtures"]

KEY = pa.schema([("k", pa.int64())])
VAL = pa.schema([("v", pa.string())])


def _history(client: PersistClient, seed: int, commits: int, per_commit: int, keys: int) -> tuple[Any, Any, list[Row]]:
    """``commits`` commits of updates (retractions, multiplicities, a (k, v) updated at
    several times; commit ``t`` draws from ``keys * (t + 1)`` keys, so later commits
    bring new (k, v)s for the later layers), compacted with the history retained."""
    rng = random.Random(seed)
    shard = ShardId.new()
    w, r = client.open(shard, KEY, VAL)
    log: list[Row] = []
    for t in range(commits):
        ups = [(rng.randrange(keys * (t + 1)), f"v{rng.randrange(2)}", t, rng.choice([1, 1, 2, -1])) for _ in range(per_commit)]
        w.compare_and_append([(((k,), (v,)), tt, d) for k, v, tt, d in ups], t, t + 1)
        log += ups
    mn.compact(client, shard)
    return w, r, log


def _batches(r: ReadHandle) -> list[Any]:
    return [b for _, b in r._machine.fetch_latest().trace_batches()]


def _scan(r: ReadHandle, as_of: int) -> pa.Table | None:
    stream = parallel_snapshot(r, ScanHolds(r), as_of, memory_budget=None, timeout_s=None, filter=None,
                               columns=None, workers=2)
    return None if stream is None else stream.read_all()


def _check_splits(r: ReadHandle, as_of: int, n: int, blob: Any) -> SnapshotSplit:
    """Key-range splits at ``as_of``: none shares a ``(k, v)`` with another, together the
    snapshot. Returns the one split of ``snapshot_splits(as_of, 1)``."""
    want = rows(r.snapshot(as_of))
    (one,) = r.snapshot_splits(as_of, 1)
    ranged = key_range_splits(r.snapshot_splits(as_of, n), r.schemas, n)
    assert ranged is not None and 1 <= len(ranged) <= n
    fetched = [s.fetch(blob) for s in ranged]
    seen: set[tuple[Any, ...]] = set()
    for t in fetched:
        kvs = set(kv_of(t.select(["k", "v"])))
        assert not seen & kvs, "a (k, v) in two splits"
        seen |= kvs
    assert rows(pa.concat_tables(fetched)) == want, as_of
    r.release_splits()
    return one


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), commits=st.integers(3, 6), layers=st.integers(2, 4),
       keys=st.sampled_from([100, 400]), n=st.integers(1, 5))
def test_scan_and_key_range_splits_of_marked_layers_equal_the_snapshot(
    seed: int, commits: int, layers: int, keys: int, n: int
) -> None:
    """At every as-of (including those that read only the older layers) the parallel
    SQL scan and the key-range splits give the snapshot; the splits carry run indices
    exactly when the read keeps the parts of one marked batch."""
    client = mem_client(compaction_time_layers=layers, compaction_layer_max_first_share=1.0,
                        compaction_layer_kv_whole=True)
    w, r, log = _history(client, seed, commits, 1200, keys)
    (b,) = _batches(r)
    assert b.runs_concatenate
    grouped = 0
    for as_of in range(commits):
        one = _check_splits(r, as_of, n, client.blob)
        marked = concatenating_batch(r._machine.fetch_latest(), as_of, lambda p: True)
        assert (one.runs is not None) == (marked is not None)
        if one.runs is not None:
            # Each part's index is its run's in the batch.
            want = {p.key: i for i, run in enumerate(batch_runs(b)) for p in run}
            assert [want[p.key] for p in one.parts] == list(one.runs)
            grouped += len(set(one.runs)) > 1
        got = _scan(r, as_of)
        if one.runs is not None and len(one.parts) > 1:
            assert got is not None, "marked layers: the parallel scan applies"
        if got is not None:
            assert rows(got) == model(log, as_of), as_of
        r.release_splits()
    assert grouped, "some as-of reads several layers"
    w.expire()
    r.expire()


def test_unmarked_layers_never_take_the_grouped_path() -> None:
    """Row-time layers (not (k, v)-disjoint) and a marked batch plus a later batch:
    the splits carry no run indices, the parts' overlapping ranges refuse the grouped
    check, and the scan falls back to the streaming read."""
    client = mem_client(compaction_time_layers=3, compaction_layer_max_first_share=1.0,
                        compaction_layer_kv_whole=False)
    w, r, log = _history(client, 7, 4, 1200, 200)
    (b,) = _batches(r)
    assert not b.kv_disjoint and len(batch_runs(b)) > 1
    (s,) = r.snapshot_splits(3, 1)
    assert s.runs is None
    assert grouped_overlaps(s.parts, s.runs, r.schemas) is None
    assert _scan(r, 3) is None
    assert key_range_splits(r.snapshot_splits(3, 2), r.schemas, 2) is None
    r.release_splits()
    w.expire()
    r.expire()
    marked = mem_client(compaction_time_layers=3, compaction_layer_max_first_share=1.0,
                        compaction_layer_kv_whole=True, compaction_enabled=False)
    w, r, log = _history(marked, 8, 4, 1200, 200)
    assert _batches(r)[0].runs_concatenate
    w.compare_and_append([(((1,), ("v0",)), 4, 1)], 4, 5)  # a second batch: runs no longer enough
    (s,) = r.snapshot_splits(4, 1)
    assert s.runs is None and s == pickle.loads(pickle.dumps(s))
    assert rows(s.fetch(marked.blob)) == model([*log, (1, "v0", 4, 1)], 4)
    r.release_splits()
    w.expire()
    r.expire()


def test_run_indices_must_match_the_parts_and_stay_out_of_the_repr() -> None:
    client = mem_client(compaction_time_layers=3, compaction_layer_max_first_share=1.0,
                        compaction_layer_kv_whole=True)
    w, r, _ = _history(client, 9, 4, 1200, 200)
    (s,) = r.snapshot_splits(3, 1)
    assert s.runs is not None and pickle.loads(pickle.dumps(s)) == s
    assert f"runs={len(set(s.runs))}" in repr(s) and "mem://" in repr(s)
    with pytest.raises(InvalidUsage, match="run indices"):
        SnapshotSplit(s.blob_uri, s.shard_id, s.schemas_json, s.as_of, s.parts, runs=(0,) * (len(s.parts) + 1))
    # A split pickled by code that predates the field (no "runs" in its state) reads
    # as one group of parts, with the same rows.
    old = SnapshotSplit.__new__(SnapshotSplit)
    old.__dict__.update({k: v for k, v in s.__dict__.items() if k != "runs"})
    revived = pickle.loads(pickle.dumps(old))
    assert revived.runs is None and rows(revived.fetch(client.blob)) == rows(s.fetch(client.blob))
    r.release_splits()
    w.expire()
    r.expire()


@pytest.mark.spark
@pytest.mark.parametrize("as_of", [0, 3])
def test_spark_read_of_marked_layers_equals_the_snapshot(spark: Any, tmp_path: Path, as_of: int) -> None:
    """``read_snapshot`` of a shard compacted into (k, v)-whole layers takes the
    key-range splits (no cross-split group) and equals the snapshot, at the oldest time
    (one layer read) and the latest (every layer)."""
    from persist_lib.spark import read_snapshot
    from tests.test_spark_key_range_splits import _plan

    cfg = PersistConfig.for_tests(
        blob_target_size=4 << 10, inline_threshold=0, compaction_layer_min_rows=1, compaction_time_layers=3,
        compaction_layer_max_first_share=1.0, compaction_layer_kv_whole=True,
    )
    client = PersistClient.open(f"file://{tmp_path}/blob", f"sqlite:///{tmp_path}/c.db", cfg)
    w, r, log = _history(client, 11, 4, 1200, 200)
    assert _batches(r)[0].runs_concatenate
    df = read_snapshot(spark, r, as_of, num_splits=3, materialize=False)
    assert "Exchange" not in _plan(df) and "Aggregate" not in _plan(df)
    assert rows(pa.Table.from_pylist([x.asDict() for x in df.collect()])) == model(log, as_of)
    r.release_splits()
    w.expire()
    r.expire()
    client.close()


@pytest.mark.parametrize("n", [2, 3])
def test_key_range_splits_of_uneven_layers_are_balanced_by_bytes(n: int) -> None:
    """Three layers of unequal sizes, each of several parts: the splits are cut at the
    gaps inside every run and packed by bytes, so no split holds more than its share
    plus one part (whole runs as the units left one split with most of the bytes)."""
    client = mem_client(compaction_time_layers=3, compaction_layer_max_first_share=1.0,
                        compaction_layer_kv_whole=True)
    w, r, _ = _history(client, 5, 4, 3000, 2000)
    planned = r.snapshot_splits(3, 4)
    parts = [p for s in planned for p in s.parts]
    assert planned[0].runs is not None and len(set(planned[0].runs)) > 1
    ranged = key_range_splits(planned, r.schemas, n)
    assert ranged is not None and len(ranged) == n
    assert sorted(str(p.key) for s in ranged for p in s.parts) == sorted(str(p.key) for p in parts)
    sizes = [sum(p.size for p in s.parts) for s in ranged]
    assert max(sizes) <= sum(sizes) / n + max(p.size for p in parts), sizes
    _check_splits(r, 3, n, client.blob)
    r.release_splits()
    w.expire()
    r.expire()
