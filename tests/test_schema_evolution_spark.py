"""Spark over an evolved collection: executors decode parts of every schema version
(the registry travels with the splits' and merges' schemas) and a Spark merge writes
its output under the latest version."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from persist_lib.shard.codec import Schemas
from persist_lib.shard.maintenance_transitions import MergeOutcome
from persist_lib.shard.part_fetch import fetch_part_bytes
from persist_lib.shard.parts import META_SCHEMAS, read_stored
from persist_lib.storage import StorageController
from tests.test_schema_evolution import whole_trace
from tests.test_spark_support import file_location, open_client

pytest_plugins = ["tests.spark_fixtures"]
pytestmark = [pytest.mark.spark, pytest.mark.slow]  # ~20 s of Spark jobs: the slow tier

K = pa.schema([pa.field("k", pa.int64(), nullable=False)])
V1 = pa.schema([("a", pa.int32())])
V2 = pa.schema([("a", pa.int32()), ("b", pa.string())])
V3 = pa.schema([("a", pa.int64()), ("b", pa.string())])


def _rows(df: Any) -> set[tuple[Any, ...]]:
    return {tuple(r) for r in df.collect()}


def test_spark_reads_and_merges_an_evolved_collection(spark: Any, tmp_path: Path) -> None:
    from persist_lib.spark import apply_merge, spark_merge
    from persist_lib.spark.read import read_collection_snapshot

    client = open_client(file_location(tmp_path))
    ctl = StorageController(client)
    ctl.create_collection("c", K, V1, num_shards=2)
    w = ctl.open_writer("c")
    w.append([(((k,), (k,)), 0, 1) for k in range(6)], 0, 1)
    w.expire()
    ctl.evolve_schema("c", K, V2)
    w = ctl.open_writer("c")
    w.append([(((6,), (6, "six")), 1, 1), (((0,), (0, None)), 1, -1)], 1, 2)
    w.expire()
    ctl.evolve_schema("c", K, V3)
    w = ctl.open_writer("c")
    w.append([(((7,), (2**33, "big")), 2, 1)], 2, 3)
    w.expire()
    r = ctl.acquire_read_handle("c")
    want = {
        0: {(k, k, None, 0, 1) for k in range(6)},
        1: {(k, k, None, 1, 1) for k in range(1, 6)} | {(6, 6, "six", 1, 1)},
    }
    want[2] = {(x[0], x[1], x[2], 2, 1) for x in want[1]} | {(7, 2**33, "big", 2, 1)}
    for t, rows in want.items():
        df = read_collection_snapshot(spark, r, t)
        assert dict(zip(df.columns, [f.dataType.simpleString() for f in df.schema.fields], strict=True))["a"] == "bigint"
        assert _rows(df) == rows, t
        assert {tuple(x.values()) for x in r.snapshot(t).to_pylist()} == rows, t
    # A Spark merge of one shard's whole trace: output under v3, same contents.
    shard = r.rendition_readers("r0")[0].shard_id
    m = client.machine(shard)
    s = m.fetch_latest()
    req = whole_trace(s)
    schemas = Schemas.from_json(s.schemas)
    assert schemas.version == 2
    out = spark_merge(spark, client, schemas, req, shard_id=shard, num_buckets=2)
    assert apply_merge(client, m, req, out).outcome is MergeOutcome.APPLIED
    fps = {
        # (a part may be an inline Arrow IPC part: read_stored reads either format)
        read_stored(fetch_part_bytes(client.blob, p, shard), shard, p.location).schema.metadata[META_SCHEMAS]
        for b in m.fetch_latest().batches.values() for p in b.parts
    }
    assert fps == {Schemas.create(K, V3).fingerprint().encode()}
    r2 = ctl.acquire_read_handle("c")
    for t, rows in want.items():
        assert _rows(read_collection_snapshot(spark, r2, t)) == rows, t
    r.expire()
    r2.expire()
    ctl.close()
    client.close()
