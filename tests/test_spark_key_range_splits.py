"""``read_snapshot`` of a shard whose parts are key-disjoint but hold history (a key at
several times): the parts are regrouped into key-range splits that share no record
(``spark.disjoint_splits``), each split consolidated on its executor, and no
cross-split grouping (shuffle) or marking pass is planned; ``materialize=False`` keeps
that DataFrame lazy with the reader's hold."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from tests.test_spark_direct_read import KEY, SHARD, VAL, _rows, _shard
from tests.test_spark_support import file_location, open_client

pytest_plugins = ["tests.spark_fixtures"]


def _keys(t: pa.Table) -> set[int]:
    return set(t.column("id").to_pylist())


def test_key_range_splits_share_no_record_and_concatenate_to_the_snapshot(tmp_path: Path) -> None:
    from persist_lib.spark.disjoint_splits import key_range_splits

    client, r = _shard(file_location(tmp_path), 21, ties=True)
    splits = r.snapshot_splits(11, 4)
    for n in (1, 2, 3, 4, 9):
        ranged = key_range_splits(splits, r.schemas, n)
        assert ranged is not None and 1 <= len(ranged) <= min(n, 4)
        assert sorted(p.key for s in ranged for p in s.parts) == sorted(str(p.key) for s in splits for p in s.parts)
        fetched = [s.fetch(client.blob) for s in ranged]
        for i, a in enumerate(fetched):
            for b in fetched[i + 1 :]:
                assert not _keys(a) & _keys(b)
        assert _rows(pa.concat_tables(fetched)) == _rows(r.snapshot(11))
    r.release_splits()
    r.expire()
    client.close()


def _batch(ids: list[int], t: int, d: int) -> pa.Table:
    return pa.table({
        "id": ids, "name": [f"n{k}" for k in ids], "score": [float(k) for k in ids],
        "ts": [t] * len(ids), "diff": [d] * len(ids),
    })


def test_parts_sharing_a_key_stay_in_one_split_and_overlapping_parts_are_refused(tmp_path: Path) -> None:
    """Key 50 is in two parts (inserted at time 0, retracted at time 1): a cut between
    them would return it twice; overlapping ranges can't be cut at all."""
    from persist_lib.spark.disjoint_splits import key_range_splits

    client = open_client(file_location(tmp_path), inline_threshold=0)
    w, r = client.open(SHARD, KEY, VAL)
    w.compare_and_append(_batch(list(range(0, 51)), 0, 1), 0, 1)
    w.compare_and_append(_batch(list(range(50, 100)), 1, 1).set_column(4, "diff", pa.array([-1] + [1] * 49)), 1, 2)
    w.compare_and_append(_batch(list(range(200, 260)), 2, 1), 2, 3)
    splits = r.snapshot_splits(2, 3)
    ranged = key_range_splits(splits, r.schemas, 10)  # every part is over the size target
    assert ranged is not None and len(ranged) == 2  # cut at the gap 99 | 200 only
    fetched = pa.concat_tables([s.fetch(client.blob) for s in ranged])
    assert 50 not in _keys(fetched)
    assert _rows(fetched) == _rows(r.snapshot(2))
    r.release_splits()
    w.compare_and_append(_batch(list(range(240, 300)), 3, 1), 3, 4)  # overlaps [200, 259]
    assert key_range_splits(r.snapshot_splits(3, 3), r.schemas, 3) is None
    r.release_splits()
    w.expire()
    r.expire()
    client.close()


def _plan(df: Any) -> str:
    return str(df._jdf.queryExecution().executedPlan().toString())


@pytest.mark.spark
def test_history_read_plans_no_shuffle_and_stays_lazy_when_asked(spark: Any, tmp_path: Path) -> None:
    from persist_lib.spark import read_snapshot

    client, r = _shard(file_location(tmp_path), 22, ties=True)
    want = _rows(r.snapshot(11))
    df = read_snapshot(spark, r, 11, materialize=False)
    assert not df.inputFiles()  # the general path (history: not read directly) ...
    assert "Exchange" not in _plan(df) and "Aggregate" not in _plan(df)  # ... with no cross-split group
    assert r._held_seqnos()  # lazy: the reader holds the parts ...
    assert _rows(df) == want
    r.release_splits()  # ... until released
    assert r._held_seqnos() == {}
    got = read_snapshot(spark, r, 11, columns=["name", "id"])  # default: materialized, hold released
    assert r._held_seqnos() == {}
    assert got.columns == ["id", "name", "ts", "diff"]
    assert _rows(got) == _rows(r.snapshot(11).select(["id", "name", "ts", "diff"]))
    r.expire()
    client.close()


class _CountingGets:
    """The client's blob, counting the part fetches the direct path's verification makes."""

    def __init__(self, blob: Any) -> None:
        self.blob = blob
        self.keys: list[str] = []

    def get(self, key: str) -> bytes | None:
        self.keys.append(key)
        data: bytes | None = self.blob.get(key)
        return data


@pytest.mark.spark
def test_a_shard_with_history_is_given_up_after_verifying_one_part(spark: Any, tmp_path: Path) -> None:
    """Every part holds ties: the direct path learns that from the first and does not
    fetch and hash the others only to fall back (the general path verifies them)."""
    from persist_lib.spark.direct_read import try_direct

    client, r = _shard(file_location(tmp_path), 23, ties=True)
    parts = [p for _, b in client.machine(SHARD).fetch_latest().trace_batches() for p in b.parts]
    assert len(parts) == 4
    counting = _CountingGets(client.blob)
    got = try_direct(spark, client.blob_uri, SHARD, r.schemas, parts, 11, filter=None, columns=None,
                     driver_blob=counting)  # type: ignore[arg-type]
    assert got is None
    assert len(counting.keys) == 1
    r.expire()
    client.close()
