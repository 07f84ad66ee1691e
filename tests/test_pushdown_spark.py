"""Spark ``read_snapshot`` with pushed-down columns and filter (issue 28)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from persist_lib.errors import InvalidUsage
from tests.test_spark_support import df_counter, file_location, open_client, table_counter

pytest_plugins = ["tests.spark_fixtures"]
pytestmark = pytest.mark.spark

KEY = pa.schema([("id", pa.int64())])
VAL = pa.schema([("name", pa.string()), ("amount", pa.int64())])
SHARD = "s00000000-0000-4000-8000-0000000000b7"


def test_read_snapshot_pushes_filter_and_columns(spark: Any, tmp_path: Path) -> None:
    from persist_lib.spark import read_snapshot

    client = open_client(file_location(tmp_path), inline_threshold=0)
    w, r = client.open(SHARD, KEY, VAL)
    for i in range(8):  # eight parts with disjoint key ranges
        ids = list(range(i * 1000, i * 1000 + 1000))
        w.compare_and_append(
            pa.table({
                "id": ids, "name": [f"n{j % 5}" for j in ids], "amount": [j % 7 for j in ids],
                "ts": [i] * 1000, "diff": [1] * 1000,
            }),
            i, i + 1,
        )
    spec = [("id", ">=", 3100), ("id", "<", 3200), ("amount", "!=", 0)]
    # Only the part holding ids [3000, 4000) is planned into a split.
    splits = r.snapshot_splits(7, 4, filter=spec)
    assert sum(len(s.parts) for s in splits) == 1
    r.release_splits()
    got = read_snapshot(spark, r, 7, columns=["id", "amount"], filter=spec)
    assert got.columns == ["id", "amount", "ts", "diff"]
    assert df_counter(got) == table_counter(r.snapshot(7, columns=["id", "amount"], filter=spec))
    full = r.snapshot(7)
    want = [x for x in full.to_pylist() if 3100 <= x["id"] < 3200 and x["amount"] != 0]
    assert got.count() == len(want) > 0
    from persist_lib.spark import read_updates

    upd = read_updates(spark, r, 2, 5, columns=["id"], filter=[("id", "<", 4010), ("ts", ">=", 4)])
    assert upd.columns == ["id", "ts", "diff"]
    assert sorted(x.id for x in upd.collect()) == list(range(4000, 4010))
    with pytest.raises(InvalidUsage, match="no column 'nope'"):
        read_snapshot(spark, r, 7, filter=[("nope", "==", 1)])
    assert r._held_seqnos() == {}
    client.close()
