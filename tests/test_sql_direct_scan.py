"""``persist sql`` reading a snapshot whose parts need no consolidation with DuckDB's own
Parquet reader, from verified copies of the parts (``persist_lib.sql.direct_scan``)."""

# ruff: noqa: S608 - queries over our own shard ids and temp paths
from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import pytest

from persist_lib import PersistClient, PersistConfig, ShardId
from persist_lib.errors import CorruptionError
from persist_lib.sql.engine import SqlSession
from persist_lib.sql.guard import SqlReadOnly

pytest.importorskip("duckdb")

KEY = pa.schema([("id", pa.int64())])
VAL = pa.schema([("name", pa.string())])
AGG = "SELECT count(*), sum(id * diff), sum(length(name) * diff), sum(diff), min(ts), max(ts) FROM {}"


def client_in(tmp: Path) -> PersistClient:
    (tmp / "blob").mkdir(exist_ok=True)
    return PersistClient.open(
        f"file://{tmp / 'blob'}", f"sqlite:///{tmp / 'c.db'}", PersistConfig.for_tests(inline_threshold=0)
    )


def rows(ids: list[int], ts: list[int], diffs: list[int] | None = None) -> pa.Table:
    return pa.table({
        "id": pa.array(ids, pa.int64()), "name": [f"n{i}" for i in ids], "ts": pa.array(ts, pa.int64()),
        "diff": pa.array(diffs or [1] * len(ids), pa.int64()),
    })


def write(client: PersistClient, batches: list[tuple[pa.Table, int, int]]) -> ShardId:
    sid = ShardId.new()
    w, r = client.open(sid, KEY, VAL)
    for t, lo, hi in batches:
        w.compare_and_append(t, lo, hi)
    w.expire()
    r.expire()
    return sid


def scans_parquet(s: SqlSession, sid: ShardId) -> bool:
    """Whether DuckDB reads the shard from Parquet copies (else it scans the Arrow stream)."""
    plan = "\n".join(str(r[1]) for r in s.sql(f"EXPLAIN SELECT * FROM {sid}").fetchall())
    return "READ_PARQUET" in plan.upper() or "PARQUET_SCAN" in plan.upper()


def both(client: PersistClient, sid: ShardId, as_of: int) -> tuple[list[tuple[object, ...]], list[tuple[object, ...]]]:
    """The snapshot's rows through the direct view and through the stream, sorted."""
    q = f"SELECT id, name, ts, diff FROM {sid} ORDER BY id, name"
    with SqlSession(client, as_of=as_of) as s:
        direct = s.sql(q).fetchall()
    with SqlSession(client, as_of=as_of, direct_reads=False) as s:
        stream = s.sql(q).fetchall()
    return direct, stream


def test_key_disjoint_parts_at_one_time_each_are_read_directly(tmp_path: Path) -> None:
    client = client_in(tmp_path)
    sid = write(client, [(rows(list(range(i * 10, i * 10 + 10)), [i] * 10), i, i + 1) for i in range(4)])
    with SqlSession(client, as_of=3) as s:
        assert scans_parquet(s, sid)
        got = s.sql(AGG.format(sid)).fetchall()[0]
        copies = Path(s._copies or "")
        assert len([p for d in copies.iterdir() for p in d.iterdir()]) == 4  # one copy per part
    assert not copies.exists()  # removed with the session
    assert got == (40, sum(range(40)), sum(len(f"n{i}") for i in range(40)), 40, 3, 3)
    direct, stream = both(client, sid, 3)
    assert direct == stream and len(direct) == 40
    client.close()


def test_a_key_at_two_times_of_one_part_is_consolidated_by_the_stream(tmp_path: Path) -> None:
    """A part holding id 5 at times 0 and 1 (its first key field repeats): the direct view
    would return two rows for it, so the scan falls back to the consolidating stream."""
    client = client_in(tmp_path)
    sid = write(client, [
        (rows([1, 5, 5, 9], [0, 0, 1, 0]), 0, 2),
        (rows([20, 30], [2, 2]), 2, 3),
    ])
    with SqlSession(client, as_of=2) as s:
        assert not scans_parquet(s, sid)
        got = s.sql(f"SELECT id, diff FROM {sid} ORDER BY id").fetchall()
    assert got == [(1, 1), (5, 2), (9, 1), (20, 1), (30, 1)]
    # Keys strictly increasing over two times: no (key, value) at two times, read directly.
    sid2 = write(client, [(rows([1, 2, 3, 4], [0, 1, 0, 1]), 0, 2)])
    with SqlSession(client, as_of=1) as s:
        assert scans_parquet(s, sid2)
        assert s.sql(f"SELECT id, ts, diff FROM {sid2} ORDER BY id").fetchall() == [
            (1, 1, 1), (2, 1, 1), (3, 1, 1), (4, 1, 1)
        ]
    client.close()


def test_parts_sharing_a_key_or_after_the_as_of_take_the_stream(tmp_path: Path) -> None:
    client = client_in(tmp_path)
    # Two parts both holding id 10 (a retraction and an insert of another value).
    sid = write(client, [
        (rows([1, 10], [0, 0]), 0, 1),
        (pa.table({"id": pa.array([10, 10], pa.int64()), "name": ["n10", "x"], "ts": pa.array([1, 1], pa.int64()),
                   "diff": pa.array([-1, 1], pa.int64())}), 1, 2),
    ])
    direct, stream = both(client, sid, 1)
    assert direct == stream == [(1, "n1", 1, 1), (10, "x", 1, 1)]
    with SqlSession(client, as_of=1) as s:
        assert not scans_parquet(s, sid)
    # A part with a time after the as-of (id 20 at time 1, read as of 0): rows are cut,
    # the stream.
    sid2 = write(client, [(rows([1, 10, 20], [0, 0, 1]), 0, 2)])
    with SqlSession(client, as_of=0) as s:
        assert not scans_parquet(s, sid2)
        assert s.sql(f"SELECT id, diff FROM {sid2} ORDER BY id").fetchall() == [(1, 1), (10, 1)]
    client.close()


def test_a_corrupt_part_is_a_corruption_error_and_leaves_no_copy(tmp_path: Path) -> None:
    client = client_in(tmp_path)
    sid = write(client, [(rows(list(range(i * 10, i * 10 + 10)), [i] * 10), i, i + 1) for i in range(3)])
    state = client.machine(sid).fetch_latest()
    key = next(p.key for _, b in state.trace_batches() for p in b.parts)
    assert key is not None
    path = os.path.join(tmp_path / "blob", *key.split("/"))
    data = bytearray(Path(path).read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte, same size
    Path(path).write_bytes(bytes(data))
    with SqlSession(client, as_of=2) as s:
        with pytest.raises(CorruptionError, match="checksum mismatch"):
            s.sql(AGG.format(sid)).fetchall()
        copies = Path(s._copies or "")
        assert copies.is_dir() and not list(copies.iterdir())
    client.close()


def test_the_copies_directory_opens_no_other_file(tmp_path: Path) -> None:
    client = client_in(tmp_path)
    sid = write(client, [(rows([1, 2], [0, 0]), 0, 1)])
    with SqlSession(client, as_of=0) as s:
        assert scans_parquet(s, sid)
        blob_file = next(str(p) for p in (tmp_path / "blob").rglob("*") if p.is_file())
        with pytest.raises(SqlReadOnly):
            s.sql(f"SELECT * FROM read_parquet('{blob_file}')").fetchall()
        with pytest.raises(SqlReadOnly):
            s.sql("SET allowed_directories = ['/']")
    client.close()


def test_quoted_field_names_and_other_types(tmp_path: Path) -> None:
    """Field names that need quoting are read directly; a field of a type outside the
    plain ones (a timestamp) takes the stream. Both give the stream's rows."""
    client = client_in(tmp_path)
    key = pa.schema([("i d", pa.int64()), ('q"k', pa.int32())])
    val = pa.schema([("v.al", pa.string()), ("at", pa.timestamp("us"))])
    for vs, direct in ((pa.schema([val.field(0)]), True), (val, False)):
        sid = ShardId.new()
        w, r = client.open(sid, key, vs)
        cols = {"i d": pa.array([1, 2], pa.int64()), 'q"k': pa.array([7, 8], pa.int32()), "v.al": ["x", "y"]}
        if len(vs) == 2:
            cols["at"] = pa.array([0, 1], pa.timestamp("us"))
        w.compare_and_append(pa.table({**cols, "ts": pa.array([0, 0], pa.int64()), "diff": pa.array([1, 1], pa.int64())}),
                             0, 1)
        w.expire()
        r.expire()
        with SqlSession(client, as_of=0) as s:
            assert scans_parquet(s, sid) is direct
            got = s.sql(f"SELECT * FROM {sid} ORDER BY 1").fetchall()
            assert [d[0] for d in s.sql(f"SELECT * FROM {sid}").description] == [*key.names, *vs.names, "ts", "diff"]
        with SqlSession(client, as_of=0, direct_reads=False) as s:
            assert got == s.sql(f"SELECT * FROM {sid} ORDER BY 1").fetchall()
    client.close()
