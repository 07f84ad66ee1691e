"""The key-range-parallel in-memory merge (``range_merge``): equal to one whole-table
consolidation on random data (duplicate leading keys straddling the pivots, nulls,
floats, composite keys, retractions cancelling across parts, sorted and unsorted
parts), within its budget, and falling back to the streaming merge when a key range
can't fit."""

from __future__ import annotations

import uuid

import numpy as np
import pyarrow as pa
import pytest

from persist_lib import Antichain
from persist_lib.location.mem import MemBlob
from persist_lib.shard import range_merge
from persist_lib.shard.batch_builder import build_batch
from persist_lib.shard.codec import Schemas, internal_schema
from persist_lib.shard.compactor import merge_batches
from persist_lib.shard.consolidate import consolidate
from persist_lib.shard.parts import fetch_part
from persist_lib.shard.ranks import comparable, row_keys
from persist_lib.shard.time_filters import advance_to_since


@pytest.fixture
def small_ranges(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranges of ~16 KiB and merges from 1,000 rows: many ranges on small data."""
    monkeypatch.setattr(range_merge, "RANGE_BYTES", 16 << 10)
    monkeypatch.setattr(range_merge, "MIN_RANGE_MERGE_ROWS", 1_000)


def _lead(rng: np.random.Generator, kind: str, n: int) -> pa.Array:
    if kind == "int":  # few distinct values: every pivot has equal keys on both sides
        return pa.array(rng.integers(-5, 6, n), mask=rng.random(n) < 0.05)
    if kind == "float":
        vals = rng.choice(np.array([-np.inf, -1.5, -0.0, 0.0, 2.0, np.inf, np.nan]), n)
        return pa.array(vals, mask=rng.random(n) < 0.05)
    if kind == "uint64":
        return pa.array(rng.choice(np.array([0, 1, 2**63 - 1, 2**63, 2**64 - 1], dtype=np.uint64), n))
    if kind == "bool":
        return pa.array(rng.random(n) < 0.5, mask=rng.random(n) < 0.1)
    assert kind == "timestamp"
    return pa.array(rng.integers(0, 50, n) * 1_000_000, pa.timestamp("us"))


def _schemas(kind: str) -> Schemas:
    lead_type = {"int": pa.int64(), "float": pa.float64(), "uint64": pa.uint64(), "bool": pa.bool_(),
                 "timestamp": pa.timestamp("us")}[kind]
    key = pa.schema([pa.field("a", lead_type), pa.field("b", pa.string())])
    return Schemas.create(key, pa.schema([("v", pa.string())]))


def _updates(rng: np.random.Generator, schemas: Schemas, kind: str, n: int, t0: int) -> pa.Table:
    return pa.table(
        {
            "k.a": _lead(rng, kind, n),
            "k.b": pa.array([f"b{j}" for j in rng.integers(0, 4, n)], mask=rng.random(n) < 0.05),
            "v.v": pa.array([f"v{j}" for j in rng.integers(0, 3, n)]),
            "t": pa.array(rng.integers(t0, t0 + 5, n)),
            "d": pa.array(rng.choice([-1, 1, 1, 2], n)),
        },
        schema=internal_schema(schemas),
    )


def _canon(t: pa.Table) -> pa.Table:
    """``t`` with float columns as their IEEE total-order integers (``Table.equals``
    never finds NaN equal to NaN)."""
    for i, f in enumerate(t.schema):
        if pa.types.is_floating(f.type):
            t = t.set_column(i, pa.field(f.name, pa.int64()), comparable(t.column(i)))
    return t


def _merge(blob: MemBlob, schemas: Schemas, inputs: list, upper: int, since: int, budget: int):  # type: ignore[no-untyped-def]
    out = merge_batches(
        blob, schemas, shard="s1", inputs=tuple(inputs), lower=Antichain([0]), upper=Antichain([upper]),
        since=Antichain([since]), memory_budget=budget, target_part_bytes=128 << 20, inline_threshold=0,
    )
    got = pa.concat_tables([fetch_part(blob, p, schemas, "s1") for p in out.batch.parts])
    return out, got


@pytest.mark.usefixtures("small_ranges")
@pytest.mark.parametrize("kind", ["int", "float", "uint64", "bool", "timestamp"])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_range_merge_equals_whole_consolidation(kind: str, seed: int) -> None:
    """Sorted and unsorted parts, with retractions of earlier rows in later parts (they
    cancel across parts, and across the pivots' neighbours when the leading keys tie):
    the range merge's output is exactly one consolidation of everything, forwarded to
    since, and one sorted run."""
    schemas = _schemas(kind)
    blob = MemBlob(uuid.uuid4().hex)
    rng = np.random.default_rng(seed)
    inputs, tables = [], []
    for i in range(6):
        t = _updates(rng, schemas, kind, int(rng.integers(300, 1_500)), i * 10)
        if i % 2 == 1:  # retract half of the previous batch's rows (same k, v; time since-forwarded)
            prev = tables[-1].slice(0, tables[-1].num_rows // 2)
            schema = prev.schema
            back = prev.set_column(4, schema.field(4), pa.array(-np.asarray(prev.column("d"))))
            back = back.set_column(3, schema.field(3), pa.array(np.full(back.num_rows, i * 10, dtype=np.int64)))
            t = pa.concat_tables([t, back])
        unsorted = {"unsorted_min_bytes": 1} if i % 3 == 0 else {}
        inputs.append(build_batch(blob, schemas, t, shard="s1", writer="w1", lower=i * 10, upper=i * 10 + 10,
                                  target_part_bytes=int(rng.choice([8 << 10, 64 << 10])), **unsorted))
        tables.append(t)
    assert any(not p.sorted for b in inputs for p in b.parts) and any(p.sorted for b in inputs for p in b.parts)
    since = 60  # everything forwarded to 59 (upper - 1): the retractions cancel
    out, got = _merge(blob, schemas, inputs, 60, since, 64 << 20)
    assert out.stats.key_ranges >= 2 and out.stats.steps == 0, out.stats
    expected = consolidate(advance_to_since(pa.concat_tables(tables), 59))
    assert _canon(consolidate(got)).equals(_canon(got)), "one sorted, consolidated run"
    assert _canon(got).equals(_canon(expected)), out.stats
    assert out.stats.output_rows == expected.num_rows


def test_leading_keys_order_is_persists_row_order() -> None:
    """The int64 a range is chosen by never contradicts persist's order of the leading
    column (``ranks``): a row before another never gets a larger leading key, and equal
    values get equal keys — so equal rows share a range and ranges are in order."""
    rng = np.random.default_rng(7)
    for kind in ["int", "float", "uint64", "bool", "timestamp"]:
        col = _lead(rng, kind, 3_000)
        lead = range_merge.leading_keys(col)
        rank = row_keys([col], len(col))
        order = np.argsort(rank, kind="stable")
        sl = lead[order]
        assert np.all(sl[1:] >= sl[:-1]), kind
        same_rank = rank[order][1:] == rank[order][:-1]
        assert np.all(lead[order][1:][same_rank] == lead[order][:-1][same_rank]), kind


@pytest.mark.usefixtures("small_ranges")
def test_merge_whose_parts_fit_but_whose_sort_does_not_takes_one_pass() -> None:
    """Unsorted bulk parts whose decoded rows fit the budget but whose one-sort working
    set (96+ bytes a row) does not: merged by key ranges in one pass, within the
    budget — no streaming merge steps, no intermediate runs written to blob and read
    back (what the 16M-row compaction of the scaling table did)."""
    schemas = Schemas.create(pa.schema([("k", pa.int64())]), pa.schema([("v", pa.string())]))
    blob = MemBlob(uuid.uuid4().hex)
    rng = np.random.default_rng(11)
    inputs, tables = [], []
    n = 60_000
    for i in range(4):
        keys = rng.integers(0, 1_000_000, n)
        t = pa.table(
            {"k.k": pa.array(keys), "v.v": pa.array([f"val_{k}" for k in keys]),
             "t": pa.array(np.full(n, i, dtype=np.int64)), "d": pa.array(np.ones(n, dtype=np.int64))},
            schema=internal_schema(schemas),
        )
        inputs.append(build_batch(blob, schemas, t, shard="s1", writer="w1", lower=i, upper=i + 1,
                                  target_part_bytes=4 << 20, unsorted_min_bytes=1))
        tables.append(t)
    assert all(not p.sorted for b in inputs for p in b.parts)
    decoded = sum(t.nbytes for t in tables)  # ~6.5 MB; one sort of 240k rows needs ~30 MB more
    budget = 20 << 20
    assert decoded < budget < 240_000 * 96
    out, got = _merge(blob, schemas, inputs, 4, 0, budget)
    st = out.stats
    assert st.passes == 1 and st.steps == 0 and st.intermediate_bytes == 0 and st.key_ranges >= 2, st
    assert st.peak_bytes_held + st.output_reserve_bytes <= budget, st
    assert got.equals(consolidate(pa.concat_tables(tables)))
    keys = {m.key for m in blob.list_keys_and_metadata("s1/")}
    assert keys == {k for b in inputs for k in b.blob_keys()} | set(out.batch.blob_keys())


@pytest.mark.usefixtures("small_ranges")
def test_a_key_range_that_cannot_fit_falls_back_to_streaming() -> None:
    """Every row shares one leading key: one key range holds everything, which does not
    fit beside the decoded parts; the merge streams instead, still exact and within
    its budget."""
    schemas = Schemas.create(pa.schema([("k", pa.int64())]), pa.schema([("v", pa.string())]))
    blob = MemBlob(uuid.uuid4().hex)
    rng = np.random.default_rng(12)
    inputs, tables = [], []
    n = 40_000
    for i in range(4):
        t = pa.table(
            {"k.k": pa.array(np.full(n, 42, dtype=np.int64)),
             "v.v": pa.array([f"v{j:07d}" for j in rng.integers(0, 1_000_000, n)]),
             "t": pa.array(np.full(n, i, dtype=np.int64)), "d": pa.array(np.ones(n, dtype=np.int64))},
            schema=internal_schema(schemas),
        )
        inputs.append(build_batch(blob, schemas, t, shard="s1", writer="w1", lower=i, upper=i + 1,
                                  target_part_bytes=4 << 20, unsorted_min_bytes=1))
        tables.append(t)
    budget = 16 << 20
    out, got = _merge(blob, schemas, inputs, 4, 0, budget)
    st = out.stats
    assert st.steps >= 1 and st.key_ranges == 0, st  # the range merge gave up; the streaming one ran
    assert st.peak_bytes_held + st.output_reserve_bytes <= budget, st
    assert got.equals(consolidate(pa.concat_tables(tables)))
