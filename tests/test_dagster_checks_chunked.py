"""The Great Expectations check in bounded memory: chunked validation adds up to the
whole-frame validation, chunks never split a key, and the check streams a collection."""

from __future__ import annotations

import random
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pytest

from dagster_project.checks import (
    key_chunks,
    latest_as_of,
    read_latest,
    rules_for,
    validate_collection,
    validate_frame,
    validate_frames,
)
from dagster_project.resources import PersistResource

pytestmark = pytest.mark.dagster

RULES = rules_for(["k"], not_null=["name"], ranges={"amount": (0.0, 100.0)}, unique_key=True)


def frame(n: int, seed: int, *, bad: bool) -> pd.DataFrame:
    """Sorted by key; with ``bad``: nulls, values out of range, negative diffs and
    duplicate keys (adjacent, as in a collection snapshot)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        k = i // 2 * 2 if bad and i % 97 == 1 else i  # duplicates: (i-1, i) share a key
        name = None if bad and i % 89 == 0 else f"n{i % 7}"
        amount = 500.0 if bad and i % 83 == 0 else rng.uniform(0, 100)
        diff = -1 if bad and i % 79 == 0 else 1
        rows.append({"k": k, "name": name, "amount": amount, "ts": 5, "diff": diff})
    return pd.DataFrame(rows)


def _chunked(df: pd.DataFrame, chunk_bytes: int) -> list[pd.DataFrame]:
    t = pa.Table.from_pandas(df, preserve_index=False)
    return [c.to_pandas() for c in key_chunks(t.to_batches(max_chunksize=50), t.schema, chunk_bytes=chunk_bytes, key_columns=["k"])]


def test_key_chunks_never_split_a_key() -> None:
    t = pa.table({"k": [1, 1, 1, 2, 3, 3, 4, 5, 5, 5, 5, 6], "v": list(range(12))})
    for size in (1, 8, 30, 10_000):
        chunks = list(key_chunks(t.to_batches(max_chunksize=2), t.schema, chunk_bytes=size, key_columns=["k"]))
        assert pa.concat_tables(chunks).equals(t)
        seen: dict[int, int] = {}
        for i, c in enumerate(chunks):
            for k in set(c.column("k").to_pylist()):
                assert seen.setdefault(k, i) == i, f"key {k} split across chunks (chunk_bytes={size})"
    assert list(key_chunks(iter(()), t.schema, chunk_bytes=10)) == []


@pytest.mark.parametrize("bad", [False, True])
def test_chunked_validation_adds_up_to_the_whole(bad: bool) -> None:
    df = frame(3000, 1, bad=bad)
    whole = validate_frame(df, RULES)
    chunks = _chunked(df, 16 << 10)
    assert len(chunks) > 3
    parts = validate_frames(chunks, RULES)
    assert parts.passed == whole.passed == (not bad)
    assert parts.rows == whole.rows == len(df)
    assert parts.chunks == len(chunks)
    assert parts.statistics["evaluated_expectations"] == whole.statistics["evaluated_expectations"]
    assert parts.statistics["successful_expectations"] == whole.statistics["successful_expectations"]
    key = lambda f: (f["expectation"], str(sorted(f["kwargs"].items())))  # noqa: E731
    got = {key(f): f["unexpected_count"] for f in parts.failures}
    want = {key(f): f["unexpected_count"] for f in whole.failures}
    assert got == want
    if bad:
        assert {f["expectation"] for f in parts.failures} == {
            "expect_column_values_to_not_be_null",
            "expect_column_values_to_be_between",
            "expect_column_values_to_be_unique",
        }
        assert all(0 < len(f["sample"]) <= 5 for f in parts.failures)


def test_check_streams_the_collection_in_chunks(tmp_path: Path) -> None:
    persist = PersistResource(home=str(tmp_path / "persist"))
    ctl = persist.controller()
    key = pa.schema([pa.field("k", pa.int64(), nullable=False)])
    val = pa.schema([("name", pa.string()), ("amount", pa.float64())])
    ctl.create_collection("c", key, val, num_shards=2)
    w = ctl.open_writer("c")
    df = frame(20_000, 2, bad=False)
    ups = [(((r.k,), (r.name, r.amount)), 0, 1) for r in df.itertuples()]
    w.append(ups, 0, 1)
    # A duplicate key (two values for k=10) and a retraction without insertion.
    w.append([(((10,), ("dup", 1.0)), 1, 1), (((-5,), ("neg", 1.0)), 1, -1)], 1, 2)
    as_of = latest_as_of(persist, "c")
    assert as_of == 1
    out = validate_collection(persist, "c", RULES, as_of, memory_budget=4 << 20)
    whole_df, _ = read_latest(persist, "c")
    whole = validate_frame(whole_df, RULES)
    assert out.chunks > 3, out
    assert out.rows == whole.rows == len(whole_df) == 20_002
    assert not out.passed and not whole.passed
    counts = {f["expectation"]: f["unexpected_count"] for f in out.failures}
    assert counts == {f["expectation"]: f["unexpected_count"] for f in whole.failures}
    assert counts["expect_column_values_to_be_unique"] == 2
    assert counts["expect_column_values_to_be_between"] == 1  # diff -1
    meta = out.metadata()
    assert meta["chunks"] == out.chunks and meta["rows"] == 20_002
    # Rules whose key isn't the collection key: noted, checked within chunks.
    other = rules_for(["name"], unique_key=True)
    assert any("within each chunk" in n for n in validate_collection(persist, "c", other, as_of).notes)
    persist.close()
