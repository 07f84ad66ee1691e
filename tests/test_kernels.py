"""The sort and gather kernels (``consolidate.sort_order``, ``persist_lib.shard.kernels``) against
the ranking they replace, on tables large enough to take the fast paths (packed integer
sorts, polars), with ties, nulls, floats' total order and nested columns — through
polars and through numpy/pyarrow alone."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from persist_lib.shard import kernels
from persist_lib.shard.consolidate import consolidate, consolidation_plan, sort_order
from persist_lib.shard.ranks import row_keys


@pytest.fixture(params=["polars", "numpy"])
def engine(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "numpy":
        monkeypatch.setenv("PERSIST_KERNELS", "numpy")
    elif kernels.polars() is None:
        pytest.skip("polars is not installed")
    return str(request.param)


def _column(kind: str, rng: np.random.Generator, n: int) -> pa.Array:
    if kind == "int_few":  # many ties: later columns decide
        return pa.array(rng.integers(-5, 5, n))
    if kind == "int_wide":  # a range too wide to pack with the indices
        return pa.array(rng.integers(np.iinfo(np.int64).min, np.iinfo(np.int64).max, n, dtype=np.int64))
    if kind == "uint64":
        return pa.array(rng.integers(0, np.iinfo(np.uint64).max, n, dtype=np.uint64) // rng.integers(1, 4, n).astype(np.uint64))
    if kind == "int_nulls":
        v = rng.integers(0, 50, n)
        return pa.array(v, mask=rng.random(n) < 0.1)
    if kind == "float":
        specials = np.array([0.0, -0.0, np.nan, -np.nan, np.inf, -np.inf, 1.5, -1.5])
        v = np.where(rng.random(n) < 0.5, rng.choice(specials, n), rng.integers(-3, 3, n).astype(float))
        return pa.array(v, mask=rng.random(n) < 0.05)
    if kind == "str":
        words = ["", "a", "ab", "abc", "b", "ba", "é", "\x00", "zz"]
        return pa.array([words[i] for i in rng.integers(0, len(words), n)], mask=rng.random(n) < 0.05)
    if kind == "str_distinct":
        return pc.binary_join_element_wise("k", pc.cast(pa.array(rng.integers(0, n * 4, n)), pa.string()), "")
    if kind == "binary":
        return pa.array([bytes([i % 3, i % 5]) for i in rng.integers(0, 100, n)], pa.binary())
    if kind == "bool":
        return pa.array(rng.random(n) < 0.5, mask=rng.random(n) < 0.1)
    if kind == "timestamp":
        return pa.array(rng.integers(0, 30, n), pa.timestamp("ms"))
    if kind == "struct":
        a = pa.array(rng.integers(0, 4, n))
        b = pa.array([["x", "y"][i] for i in rng.integers(0, 2, n)])
        return pa.StructArray.from_arrays([a, b], names=["a", "b"], mask=pa.array(rng.random(n) < 0.1))
    raise AssertionError(kind)


KINDS = ["int_few", "int_wide", "uint64", "int_nulls", "float", "str", "str_distinct", "binary", "bool", "timestamp", "struct"]


@pytest.mark.parametrize("first", KINDS)
@pytest.mark.parametrize("n", [3_000, 40_000])
def test_sort_order_matches_ranking(first: str, n: int, engine: str) -> None:
    rng = np.random.default_rng(hash((first, n)) % 2**32)
    second = "str" if first != "str" else "int_few"
    _check_sort_order([_column(first, rng, n), _column(second, rng, n), pa.array(rng.integers(0, 3, n))], n)


@pytest.mark.parametrize("second", KINDS)
def test_ties_are_broken_by_every_column_type(second: str, engine: str) -> None:
    """Leading keys tied in pairs (the pair comparison) and in bigger groups (ranking),
    then any column type, then a third column."""
    rng = np.random.default_rng(hash(second) % 2**32)
    n = 30_000
    lead = np.concatenate([np.repeat(np.arange(10_000), 2), rng.integers(20_000, 20_100, n - 20_000)])
    cols = [pa.array(rng.permutation(lead)), _column(second, rng, n), _column("int_few", rng, n)]
    _check_sort_order(cols, n)


def _check_sort_order(cols: list[pa.Array], n: int) -> None:
    perm, dup = sort_order(cols, n)
    assert sorted(perm.tolist()) == list(range(n))
    key = row_keys(cols, n)  # the ranking: equal keys <=> equal rows, key order = row order
    sk = key[perm]
    assert np.all(sk[1:] >= sk[:-1]), "not sorted"
    assert np.array_equal(dup[1:], sk[1:] == sk[:-1]) and not dup[0]


def _same(a: pa.Table, b: pa.Table) -> bool:
    """Equality bit for bit on floats (``Table.equals`` says NaN != NaN)."""
    if a.schema != b.schema:
        return False
    for name in a.column_names:
        x, y = a.column(name).combine_chunks(), b.column(name).combine_chunks()
        if pa.types.is_floating(x.type):
            x, y = (c.cast(pa.float64()).view(pa.int64()) for c in (x, y))
        if not x.equals(y):
            return False
    return True


@pytest.mark.parametrize("first", ["int_few", "str_distinct", "float", "struct"])
def test_consolidate_matches_the_ranking_consolidation(first: str, engine: str) -> None:
    rng = np.random.default_rng(7)
    n = 30_000
    t = pa.table({
        "k": _column(first, rng, n),
        "v": _column("str", rng, n),
        "t": pa.array(rng.integers(0, 4, n)),
        "d": pa.array(rng.choice([-1, 1, 2], n)),
    })
    got = consolidate(t)
    key = row_keys([t.column(c) for c in ("k", "v", "t")], n)
    order = np.argsort(key, kind="stable")
    sk = key[order]
    starts = np.flatnonzero(np.r_[True, sk[1:] != sk[:-1]])
    sums = np.add.reduceat(t.column("d").to_numpy()[order], starts)
    keep = sums != 0
    expected = t.take(pa.array(order[starts[keep]]))
    expected = expected.set_column(3, "d", pa.array(sums[keep]))
    assert _same(got, expected)
    rows, diffs = consolidation_plan(t)
    assert np.array_equal(diffs, sums[keep]) and len(rows) == got.num_rows


@pytest.mark.parametrize("typ", [pa.string(), pa.large_string(), pa.binary(), pa.large_binary(), pa.int64(), pa.float32()])
def test_take_rows_keeps_types_values_and_nulls(typ: pa.DataType, engine: str) -> None:
    rng = np.random.default_rng(3)
    n = 50_000
    if pa.types.is_integer(typ) or pa.types.is_floating(typ):
        col = pa.array(rng.integers(0, 100, n), mask=rng.random(n) < 0.1).cast(typ)
    else:
        col = pa.array([f"v{i}" for i in rng.integers(0, 1000, n)], mask=rng.random(n) < 0.1).cast(typ)
    t = pa.Table.from_arrays([pa.chunked_array([col.slice(0, 20_000), col.slice(20_000)]), pa.array(np.arange(n))], names=["c", "i"])
    idx = rng.integers(0, n, 40_000)
    got = kernels.take_rows(t, idx)
    assert got.schema == t.schema
    assert got.equals(t.take(pa.array(idx)))
    src = kernels.RowSource(t)
    for lo in range(0, 40_000, 15_000):
        assert src.take(idx[lo : lo + 15_000]).equals(t.take(pa.array(idx[lo : lo + 15_000])))


def test_sort_int64_equals_numpy(engine: str) -> None:
    rng = np.random.default_rng(5)
    for n in (10, 50_000):
        v = rng.integers(-(1 << 62), 1 << 62, n)
        before = v.copy()
        out = kernels.sort_int64(v)
        assert np.array_equal(out, np.sort(before)) and np.array_equal(v, before)
        out[:1] = 0  # writable


@pytest.mark.parametrize("value_kind", ["str", "int_few"])
def test_consolidation_plan_split_in_two_key_ranges(value_kind: str, engine: str) -> None:
    """Above ``PARALLEL_PLAN_ROWS`` an integer, string or binary leading key is split at a
    sampled median and the halves sorted on two threads: the same rows and sums as the
    ranking, including keys equal to the pivot (all on one side), null keys (sorted first:
    in the lower half) and a shard of one key or of nulls only (no split)."""
    from persist_lib.shard.consolidate import PARALLEL_PLAN_ROWS
    from persist_lib.shard.kernels import RowSource

    rng = np.random.default_rng(11)
    n = PARALLEL_PLAN_ROWS + 50_000
    ints = [rng.integers(0, 1_000, n), rng.integers(0, 10**9, n), np.full(n, 7)]
    strs = [f"user_{i}" for i in rng.integers(0, n // 2, n)]
    with_nulls = [None if i % 97 == 0 else x for i, x in enumerate(strs)]
    var = [
        pa.array(strs), pa.array(with_nulls), pa.array([x.encode() if x else None for x in with_nulls]),
        pa.array(with_nulls, pa.large_string()), pa.array(["same"] * n), pa.array([None] * n, pa.string()),
    ]
    for keys in [pa.array(k) for k in ints] + var:
        t = pa.table({
            "k": keys,
            "v": _column(value_kind, rng, n),
            "t": pa.array(rng.integers(0, 3, n)),
            "d": pa.array(rng.choice([-1, 1, 2], n)),
        })
        key = row_keys([t.column(c) for c in ("k", "v", "t")], n)
        order = np.argsort(key, kind="stable")
        sk = key[order]
        starts = np.flatnonzero(np.r_[True, sk[1:] != sk[:-1]])
        sums = np.add.reduceat(t.column("d").to_numpy()[order], starts)
        keep = sums != 0
        for source in (None, RowSource(t)):
            rows, diffs = consolidation_plan(t, source)
            assert np.array_equal(diffs, sums[keep])
            assert np.array_equal(key[rows], sk[starts[keep]])


def test_a_child_forked_after_polars_ran_uses_the_numpy_kernels_and_new_pools() -> None:
    """polars' threads (and the kernel and compactor pools' threads) do not survive a
    fork: a forked child must neither deadlock on them nor wait on a pool without
    threads."""
    import multiprocessing as mp

    if kernels.polars() is None:
        pytest.skip("polars is not installed")
    rng = np.random.default_rng(2)
    n = 300_000
    t = pa.table({"k": pa.array(rng.integers(0, 1000, n)), "v": _column("str", rng, n),
                  "t": pa.array(np.zeros(n, dtype=np.int64)), "d": pa.array(np.ones(n, dtype=np.int64))})
    expected = consolidate(t)  # uses polars and the kernel pool here
    ctx = mp.get_context("fork")
    q = ctx.Queue()

    def child() -> None:
        q.put((kernels.polars() is None, consolidate(t).equals(expected)))

    p = ctx.Process(target=child)
    p.start()
    p.join(60)
    assert p.exitcode == 0, "the forked child hung or failed"
    assert q.get(timeout=5) == (True, True)
