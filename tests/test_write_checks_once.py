"""Each table a write is given is checked once (issue 29: the write path normalized the
same table twice, codec -> write handle -> batch builder -> codec again).

The counters wrap the functions that do the work: ``utf8.check_table`` (every check
path ends in it, once per check) and the codec's table/tuple normalizers. The writes
run on in-memory locations, with the real handles, builders and storage controller;
every write is read back, so a path that skipped its check by dropping the data would
fail too. Bad input is still refused before anything is written: the CheckedUpdates
that carry "checked already" can't be made by hand, and one checked for other schemas
is checked again.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

import pyarrow as pa
import pytest

from persist_lib import PersistClient, PersistConfig, ShardId, utf8
from persist_lib.errors import InvalidUsage, InvalidUtf8
from persist_lib.shard import codec
from persist_lib.storage import StorageController

KEY = pa.schema([("id", pa.int64())])
VAL = pa.schema([("name", pa.string())])


def _client() -> PersistClient:
    tag = uuid.uuid4().hex
    return PersistClient.open(f"mem://b-{tag}", f"mem://c-{tag}", PersistConfig.for_tests())


def _user_table(n: int, t: int = 0) -> pa.Table:
    return pa.table(
        {
            "id": pa.array(range(n), pa.int64()),
            "name": pa.array([f"n{i}" for i in range(n)]),
            "ts": pa.array([t] * n, pa.int64()),
            "diff": pa.array([1] * n, pa.int64()),
        }
    )


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """How often each checking function ran, and how many rows the UTF-8 check saw."""
    counts: Counter[str] = Counter()

    def counted(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*a: Any, **kw: Any) -> Any:
            counts[name] += 1
            return fn(*a, **kw)

        return wrapper

    check_table = counted("check_table", utf8.check_table)

    def check_and_count_rows(table: pa.Table, *a: Any, **kw: Any) -> Any:
        counts["rows checked"] += table.num_rows
        return check_table(table, *a, **kw)

    monkeypatch.setattr(utf8, "check_table", check_and_count_rows)
    monkeypatch.setattr(codec, "_normalize_table", counted("normalize_table", codec._normalize_table))
    monkeypatch.setattr(codec, "_normalize_tuples", counted("normalize_tuples", codec._normalize_tuples))
    return counts


def _rows(client: PersistClient, shard: ShardId, as_of: int) -> list[tuple[int, str, int]]:
    r = client.open_leased_reader(shard, KEY, VAL)
    try:
        return sorted((x["id"], x["name"], x["diff"]) for x in r.snapshot(as_of).to_pylist())
    finally:
        r.expire()


def test_compare_and_append_of_a_table_checks_it_once(calls: Counter[str]) -> None:
    client, shard = _client(), ShardId.new()
    w = client.open_writer(shard, KEY, VAL)
    calls.clear()
    w.compare_and_append(_user_table(50), 0, 1)
    assert calls == {"normalize_table": 1, "check_table": 1, "rows checked": 50}
    assert _rows(client, shard, 0) == [(i, f"n{i}", 1) for i in range(50)]


def test_append_of_tuples_checks_them_once_also_when_trimmed(calls: Counter[str]) -> None:
    client, shard = _client(), ShardId.new()
    w = client.open_writer(shard, KEY, VAL)
    w.append([], 0, 1)  # the shard upper is now 1
    calls.clear()
    # [0, 3) over a shard at 1: only the updates at t >= 1 are written (a filter of the
    # checked table: not checked again).
    w.append([(((t,), (f"x{t}",)), t, 1) for t in range(3)], 0, 3)
    assert calls == {"normalize_tuples": 1, "check_table": 1, "rows checked": 3}
    assert _rows(client, shard, 2) == [(1, "x1", 1), (2, "x2", 1)]


def test_builder_fed_from_normalize_checks_once(calls: Counter[str]) -> None:
    client, shard = _client(), ShardId.new()
    w = client.open_writer(shard, KEY, VAL)
    calls.clear()
    b = w.builder(0)
    b.add(w.normalize(_user_table(20)))
    w.compare_and_append_batch(b.finish(1), 0, 1)
    assert calls == {"normalize_table": 1, "check_table": 1, "rows checked": 20}
    assert len(_rows(client, shard, 0)) == 20


def test_a_collection_write_routed_to_shards_checks_once(calls: Counter[str]) -> None:
    ctl = StorageController(_client())
    # The direct path (a transactional collection's writes also append txn log rows,
    # which are checked as the log's own updates).
    ctl.create_collection("c", KEY, VAL, num_shards=3, transactional=False)
    cw = ctl.open_writer("c")
    calls.clear()
    cw.append(_user_table(90), 0, 1)
    cw.compare_and_append(_user_table(30, t=1).set_column(0, "id", pa.array(range(100, 130), pa.int64())), 1, 2)
    # (each call also advances the metadata shard's upper: an empty append, checked too)
    assert calls["normalize_table"] == 2 and calls["rows checked"] == 120, "each row checked once, not per layer"
    assert calls["check_table"] == 2 + calls["normalize_tuples"]
    reader = ctl.acquire_read_handle("c")
    try:
        got = reader.snapshot(1).to_pylist()
    finally:
        reader.expire()
    assert sorted(r["id"] for r in got) == list(range(90)) + list(range(100, 130))
    # every shard got its routed rows (the route is a pure function of the key values)
    from persist_lib.storage.routing import route

    sizes = Counter(route(_user_table(90), ["id"], 3).tolist())
    assert all(sizes[i] for i in range(3))


def test_a_spark_partition_checks_each_chunk_once(calls: Counter[str]) -> None:
    from persist_lib.spark.write import _partition_writer, _WriteSpec

    client = _client()
    shards = [ShardId.new() for _ in range(2)]
    for s in shards:
        client.open_writer(s, KEY, VAL).expire()
    spec = _WriteSpec(
        blob_uri=client.blob_uri, shard_ids=tuple(str(s) for s in shards),
        schemas_json=codec.Schemas.create(KEY, VAL).to_json(), part_writer="w-test", lower=0, upper=1,
        target_part_bytes=1 << 20, inline_threshold=0, max_inflight_uploads=1, chunk_bytes=1 << 30,
    )
    calls.clear()
    out = list(_partition_writer(spec, None)(iter(_user_table(40).to_batches())))
    assert calls == {"normalize_table": 1, "check_table": 1, "rows checked": 40}, "one chunk, two shards: one check"
    rows = out[0].to_pydict()
    assert sum(r for s, r in zip(rows["shard"], rows["rows"], strict=True) if s == -1) == 40
    assert sum(1 for s in rows["shard"] if s >= 0) == 2  # a part per shard


def test_checked_updates_cannot_be_made_by_hand() -> None:
    from persist_lib.shard.codec import CheckedUpdates, Schemas, normalize_checked

    schemas = Schemas.create(KEY, VAL)
    bad = pa.table(
        {"k.id": pa.array([1], pa.int64()), "v.name": pa.array([b"\xff"], pa.binary()).cast(pa.string(), safe=False),
         "t": pa.array([0], pa.int64()), "d": pa.array([1], pa.int64())},
        schema=codec.internal_schema(schemas),
    )
    with pytest.raises(InvalidUsage, match="made only by"):
        CheckedUpdates(bad, schemas)
    ok = normalize_checked(_user_table(1), schemas, shard="s")
    with pytest.raises(InvalidUsage, match="made only by"):
        dataclasses.replace(ok, table=bad)
    # the builder checks a hand-made internal table as before
    client, shard = _client(), ShardId.new()
    w = client.open_writer(shard, KEY, VAL)
    b = w.builder(0)
    with pytest.raises(InvalidUtf8):
        b.add(bad)
    b.abort()
    assert w.fetch_recent_upper().time == 0


def test_checked_updates_of_other_schemas_are_checked_again() -> None:
    from persist_lib.shard.codec import Schemas, normalize_checked

    wide = normalize_checked(
        _user_table(3).set_column(0, "id", pa.array([1, 2, 1 << 40], pa.int64())), Schemas.create(KEY, VAL), shard="s"
    )
    narrow_key = pa.schema([("id", pa.int32())])
    client, shard = _client(), ShardId.new()
    w = client.open_writer(shard, narrow_key, VAL)
    with pytest.raises(InvalidUsage, match="cast safely|not safely castable"):
        w.compare_and_append(wide, 0, 1)
    b = w.builder(0)
    with pytest.raises(InvalidUsage, match="cast safely|not safely castable"):
        b.add(wide)
    b.abort()
    assert w.fetch_recent_upper().time == 0
