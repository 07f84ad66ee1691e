"""Inline parts written as Arrow IPC streams (``persist_lib.shard.inline_format``): they
decode to exactly what the Parquet part of the same rows decodes to, stay verified by
their checksum, older inline Parquet parts keep reading, and no IPC part ever reaches
blob (moving an inline part to blob re-encodes it as Parquet) or DuckDB."""

# ruff: noqa: S608 - queries over our own shard ids
from __future__ import annotations

import datetime as dt
import decimal
import hashlib
import uuid
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from persist_lib import PersistClient, PersistConfig, ShardId
from persist_lib.errors import CorruptionError
from persist_lib.location.mem import MemBlob
from persist_lib.shard.batch_builder import build_batch
from persist_lib.shard.batch_meta import HollowBatch, PartMeta
from persist_lib.shard.codec import Schemas, internal_schema
from persist_lib.shard.compactor import _uninline
from persist_lib.shard.consolidate import consolidate
from persist_lib.shard.inline_format import IPC_MAGIC, is_ipc_part
from persist_lib.shard.part_fetch import decode_whole
from persist_lib.shard.parts import encode_part, fetch_part, part_meta_for

KEY = pa.schema([("id", pa.int64()), ("tag", pa.string())])
VAL = pa.schema([
    ("x", pa.float64()), ("day", pa.date64()), ("at", pa.timestamp("s", tz="UTC")), ("raw", pa.binary()),
])
SCHEMAS = Schemas.create(KEY, VAL)


def updates(n: int, seed: int) -> pa.Table:
    """``n`` updates (internal layout) with nulls, NaN, -0.0, non-midnight date64 values."""
    rng = np.random.default_rng(seed)
    return pa.table(
        {
            "k.id": pa.array(rng.integers(-50, 50, n), pa.int64()),
            "k.tag": pa.array([f"t{j}é" for j in rng.integers(0, 3, n)], mask=rng.random(n) < 0.1),
            "v.x": pa.array(rng.choice(np.array([np.nan, -0.0, 0.0, 1.5, -np.inf]), n)),
            # date64 holds milliseconds: a value not on a day boundary must survive
            "v.day": pa.array([int(j) * 86_400_000 + 1234 for j in rng.integers(0, 9, n)], pa.int64()).cast(pa.date64()),
            "v.at": pa.array([dt.datetime(2021, 5, 1, tzinfo=dt.UTC)] * n, pa.timestamp("s", tz="UTC")),
            "v.raw": pa.array([bytes([int(j), 0, 255]) for j in rng.integers(0, 7, n)], mask=rng.random(n) < 0.2),
            "t": pa.array(rng.integers(0, 4, n), pa.int64()),
            "d": pa.array(rng.choice([-1, 1, 2], n), pa.int64()),
        },
        schema=internal_schema(SCHEMAS),
    )


def same(a: pa.Table, b: pa.Table) -> None:
    assert a.schema.equals(b.schema, check_metadata=False)
    for x, y in zip(a.columns, b.columns, strict=True):
        if pa.types.is_floating(x.type):  # NaN != NaN: compare bit patterns
            x, y = x.combine_chunks().view(pa.int64()), y.combine_chunks().view(pa.int64())
        assert x.equals(y)


def one_part(table: pa.Table, inline_threshold: int) -> tuple[MemBlob, PartMeta]:
    blob = MemBlob(uuid.uuid4().hex)
    batch = build_batch(blob, SCHEMAS, table, shard="s1", writer="w1", lower=0, upper=10,
                        inline_threshold=inline_threshold)
    (p,) = batch.parts
    return blob, p


@pytest.mark.parametrize("n", [1, 7, 1000])
def test_an_inline_part_is_ipc_and_decodes_like_the_parquet_part(n: int) -> None:
    table = updates(n, n)
    blob_i, inline = one_part(table, 1 << 20)
    blob_p, in_blob = one_part(table, 0)
    assert inline.inline is not None and inline.inline[:4] == IPC_MAGIC
    assert in_blob.key is not None and (blob_p.get(in_blob.key) or b"")[:4] == b"PAR1"
    assert (inline.count, inline.tmin, inline.tmax, inline.stats) == (in_blob.count, in_blob.tmin, in_blob.tmax, in_blob.stats)
    expected = fetch_part(blob_p, in_blob, SCHEMAS, "s1")
    same(expected, consolidate(table))
    same(fetch_part(blob_i, inline, SCHEMAS, "s1"), expected)
    same(decode_whole(inline.inline, inline, SCHEMAS, "s1"), expected)


def test_an_inline_parquet_part_written_by_older_code_still_reads() -> None:
    table = consolidate(updates(300, 3))
    data = encode_part(table, SCHEMAS)  # what inline parts were before: Parquet bytes in state
    p = part_meta_for(data, table, None, inline=True)
    assert not is_ipc_part(p.inline or b"")
    blob = MemBlob(uuid.uuid4().hex)
    same(fetch_part(blob, p, SCHEMAS, "s1"), table)
    same(decode_whole(data, p, SCHEMAS, "s1"), table)


def test_a_corrupt_inline_ipc_part_is_a_corruption_error() -> None:
    blob, p = one_part(updates(500, 5), 1 << 20)
    assert p.inline is not None
    flipped = bytearray(p.inline)
    flipped[len(flipped) // 2] ^= 0xFF
    bad = PartMeta(**{**p.__dict__, "inline": bytes(flipped)})
    with pytest.raises(CorruptionError, match="checksum"):
        fetch_part(blob, bad, SCHEMAS, "s1")
    with pytest.raises(CorruptionError, match="checksum"):
        decode_whole(bytes(flipped), bad, SCHEMAS, "s1")
    # A truncated stream recorded with its own checksum (a writer bug, not bit rot): the
    # decode fails as a typed CorruptionError naming the format, never a bare Arrow error.
    cut = p.inline[: len(p.inline) - 40]
    truncated = PartMeta(**{**p.__dict__, "inline": cut, "size": len(cut), "sha256": hashlib.sha256(cut).hexdigest()})
    with pytest.raises(CorruptionError, match="Arrow IPC inline part"):
        fetch_part(blob, truncated, SCHEMAS, "s1")
    with pytest.raises(CorruptionError, match="Arrow IPC inline part"):
        decode_whole(cut, truncated, SCHEMAS, "s1")


def file_client(d: Path, **cfg: object) -> PersistClient:
    (d / "blob").mkdir(exist_ok=True)
    return PersistClient.open(f"file://{d / 'blob'}", f"sqlite:///{d / 'c.db'}", PersistConfig.for_tests(**cfg))


def user_rows(n: int, t: int) -> pa.Table:
    ids = list(range(t * n, t * n + n))
    return pa.table({"id": pa.array(ids, pa.int64()), "name": [f"n{i}" for i in ids],
                     "ts": pa.array([t] * n, pa.int64()), "diff": pa.array([1] * n, pa.int64())})


def test_parts_moved_to_blob_by_inline_backpressure_are_parquet(tmp_path: Path) -> None:
    """A 1-byte inline budget: every append meets backpressure and moves its (IPC) inline
    part to blob, where it must be a Parquet file whose recorded checksum is its own."""
    client = file_client(tmp_path, inline_threshold=1 << 20, inline_max_total=1)
    sid = ShardId.new()
    w, r = client.open(sid, pa.schema([("id", pa.int64())]), pa.schema([("name", pa.string())]))
    for t in range(3):
        w.compare_and_append(user_rows(5, t), t, t + 1)
    state = client.machine(sid).fetch_latest()
    parts = [p for b in state.batches.values() for p in b.parts]
    assert len(parts) == 3 and all(p.inline is None and p.key is not None for p in parts)
    for p in parts:
        data = client.blob.get(p.key or "") or b""
        assert data[:4] == b"PAR1" and hashlib.sha256(data).hexdigest() == p.sha256 and len(data) == p.size
    got = sorted((x["id"], x["name"], x["ts"]) for x in r.snapshot(2).to_pylist())
    assert got == [(i, f"n{i}", 2) for i in range(15)]  # (read as of 2: times advanced to 2)
    client.close()


@pytest.mark.parametrize("mover", ["writer", "compactor"])
def test_a_move_to_blob_writes_parquet(tmp_path: Path, mover: str) -> None:
    """An append (``WriteHandle._uninline``) or a merge (``compactor._uninline``) whose
    inline part finds no inline room when it commits moves the part to blob."""
    client = file_client(tmp_path)
    sid = ShardId.new()
    w, r = client.open(sid, KEY, VAL)
    _, p = one_part(updates(200, 9), 1 << 20)
    assert p.inline is not None and is_ipc_part(p.inline)
    batch = HollowBatch(lower=w.upper, upper=w.upper, since=w.upper, parts=(p,))
    uploaded: list[HollowBatch] = []
    if mover == "writer":
        moved = w._uninline(batch, uploaded)
        assert [b.parts for b in uploaded] == [moved.parts]  # recorded: deleted if the CAS loses
    else:
        moved = _uninline(client.machine(sid), batch, w.writer_id)
    (q,) = moved.parts
    assert q.inline is None and q.key is not None and (q.count, q.tmin, q.tmax) == (p.count, p.tmin, p.tmax)
    data = client.blob.get(q.key) or b""
    assert data[:4] == b"PAR1" and hashlib.sha256(data).hexdigest() == q.sha256
    same(fetch_part(client.blob, q, SCHEMAS, str(sid)), fetch_part(client.blob, p, SCHEMAS, str(sid)))
    client.close()


def test_persist_sql_reads_inline_ipc_parts_directly(tmp_path: Path) -> None:
    """DuckDB reads copies of the parts as Parquet: an inline IPC part is copied as Parquet."""
    pytest.importorskip("duckdb")
    from persist_lib.sql.engine import SqlSession

    client = file_client(tmp_path, inline_threshold=1 << 20)
    sid = ShardId.new()
    w, r = client.open(sid, pa.schema([("id", pa.int64())]), pa.schema([("name", pa.string())]))
    for t in range(4):
        w.compare_and_append(user_rows(10, t), t, t + 1)
    state = client.machine(sid).fetch_latest()
    assert all(p.inline is not None and is_ipc_part(p.inline) for b in state.batches.values() for p in b.parts)
    q = f"SELECT id, name, ts, diff FROM {sid} ORDER BY id"
    with SqlSession(client, as_of=3) as s:
        plan = "\n".join(str(x[1]) for x in s.sql(f"EXPLAIN SELECT * FROM {sid}").fetchall()).upper()
        assert "READ_PARQUET" in plan or "PARQUET_SCAN" in plan
        direct = s.sql(q).fetchall()
    with SqlSession(client, as_of=3, direct_reads=False) as s:
        stream = s.sql(q).fetchall()
    assert direct == stream == [(i, f"n{i}", 3, 1) for i in range(40)]  # (as of 3)
    client.close()


TYPES = {
    "bool": (pa.bool_(), [True, None, False]),
    "decimal": (pa.decimal128(10, 2), [decimal.Decimal("1.25"), None, decimal.Decimal("-3.10")]),
    "large_string": (pa.large_string(), ["a", None, "ü"]),
    "list": (pa.list_(pa.int32()), [[1, 2], None, []]),
    "struct": (pa.struct([("x", pa.int16()), ("y", pa.string())]), [{"x": 1, "y": "a"}, None, {"x": None, "y": None}]),
    "date32": (pa.date32(), [dt.date(2020, 1, 1), None, dt.date(1969, 12, 31)]),
    "time64": (pa.time64("us"), [dt.time(1, 2, 3), None, dt.time(0)]),
    "timestamp_ns": (pa.timestamp("ns"), [0, None, 10**18]),
    "duration": (pa.duration("ms"), [1, None, -5]),
    "fixed_binary": (pa.binary(3), [b"abc", None, b"\x00\x01\x02"]),
    "uint64": (pa.uint64(), [2**64 - 1, None, 0]),
}


@pytest.mark.parametrize("name", sorted(TYPES))
def test_every_value_type_reads_back_from_an_inline_part_as_from_parquet(name: str) -> None:
    t, vals = TYPES[name]
    schemas = Schemas.create(pa.schema([("id", pa.int64())]), pa.schema([("c", t)]))
    table = pa.table(
        {"k.id": pa.array([1, 2, 3], pa.int64()), "v.c": pa.array(vals, t),
         "t": pa.array([0, 0, 1], pa.int64()), "d": pa.array([1, 1, 1], pa.int64())},
        schema=internal_schema(schemas),
    )
    got = []
    for threshold in (1 << 20, 0):
        blob = MemBlob(uuid.uuid4().hex)
        batch = build_batch(blob, schemas, table, shard="s1", writer="w1", lower=0, upper=5, inline_threshold=threshold)
        (p,) = batch.parts
        assert (p.inline is not None) == (threshold > 0)
        got.append(fetch_part(blob, p, schemas, "s1"))
    assert got[0].equals(got[1]) and got[0].equals(table)


def test_a_state_holding_an_ipc_inline_part_is_format_4_and_older_code_refuses_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """3.x code would take an IPC inline part for corrupt Parquet: a state holding one is
    written as 4.0 (diffs and rollups), which such code refuses with StateFormatTooNew
    before it reads any part; once no IPC inline part is left, the format falls back."""
    import json

    from persist_lib.errors import StateFormatTooNew
    from persist_lib.shard import machine as machine_mod
    from persist_lib.shard import state as st

    client = file_client(tmp_path, rollup_interval=0, compaction_enabled=False)
    shard = ShardId.new()
    key, val = pa.schema([("id", pa.int64())]), pa.schema([("name", pa.string())])
    w, r = client.open(shard, key, val)
    w.compare_and_append(user_rows(50, 0), 0, 1)
    m = client.machine(shard)
    s = m.fetch_latest()
    assert s.has_ipc_inline and st.state_format(s) == [4, 0]
    head = client.consensus.head(str(shard))
    assert head is not None
    assert json.loads(machine_mod.unframe(head.data, shard="x", what="h"))["format"] == [4, 0]
    assert json.loads(s.encode_rollup())["format"] == [4, 0]
    # The same state read by code that knows 3.x at most: refused, typed, naming the fix.
    monkeypatch.setattr(st, "FORMAT_MAJOR", 3)
    machine_mod.clear_state_cache()
    older = PersistClient(client.raw_blob, client.raw_consensus, client.config)
    with pytest.raises(StateFormatTooNew, match="upgrade persist_lib"):
        older.open(shard, key, val)
    older.close()
    monkeypatch.undo()
    # The inline part moved to blob (a Parquet file): nothing needs 4.0 any more.
    moved = s.evolve(batches={i: _uninline(m, b, w.writer_id) for i, b in s.batches.items()})
    assert not moved.has_ipc_inline and st.state_format(moved) == [2, 1]
    assert r.snapshot(0).num_rows == 50
    client.close()
