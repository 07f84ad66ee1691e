"""The snapshot read's fast paths (issue 28) and the conditions under which each applies.

- ``consolidate_sorted``: the linear consolidation of a table already sorted by
  ``(k, v, t)`` equals ``consolidate`` (a sort) on random data with ties and zero sums,
  hands the input back uncopied when nothing folds, and refuses unsorted input.
- ``snapshot_at(..., all_at_or_before=True)``: no filter, the other columns' buffers
  are the input's.
- A snapshot of one sorted run (a compacted shard) takes the sorted-run path (one run,
  no merge); a snapshot over two overlapping batches does not; both equal a model over
  random data.
"""

from __future__ import annotations

import random
import uuid
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from persist_lib import PersistClient, PersistConfig, ShardId
from persist_lib.handles import maintenance as mn
from persist_lib.shard.consolidate import consolidate, consolidate_sorted
from persist_lib.shard.runs import batch_runs
from persist_lib.shard.time_filters import snapshot_at
from tests.test_streaming_reads import model_snapshot as _model

KEY = pa.schema([("k", pa.int64())])
VAL = pa.schema([("v", pa.string())])
Row = tuple[int, str, int, int]


def _updates(rng: np.random.Generator, n: int, keys: int, times: int) -> pa.Table:
    """Random updates (internal layout) with repeated ``(k, v)``, several times each,
    retractions (so some sums are zero) and null values."""
    k = rng.integers(0, keys, n)
    v = pa.array([f"v{x % 3}" for x in k], mask=rng.random(n) < 0.05)
    return pa.table(
        {
            "k.k": pa.array(k, pa.int64()),
            "v.v": v,
            "t": pa.array(rng.integers(0, times, n), pa.int64()),
            "d": pa.array(rng.choice([-1, 1, 1, 2], n), pa.int64()),
        }
    )


@pytest.mark.parametrize("seed", range(6))
def test_consolidate_sorted_equals_consolidate(seed: int) -> None:
    rng = np.random.default_rng(seed)
    base = consolidate(_updates(rng, int(rng.integers(1, 4000)), int(rng.integers(1, 500)), 6))
    for as_of in (0, 2, 5, 9):
        forwarded = snapshot_at(base, as_of)  # still sorted by (k, v, t); now with ties
        # chunked as a run of several parts is
        cut = sorted(rng.integers(0, forwarded.num_rows + 1, 3))
        chunked = pa.concat_tables(
            [forwarded.slice(a, b - a) for a, b in zip([0, *cut], [*cut, forwarded.num_rows], strict=True)]
        )
        got = consolidate_sorted(chunked)
        assert got is not None
        assert got.combine_chunks().equals(consolidate(forwarded)), f"as of {as_of}"


def test_consolidate_sorted_no_copy_and_refusals() -> None:
    rng = np.random.default_rng(11)
    strict = consolidate(_updates(rng, 3000, 100_000, 1))
    assert consolidate_sorted(strict) is strict  # nothing folds: the input itself
    with_zero = strict.set_column(3, "d", pa.array(np.where(np.arange(strict.num_rows) % 7 == 0, 0, 1)))
    assert consolidate_sorted(with_zero).equals(consolidate(with_zero))
    shuffled = strict.take(pa.array(rng.permutation(strict.num_rows)))
    assert consolidate_sorted(shuffled) is None  # not sorted: the caller sorts


def test_snapshot_at_known_bounds_keeps_buffers() -> None:
    rng = np.random.default_rng(3)
    t = _updates(rng, 1000, 50, 10)
    for as_of in (0, 4, 9):
        assert snapshot_at(t, as_of).equals(snapshot_at(t.filter(pa.compute.less_equal(t["t"], as_of)), as_of))
    out = snapshot_at(t, 9, all_at_or_before=True)
    assert out.column("v.v").chunk(0).buffers()[2].address == t.column("v.v").chunk(0).buffers()[2].address
    assert out.column("t").to_pylist() == [9] * t.num_rows
    out = snapshot_at(t, 20)  # no flag, but every time is <= 20: found by one pass, no copy
    assert out.column("k.k").chunk(0).buffers()[1].address == t.column("k.k").chunk(0).buffers()[1].address


def _client(**cfg: Any) -> PersistClient:
    name = uuid.uuid4().hex
    base: dict[str, Any] = {"blob_target_size": 8 << 10, "inline_threshold": 0}
    return PersistClient.open(f"mem://{name}", f"mem://{name}", PersistConfig.for_tests(**{**base, **cfg}))


def _rows(table: pa.Table) -> list[Row]:
    return [(r["k"], r["v"], r["ts"], r["diff"]) for r in table.to_pylist()]


def _write(client: PersistClient, rng: random.Random, batches: int) -> tuple[Any, Any, Any, list[Row], int]:
    shard = ShardId.new()
    w, r = client.open(shard, KEY, VAL)
    log: list[Row] = []
    for t in range(batches):
        ups: list[Row] = []
        for _ in range(rng.choice([50, 800])):
            if log and rng.random() < 0.3:  # retract an earlier insert: zero sums later
                k, v, _, _ = rng.choice(log)
                ups.append((k, v, t, -1))
            else:
                ups.append((rng.randint(0, 400), f"v{rng.randint(0, 2)}", t, rng.choice([1, 2])))
        w.compare_and_append([(((k,), (v,)), tt, d) for k, v, tt, d in ups], t, t + 1)
        log += ups
    return shard, w, r, log, batches


@pytest.mark.parametrize("seed", range(4))
def test_compacted_shard_reads_as_one_sorted_run(seed: int) -> None:
    """After compaction the shard is one sorted run of several parts, with the same
    (k, v) at several times: every as-of takes the sorted-run path (one run, no merge
    step) and equals the model, including as-ofs inside the run's times (filtered) and
    past them (ties summed, zero sums dropped)."""
    client = _client()
    shard, w, r, log, upper = _write(client, random.Random(seed), 6)
    r.downgrade_since(upper - 3)
    mn.compact(client, shard)
    state = client.machine(shard).fetch_latest()
    batches = [b for _, b in state.trace_batches()]
    assert len(batches) == 1 and len(batch_runs(batches[0])) == 1 and len(batches[0].parts) > 1
    for as_of in range(upper - 3, upper):
        want = _model(log, as_of)
        assert _rows(r.snapshot(as_of)) == want, f"as of {as_of}"
        with r.snapshot_batches(as_of) as stream:
            got = pa.Table.from_batches(list(stream), schema=stream.schema)
        assert _rows(got) == want
        st = stream.stats
        assert st.runs == 1 and st.passes == 0 and st.steps == 0, st


@pytest.mark.parametrize("seed", range(4))
def test_overlapping_batches_are_not_read_as_one_run(seed: int) -> None:
    """Two batches (not compacted) hold the same (k, v) at two times: each is sorted and
    consolidated, but their union is not, so the sorted-run path must not be taken;
    the snapshot still equals the model. And one batch alone (at an as-of before the
    second) is one run again."""
    client = _client(blob_target_size=1 << 20)
    shard, w, r, log, upper = _write(client, random.Random(100 + seed), 2)
    state = client.machine(shard).fetch_latest()
    assert all(len(batch_runs(b)) == 1 for _, b in state.trace_batches())
    for as_of, runs in ((0, 1), (1, 2)):
        want = _model(log, as_of)
        assert _rows(r.snapshot(as_of)) == want
        with r.snapshot_batches(as_of) as stream:
            got = pa.Table.from_batches(list(stream), schema=stream.schema)
        assert _rows(got) == want
        assert stream.stats.runs == runs, stream.stats


def _bulk_shard(client: PersistClient, seed: int, n: int, keys: int) -> tuple[Any, Any, list[Row], Any, list[Any]]:
    """One bulk write of ``n`` updates at time 0 (same (k, v) many times, retractions),
    stored as several unsorted parts: (writer, reader, updates, state, parts)."""
    rng = random.Random(seed)
    w, r = client.open(ShardId.new(), KEY, VAL)
    ups = [(rng.randint(0, keys), f"v{rng.randint(0, 1)}", 0, rng.choice([-1, 1, 1])) for _ in range(n)]
    w.compare_and_append([(((k,), (v,)), t, d) for k, v, t, d in ups], 0, 1)
    state = client.machine(r.shard_id).fetch_latest()
    parts = [p for _, b in state.trace_batches() for p in b.parts]
    assert len(parts) > 1 and not any(p.sorted for p in parts)
    return w, r, ups, state, parts


def test_bulk_written_unsorted_parts_consolidated_once() -> None:
    """Unsorted parts (a bulk write) holding the same (k, v) several times, in and across
    parts, with retractions: the snapshot (one concatenation, one sort) equals the model,
    sorted by (k, v)."""
    client = _client(unsorted_min_bytes=1024, blob_target_size=16 << 10)
    _, r, ups, _, _ = _bulk_shard(client, 7, 6000, 300)
    got = _rows(r.snapshot(0))
    assert got == _model(ups, 0)  # in (k, v) order, not only the same rows


def test_snapshot_budget_counts_memory_beyond_the_result() -> None:
    """``snapshot`` returns the whole table anyway, so its whole read is compared with the
    budget without the output (as the streaming path's budget excludes the table built
    from the stream); ``snapshot_batches`` counts it. With a budget between the two
    costs the first decodes whole and the second streams; both equal the model. The
    plan uses the decoded size the writer recorded, not the 4x guess from encoded bytes."""
    from persist_lib.handles.read_plan import decoded_bytes, whole_read_bytes
    from persist_lib.shard.memory_plan import MergeStats, estimate_decoded_bytes

    client = _client(unsorted_min_bytes=1024, blob_target_size=64 << 10)
    _, r, ups, state, parts = _bulk_shard(client, 9, 12_000, 5000)
    assert all(p.decoded is not None and decoded_bytes(p, r.schemas) == p.decoded + 4096 for p in parts)
    assert any(decoded_bytes(p, r.schemas) < estimate_decoded_bytes(p, r.schemas) for p in parts)
    budget = whole_read_bytes(parts, r.schemas, beyond_result=True)
    assert budget < whole_read_bytes(parts, r.schemas) and budget >= 1 << 20
    want = _model(ups, 0)
    for held, streams in ((True, False), (False, True)):
        stats = MergeStats()
        got = pa.concat_tables(list(r._snapshot_tables(state, 0, budget, stats, result_held=held)))
        assert (stats.passes >= 1) == streams, stats
        assert [(row["k.k"], row["v.v"], row["t"], row["d"]) for row in got.to_pylist()] == want
    assert _rows(r.snapshot(0, memory_budget=budget)) == want


def _parts_of(table: pa.Table, cuts: list[int]) -> list[pa.Table]:
    bounds = [0, *cuts, table.num_rows]
    return [table.slice(a, b - a) for a, b in zip(bounds, bounds[1:], strict=False)]


@pytest.mark.parametrize("seed", range(8))
def test_stream_sorted_run_equals_consolidate(seed: int) -> None:
    """A sorted run cut into parts anywhere — inside runs of equal (k, v) after
    forwarding, so equal rows meet across part boundaries, some summing to zero, and
    parts that consolidate to nothing — streams to exactly ``consolidate`` of the whole,
    in order."""
    from persist_lib.shard.batch_meta import PartMeta
    from persist_lib.shard.sorted_run_stream import stream_sorted_run

    rng = np.random.default_rng(seed)
    run = consolidate(_updates(rng, int(rng.integers(2, 3000)), int(rng.integers(1, 60)), 4))
    cuts = sorted({int(x) for x in rng.integers(0, run.num_rows + 1, int(rng.integers(1, 12)))})
    tables = _parts_of(run, cuts)
    metas = [PartMeta(key=f"p{i}", size=0, count=max(1, t.num_rows), sha256="", tmin=0, tmax=3)
             for i, t in enumerate(tables)]
    by_key = {m.key: t for m, t in zip(metas, tables, strict=True)}
    for as_of in (1, 3):
        got = list(stream_sorted_run(metas, as_of, lambda p: by_key[p.key], "s"))
        want = consolidate(snapshot_at(run, as_of))
        assert all(t.num_rows for t in got)
        assert (pa.concat_tables(got).combine_chunks() if got else want.slice(0, 0)).equals(want)


@pytest.mark.parametrize("own_pool", [True, False])
def test_stream_sorted_run_loads_parts_ahead_on_the_pool(own_pool: bool) -> None:
    """``AHEAD`` parts are fetched, forwarded and consolidated at once off the caller's
    thread (both cores work while the caller folds part boundaries), on the read's own
    threads or on a pool it is given: the first two fetches meet at a barrier, which a
    reader loading one part ahead never gets past. The rows still equal ``consolidate``
    of the whole."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from persist_lib.shard.batch_meta import PartMeta
    from persist_lib.shard.sorted_run_stream import AHEAD, stream_sorted_run

    rng = np.random.default_rng(3)
    run = consolidate(_updates(rng, 3000, 40, 4))
    tables = _parts_of(run, [700, 1400, 2100])
    metas = [PartMeta(key=f"p{i}", size=0, count=max(1, t.num_rows), sha256="", tmin=0, tmax=3)
             for i, t in enumerate(tables)]
    by_key = {m.key: t for m, t in zip(metas, tables, strict=True)}
    barrier = threading.Barrier(AHEAD, timeout=10)
    loaded_on: set[int] = set()

    def fetch(p: PartMeta) -> pa.Table:
        loaded_on.add(threading.get_ident())
        if p.key in {f"p{i}" for i in range(AHEAD)}:
            barrier.wait()  # BrokenBarrierError after 10 s if the parts load one by one
        return by_key[p.key]

    if own_pool:
        got = list(stream_sorted_run(metas, 2, fetch, "s"))
    else:
        with ThreadPoolExecutor(max_workers=AHEAD) as pool:
            got = list(stream_sorted_run(metas, 2, fetch, "s", pool))
    assert threading.get_ident() not in loaded_on
    assert pa.concat_tables(got).combine_chunks().equals(consolidate(snapshot_at(run, 2)))


def test_stream_sorted_run_refuses_overlapping_parts() -> None:
    """A run that is not sorted: ``RunOrderViolation`` when found before any row was
    yielded (an unsorted first part: the read falls back to a run per part), else
    ``CorruptionError`` (two sorted parts that overlap: the first was handed on)."""
    from persist_lib.errors import CorruptionError
    from persist_lib.shard.batch_meta import PartMeta
    from persist_lib.shard.runs import RunOrderViolation
    from persist_lib.shard.sorted_run_stream import stream_sorted_run

    rng = np.random.default_rng(1)
    a = consolidate(_updates(rng, 500, 100_000, 1))
    metas = [PartMeta(key=f"p{i}", size=0, count=1, sha256="", tmin=0, tmax=0) for i in range(3)]
    shuffled = a.take(pa.array(rng.permutation(a.num_rows)))
    for tables, error in (([shuffled, a], RunOrderViolation), ([a, a], CorruptionError)):
        by_key = {m.key: t for m, t in zip(metas, tables, strict=False)}
        with pytest.raises(error):
            list(stream_sorted_run(metas[: len(tables)], 0, lambda p, by_key=by_key: by_key[p.key], "s"))


def test_restartable_sorted_run_read_refuses_overlap_without_corruption() -> None:
    """A whole snapshot reads one sorted run through ``stream_sorted_run`` but keeps every
    table until the end (``restartable``): two sorted parts that overlap then raise
    ``RunOrderViolation`` even after the first part went by, so the snapshot can read
    the batch with a run per part instead of failing with ``CorruptionError``."""
    from persist_lib.shard.batch_meta import PartMeta
    from persist_lib.shard.runs import RunOrderViolation
    from persist_lib.shard.sorted_run_stream import stream_sorted_run

    rng = np.random.default_rng(2)
    a = consolidate(_updates(rng, 500, 100_000, 1))
    metas = [PartMeta(key=f"p{i}", size=0, count=1, sha256="", tmin=0, tmax=0) for i in range(2)]
    with pytest.raises(RunOrderViolation):
        list(stream_sorted_run(metas, 0, lambda p: a, "s", restartable=True))
    # Also when the overlap comes right after a part boundary handed a held-back row on:
    # parts a[:200], a[200] (one row, in order: the first part's last row goes out alone,
    # the second part's only row is held back) and a[:100].
    pieces = {"p0": a.slice(0, 200), "p1": a.slice(200, 1), "p2": a.slice(0, 100)}
    three = [PartMeta(key=f"p{i}", size=0, count=1, sha256="", tmin=0, tmax=0) for i in range(3)]
    with pytest.raises(RunOrderViolation):
        list(stream_sorted_run(three, 0, lambda p: pieces[str(p.key)], "s", restartable=True))
    # A post filter runs on each part's forwarded rows before they are consolidated.
    got = list(stream_sorted_run(metas[:1], 0, lambda p: a, "s", post=lambda t: t.filter(pa.compute.greater(t["d"], 0))))
    want = consolidate(snapshot_at(a, 0))
    assert pa.concat_tables(got).combine_chunks().equals(want.filter(pa.compute.greater(want["d"], 0)))


def test_large_compacted_run_is_streamed_part_by_part() -> None:
    """A compacted run too large to decode whole within the budget but whose parts fit
    it two at a time is read by ``stream_sorted_run`` (one run, no merge pass), and
    equals the model."""
    from persist_lib.handles.read_plan import decoded_bytes, sorted_run_read_bytes
    from persist_lib.shard.memory_plan import MergeStats
    from persist_lib.shard.sorted_run_stream import sorted_run_stream_bytes

    # One run: the retained history is not split into time layers (``time_layers``).
    client = _client(blob_target_size=64 << 10, compaction_time_layers=1)
    shard, w, r, log, upper = _write(client, random.Random(5), 90)
    mn.compact(client, shard)
    state = client.machine(shard).fetch_latest()
    (b,) = [b for _, b in state.trace_batches()]
    parts = list(b.parts)
    assert len(batch_runs(b)) == 1 and len(parts) > 3
    stream_cost = sorted_run_stream_bytes([decoded_bytes(p, r.schemas) for p in parts], [p.count for p in parts])
    budget = max(1 << 20, stream_cost)
    assert sorted_run_read_bytes(parts, r.schemas, beyond_result=True) > budget
    want = _model(log, upper - 1)
    stats = MergeStats()
    got = pa.concat_tables(list(r._snapshot_tables(state, upper - 1, budget, stats, result_held=True)))
    assert stats.runs == 1 and stats.passes == 0 and stats.output_rows == got.num_rows, stats
    assert [(x["k.k"], x["v.v"], x["t"], x["d"]) for x in got.to_pylist()] == want
    assert _rows(r.snapshot(upper - 1, memory_budget=budget)) == want
