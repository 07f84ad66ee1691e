"""The merge's linear kernels (``sorted_checks.sorted_state`` / ``count_less``) and the
compactor's search-bounded merge step, against the reference: ranking
(``row_keys``) and one whole-table ``consolidate``.

Random inputs over string, integer, float (NaN, -0.0, infinities), boolean, timestamp
and binary columns, with nulls, duplicates within and across runs, negative diffs and
zero-sum cancellations; budgets small enough that merges take many steps."""

from __future__ import annotations

import uuid

import numpy as np
import pyarrow as pa
import pytest

from persist_lib import Antichain
from persist_lib.errors import CorruptionError
from persist_lib.location.mem import MemBlob
from persist_lib.shard.batch_builder import build_batch
from persist_lib.shard.batch_meta import HollowBatch
from persist_lib.shard.codec import Schemas, internal_schema
from persist_lib.shard.compactor import merge_batches
from persist_lib.shard.consolidate import consolidate
from persist_lib.shard.memory_plan import MergeStats
from persist_lib.shard.parts import encode_part, fetch_part, part_blob_key, part_meta_for
from persist_lib.shard.ranks import row_keys
from persist_lib.shard.read_merge import stream_merge
from persist_lib.shard.runs import COMPACTOR_WRITER_PREFIX
from persist_lib.shard.sorted_checks import (
    SORTED_STRICT,
    SORTED_WITH_TIES,
    UNSORTED,
    count_less,
    linear_kernels_apply,
    sorted_state,
)
from persist_lib.shard.time_filters import advance_to_since, snapshot_at


def _col(rng: np.random.Generator, kind: str, n: int, card: int) -> pa.Array:
    """A column of ``n`` values drawn from about ``card`` distinct ones, ~10% null."""
    ints = rng.integers(0, card, n)
    null = rng.random(n) < 0.1
    if kind == "int":
        vals: list = [int(x) - card // 2 for x in ints]
        typ = pa.int64()
    elif kind == "str":
        vals = [f"s{x}\u00e9" if x % 3 else f"s{x}" for x in ints]
        typ = pa.string()
    elif kind == "float":
        pool = [float("nan"), -0.0, 0.0, float("inf"), float("-inf"), 1.5, -2.25, 3.0]
        vals = [pool[x % len(pool)] if x < len(pool) else float(x) / 7 for x in ints]
        typ = pa.float64()
    elif kind == "bool":
        vals = [bool(x % 2) for x in ints]
        typ = pa.bool_()
    elif kind == "ts":
        vals = [int(x) * 1_000 for x in ints]
        typ = pa.timestamp("us")
    elif kind == "bin":
        vals = [bytes([x % 256, x // 256 % 256])[: 1 + x % 2] for x in ints]
        typ = pa.binary()
    else:
        raise AssertionError(kind)
    return pa.array([None if m else v for v, m in zip(vals, null, strict=True)], typ)


KINDS = ["int", "str", "float", "bool", "ts", "bin"]


def _update_table(rng: np.random.Generator, kinds: list[str], n: int, card: int, tmax: int = 3) -> pa.Table:
    cols = {f"c{i}": _col(rng, k, n, card) for i, k in enumerate(kinds)}
    cols["t"] = pa.array(rng.integers(0, tmax, n), pa.int64())
    cols["d"] = pa.array(rng.choice([-2, -1, 1, 1, 2], n), pa.int64())
    return pa.table(cols)


def _ref_keys(t: pa.Table) -> np.ndarray:
    return row_keys([t.column(c) for c in t.column_names if c != "d"], t.num_rows)


@pytest.mark.parametrize("seed", range(12))
def test_sorted_state_matches_ranking(seed: int) -> None:
    rng = np.random.default_rng(seed)
    kinds = [KINDS[seed % len(KINDS)], KINDS[(seed * 7 + 1) % len(KINDS)]]
    t = _update_table(rng, kinds, int(rng.integers(2, 400)), int(rng.integers(2, 30)))
    names = [c for c in t.column_names if c != "d"]
    assert linear_kernels_apply(t.schema.field(c).type for c in names)
    cands = [t, consolidate(t)]
    # Sorted with duplicates: a sorted table with some rows repeated in place.
    s = consolidate(t)
    if s.num_rows:
        idx = np.sort(rng.integers(0, s.num_rows, s.num_rows + 5))
        cands.append(s.take(pa.array(idx)))
        # One swapped neighbour pair: unsorted unless the two are equal.
        if s.num_rows > 2:
            i = int(rng.integers(0, s.num_rows - 1))
            order = np.arange(s.num_rows)
            order[i], order[i + 1] = order[i + 1], order[i]
            cands.append(s.take(pa.array(order)))
    for c in cands:
        k = _ref_keys(c)
        if np.all(k[1:] > k[:-1]):
            want = SORTED_STRICT
        elif np.all(k[1:] >= k[:-1]):
            want = SORTED_WITH_TIES
        else:
            want = UNSORTED
        assert sorted_state([c.column(n) for n in names]) == want


@pytest.mark.parametrize("seed", range(12))
def test_count_less_matches_ranking(seed: int) -> None:
    rng = np.random.default_rng(100 + seed)
    kinds = [KINDS[seed % len(KINDS)], KINDS[(seed * 5 + 2) % len(KINDS)]]
    t = consolidate(_update_table(rng, kinds, int(rng.integers(1, 500)), int(rng.integers(2, 40))))
    if t.num_rows == 0:
        return
    names = [c for c in t.column_names if c != "d"]
    probes = _update_table(rng, kinds, 20, 40)
    probes = pa.concat_tables([probes, t.slice(0, 1), t.slice(t.num_rows - 1, 1), t.slice(t.num_rows // 2, 1)])
    for i in range(probes.num_rows):
        row = probes.slice(i, 1)
        k = _ref_keys(pa.concat_tables([t, row]))
        want = int(np.count_nonzero(k[:-1] < k[-1]))
        assert count_less(t, names, row) == want


def _same(a: pa.Table, b: pa.Table) -> bool:
    """Table equality with NaN equal to NaN (``Table.equals`` says NaN != NaN), bit for
    bit on floats (so -0.0 != 0.0, as in the consolidation order)."""
    if a.schema != b.schema or a.num_rows != b.num_rows:
        return False
    for name in a.column_names:
        x, y = a.column(name).combine_chunks(), b.column(name).combine_chunks()
        if pa.types.is_floating(x.type):
            if not x.is_valid().equals(y.is_valid()):
                return False
            xb = x.fill_null(0).to_numpy(zero_copy_only=False).view(np.int64)
            yb = y.fill_null(0).to_numpy(zero_copy_only=False).view(np.int64)
            if not np.array_equal(xb, yb):
                return False
        elif not x.equals(y):
            return False
    return True


def _schemas(key_kind: str) -> Schemas:
    kt = {"int": pa.int64(), "str": pa.string(), "float": pa.float64()}[key_kind]
    return Schemas.create(pa.schema([("k", kt)]), pa.schema([("v", pa.string())]))


def _input_table(schemas: Schemas, rng: np.random.Generator, key_kind: str, n: int, lo: int, hi: int) -> pa.Table:
    card = int(rng.integers(5, 3000))
    k = _col(rng, key_kind, n, card)
    if key_kind != "float":  # key columns of these schemas are not nullable
        k = k.fill_null(0 if key_kind == "int" else "")
    v = pa.array([f"x{j % 3}" for j in rng.integers(0, 3, n)])
    return pa.table(
        {"k.k": k, "v.v": v, "t": pa.array(rng.integers(lo, hi, n)), "d": pa.array(rng.choice([-1, 1, 2], n))},
        schema=internal_schema(schemas),
    )


@pytest.mark.parametrize("in_memory", [False, None])
@pytest.mark.parametrize("key_kind", ["int", "str", "float"])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_merge_equals_consolidation(key_kind: str, seed: int, in_memory: bool | None) -> None:
    """Runs with duplicates across runs, retractions that cancel earlier inserts exactly,
    forwarding to a since that makes more rows equal; budgets forcing many steps."""
    schemas = _schemas(key_kind)
    if key_kind == "float":
        schemas = Schemas.create(pa.schema([pa.field("k", pa.float64(), nullable=True)]), pa.schema([("v", pa.string())]))
    blob = MemBlob(uuid.uuid4().hex)
    rng = np.random.default_rng(seed)
    inputs, tables = [], []
    for i in range(int(rng.integers(3, 9))):
        t = _input_table(schemas, rng, key_kind, int(rng.integers(100, 20_000)), i * 10, i * 10 + 10)
        if i % 3 == 2 and tables:  # retract an earlier batch's rows (zero-sum at the since)
            prev = tables[-1]
            neg = prev.set_column(3, prev.schema.field(3), pa.array(-prev.column("d").to_numpy()))
            t = pa.concat_tables([t, neg])
            t = t.set_column(2, t.schema.field(2), pa.array(rng.integers(i * 10, i * 10 + 10, t.num_rows)))
        inputs.append(build_batch(
            blob, schemas, t, shard="s1", writer="w1", lower=i * 10, upper=i * 10 + 10,
            target_part_bytes=int(rng.choice([16 << 10, 64 << 10])), inline_threshold=0,
        ))
        tables.append(t)
    upper = len(tables) * 10
    since = int(rng.integers(0, upper))
    out = merge_batches(
        blob, schemas, shard="s1", inputs=tuple(inputs), lower=Antichain([0]), upper=Antichain([upper]),
        since=Antichain([since]), memory_budget=(1 << 20) if in_memory is False else (64 << 20),
        target_part_bytes=64 << 10, inline_threshold=0, in_memory=in_memory,
    )
    got = pa.concat_tables([fetch_part(blob, p, schemas, "s1") for p in out.batch.parts])
    expected = consolidate(advance_to_since(pa.concat_tables(tables), min(since, upper - 1)))
    assert _same(got, expected), out.stats
    if in_memory is False:
        assert out.stats.steps > 1
    else:  # everything fits 64 MiB: one sort of all rows
        assert out.stats.steps == 0 and out.stats.passes == 1, out.stats


@pytest.mark.parametrize("seed", [1, 2])
def test_single_run_read_with_forwarding(seed: int) -> None:
    """One compactor run of many parts holding many times, read as of a time that makes
    rows of neighbouring chunks and parts equal: the single-run path sums them across
    chunk and part boundaries (no ranking) and equals a whole-table consolidation."""
    schemas = _schemas("int")
    blob = MemBlob(uuid.uuid4().hex)
    rng = np.random.default_rng(seed)
    n = 30_000
    t = pa.table(
        {
            "k.k": pa.array(np.sort(rng.integers(0, 2_000, n))),
            "v.v": pa.array([f"x{j}" for j in rng.integers(0, 2, n)]),
            "t": pa.array(rng.integers(0, 20, n)),
            "d": pa.array(rng.choice([-1, 1], n)),
        },
        schema=internal_schema(schemas),
    )
    t = consolidate(t)
    writer = COMPACTOR_WRITER_PREFIX + str(uuid.uuid4())
    b = build_batch(blob, schemas, t, shard="s1", writer=writer, lower=0, upper=20,
                    target_part_bytes=8 << 10, inline_threshold=0, consolidated=True)
    assert len(b.parts) > 3
    for as_of in (0, 7, 19):
        st = MergeStats()
        runs = [[p for p in b.parts if p.tmin <= as_of]]
        got = pa.concat_tables(list(stream_merge(
            blob, schemas, shard="s1", runs=runs, memory_budget=1 << 20, since=as_of, upper=as_of + 1, stats=st,
        )))
        assert got.equals(consolidate(snapshot_at(t, as_of))), st
        assert not st.restarted_per_part


def _raw_part_batch(blob: MemBlob, schemas: Schemas, pieces: list[pa.Table], writer: str) -> HollowBatch:
    """A batch of one part per table, written as given (no sorting), claiming to be sorted."""
    parts = []
    for piece in pieces:
        data = encode_part(piece, schemas)
        key = part_blob_key("s1", writer)
        blob.set(key, data)
        parts.append(part_meta_for(data, piece, key, False))
    return HollowBatch(Antichain([0]), Antichain([10]), Antichain([0]), tuple(parts))


def test_part_claiming_sorted_but_unsorted_is_corruption() -> None:
    schemas = _schemas("str")
    blob = MemBlob(uuid.uuid4().hex)
    rng = np.random.default_rng(3)
    t = _input_table(schemas, rng, "str", 5_000, 0, 10)  # not sorted
    b = _raw_part_batch(blob, schemas, [t], "w1")
    b2 = _raw_part_batch(blob, schemas, [consolidate(_input_table(schemas, rng, "str", 100, 0, 10))], "w1")
    with pytest.raises(CorruptionError, match="not sorted"):
        merge_batches(
            blob, schemas, shard="s1", inputs=(b, b2), lower=Antichain([0]), upper=Antichain([10]),
            since=Antichain([0]), memory_budget=1 << 20, target_part_bytes=64 << 10, inline_threshold=0,
            in_memory=False,
        )


def test_compactor_run_with_overlapping_parts_restarts_per_part() -> None:
    """Each part sorted, but the parts overlap: the one-run claim is wrong; the merge
    restarts with a run per part and is still exact."""
    schemas = _schemas("str")
    blob = MemBlob(uuid.uuid4().hex)
    rng = np.random.default_rng(4)
    a = consolidate(_input_table(schemas, rng, "str", 3_000, 0, 10))
    c = consolidate(_input_table(schemas, rng, "str", 3_000, 0, 10))
    writer = COMPACTOR_WRITER_PREFIX + str(uuid.uuid4())
    b = _raw_part_batch(blob, schemas, [a, c], writer)
    for since in (0, 9):
        out = merge_batches(
            blob, schemas, shard="s1", inputs=(b,), lower=Antichain([0]), upper=Antichain([10]),
            since=Antichain([since]), memory_budget=1 << 20, target_part_bytes=64 << 10, inline_threshold=0,
            in_memory=False,
        )
        assert out.stats.restarted_per_part
        got = pa.concat_tables([fetch_part(blob, p, schemas, "s1") for p in out.batch.parts])
        assert got.equals(consolidate(advance_to_since(pa.concat_tables([a, c]), since)))
