"""``read_snapshot`` reads parts that need no consolidation with Spark's own Parquet
reader after verifying them (``spark.direct_read``, issue 28): the same rows as the
snapshot; parts with history, of an earlier schema or on S3 take the general path; a
corrupt part fails the read on either path."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from persist_lib.errors import CorruptionError
from tests.test_spark_support import file_location, open_client

pytest_plugins = ["tests.spark_fixtures"]

KEY = pa.schema([("id", pa.int64())])
VAL = pa.schema([("name", pa.string()), ("score", pa.float64())])
VAL2 = pa.schema([("name", pa.string()), ("score", pa.float64()), ("extra", pa.int32())])
SHARD = "s00000000-0000-4000-8000-0000000000d1"


def _batch(rng: random.Random, i: int, *, ties: bool, extra: bool) -> pa.Table:
    """Batch ``i``: keys in [100i, 100i + 99] at times 3i..3i+2 with random nonzero
    diffs; ``ties``: some keys also at a later time (the same (id, name): a part with
    history a snapshot must consolidate)."""
    ids = sorted(rng.sample(range(100 * i, 100 * i + 100), 60))
    rows = [(k, f"n{k % 7}", rng.random() * 10, 3 * i + rng.randint(0, 1), rng.choice([1, 2, -1])) for k in ids]
    if ties:
        rows += [(k, n, s, t + 1, -d) for k, n, s, t, d in rows[:20]]
    cols: dict[str, Any] = {
        "id": [r[0] for r in rows], "name": [r[1] for r in rows], "score": [r[2] for r in rows],
    }
    if extra:
        cols["extra"] = pa.array([r[0] % 5 for r in rows], pa.int32())
    cols |= {"ts": [r[3] for r in rows], "diff": [r[4] for r in rows]}
    return pa.table(cols)


def _shard(loc: tuple[str, str], seed: int, *, ties: bool = False, evolve: bool = False) -> tuple[Any, Any]:
    rng = random.Random(seed)
    client = open_client(loc, inline_threshold=0)
    w, _ = client.open(SHARD, KEY, VAL)
    for i in range(4):
        if evolve and i == 2:
            assert client.compare_and_evolve_schema(SHARD, (KEY, VAL), (KEY, VAL2)).outcome.name == "APPLIED"
            w.expire()
            w, _ = client.open(SHARD, KEY, VAL2)
        w.compare_and_append(_batch(rng, i, ties=ties, extra=evolve and i >= 2), 3 * i, 3 * i + 3)
    w.expire()
    r = client.open_leased_reader(SHARD, KEY, VAL2 if evolve else VAL)
    return client, r


def _rows(table_or_df: Any) -> list[tuple[Any, ...]]:
    rows = table_or_df.to_pylist() if isinstance(table_or_df, pa.Table) else [r.asDict() for r in table_or_df.collect()]
    return sorted((tuple(r.values()) for r in rows), key=repr)


@pytest.mark.spark
def test_direct_read_equals_the_snapshot(spark: Any, tmp_path: Path) -> None:
    from persist_lib.spark import read_snapshot

    client, r = _shard(file_location(tmp_path), 11)
    want = r.snapshot(11)
    df = read_snapshot(spark, r, 11, materialize=False)
    assert df.inputFiles()  # Spark reads the part files themselves
    assert df.columns == want.column_names
    assert _rows(df) == _rows(want)
    assert r._held_seqnos()  # the lazy DataFrame's parts stay held ...
    r.release_splits()  # ... until released
    got = read_snapshot(spark, r, 11, columns=["score", "id"])  # materialized, projected
    assert got.columns == ["id", "score", "ts", "diff"]  # the shard's order, as the general path
    assert _rows(got) == _rows(want.select(["id", "score", "ts", "diff"]))
    assert r._held_seqnos() == {}
    r.expire()
    client.close()


@pytest.mark.parametrize(("ties", "evolve", "verdict"), [(True, False, "merge"), (False, True, "migrate")])
def test_parts_with_history_or_an_earlier_schema_are_not_read_directly(
    tmp_path: Path, ties: bool, evolve: bool, verdict: str
) -> None:
    """Verified on the driver (no Spark job): a part holding one (id, name) at two times
    needs consolidating, a part of the first schema version needs migrating."""
    from persist_lib.spark.direct_read import MIGRATE, NEEDS_MERGE, OK, verify_parts

    client, r = _shard(file_location(tmp_path), 14, ties=ties, evolve=evolve)
    parts = [p for _, b in client.machine(SHARD).fetch_latest().trace_batches() for p in b.parts]
    got = verify_parts(None, client.blob_uri, SHARD, r.schemas, parts, client.blob)
    assert verdict in (NEEDS_MERGE, MIGRATE)
    assert set(got) == ({verdict} if ties else {MIGRATE, OK})
    r.expire()
    client.close()


@pytest.mark.spark
@pytest.mark.slow  # ~30-60 s of Spark jobs under load: the general path, twice
def test_history_and_evolved_parts_read_the_general_way(spark: Any, tmp_path: Path) -> None:
    from persist_lib.spark import read_snapshot

    for tag, ties, evolve in (("history", True, False), ("evolved", False, True)):
        client, r = _shard(file_location(tmp_path, tag), 11, ties=ties, evolve=evolve)
        want = r.snapshot(11)
        df = read_snapshot(spark, r, 11, materialize=False)
        assert not df.inputFiles(), tag
        assert _rows(df) == _rows(want), tag
        assert r._held_seqnos()  # lazy on the general path too: held until released
        r.release_splits()
        r.expire()
        client.close()


@pytest.mark.spark
def test_a_corrupt_part_fails_the_direct_read(spark: Any, tmp_path: Path) -> None:
    from persist_lib.spark import read_snapshot
    from persist_lib.spark.direct_read import CORRUPT, OK, verify_parts

    client, r = _shard(file_location(tmp_path), 12)
    parts = [p for _, b in client.machine(SHARD).fetch_latest().trace_batches() for p in b.parts]
    # The executors' verification (a read too large for the driver's) passes them all...
    assert verify_parts(spark, client.blob_uri, SHARD, r.schemas, parts) == [OK] * len(parts)
    key = parts[1].key
    assert key is not None
    data = bytearray(client.blob.get(key) or b"")
    data[len(data) // 2] ^= 0x10
    client.raw_blob.delete(key)
    client.raw_blob.set(key, bytes(data))
    # ... and finds the flipped bit, as the driver's does.
    verdicts = verify_parts(spark, client.blob_uri, SHARD, r.schemas, parts)
    assert verdicts[1].startswith(CORRUPT) and "checksum mismatch" in verdicts[1]
    assert verdicts[0] == OK
    for materialize in (True, False):
        with pytest.raises(CorruptionError, match="checksum mismatch"):
            read_snapshot(spark, r, 11, materialize=materialize)
        assert r._held_seqnos() == {}
    r.expire()
    client.close()


@pytest.mark.spark
def test_an_s3_blob_takes_the_general_path(spark: Any, s3_blob_uri: str, tmp_path: Path) -> None:
    from persist_lib.spark import read_snapshot
    from persist_lib.spark.direct_read import eligible_parts

    blob_uri = s3_blob_uri + "&access_key_id=testing&secret_access_key=testing"
    client, r = _shard((blob_uri, f"sqlite:///{tmp_path / 'c.db'}"), 13)
    parts = [p for _, b in client.machine(SHARD).fetch_latest().trace_batches() for p in b.parts]
    assert eligible_parts(spark, blob_uri, r.schemas, parts, 11, None) is None
    df = read_snapshot(spark, r, 11, materialize=False)
    assert not df.inputFiles()
    assert _rows(df) == _rows(r.snapshot(11))
    assert r._held_seqnos()  # lazy on the general path too: held until released
    r.release_splits()
    r.expire()
    client.close()
