"""Sorted runs with disjoint key ranges read as one run (issue 28): the statistics
decide, the linear path checks, and a wrong record falls back to the merge."""

from __future__ import annotations

import dataclasses
from typing import Any

import pyarrow as pa

from persist_lib import ShardId
from persist_lib.handles.read import ReadHandle
from persist_lib.shard.batch_meta import PartMeta
from persist_lib.shard.codec import Schemas
from persist_lib.shard.disjoint_runs import chain_disjoint_runs
from tests.test_pushdown import KEY, VAL, append, as_rows, mem_client, updates


def streamed(r: ReadHandle, as_of: int) -> tuple[list[tuple[Any, ...]], int]:
    """The snapshot's rows and how many runs the read used."""
    with r.snapshot_batches(as_of) as s:
        t = pa.Table.from_batches(list(s), schema=s.schema)
        return as_rows(t), s.stats.runs


def rows_at(keys: range, t: int) -> list[tuple[int, str, int, int, int]]:
    return [(k, f"n{k}", k % 7, t, 1) for k in keys]


def test_batches_of_disjoint_key_ranges_read_as_one_run() -> None:
    client = mem_client()
    shard = ShardId.new()
    w, r = client.open(shard, KEY, VAL)
    written = rows_at(range(200, 300), 0) + rows_at(range(0, 100), 1) + rows_at(range(100, 200), 2)
    append(w, written[:100], 0, 1)
    append(w, written[100:200], 1, 2)
    append(w, written[200:], 2, 3)
    expected = sorted(((k, n, s, 2, d) for k, n, s, _, d in written), key=repr)
    got, runs = streamed(r, 2)
    assert got == expected and runs == 1
    assert as_rows(r.snapshot(2)) == expected
    # An overlapping batch (it retracts key 150 and adds 1000) is a run of its own; the
    # others stay chained.
    append(w, [(150, "n150", 150 % 7, 3, -1), (1000, "x", 0, 3, 1)], 3, 4)
    got, runs = streamed(r, 3)
    assert runs == 2
    assert got == sorted(
        [(k, n, s, 3, d) for k, n, s, _, d in written if k != 150] + [(1000, "x", 0, 3, 1)], key=repr
    )


def test_statistics_that_lie_cost_time_not_rows() -> None:
    """Parts whose recorded key bounds claim disjoint ranges that overlap: the linear
    path finds rows out of order and the read merges them instead."""
    client = mem_client()
    shard = ShardId.new()
    w, r = client.open(shard, KEY, VAL)
    append(w, rows_at(range(0, 50), 0), 0, 1)
    b = w.builder(1)
    b.add(w.normalize(updates(rows_at(range(25, 75), 1))))
    batch = b.finish(2)
    (p,) = batch.parts
    assert p.stats is not None
    lying = tuple(("k.id", 1000, 2000, 0) if s[0] == "k.id" else s for s in p.stats)
    w.compare_and_append_batch(dataclasses.replace(batch, parts=(dataclasses.replace(p, stats=lying),)), 1, 2)
    expected = sorted(
        [(k, f"n{k}", k % 7, 1, 1) for k in range(0, 25)]
        + [(k, f"n{k}", k % 7, 1, 2) for k in range(25, 50)]
        + [(k, f"n{k}", k % 7, 1, 1) for k in range(50, 75)],
        key=repr,
    )
    assert as_rows(r.snapshot(1)) == expected
    got, runs = streamed(r, 1)
    assert got == expected and runs == 2


def _part(lo: int, hi: int, *, sorted: bool = True, nulls: int = 0) -> PartMeta:
    return PartMeta(
        key=f"s/w/p{lo}-{hi}", size=1, count=1, sha256="0" * 64, tmin=0, tmax=0, sorted=sorted,
        stats=(("k.id", lo, hi, nulls),),
    )


def test_chain_disjoint_runs_rules() -> None:
    schemas = Schemas(KEY, VAL)
    a, b, c, d = _part(0, 9), _part(10, 19), _part(15, 30), _part(40, 50)
    # Disjoint runs are chained in key order, whatever order they came in.
    assert chain_disjoint_runs([[b], [d], [a]], schemas) == [[a, b, d]]
    # An overlapping run starts a chain of its own; later disjoint runs extend that one.
    assert chain_disjoint_runs([[a], [b], [c], [d]], schemas) == [[a, b], [c, d]]
    # Equal bounds at the seam are not disjoint (rows with that key may interleave).
    assert chain_disjoint_runs([[_part(0, 10)], [_part(10, 20)]], schemas) == [[_part(0, 10)], [_part(10, 20)]]
    # Unsorted parts and parts without statistics are left alone.
    u = _part(100, 110, sorted=False)
    no_stats = dataclasses.replace(_part(300, 310), stats=None)
    assert chain_disjoint_runs([[a], [u], [no_stats], [d]], schemas) == [[a, d], [u], [no_stats]]
    # Null keys sort first: a run holding some starts a chain (its smallest key is below
    # every value), here before the run of keys 300..310, not after 0..9 (overlap).
    n = _part(200, 210, nulls=1)
    assert chain_disjoint_runs([[a], [n], [_part(300, 310)]], schemas) == [[n, _part(300, 310)], [a]]
    # Two runs with nulls never chain; a run of nulls only chains before any run without.
    only_nulls = dataclasses.replace(_part(0, 0), stats=(("k.id", None, None, 5),))
    assert chain_disjoint_runs([[n], [only_nulls]], schemas) == [[only_nulls], [n]]
    assert chain_disjoint_runs([[d], [only_nulls]], schemas) == [[only_nulls, d]]
    # A damaged record (a bound of the wrong type) is no bound: left alone, no error.
    bad = dataclasses.replace(_part(0, 0), stats=(("k.id", "x", 5, 0),))
    assert chain_disjoint_runs([[bad], [d]], schemas) == [[d], [bad]]
