"""Indexed parts and verified ranged reads (issue 28): reads fetch only the row groups
that may hold times <= the as-of (or in the range) and rows passing the filter, every
byte they decode checked against a hash chained from state; the results equal a model
of the full read filtered afterwards, with and without the index (old parts too)."""

from __future__ import annotations

import dataclasses
import json
import os
import uuid
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hs

from persist_lib import PersistClient, PersistConfig, ShardId
from persist_lib.errors import CorruptionError
from persist_lib.handles.read import ReadHandle
from persist_lib.location import FileBlob, MemConsensus
from persist_lib.shard import part_index
from persist_lib.shard.batch_meta import PartMeta
from persist_lib.shard.predicate import Predicate, Term
from tests.test_pushdown import NAMES, append, as_rows, mem_client, py_eval, term_st

KEY = pa.schema([("id", pa.int64())])
VAL = pa.schema([("name", pa.string()), ("score", pa.int64())])
GROUP_ROWS = 4


@pytest.fixture
def small_groups(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Row groups of 4 rows, so that small parts have many of them."""
    monkeypatch.setattr(part_index, "INDEXED_ROW_GROUP_ROWS", GROUP_ROWS)
    yield


def file_client(root: Path) -> PersistClient:
    cfg = PersistConfig.for_tests(metrics=True, inline_threshold=0)
    return PersistClient(FileBlob(root), MemConsensus(uuid.uuid4().hex), cfg)


def bytes_read(client: PersistClient, shard: ShardId) -> int:
    assert client.metrics is not None
    return client.metrics.shard(str(shard)).bytes_read


def model(rows: list[tuple[int, str | None, int | None, int, int]], lo: int, hi: int, *, as_of: int | None) -> list[dict[str, Any]]:
    """The updates at times in ``[lo, hi)`` consolidated, times forwarded to ``as_of``
    when given (a snapshot), kept otherwise (a range read)."""
    acc: dict[tuple[Any, ...], int] = defaultdict(int)
    for i, n, s, t, d in rows:
        if lo <= t < hi:
            acc[(i, n, s, as_of if as_of is not None else t)] += d
    return [{"id": i, "name": n, "score": s, "ts": t, "diff": d} for (i, n, s, t), d in acc.items() if d]


def summed(tables: list[pa.Table]) -> list[tuple[Any, ...]]:
    """The rows of split tables consolidated across splits (what a caller of the splits
    does: each split is consolidated on its own)."""
    acc: dict[tuple[Any, ...], int] = defaultdict(int)
    for t in tables:
        for row in t.to_pylist():
            acc[(row["id"], row["name"], row["score"], row["ts"])] += row["diff"]
    return sorted(((*k, d) for k, d in acc.items() if d), key=repr)


def indexed_parts(r: ReadHandle) -> list[PartMeta]:
    state = r._machine.fetch_latest()
    return [p for _, b in state.trace_batches() for p in b.parts if p.footer is not None]


# -- format ------------------------------------------------------------------------------


def test_sorted_parts_carry_a_footer_index_and_old_state_parses(small_groups: None) -> None:
    client = mem_client()
    shard = ShardId.new()
    w, r = client.open(shard, KEY, VAL)
    batch = append(w, [(i, "n", i, 0, 1) for i in range(10)], 0, 1)
    (p,) = batch.parts
    assert p.footer is not None and len(p.footer[1]) == 64 and p.footer[2] == 0
    d = p.to_json()
    assert PartMeta.from_json(json.loads(json.dumps(d))) == p
    assert PartMeta.from_json({k: v for k, v in d.items() if k != "footer"}).footer is None
    # Four rows or fewer are one row group: nothing to index. And writers told to record
    # no statistics write parts as before.
    assert append(w, [(1, "x", 1, 1, 1)], 1, 2).parts[0].footer is None
    assert append(w, [(i, "y", i, 2, 1) for i in range(10)], 2, 3, stats=False).parts[0].footer is None
    assert r.snapshot(2).num_rows == 21


# -- pruning == reading everything and filtering afterwards ---------------------------------

row_st = hs.tuples(
    hs.integers(0, 30), hs.sampled_from(NAMES), hs.one_of(hs.none(), hs.integers(-3, 3)), hs.sampled_from([-1, 1, 2])
)


@settings(
    max_examples=80, deadline=None, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    batches=hs.lists(
        hs.tuples(hs.lists(hs.tuples(row_st, hs.integers(0, 2)), min_size=1, max_size=30), hs.booleans()),
        min_size=1, max_size=4,
    ),
    terms=hs.lists(term_st, max_size=3),
    as_of_back=hs.integers(0, 11),
    compact=hs.booleans(),
)
def test_ranged_reads_equal_the_model(
    small_groups: None,
    batches: list[tuple[list[tuple[tuple[int, str | None, int | None, int], int]], bool]],
    terms: list[Term],
    as_of_back: int,
    compact: bool,
) -> None:
    """Random updates in batches of three times each, written with the index or as old
    parts, some compacted; random as-of and conjunctions (or none): the snapshot, its
    stream and the range read equal a model of every update consolidated and filtered
    afterwards."""
    client = mem_client()
    shard = ShardId.new()
    w, r = client.open(shard, KEY, VAL)
    written: list[tuple[int, str | None, int | None, int, int]] = []
    for b, (rows, index) in enumerate(batches):
        lower = 3 * b
        batch = [(i, n, s, lower + dt, d) for (i, n, s, d), dt in rows]
        append(w, batch, lower, lower + 3, stats=index)
        written += batch
    upper = 3 * len(batches)
    as_of = max(0, upper - 1 - as_of_back)
    pred = Predicate(tuple(terms))
    lower = 0
    if compact and as_of > 0:
        r.downgrade_since(as_of)  # compaction may forward times up to as_of
        client.compact(shard, raise_on_failure=True)
        lower = as_of + 1

    def expect(rows: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
        return sorted((tuple(row.values()) for row in rows if py_eval(pred, row)), key=repr)

    assert as_rows(r.snapshot(as_of, filter=pred)) == expect(model(written, 0, as_of + 1, as_of=as_of))
    with r.snapshot_batches(as_of, filter=pred) as s:
        streamed = pa.Table.from_batches(list(s), schema=s.schema)
    assert as_rows(streamed) == expect(model(written, 0, as_of + 1, as_of=as_of))
    # The splits other processes (Spark executors) fetch read ranged too.
    split_tables = [s.fetch(client.blob) for s in r.snapshot_splits(as_of, 2, filter=pred)]
    assert summed(split_tables) == expect(model(written, 0, as_of + 1, as_of=as_of))
    r.release_splits()
    if lower < upper:
        got = r.updates_between(lower, upper, filter=pred)
        assert as_rows(got) == expect(model(written, lower, upper, as_of=None))
        ranged = [s.fetch(client.blob) for s in r.range_splits(lower, upper, 2, filter=pred)]
        assert summed(ranged) == expect(model(written, lower, upper, as_of=None))
        r.release_splits()


# -- what is fetched ------------------------------------------------------------------------


def test_old_as_of_reads_only_the_row_groups_of_old_times(monkeypatch: pytest.MonkeyPatch) -> None:
    """A part whose rows are ordered in time (keys grow with time) read as of an early
    time fetches the footer and the early row groups, not the part."""
    monkeypatch.setattr(part_index, "INDEXED_ROW_GROUP_ROWS", 256)
    client = mem_client()
    shard = ShardId.new()
    w, r = client.open(shard, KEY, VAL)
    rows = [(t * 10_000 + j, f"name {j * 7919}", j, t, 1) for t in range(10) for j in range(1024)]
    append(w, rows, 0, 10)
    (p,) = indexed_parts(r)
    b0 = bytes_read(client, shard)
    full = r.snapshot(9)
    b1 = bytes_read(client, shard)
    assert b1 - b0 == p.size  # nothing to prune as of the last time: the whole part
    old = r.snapshot(1)
    b2 = bytes_read(client, shard)
    assert as_rows(old) == as_rows(pa.Table.from_pylist(model(rows, 0, 2, as_of=1)))
    assert full.num_rows == 10240 and old.num_rows == 2048
    assert p.footer is not None
    footer, groups = p.footer[0], p.size - p.footer[0]
    assert (b2 - b1 - footer) * 4 < groups, (b2 - b1, footer, groups)  # 2 of 10 times
    # The time-range read of one time fetches its row groups only, too.
    between = r.updates_between(5, 6)
    assert as_rows(between) == as_rows(pa.Table.from_pylist(model(rows, 5, 6, as_of=None)))
    assert (bytes_read(client, shard) - b2 - footer) * 8 < groups


def test_times_mixed_in_every_row_group_read_the_part_whole(small_groups: None) -> None:
    """Random keys: every row group holds early times, so an old as-of can skip none;
    state says so (the largest smallest-time of the groups) and the read is one GET of
    the whole part, no footer first."""
    client = mem_client()
    shard = ShardId.new()
    w, r = client.open(shard, KEY, VAL)
    rows = [((i * 7919) % 400, "n", i, i % 3, 1) for i in range(400)]  # times 0, 1, 2 everywhere
    append(w, rows, 0, 3)
    (p,) = indexed_parts(r)
    assert p.footer is not None and p.footer[2] == 0
    assert client.metrics is not None
    sm = client.metrics.shard(str(shard))
    gets, b0 = sm.parts_read, bytes_read(client, shard)
    got = r.snapshot(1)
    assert (sm.parts_read - gets, bytes_read(client, shard) - b0) == (1, p.size)
    assert as_rows(got) == as_rows(pa.Table.from_pylist(model(rows, 0, 2, as_of=1)))


def test_selective_filter_reads_a_few_row_groups_of_a_big_part(small_groups: None) -> None:
    client = mem_client()
    shard = ShardId.new()
    w, r = client.open(shard, KEY, VAL)
    rows = [(i, f"n{i % 7}", i, 0, 1) for i in range(400)]
    append(w, rows, 0, 1)
    (p,) = indexed_parts(r)
    b0 = bytes_read(client, shard)
    got = r.snapshot(0, filter=[("id", ">=", 200), ("id", "<", 204)])
    fetched = bytes_read(client, shard) - b0
    assert as_rows(got) == [(i, f"n{i % 7}", i, 0, 1) for i in range(200, 204)]
    assert p.footer is not None
    footer, groups = p.footer[0], p.size - p.footer[0]
    assert (fetched - footer) * 50 < groups, (fetched, footer, groups)  # 1 of 100 groups
    # So does a split fetched by another process (Spark's read_snapshot).
    (split,) = r.snapshot_splits(0, 1, filter=[("id", ">=", 200), ("id", "<", 204)])
    b1 = bytes_read(client, shard)
    assert as_rows(split.fetch(client.blob)) == as_rows(got)
    assert (bytes_read(client, shard) - b1 - footer) * 50 < groups
    r.release_splits()


# -- every byte returned is verified ---------------------------------------------------------


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def _group_ranges(data: bytes) -> list[tuple[int, int]]:
    index = json.loads(
        __import__("pyarrow.parquet", fromlist=["x"]).read_metadata(pa.BufferReader(data)).metadata[part_index.META_INDEX]
    )
    ends = index["ends"]
    return list(zip([4] + ends[:-1], ends, strict=True))


def test_a_corrupted_row_group_that_is_read_raises_and_one_skipped_does_not(
    small_groups: None, tmp_path: Path
) -> None:
    client = file_client(tmp_path / "blob")
    shard = ShardId.new()
    w, r = client.open(shard, KEY, VAL)
    rows = [(i, "n", i, 0, 1) for i in range(40)]  # ten row groups: ids 0-3, 4-7, ...
    append(w, rows, 0, 1)
    (p,) = indexed_parts(r)
    assert p.key is not None
    path = os.path.join(str(tmp_path / "blob"), *p.key.split("/"))
    with open(path, "rb") as f:
        data = f.read()
    ranges = _group_ranges(data)
    assert len(ranges) == 10
    a, b = ranges[5]  # ids 20-23
    _flip(path, (a + b) // 2)
    # A read that needs group 5 fails, typed, whichever way it reads.
    with pytest.raises(CorruptionError, match="row group 5: checksum mismatch"):
        r.snapshot(0, filter=[("id", "==", 21)])
    with pytest.raises(CorruptionError, match="checksum mismatch"):
        r.snapshot(0)
    # One that doesn't need it reads verified bytes only, and is right.
    got = r.snapshot(0, filter=[("id", ">=", 30)])
    assert as_rows(got) == [(i, "n", i, 0, 1) for i in range(30, 40)]
    # A damaged footer fails every ranged read before anything is decoded.
    _flip(path, (a + b) // 2)  # (group 5 repaired)
    _flip(path, len(data) - 20)
    with pytest.raises(CorruptionError, match="footer: checksum mismatch"):
        r.snapshot(0, filter=[("id", ">=", 30)])


def test_truncated_indexed_part_raises(small_groups: None, tmp_path: Path) -> None:
    client = file_client(tmp_path / "blob")
    shard = ShardId.new()
    w, r = client.open(shard, KEY, VAL)
    append(w, [(i, "n", i, 0, 1) for i in range(40)], 0, 1)
    (p,) = indexed_parts(r)
    assert p.key is not None
    path = os.path.join(str(tmp_path / "blob"), *p.key.split("/"))
    with open(path, "r+b") as f:
        f.truncate(p.size - 5)
    with pytest.raises(CorruptionError):
        r.snapshot(0, filter=[("id", "==", 3)])
    with pytest.raises(CorruptionError):
        r.snapshot(0)


def test_ranged_reads_on_every_blob_backend(small_groups: None, blob_uri: str) -> None:
    """File (``pread``), S3 (HTTP ``Range`` against moto) and memory: a filtered snapshot
    fetches a few row groups through the client's retrying, metered blob."""
    client = PersistClient.open(blob_uri, f"mem://{uuid.uuid4().hex}", PersistConfig.for_tests(metrics=True))
    shard = ShardId.new()
    w, r = client.open(shard, KEY, VAL)
    rows = [(i, f"n{i % 5}", i, 0, 1) for i in range(200)]
    append(w, rows, 0, 1)
    (p,) = indexed_parts(r)
    assert p.footer is not None and p.key is not None
    b0 = bytes_read(client, shard)
    got = r.snapshot(0, filter=[("id", "in", [3, 150])])
    assert as_rows(got) == sorted([(3, "n3", 3, 0, 1), (150, "n0", 150, 0, 1)], key=repr)
    fetched = bytes_read(client, shard) - b0
    assert fetched - p.footer[0] < (p.size - p.footer[0]) // 10  # 2 of 50 groups
    assert as_rows(r.snapshot(0)) == sorted(((i, n, s, t, d) for i, n, s, t, d in rows), key=repr)
    client.close()


def test_indexed_parts_read_whole_by_readers_that_predate_the_index(small_groups: None, tmp_path: Path) -> None:
    """An indexed part is a plain part: the whole-part decode (what older readers and
    the compactor do, verifying the whole SHA-256) and any Parquet reader return its rows."""
    import pyarrow.parquet as pq

    from persist_lib.shard.codec import Schemas
    from persist_lib.shard.parts import decode_part

    client = file_client(tmp_path / "blob")
    shard = ShardId.new()
    w, r = client.open(shard, KEY, VAL)
    rows = [(i, f"n{i}", i, 0, 1) for i in range(30)]
    append(w, rows, 0, 1)
    (p,) = indexed_parts(r)
    assert p.key is not None
    data = client.blob.get(p.key)
    assert data is not None
    whole = decode_part(data, Schemas(KEY, VAL), expected_sha256=p.sha256, expected_size=p.size, shard=str(shard), key=p.key)
    assert whole.num_rows == 30 and whole.column("k.id").to_pylist() == list(range(30))
    assert pq.read_table(pa.BufferReader(data)).num_rows == 30
    assert pq.read_metadata(pa.BufferReader(data)).num_row_groups == 8
    # State written by this code parses in a reader that ignores the new key.
    d = p.to_json()
    assert PartMeta.from_json({k: v for k, v in d.items() if k != "footer"}) == dataclasses.replace(p, footer=None)


def test_ranged_reads_of_parts_written_before_a_schema_evolution(small_groups: None) -> None:
    """An indexed part written under v1 (name, score int32), read after the schema added
    a column and widened score (v3) through a filter that prunes row groups: the groups
    read are decoded under v1, verified, and migrated (nulls in the new column)."""
    val1 = pa.schema([("name", pa.string()), ("score", pa.int32())])
    val3 = pa.schema([("name", pa.string()), ("score", pa.int64()), ("tag", pa.string())])
    client = file_client(Path(os.environ.get("TMPDIR", "/tmp")) / f"ranged-evolve-{uuid.uuid4().hex}")
    shard = ShardId.new()
    w, _ = client.open(shard, KEY, val1)
    rows = pa.table({
        "id": pa.array(range(40), pa.int64()), "name": [f"n{i}" for i in range(40)],
        "score": pa.array(range(40), pa.int32()), "ts": pa.array([0] * 40, pa.int64()),
        "diff": pa.array([1] * 40, pa.int64()),
    })
    w.compare_and_append(rows, 0, 1)
    w.expire()
    assert client.compare_and_evolve_schema(shard, (KEY, val1), (KEY, val3)).outcome.name == "APPLIED"
    _, r = client.open(shard, KEY, val3)
    assert indexed_parts(r), "the v1 part carries a row-group index"
    before = bytes_read(client, shard)
    pred = Predicate((Term("id", ">=", 8), Term("id", "<", 12)))
    got = r.snapshot(0, filter=pred)
    fetched = bytes_read(client, shard) - before
    assert got.column_names == ["id", "name", "score", "tag", "ts", "diff"]
    assert got.schema.field("score").type == pa.int64()
    assert sorted(got["id"].to_pylist()) == list(range(8, 12))
    assert got["tag"].null_count == got.num_rows
    assert sorted(got["score"].to_pylist()) == list(range(8, 12))
    whole = sum(p.size for p in indexed_parts(r))
    assert 0 < fetched < whole, (fetched, whole)  # groups were pruned, not the whole part read
