"""Small parts a writer encodes go to the decoded-part cache (``part_fetch.remember_written_part``):
the same process's next merge of them skips decoding, and what the cache serves is
exactly what decoding the part's bytes yields. Inline parts (Arrow IPC, ``inline_format``)
are not offered: decoding one costs less than the copy."""

from __future__ import annotations

import uuid

import numpy as np
import pyarrow as pa
import pytest

from persist_lib.errors import CorruptionError
from persist_lib.location.mem import MemBlob
from persist_lib.shard.batch_builder import build_batch
from persist_lib.shard.codec import Schemas, internal_schema
from persist_lib.shard.inline_format import is_ipc_part
from persist_lib.shard.part_fetch import (
    DECODED_CACHE,
    decode_whole,
    fetch_part_bytes,
    fetch_small_part,
)


def _schemas(kind: str) -> Schemas:
    lead = {"int": pa.int64(), "float": pa.float64(), "ts": pa.timestamp("us", tz="UTC"), "str": pa.string()}[kind]
    key = pa.schema([pa.field("a", lead), pa.field("b", pa.string())])
    return Schemas.create(key, pa.schema([pa.field("v", pa.float32()), pa.field("w", pa.binary())]))


def _updates(schemas: Schemas, kind: str, n: int, seed: int) -> pa.Table:
    rng = np.random.default_rng(seed)
    mask = rng.random(n) < 0.1
    if kind == "float":
        lead = pa.array(rng.choice(np.array([-np.inf, -0.0, 0.0, 1.5, np.nan]), n), mask=mask)
    elif kind == "str":
        lead = pa.array([f"k{j}é" for j in rng.integers(0, 50, n)], mask=mask)
    else:
        lead = pa.array(rng.integers(-100, 100, n), mask=mask).cast(internal_schema(schemas).field(0).type)
    return pa.table(
        {
            "k.a": lead,
            "k.b": pa.array([f"b{j}" for j in rng.integers(0, 4, n)], mask=rng.random(n) < 0.1),
            "v.v": pa.array(rng.random(n).astype(np.float32), mask=rng.random(n) < 0.1),
            "v.w": pa.array([bytes([j, 0, 255]) for j in rng.integers(0, 9, n)]),
            "t": pa.array(rng.integers(0, 5, n)),
            "d": pa.array(rng.choice([-1, 1, 2], n)),
        },
        schema=internal_schema(schemas),
    )


@pytest.fixture(autouse=True)
def empty_cache() -> None:
    with DECODED_CACHE._lock:
        DECODED_CACHE._d.clear()
        DECODED_CACHE._bytes = 0


@pytest.mark.parametrize("kind", ["int", "float", "ts", "str"])
@pytest.mark.parametrize("inline", [0, 1 << 20])
def test_a_written_small_part_is_served_from_the_cache_and_equals_its_decoding(kind: str, inline: int) -> None:
    schemas = _schemas(kind)
    blob = MemBlob(uuid.uuid4().hex)
    batch = build_batch(blob, schemas, _updates(schemas, kind, 3_000, 7), shard="s1", writer="w1", lower=0,
                        upper=10, target_part_bytes=16 << 10, inline_threshold=inline)
    assert len(batch.parts) >= 2
    for p in batch.parts:
        hits = DECODED_CACHE.hits
        got = fetch_small_part(blob, p, schemas, "s1")
        if inline:  # an inline IPC part is not offered: decoding it is cheaper than the copy
            assert p.inline is not None and is_ipc_part(p.inline)
            assert DECODED_CACHE.hits == hits
        else:
            assert DECODED_CACHE.hits == hits + 1, "the writer's table serves the merge: no decode"
        decoded = decode_whole(fetch_part_bytes(blob, p, "s1"), p, schemas, "s1")
        assert got.schema.equals(decoded.schema, check_metadata=True)
        # (NaN != NaN in ``equals``: compare the IEEE bit patterns of float columns)
        for a, b in zip(got.columns, decoded.columns, strict=True):
            if pa.types.is_floating(a.type):
                width = pa.int64() if a.type.bit_width == 64 else pa.int32()
                a, b = a.combine_chunks().view(width), b.combine_chunks().view(width)
            assert a.equals(b)


def test_a_part_whose_bytes_are_corrupted_fails_its_checksum_despite_the_cache() -> None:
    schemas = _schemas("int")
    blob = MemBlob(uuid.uuid4().hex)
    batch = build_batch(blob, schemas, _updates(schemas, "int", 500, 3), shard="s1", writer="w1", lower=0,
                        upper=10, inline_threshold=0)
    (p,) = batch.parts
    assert p.key is not None and DECODED_CACHE.get(p.sha256, schemas.fingerprint()) is not None
    data = bytearray(blob.get(p.key) or b"")
    data[len(data) // 2] ^= 0xFF
    blob.set(p.key, bytes(data))
    with pytest.raises(CorruptionError):
        fetch_small_part(blob, p, schemas, "s1")


def test_a_small_slice_of_a_large_table_is_not_kept_alive_by_the_cache() -> None:
    schemas = _schemas("int")
    big = _updates(schemas, "int", 200_000, 5).combine_chunks()
    blob = MemBlob(uuid.uuid4().hex)
    # (a builder that keeps the caller's buffers: the consolidated flag skips the copy)
    batch = build_batch(blob, schemas, big.slice(0, 100), shard="s1", writer="w1", lower=0, upper=10,
                        inline_threshold=0, consolidated=True)
    (p,) = batch.parts
    assert big.get_total_buffer_size() > DECODED_CACHE.max_entry
    assert DECODED_CACHE.get(p.sha256, schemas.fingerprint()) is None



def test_a_caller_changing_its_buffers_after_the_append_changes_nothing() -> None:
    """Batches built zero-copy from numpy arrays (sorted keys: the writer may keep slices
    of the caller's buffers) and changed by their caller after ``compare_and_append``
    returned (a loop reusing its arrays): the cached tables must not see the change, or
    the next merge would write the caller's new values under the old parts' checksums."""
    from test_key_range_parts import VAL, client

    from persist_lib.ids import ShardId

    c = client(key_ranges=True)
    shard = ShardId.new()
    w, r = c.open(shard, pa.schema([("k", pa.int64())]), VAL)
    n = 200
    keys = np.empty(n, dtype=np.int64)
    ns = np.empty(n, dtype=np.int64)
    for i in range(5):
        keys[:] = np.arange(n) + 1000 * i  # one pair of arrays, refilled for every batch
        ns[:] = np.arange(n) * 7 + i
        w.compare_and_append(pa.table({
            "k": pa.array(keys),  # zero-copy views of the numpy buffers
            "v": pa.array(["v"] * n),
            "n": pa.array(ns),
            "ts": pa.array(np.full(n, i, dtype=np.int64)),
            "diff": pa.array(np.ones(n, dtype=np.int64)),
        }), i, i + 1)
    want = sorted((1000 * i + j, j * 7 + i) for i in range(5) for j in range(n))
    hits = DECODED_CACHE.hits
    c.compact(shard)
    assert DECODED_CACHE.hits > hits  # the merge did read the written parts from the cache
    got = r.snapshot(4)
    assert sorted(zip(got.column("k").to_pylist(), got.column("n").to_pylist(), strict=True)) == want
    w.expire()
    r.expire()
    c.close()
