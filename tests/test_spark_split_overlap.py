"""Spark reads group only the rows another split may hold (``handles.split_overlap``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from persist_lib.handles import split_overlap
from persist_lib.shard.batch_meta import PartMeta
from persist_lib.shard.codec import Schemas
from tests.test_spark_support import file_location, open_client

pytest_plugins = ["tests.spark_fixtures"]

KEY = pa.schema([("id", pa.int64())])
VAL = pa.schema([("name", pa.string())])
SCHEMAS = Schemas(KEY, VAL)


def _part(lo: int | None, hi: int | None, nulls: int = 0, count: int = 10, stats: bool = True) -> PartMeta:
    st = (("k.id", lo, hi, nulls), ("t", 0, 0, 0)) if stats else None
    return PartMeta(key="p", size=1, count=count, sha256="0" * 64, tmin=0, tmax=0, stats=st)


def test_plan_bounds_the_other_splits_and_masks_exactly_their_rows() -> None:
    splits = [[_part(0, 9), _part(20, 29)], [_part(9, 15)], [_part(40, 49, nulls=2)]]
    ov = split_overlap.plan(splits, SCHEMAS)
    assert ov is not None
    assert (ov[0].los, ov[0].his, ov[0].nulls) == ((9, 40), (15, 49), True)
    assert (ov[1].los, ov[1].his, ov[1].nulls) == ((0, 20, 40), (9, 29, 49), True)
    assert (ov[2].los, ov[2].his, ov[2].nulls) == ((0, 20), (15, 29), False)
    t = pa.table({"id": pa.array([-1, 0, 8, 9, 10, 15, 16, 20, 29, 30, None], pa.int64())})
    assert ov[0].mask(t).to_pylist() == [False, False, False, True, True, True, False, False, False, False, True]
    assert ov[1].mask(t).to_pylist() == [False, True, True, True, False, False, False, True, True, False, True]
    assert ov[2].mask(t).to_pylist() == [False, True, True, True, True, True, False, True, True, False, False]


def test_plan_is_none_without_bounds_or_for_non_integer_keys() -> None:
    assert split_overlap.plan([[_part(0, 9)], [_part(0, 0, stats=False)]], SCHEMAS) is None
    assert split_overlap.plan([[_part(0, 9)], [_part("a", "b")]], SCHEMAS) is None  # type: ignore[arg-type]
    assert split_overlap.plan([[_part(0, 9)]], Schemas(pa.schema([("s", pa.string())]), VAL)) is None
    # a part of nulls only has no bounds but its null count
    ov = split_overlap.plan([[_part(None, None, nulls=10)], [_part(3, 4)]], SCHEMAS)
    assert ov is not None and ov[0].los == (3,) and ov[1].los == () and ov[1].nulls


def _key(row: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple((x is None, x if x is not None else 0) for x in row)


def _rows(df: Any) -> list[tuple[Any, ...]]:
    return sorted((tuple(r) for r in df.collect()), key=_key)


def _want(table: pa.Table) -> list[tuple[Any, ...]]:
    cols = table.column_names
    d = table.to_pydict()
    return sorted((tuple(d[c][i] for c in cols) for i in range(table.num_rows)), key=_key)


def _four_commits(tmp_path: Path, shard: str, *, extra: bool) -> tuple[Any, str, Any]:
    """A shard of 4 commits of 400 overlapping ids in parts of ~2 KiB, every other
    commit retracting the odd ids the one before added; ``extra``: also (7, "x") and
    (7, "y") at every time (one of them retracted) and a null key."""
    client = open_client(file_location(tmp_path), inline_threshold=0, blob_target_size=2048)
    w, r = client.open(shard, KEY, VAL)
    more = ([7, 7, None], ["x", "y", "z"], [1, -1, 1]) if extra else ([], [], [])
    for t in range(4):
        ids = list(range(t * 50, t * 50 + 400))
        w.compare_and_append(
            pa.table({
                "id": pa.array(ids + more[0], pa.int64()),
                "name": [f"n{j % 3}" for j in ids] + more[1],
                "ts": [t] * (len(ids) + len(more[0])),
                "diff": [(-1 if (t % 2 and j % 2) else 1) for j in ids] + more[2],
            }),
            t, t + 1,
        )
    return client, shard, r


@pytest.mark.spark
@pytest.mark.slow  # ~20 s of Spark jobs; read_snapshot's default-tier tests run the same path
def test_read_snapshot_consolidates_across_splits_with_and_without_overlap(spark: Any, tmp_path: Path) -> None:
    """Records split across splits (same (k, v) in parts of different splits, diffs
    summing to zero or not) come back once, consolidated; rows of one split only pass
    through; the compacted shard (key-disjoint parts) and the overlapping one agree
    with ``snapshot``."""
    from persist_lib.spark import read_snapshot, read_updates

    client, shard, r = _four_commits(tmp_path, "s00000000-0000-4000-8000-0000000000c1", extra=True)
    for compacted in (False, True):
        if compacted:
            client.compact(shard)
        parts = [p for _, b in client.machine(shard).fetch_latest().trace_batches() for p in b.parts]
        assert len(parts) >= 3 and all(p.stats is not None for p in parts)
        splits = r.snapshot_splits(3, 4)
        assert split_overlap.plan([s.parts for s in splits], r.schemas) is not None
        r.release_splits()
        got = _rows(read_snapshot(spark, r, 3, num_splits=4))
        assert got == _want(r.snapshot(3))
        assert len({g[:2] for g in got}) == len(got) and all(g[3] != 0 for g in got)
        proj = read_snapshot(spark, r, 3, num_splits=4, columns=["id"])
        assert proj.columns == ["id", "ts", "diff"]
        upd = _rows(read_updates(spark, r, 0, 3, num_splits=3))
        assert upd == _want(r.updates_between(1, 4))
    assert r._held_seqnos() == {}
    client.close()


def test_split_fetch_of_a_sorted_run_is_consolidated_in_key_order(tmp_path: Path) -> None:
    """A split of a compacted shard holds parts of one sorted run in any order (splits
    are balanced by size); fetched, it is consolidated like the snapshot's rows it
    holds, whatever order its parts were planned in."""
    from collections import Counter

    from persist_lib.handles.splits import SnapshotSplit, _in_key_order

    client, shard, r = _four_commits(tmp_path, "s00000000-0000-4000-8000-0000000000c2", extra=False)
    client.compact(shard)
    run = [p for _, b in client.machine(shard).fetch_latest().trace_batches() for p in b.parts]
    assert len(run) >= 3 and all(p.sorted for p in run)
    assert _in_key_order(tuple(reversed(run))) == tuple(run)
    whole = SnapshotSplit(client.blob_uri, shard, r.schemas.to_json(), 3, tuple(reversed(run))).fetch(client.blob)
    assert _want(whole) == _want(r.snapshot(3))
    total: Counter[tuple[Any, ...]] = Counter()
    for s in r.snapshot_splits(3, 2):
        got = s.fetch(client.blob)
        keys = list(zip(got.column("id").to_pylist(), got.column("name").to_pylist(), strict=True))
        assert len(set(keys)) == len(keys) and 0 not in got.column("diff").to_pylist()
        for k, d in zip(keys, got.column("diff").to_pylist(), strict=True):
            total[k] += d
    r.release_splits()
    assert sorted((k[0], k[1], 3, d) for k, d in total.items() if d) == _want(r.snapshot(3))
    client.close()
