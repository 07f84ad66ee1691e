"""Distributed compaction: the Spark merge equals the in-process merge on the same input,
row for row, and is applied with the same transition (apply_merge_res)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from persist_lib.shard.codec import Schemas
from persist_lib.shard.compactor import merge_batches
from persist_lib.shard.maintenance_transitions import MergeOutcome
from persist_lib.shard.parts import fetch_part
from persist_lib.shard.spine import CompactionRequest, compaction_requests
from tests.test_spark_support import file_location, open_client, table_counter

pytest_plugins = ["tests.spark_fixtures"]
pytestmark = pytest.mark.spark

KEY = pa.schema([("id", pa.int64()), ("tag", pa.string())])
VAL = pa.schema([("x", pa.float64()), ("l", pa.list_(pa.int32()))])


def _fill(w: Any, batches: int, rows: int, seed: int) -> None:
    """Overlapping keys, retractions and repeated times, so merges consolidate a lot."""
    rng = np.random.default_rng(seed)
    for i in range(batches):
        ids = rng.integers(0, rows // 2, rows)
        t = pa.table(
            {
                "id": ids,
                "tag": pa.array([None if v % 11 == 0 else f"t{v % 7}" for v in ids]),
                "x": np.where(ids % 5 == 0, -0.0, (ids % 13).astype(float)),
                "l": pa.array([[int(v % 3)] * int(v % 3) for v in ids], pa.list_(pa.int32())),
                "ts": np.full(rows, 2 * i, dtype=np.int64) + (ids % 2),
                "diff": rng.choice(np.array([-1, 1, 1, 2], dtype=np.int64), rows),
            }
        )
        w.compare_and_append(t, 2 * i, 2 * i + 2)


def _whole_merge(s: Any) -> CompactionRequest:
    trace = s.trace_batches()
    return CompactionRequest(
        tuple(i for i, _ in trace), trace[0][1].lower, trace[-1][1].upper, s.since,
        tuple(b for _, b in trace),
    )


def _rows(client: Any, schemas: Schemas, shard: str, batch: Any) -> pa.Table:
    return pa.concat_tables([fetch_part(client.blob, p, schemas, shard) for p in batch.parts])


@pytest.mark.parametrize("unsorted_min_bytes", [None, 0], ids=["sorted-parts", "unsorted-parts"])
def test_spark_merge_equals_in_process_merge_row_for_row(
    spark: Any, tmp_path: Path, unsorted_min_bytes: int | None
) -> None:
    """Also over parts a bulk write stored unsorted (issue 14): each task groups such a
    part's rows by bucket, and the result is still the in-process merge, row for row."""
    from persist_lib.spark import apply_merge, spark_merge
    from persist_lib.spark.compact import SparkMergeOutput

    client = open_client(
        file_location(tmp_path), blob_target_size=64 << 10, unsorted_min_bytes=unsorted_min_bytes
    )
    shard = "s00000000-0000-4000-8000-0000000000c1"
    w, r = client.open(shard, KEY, VAL)
    _fill(w, 8, 6000, seed=1)
    r.downgrade_since(10)  # times below 10 are forwarded by the merge
    m = client.machine(shard)
    s = m.fetch_latest()
    stored_sorted = {p.sorted for b in s.batches.values() for p in b.parts}
    assert stored_sorted == ({True} if unsorted_min_bytes is None else {False})
    schemas = Schemas.from_json(s.schemas)
    req = _whole_merge(s)
    before = {t: table_counter(r.snapshot(t)) for t in (10, 15)}
    out = spark_merge(spark, client, schemas, req, shard_id=shard, num_buckets=3)
    local = merge_batches(
        client.blob, schemas, shard=shard, inputs=req.inputs, lower=req.lower, upper=req.upper,
        since=req.since, memory_budget=8 << 20, target_part_bytes=64 << 10, inline_threshold=4096,
    )
    a, b = _rows(client, schemas, shard, out.batch), _rows(client, schemas, shard, local.batch)
    assert out.stats.buckets == 3 and len(out.batch.parts) >= 3
    assert out.stats.rows_in == req.num_updates and a.num_rows < req.num_updates
    assert a.equals(b), "the Spark merge must equal the in-process merge row for row"
    assert (out.batch.lower, out.batch.upper, out.batch.since) == (
        local.batch.lower, local.batch.upper, local.batch.since,
    )
    assert {p.key.split("/")[1] for p in out.batch.parts if p.key} == {out.writer}
    assert out.writer.startswith("cmp-")  # one sorted run, like any compactor output
    # Applied with the in-process compactor's transition; the contents don't change.
    res = apply_merge(client, m, req, out)
    assert res.outcome is MergeOutcome.APPLIED
    assert len(m.fetch_latest().batches) == 1
    assert {t: table_counter(r.snapshot(t)) for t in (10, 15)} == before
    # Applying the same inputs again is refused and that output (here the in-process
    # merge's) deleted.
    res2 = apply_merge(client, m, req, SparkMergeOutput(local.batch, out.stats, "unused"))
    assert not res2.applied and res2.deleted_output
    assert client.unreferenced_blobs(shard, older_than_ms=0) == []
    client.close()


def test_compact_shard_ends_where_in_process_compaction_ends(spark: Any, tmp_path: Path) -> None:
    from persist_lib.spark import compact_shard

    client = open_client(file_location(tmp_path), blob_target_size=64 << 10)
    a = "s00000000-0000-4000-8000-0000000000c2"
    b = "s00000000-0000-4000-8000-0000000000c3"
    wa, ra = client.open(a, KEY, VAL)
    wb, rb = client.open(b, KEY, VAL)
    for w in (wa, wb):
        _fill(w, 6, 3000, seed=2)
    ra.downgrade_since(7)
    rb.downgrade_since(7)
    # Big merges on Spark (min_bytes: the first one qualifies), small ones in-process.
    first = compaction_requests(client.machine(a).fetch_latest())
    threshold = max(req.num_bytes for req in first)
    sa = compact_shard(spark, client, a, min_bytes=threshold, num_buckets=2)
    sb = client.compact(b)
    assert sa["spark_merges_applied"] >= 1
    assert sa["batches_after"] == sb["batches_after"]
    da, db = client.inspect(a)["batches"], client.inspect(b)["batches"]
    shape = [(x["lower"], x["upper"], x["since"], x["len"]) for x in da]
    assert shape == [(x["lower"], x["upper"], x["since"], x["len"]) for x in db]
    for t in (7, 9, 11):
        assert table_counter(ra.snapshot(t)) == table_counter(rb.snapshot(t))
    assert compaction_requests(client.machine(a).fetch_latest()) == []
    client.close()


def test_failed_spark_merge_applies_nothing_and_leaves_nothing(spark: Any, tmp_path: Path) -> None:
    from persist_lib.spark import spark_merge

    # Appends' parts in blob (not inlined), so that one of them can go missing.
    client = open_client(file_location(tmp_path), blob_target_size=64 << 10, inline_append_threshold=4096)
    shard = "s00000000-0000-4000-8000-0000000000c4"
    w, _ = client.open(shard, KEY, VAL)
    _fill(w, 3, 2000, seed=3)
    s = client.machine(shard).fetch_latest()
    req = _whole_merge(s)
    victim = req.inputs[-1].parts[0]
    assert victim.key is not None
    client.blob.delete(victim.key)  # an input part is gone: every task reading it fails
    with pytest.raises(Exception, match="missing"):
        spark_merge(spark, client, Schemas.from_json(s.schemas), req, shard_id=shard, num_buckets=2)
    after = client.machine(shard).fetch_latest()
    assert after.batches == s.batches and after.writers.keys() == s.writers.keys()
    assert client.unreferenced_blobs(shard, older_than_ms=0) == []
    client.close()
