"""The cold time-travel read's paths of issue 28 (session 18): several (k, v)-disjoint
sorted runs read at once (``sorted_run_stream.read_sorted_runs``), the shared constant
time column (``time_filters.constant_times``), and the snapshot of a layered batch that
uses them.

Real components: the runs' parts are real tables handed over by ``fetch`` (the part
fetch itself is covered elsewhere); the snapshot tests use ``mem://`` and file-blob
clients with real compaction into (k, v)-whole layers.
"""

from __future__ import annotations

import pickle
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from persist_lib import PersistClient, PersistConfig
from persist_lib.errors import BlobNotFound
from persist_lib.handles import snapshot as snapshot_mod
from persist_lib.shard import sorted_run_stream as srs
from persist_lib.shard import time_filters
from persist_lib.shard.batch_meta import PartMeta
from persist_lib.shard.consolidate import consolidate
from persist_lib.shard.runs import RunOrderViolation
from persist_lib.shard.time_filters import constant_times, snapshot_at
from tests.support.time_layers import mem_client, model, rows
from tests.test_time_layers_kv import _four_commits

INT_KEY = pa.schema([("k", pa.int64())])
VAL = pa.schema([("v", pa.string())])


def _run(rng: np.random.Generator, n: int, keys: range) -> pa.Table:
    """A consolidated sorted run (internal layout) of random updates at times 0..3 with
    keys in ``keys``: several times per (k, v), retractions, zero sums after forwarding."""
    k = rng.integers(keys.start, keys.stop, n)
    return consolidate(pa.table({
        "k.k": pa.array(k, pa.int64()),
        "v.v": pa.array([f"v{x % 3}" for x in k]),
        "t": pa.array(rng.integers(0, 4, n), pa.int64()),
        "d": pa.array(rng.choice([-1, 1, 1, 2], n), pa.int64()),
    }))


def _cut(table: pa.Table, rng: np.random.Generator, prefix: str) -> list[tuple[PartMeta, pa.Table]]:
    """``table`` cut into parts anywhere (inside groups of equal (k, v), so equal rows
    meet across part boundaries once forwarded), with their records."""
    cuts = sorted({int(x) for x in rng.integers(0, table.num_rows + 1, int(rng.integers(0, 6)))})
    bounds = [0, *cuts, table.num_rows]
    out = []
    for i, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False)):
        t = table.slice(a, b - a)
        out.append((PartMeta(key=f"{prefix}{i}", size=0, count=max(1, t.num_rows), sha256="", tmin=0, tmax=3), t))
    return out


@pytest.mark.parametrize("seed", range(8))
def test_read_at_once_equals_each_run_consolidated(seed: int) -> None:
    """Every run's parts on the pool at once: per run, exactly ``consolidate`` of the
    run forwarded to the as-of, in order, whatever the cuts and the pool's width."""
    rng = np.random.default_rng(seed)
    runs = [_cut(_run(rng, int(rng.integers(1, 1500)), range(i * 100, i * 100 + 60)), rng, f"r{i}p")
            for i in range(int(rng.integers(1, 4)))]
    by_key = {m.key: t for run in runs for m, t in run}
    metas = [[m for m, _ in run] for run in runs]
    with ThreadPoolExecutor(max_workers=int(rng.integers(1, 5))) as pool:
        for as_of in (0, 1, 3):
            got = srs.read_sorted_runs(metas, as_of, lambda p: by_key[p.key], "s", pool)
            assert len(got) == len(runs)
            for run, tables in zip(runs, got, strict=True):
                want = consolidate(snapshot_at(pa.concat_tables([t for _, t in run]), as_of))
                have = pa.concat_tables(tables).combine_chunks() if tables else want.slice(0, 0)
                assert have.equals(want), as_of


def test_every_part_is_submitted_before_the_first_is_taken_largest_first() -> None:
    """The parts of all runs go to the pool at once, largest first: with one thread, the
    fetch order is by row count, and the first run's first part (not the largest) is
    fetched only after the larger parts of the second run; all are in flight together
    with as many threads as parts (they meet at a barrier)."""
    rng = np.random.default_rng(4)
    a, b = _run(rng, 900, range(0, 50)), _run(rng, 900, range(100, 150))
    runs = [[(PartMeta(key="a0", size=0, count=10, sha256="", tmin=0, tmax=3), a.slice(0, 10)),
             (PartMeta(key="a1", size=0, count=a.num_rows - 10, sha256="", tmin=0, tmax=3), a.slice(10))],
            [(PartMeta(key="b0", size=0, count=b.num_rows, sha256="", tmin=0, tmax=3), b)]]
    by_key = {m.key: t for run in runs for m, t in run}
    metas = [[m for m, _ in run] for run in runs]
    order: list[str] = []
    with ThreadPoolExecutor(max_workers=1) as pool:
        srs.read_sorted_runs(metas, 1, lambda p: order.append(str(p.key)) or by_key[p.key], "s", pool)
    counts = {m.key: m.count for run in metas for m in run}
    assert order == sorted(counts, key=lambda k: -counts[k]) and order[-1] == "a0"
    barrier = threading.Barrier(3, timeout=10)

    def fetch(p: PartMeta) -> pa.Table:
        barrier.wait()  # BrokenBarrierError if any part waits for another run's to finish
        return by_key[p.key]

    with ThreadPoolExecutor(max_workers=3) as pool:
        got = srs.read_sorted_runs(metas, 1, fetch, "s", pool)
    assert pa.concat_tables(got[1]).combine_chunks().equals(consolidate(snapshot_at(b, 1)))


def test_an_unsorted_run_raises_and_the_rest_is_cancelled() -> None:
    """A run whose parts overlap raises ``RunOrderViolation`` (the caller reads the runs
    another way), also when a part that was already handed on overlaps the next; parts
    not yet started are cancelled, not fetched."""
    rng = np.random.default_rng(6)
    a = _run(rng, 500, range(0, 10_000))
    parts = [PartMeta(key=f"p{i}", size=0, count=a.num_rows, sha256="", tmin=0, tmax=3) for i in range(2)]
    with ThreadPoolExecutor(max_workers=2) as pool, pytest.raises(RunOrderViolation):
        srs.read_sorted_runs([parts], 3, lambda p: a, "s", pool)
    fetched: list[str] = []
    gate = threading.Event()

    def fetch(p: PartMeta) -> pa.Table:
        fetched.append(str(p.key))
        if p.key == "big":
            raise BlobNotFound("gone")
        gate.wait(10)
        return a

    many = [PartMeta(key="big", size=0, count=10**6, sha256="", tmin=0, tmax=3)] + [
        PartMeta(key=f"q{i}", size=0, count=1, sha256="", tmin=0, tmax=3) for i in range(20)
    ]
    with ThreadPoolExecutor(max_workers=1) as pool:
        with pytest.raises(BlobNotFound):
            srs.read_sorted_runs([many[:1], many[1:]], 3, fetch, "s", pool)
        gate.set()
    assert fetched == ["big"]


def test_constant_times_share_a_buffer_only_for_large_slices() -> None:
    """``constant_times``: the right values; parts of one as-of share one buffer; a
    slice under half of the kept array is a new array (a pickled slice carries its
    whole buffer); beyond ``CONSTANT_TIMES_MAX_ROWS`` always new; old times evicted."""
    time_filters._CONSTANT_TIMES.clear()
    a, b = constant_times(7, 5000), constant_times(7, 4000)
    assert a.to_pylist() == [7] * 5000 and b.to_pylist() == [7] * 4000 and a.type == pa.int64()
    assert a.buffers()[1].address == b.buffers()[1].address
    small = constant_times(7, 100)
    assert small.to_pylist() == [7] * 100 and small.buffers()[1].address != a.buffers()[1].address
    assert len(pickle.dumps(small)) < 5000
    big = constant_times(8, time_filters.CONSTANT_TIMES_MAX_ROWS + 1)
    assert 8 not in time_filters._CONSTANT_TIMES and big.null_count == 0 and len(big) > len(a)
    for t in range(10, 10 + time_filters._CONSTANT_TIMES_KEPT):
        constant_times(t, 10)
    assert 7 not in time_filters._CONSTANT_TIMES and len(time_filters._CONSTANT_TIMES) == time_filters._CONSTANT_TIMES_KEPT
    assert constant_times(7, 4000).to_pylist() == [7] * 4000
    assert constant_times(3, 0).to_pylist() == []


# ----- the snapshot of a layered batch ------------------------------------------------


@pytest.mark.parametrize("budget", [None, 1])
def test_layered_snapshot_reads_runs_at_once_within_the_budget(
    budget: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A snapshot of a layered batch reads its runs at once when that fits the budget,
    and run after run otherwise (here: a budget that only the run-by-run stream fits);
    both equal the model at every as-of."""
    client = mem_client(compaction_layer_min_rows=1, inline_threshold=0, blob_target_size=2 << 10)
    shard, w, r, log = _four_commits(client)
    at_once: list[int] = []
    orig = srs.read_sorted_runs

    def spy(runs: list[list[PartMeta]], *args: Any, **kw: Any) -> Any:
        at_once.append(len(runs))
        return orig(runs, *args, **kw)

    monkeypatch.setattr(snapshot_mod, "read_sorted_runs", spy)
    if budget is not None:  # just what the run-by-run stream needs
        monkeypatch.setattr(snapshot_mod, "sorted_runs_read_bytes", lambda *a: 1 << 40)
    for as_of in range(4):
        assert rows(r.snapshot(as_of)) == model(log, as_of), as_of
    assert (max(at_once, default=0) >= 2) == (budget is None)
    w.expire()
    r.expire()


def test_a_part_collected_under_a_one_shot_read_starts_it_over(tmp_path: Path) -> None:
    """A one-shot read whose part is gone (GC after a merge) while it reads the runs at
    once starts over from the newer state, and returns the model's rows."""
    cfg = PersistConfig.for_tests(compaction_layer_min_rows=1, inline_threshold=0, blob_target_size=2 << 10)
    client = PersistClient.open(f"file://{tmp_path}/blob", f"sqlite:///{tmp_path}/c.db", cfg)
    shard, w, r, log = _four_commits(client)
    calls = {"n": 0}
    orig = srs.read_sorted_runs

    def once_missing(runs: list[list[PartMeta]], *args: Any, **kw: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 1:
            # A merge committed meanwhile (a newer state) and the part was collected.
            w.compare_and_append([(((1,), ("v0",)), 4, 1)], 4, 5)
            raise BlobNotFound("collected")
        return orig(runs, *args, **kw)

    snapshot_mod.read_sorted_runs, saved = once_missing, snapshot_mod.read_sorted_runs
    try:
        got = client.snapshot(shard, INT_KEY, VAL, 1)
    finally:
        snapshot_mod.read_sorted_runs = saved
    assert calls["n"] == 2 and rows(got) == model(log, 1)
    w.expire()
    r.expire()
    client.close()
