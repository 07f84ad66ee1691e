"""Compactions decode their large input parts into a pool of their own
(``part_fetch.merge_memory_pool``: Arrow's jemalloc pool unless an allocator was
chosen), and hand its freed pages back when the merge ends. The pool changes where
bytes live, never what a merge writes: outputs are byte-identical either way."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import numpy as np
import pyarrow as pa
import pytest

from persist_lib import Antichain
from persist_lib.allocator import MERGE_POOL_ENV, merge_pool_backend
from persist_lib.errors import CorruptionError, InvalidUsage
from persist_lib.location.mem import MemBlob
from persist_lib.shard import part_fetch, range_merge
from persist_lib.shard.batch_builder import build_batch
from persist_lib.shard.batch_meta import HollowBatch
from persist_lib.shard.codec import Schemas, internal_schema
from persist_lib.shard.compactor import merge_batches
from persist_lib.shard.in_memory_merge import decode_parts
from persist_lib.shard.part_fetch import DECODED_CACHE, decode_whole, fetch_part_bytes

try:
    JEMALLOC: pa.MemoryPool | None = pa.jemalloc_memory_pool()
except NotImplementedError:  # pragma: no cover - a pyarrow built without jemalloc
    JEMALLOC = None

needs_jemalloc = pytest.mark.skipif(JEMALLOC is None, reason="this pyarrow has no jemalloc pool")


def test_the_pool_choice_keeps_a_chosen_allocator_and_rejects_unknown_values() -> None:
    assert merge_pool_backend("mimalloc", True, None) == "jemalloc"
    assert merge_pool_backend("mimalloc", True, " Auto ") == "jemalloc"
    assert merge_pool_backend("mimalloc", False, None) == "default"
    assert merge_pool_backend("system", True, None) == "default", "the bounded allocator's choice stays"
    assert merge_pool_backend("jemalloc", True, None) == "default"
    assert merge_pool_backend("mimalloc", True, "default") == "default"
    assert merge_pool_backend("system", True, "jemalloc") == "jemalloc"
    with pytest.raises(InvalidUsage, match=f"{MERGE_POOL_ENV}='arena'.*auto, default, jemalloc"):
        merge_pool_backend("mimalloc", True, "arena")
    with pytest.raises(InvalidUsage, match="without jemalloc"):
        merge_pool_backend("mimalloc", False, "jemalloc")


def _schemas() -> Schemas:
    key = pa.schema([pa.field("a", pa.int64()), pa.field("b", pa.string())])
    return Schemas.create(key, pa.schema([pa.field("v", pa.float64()), pa.field("w", pa.binary())]))


def _updates(schemas: Schemas, n: int, seed: int, t0: int) -> pa.Table:
    rng = np.random.default_rng(seed)
    return pa.table(
        {
            "k.a": pa.array(rng.integers(-500, 500, n), mask=rng.random(n) < 0.05),
            "k.b": pa.array([f"b{j}é" for j in rng.integers(0, 4, n)], mask=rng.random(n) < 0.1),
            "v.v": pa.array(rng.choice(np.array([-0.0, 0.0, 1.5, np.nan, -np.inf]), n), mask=rng.random(n) < 0.1),
            "v.w": pa.array([bytes([j, 0, 255]) for j in rng.integers(0, 9, n)]),
            "t": pa.array(rng.integers(t0, t0 + 5, n)),
            "d": pa.array(rng.choice([-1, 1, 2], n)),
        },
        schema=internal_schema(schemas),
    )


def _inputs(blob: MemBlob, schemas: Schemas, seed: int) -> list[HollowBatch]:
    out = []
    for i in range(4):
        t = _updates(schemas, 3_000 + 1_000 * i, seed * 10 + i, i * 10)
        unsorted = {"unsorted_min_bytes": 1} if i % 2 == 0 else {}
        out.append(build_batch(blob, schemas, t, shard="s1", writer="w1", lower=i * 10, upper=i * 10 + 10,
                               target_part_bytes=32 << 10, **unsorted))
    return out


@pytest.fixture
def every_part_decoded(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No part served by the decoded-part cache (every part goes through
    ``decode_whole``), and range merges from 1,000 rows."""
    monkeypatch.setattr(DECODED_CACHE, "max_entry", 0)
    monkeypatch.setattr(range_merge, "RANGE_BYTES", 16 << 10)
    monkeypatch.setattr(range_merge, "MIN_RANGE_MERGE_ROWS", 1_000)
    yield


def _with_merge_pool(monkeypatch: pytest.MonkeyPatch, pool: pa.MemoryPool) -> None:
    monkeypatch.setattr(part_fetch, "_MERGE_POOL", [pool])
    monkeypatch.setattr(part_fetch, "_MERGE_POOL_OWN", [pool.backend_name != pa.default_memory_pool().backend_name])


@needs_jemalloc
def test_decoding_into_a_pool_yields_the_same_table_and_still_verifies() -> None:
    assert JEMALLOC is not None
    schemas = _schemas()
    blob = MemBlob(uuid.uuid4().hex)
    batch = _inputs(blob, schemas, 1)[0]
    for p in batch.parts:
        data = fetch_part_bytes(blob, p, "s1")
        before = JEMALLOC.bytes_allocated()
        pooled = decode_whole(data, p, schemas, "s1", memory_pool=JEMALLOC)
        assert JEMALLOC.bytes_allocated() - before >= pooled.nbytes // 2, "the columns live in the pool passed"
        plain = decode_whole(data, p, schemas, "s1")
        assert pooled.schema.equals(plain.schema, check_metadata=True)
        for a, b in zip(pooled.columns, plain.columns, strict=True):
            if pa.types.is_floating(a.type):  # (NaN != NaN: compare the bit patterns)
                a, b = a.combine_chunks().view(pa.int64()), b.combine_chunks().view(pa.int64())
            assert a.equals(b)
        bad = bytearray(data)
        bad[len(bad) // 2] ^= 0xFF
        with pytest.raises(CorruptionError):
            decode_whole(bytes(bad), p, schemas, "s1", memory_pool=JEMALLOC)
        del pooled, plain


@needs_jemalloc
@pytest.mark.usefixtures("every_part_decoded")
def test_a_compaction_decodes_into_the_merge_pool_and_a_read_does_not(monkeypatch: pytest.MonkeyPatch) -> None:
    assert JEMALLOC is not None
    _with_merge_pool(monkeypatch, JEMALLOC)
    schemas = _schemas()
    blob = MemBlob(uuid.uuid4().hex)
    runs = [[p] for b in _inputs(blob, schemas, 2) for p in b.parts]
    before = JEMALLOC.bytes_allocated()
    read = decode_parts(blob, schemas, "s1", runs, None, purpose="read")
    assert read is not None and JEMALLOC.bytes_allocated() == before
    merged = decode_parts(blob, schemas, "s1", runs, None, purpose="compaction")
    assert merged is not None
    held = JEMALLOC.bytes_allocated() - before
    assert held >= sum(t.get_total_buffer_size() for t in merged) // 2, held


@needs_jemalloc
@pytest.mark.usefixtures("every_part_decoded")
@pytest.mark.parametrize("in_memory", [None, False])
@pytest.mark.parametrize("seed", [1, 2])
def test_merges_write_the_same_bytes_whichever_pool_and_leave_nothing_in_it(
    monkeypatch: pytest.MonkeyPatch, in_memory: bool | None, seed: int
) -> None:
    """A range merge (``in_memory`` None) and the streaming merge, with the merge pool
    jemalloc and then Arrow's default pool: the same output parts, byte for byte; and
    once a merge returned, nothing it decoded is left in the merge pool."""
    assert JEMALLOC is not None
    schemas = _schemas()
    blob = MemBlob(uuid.uuid4().hex)
    inputs = tuple(_inputs(blob, schemas, seed))
    shas = []
    for pool in (JEMALLOC, pa.default_memory_pool()):
        _with_merge_pool(monkeypatch, pool)
        held = JEMALLOC.bytes_allocated()
        out = merge_batches(
            blob, schemas, shard="s1", inputs=inputs, lower=Antichain([0]), upper=Antichain([40]),
            since=Antichain([25]), memory_budget=64 << 20, target_part_bytes=64 << 10, inline_threshold=0,
            writer="w-merge", in_memory=in_memory,
        )
        if in_memory is None:
            assert out.stats.key_ranges >= 2, out.stats
        assert JEMALLOC.bytes_allocated() == held, "the merge's decoded inputs were all freed"
        shas.append([p.sha256 for p in out.batch.parts])
    assert shas[0] == shas[1] and shas[0]
