"""Schema evolution of a shard (issue 27 item 3): a registry of versions in shard state,
changed by one compare-and-set, old parts migrated on read and rewritten by compaction
under the latest version, incompatible changes refused with nothing changed."""

from __future__ import annotations

import json
import uuid
from decimal import Decimal
from typing import Any

import pyarrow as pa
import pytest

from persist_lib.config import PersistConfig
from persist_lib.errors import IncompatibleSchemaChange, SchemaMismatch, StaleSchema
from persist_lib.handles.client import PersistClient
from persist_lib.ids import ShardId
from persist_lib.shard import machine as machine_mod
from persist_lib.shard import state as st
from persist_lib.shard.codec import Schemas
from persist_lib.shard.compactor import compact_request
from persist_lib.shard.part_fetch import fetch_part_bytes
from persist_lib.shard.parts import META_SCHEMAS, read_stored
from persist_lib.shard.schema_registry import EvolveOutcome
from persist_lib.shard.spine import CompactionRequest

KEY = pa.schema([pa.field("k", pa.int64(), nullable=False)])
V1 = pa.schema([("a", pa.int32()), ("s", pa.string())])
V2 = pa.schema([("a", pa.int32()), ("s", pa.string()), ("b", pa.float32())])
V3 = pa.schema([("a", pa.int64()), ("s", pa.string()), ("b", pa.float64())])


def mem_client(**cfg: Any) -> PersistClient:
    name = uuid.uuid4().hex
    return PersistClient.open(f"mem://{name}", f"mem://{name}", PersistConfig.for_tests(**cfg))


def rows(table: pa.Table) -> set[tuple[Any, ...]]:
    out = set()
    for r in table.to_pylist():
        assert r["diff"] != 0
        out.add(tuple(r[n] for n in table.column_names))
    return out


def head_bytes(client: PersistClient, shard: ShardId) -> bytes | None:
    h = client.raw_consensus.head(str(shard))
    return None if h is None else h.data


def write_three_versions(client: PersistClient, shard: ShardId) -> None:
    """v1 rows at 0; v2 (b added) rows at 1; v3 (a and b widened) rows at 2."""
    w1 = client.open_writer(shard, KEY, V1)
    w1.compare_and_append([(((k,), (k, f"s{k}")), 0, 1) for k in range(5)], 0, 1)
    res = client.compare_and_evolve_schema(shard, (KEY, V1), (KEY, V2))
    assert res.outcome is EvolveOutcome.APPLIED and res.version == 1
    # A writer of the old version is refused at its next write: nothing is appended.
    with pytest.raises(StaleSchema, match="version 1") as e:
        w1.compare_and_append([(((9,), (9, "x")), 1, 1)], 1, 2)
    assert e.value.current_version == 1
    assert client.machine(shard).fetch_latest().upper.time == 1
    w2 = client.open_writer(shard, KEY, V2)
    w2.compare_and_append(
        [(((0,), (0, "s0", None)), 1, -1), (((0,), (0, "s0", 0.5)), 1, 1), (((5,), (5, "s5", 5.5)), 1, 1)],
        1, 2,
    )
    res = client.compare_and_evolve_schema(shard, (KEY, V2), (KEY, V3))
    assert res.outcome is EvolveOutcome.APPLIED and res.version == 2
    assert [c.describe() for c in res.changes] == ["widen a: int32 -> int64", "widen b: float -> double"]
    w3 = client.open_writer(shard, KEY, V3)
    w3.compare_and_append([(((6,), (2**40, "s6", 6.25)), 2, 1), (((1,), (1, "s1", None)), 2, -1)], 2, 3)
    for w in (w1, w2, w3):
        w.expire()


def whole_trace(s: st.ShardState) -> CompactionRequest:
    """A merge of the shard's whole trace (what the spine would do eventually)."""
    trace = s.trace_batches()
    return CompactionRequest(
        tuple(i for i, _ in trace), trace[0][1].lower, trace[-1][1].upper, s.since,
        tuple(b for _, b in trace),
    )


def compact_all(client: PersistClient, shard: ShardId) -> None:
    m = client.machine(shard)
    s = m.fetch_latest()
    res = compact_request(m, Schemas.from_json(s.schemas), client.config, whole_trace(s), context=client)
    assert res.applied


EXPECTED = {
    0: {(k, k, f"s{k}", None, 0, 1) for k in range(5)},
    1: {(0, 0, "s0", 0.5, 1, 1), (5, 5, "s5", 5.5, 1, 1)}
    | {(k, k, f"s{k}", None, 1, 1) for k in range(1, 5)},
    2: {(0, 0, "s0", 0.5, 2, 1), (5, 5, "s5", 5.5, 2, 1), (6, 2**40, "s6", 6.25, 2, 1)}
    | {(k, k, f"s{k}", None, 2, 1) for k in range(2, 5)},
}


def test_snapshot_listen_and_compaction_across_three_versions() -> None:
    client = mem_client()
    shard = ShardId.new()
    write_three_versions(client, shard)
    r = client.open_leased_reader(shard, KEY, V3)
    assert r.schemas.version == 2
    for t, want in EXPECTED.items():
        got = r.snapshot(t)
        assert got.schema.field("a").type == pa.int64() and got.schema.field("b").type == pa.float64()
        assert rows(got) == want, t
        assert rows(client.snapshot(shard, KEY, V3, t)) == want  # the one-shot read too
    # Filters on widened columns over parts written narrower (their statistics too).
    assert {x["k"] for x in r.snapshot(2, filter=[("a", ">=", 2**40)]).to_pylist()} == {6}
    assert {x["k"] for x in r.snapshot(2, filter=[("b", ">", 5.0)]).to_pylist()} == {5, 6}
    assert {x["k"] for x in r.snapshot(2, filter=[("a", "<", 3)]).to_pylist()} == {0, 2}
    # updates_between and listen return each time's updates in the latest layout.
    assert rows(r.updates_between(1, 2)) == {
        (0, 0, "s0", None, 1, -1), (0, 0, "s0", 0.5, 1, 1), (5, 5, "s5", 5.5, 1, 1)
    }
    got = [tuple(x.values()) for x in r.listen(0).read_until(3).to_pylist()]
    assert set(got) == {
        (0, 0, "s0", None, 1, -1), (0, 0, "s0", 0.5, 1, 1), (5, 5, "s5", 5.5, 1, 1),
        (6, 2**40, "s6", 6.25, 2, 1), (1, 1, "s1", None, 2, -1),
    }
    # Compaction rewrites every part under the latest version; reads are unchanged.
    compact_all(client, shard)
    s = client.machine(shard).fetch_latest()
    # (a part may be an inline Arrow IPC part: read_stored reads either format)
    fps = {read_stored(fetch_part_bytes(client.blob, p, str(shard)), str(shard), p.location).schema.metadata[META_SCHEMAS]
           for b in s.batches.values() for p in b.parts}
    assert fps == {Schemas.create(KEY, V3).fingerprint().encode()}
    for t, want in EXPECTED.items():
        assert rows(r.snapshot(t)) == want, t


def test_handles_of_an_earlier_version_are_refused() -> None:
    client = mem_client()
    shard = ShardId.new()
    write_three_versions(client, shard)
    with pytest.raises(StaleSchema, match="evolved to version 2"):
        client.open_leased_reader(shard, KEY, V1)
    with pytest.raises(StaleSchema):
        client.open_writer(shard, KEY, V2)
    other = pa.schema([("zzz", pa.int8())])
    with pytest.raises(SchemaMismatch) as e:
        client.open_writer(shard, KEY, other)
    assert not isinstance(e.value, StaleSchema)


def test_a_reader_opened_before_an_evolution_fails_typed_on_newer_parts() -> None:
    client = mem_client()
    shard = ShardId.new()
    w, r = client.open(shard, KEY, V1)
    w.compare_and_append([(((1,), (1, "x")), 0, 1)], 0, 1)
    client.compare_and_evolve_schema(shard, (KEY, V1), (KEY, V2))
    w2 = client.open_writer(shard, KEY, V2)
    w2.compare_and_append([(((2,), (2, "y", 1.0)), 1, 1)], 1, 2)
    assert rows(r.snapshot(0)) == {(1, 1, "x", 0, 1)}  # only v1 parts: still readable
    with pytest.raises(StaleSchema, match="Reopen"):
        r.snapshot(1)


def test_dropping_a_value_column_consolidates_rows_that_become_equal() -> None:
    client = mem_client()
    shard = ShardId.new()
    v1 = pa.schema([("a", pa.int64()), ("b", pa.int64())])
    v2 = pa.schema([("b", pa.int64())])
    w, _ = client.open(shard, KEY, v1)
    # Sorted by (k, a, b): after dropping a the rows of k=1 are no longer in order, and
    # the two with b=9 are not neighbours.
    w.compare_and_append(
        [(((1,), (1, 9)), 0, 1), (((1,), (2, 0)), 0, 1), (((1,), (3, 9)), 0, 1), (((2,), (5, 5)), 0, 1)],
        0, 1,
    )
    assert all(p.sorted for b in client.machine(shard).fetch_latest().batches.values() for p in b.parts)
    client.compare_and_evolve_schema(shard, (KEY, v1), (KEY, v2))
    r = client.open_leased_reader(shard, KEY, v2)
    want = [
        {"k": 1, "b": 0, "ts": 0, "diff": 1},
        {"k": 1, "b": 9, "ts": 0, "diff": 2},
        {"k": 2, "b": 5, "ts": 0, "diff": 1},
    ]
    assert r.snapshot(0).to_pylist() == want
    assert r.updates_between(0, 1).to_pylist() == want
    # A merge of the migrated part with a part of the new version sees sorted runs.
    w2 = client.open_writer(shard, KEY, v2)
    w2.compare_and_append([(((1,), (9,)), 1, -2), (((1,), (4,)), 1, 1)], 1, 2)
    compact_all(client, shard)
    assert r.snapshot(1).to_pylist() == [
        {"k": 1, "b": 0, "ts": 1, "diff": 1},
        {"k": 1, "b": 4, "ts": 1, "diff": 1},
        {"k": 2, "b": 5, "ts": 1, "diff": 1},
    ]
    # The dropped name can't come back (its old values would reappear under it).
    with pytest.raises(IncompatibleSchemaChange, match="existed in an earlier version"):
        client.compare_and_evolve_schema(shard, (KEY, v2), (KEY, v1))


def test_decimal_and_string_widenings() -> None:
    client = mem_client()
    shard = ShardId.new()
    v1 = pa.schema([("d", pa.decimal128(5, 2)), ("s", pa.string()), ("i", pa.uint16())])
    v2 = pa.schema([("d", pa.decimal128(12, 2)), ("s", pa.large_string()), ("i", pa.int32())])
    w, _ = client.open(shard, KEY, v1)
    w.compare_and_append([(((1,), (Decimal("123.45"), "x", 65535)), 0, 1)], 0, 1)
    client.compare_and_evolve_schema(shard, (KEY, v1), (KEY, v2))
    r = client.open_leased_reader(shard, KEY, v2)
    got = r.snapshot(0)
    assert got.schema.field("d").type == pa.decimal128(12, 2)
    assert got.to_pylist() == [{"k": 1, "d": Decimal("123.45"), "s": "x", "i": 65535, "ts": 0, "diff": 1}]


INCOMPATIBLE = [
    ("key", pa.schema([pa.field("k", pa.string(), nullable=False)]), V1, "key fields can't change"),
    ("narrow", KEY, pa.schema([("a", pa.int16()), ("s", pa.string())]), "can't change from int32 to int16"),
    ("kind", KEY, pa.schema([("a", pa.string()), ("s", pa.string())]), "can't change from int32 to string"),
    ("not-null-add", KEY, pa.schema([("a", pa.int32()), ("s", pa.string()), pa.field("n", pa.int8(), nullable=False)]), "must be nullable"),
    ("reorder", KEY, pa.schema([("s", pa.string()), ("a", pa.int32())]), "can't be reordered"),
    ("not-null", KEY, pa.schema([pa.field("a", pa.int32(), nullable=False), ("s", pa.string())]), "can't become not null"),
]


@pytest.mark.parametrize("name,key,val,msg", INCOMPATIBLE, ids=[x[0] for x in INCOMPATIBLE])
def test_incompatible_changes_are_refused_and_change_nothing(
    name: str, key: pa.Schema, val: pa.Schema, msg: str
) -> None:
    client = mem_client()
    shard = ShardId.new()
    w, _ = client.open(shard, KEY, V1)
    w.compare_and_append([(((1,), (1, "x")), 0, 1)], 0, 1)
    before = head_bytes(client, shard)
    with pytest.raises(IncompatibleSchemaChange, match=msg) as e:
        client.compare_and_evolve_schema(shard, (KEY, V1), (key, val))
    assert "build a new rendition" in str(e.value)
    assert head_bytes(client, shard) == before
    w.compare_and_append([(((2,), (2, "y")), 1, 1)], 1, 2)  # the v1 writer still writes


def test_expected_mismatch_changes_nothing_and_a_repeat_is_idempotent() -> None:
    client = mem_client()
    shard = ShardId.new()
    client.open(shard, KEY, V1)
    before = head_bytes(client, shard)
    res = client.compare_and_evolve_schema(shard, (KEY, V2), (KEY, V3))
    assert res.outcome is EvolveOutcome.MISMATCH and res.version == 0
    assert head_bytes(client, shard) == before
    assert client.compare_and_evolve_schema(shard, (KEY, V1), (KEY, V2)).outcome is EvolveOutcome.APPLIED
    after = head_bytes(client, shard)
    assert client.compare_and_evolve_schema(shard, (KEY, V1), (KEY, V2)).outcome is EvolveOutcome.ALREADY
    assert head_bytes(client, shard) == after


def test_state_format_stays_2_1_until_the_schemas_evolve() -> None:
    # No inline parts: an inline IPC part makes the state 4.0 (test_inline_ipc_parts.py).
    client = mem_client(rollup_interval=0, inline_threshold=0)
    shard = ShardId.new()
    w, _ = client.open(shard, KEY, V1)
    w.compare_and_append([(((1,), (1, "x")), 0, 1)], 0, 1)
    m = client.machine(shard)
    s = m.fetch_latest()
    assert st.state_format(s) == [2, 1]
    assert json.loads(machine_mod.unframe(head_bytes(client, shard) or b"", shard="x", what="h"))["format"] == [2, 1]
    assert "versions" not in (s.schemas or {})
    client.compare_and_evolve_schema(shard, (KEY, V1), (KEY, V2))
    s = m.fetch_latest()
    assert st.state_format(s) == [3, 0]
    body = json.loads(machine_mod.unframe(head_bytes(client, shard) or b"", shard="x", what="h"))
    assert body["format"] == [3, 0]
    assert Schemas.from_json(s.schemas).history == (Schemas.create(KEY, V1),)
    # A rollup of the evolved state round-trips its registry.
    again = st.ShardState.decode_rollup(s.encode_rollup(), shard=str(shard), key="x")
    assert Schemas.from_json(again.schemas or {}).version == 1


def test_a_filter_on_an_added_column_does_not_prune_old_parts() -> None:
    client = mem_client()
    shard = ShardId.new()
    w, _ = client.open(shard, KEY, V1)
    w.compare_and_append([(((k,), (k, "x")), 0, 1) for k in range(3)], 0, 1)
    client.compare_and_evolve_schema(shard, (KEY, V1), (KEY, V2))
    w2 = client.open_writer(shard, KEY, V2)
    w2.compare_and_append([(((7,), (7, "y", 2.0)), 1, 1)], 1, 2)
    r = client.open_leased_reader(shard, KEY, V2)
    assert {x["k"] for x in r.snapshot(1, filter=[("b", "is_null", None)]).to_pylist()} == {0, 1, 2}
    assert {x["k"] for x in r.snapshot(1, filter=[("b", ">", 1.0)]).to_pylist()} == {7}
    assert {x["k"] for x in r.snapshot(1, filter=[("a", "<=", 1)]).to_pylist()} == {0, 1}
