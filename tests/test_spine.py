"""The size-tiered spine: which batches to merge, and the compaction-debt signal (pure)."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as stg

from persist_lib.frontier import Antichain
from persist_lib.shard.batch_meta import HollowBatch, PartMeta
from persist_lib.shard.spine import (
    CompactionRequest,
    compaction_debt,
    compaction_requests,
    describe_spine,
    healthy_batch_count,
    level,
)
from persist_lib.shard.state import ShardState


def part(count: int, tmin: int = 0, tmax: int = 0) -> PartMeta:
    return PartMeta(key=f"s/w/p{count}-{tmin}", size=count * 10, count=count, sha256="0" * 64, tmin=tmin, tmax=tmax)


def batch(lo: int, hi: int, count: int, since: int | None = None, tspan: bool = False) -> HollowBatch:
    parts = (part(count, lo, hi - 1 if tspan else lo),) if count else ()
    return HollowBatch(Antichain([lo]), Antichain([hi]), Antichain([lo if since is None else since]), parts)


def state_of(sizes: list[int], since: int = 0, **kw: bool) -> ShardState:
    batches = {i + 1: batch(i * 10, i * 10 + 10, n, **kw) for i, n in enumerate(sizes)}
    return ShardState(
        "s", seqno=5, since=Antichain([since]), upper=Antichain([len(sizes) * 10]),
        batches=batches, next_id=len(sizes) + 1,
    )


def windows(reqs: list[CompactionRequest]) -> list[tuple[int, ...]]:
    return [r.batch_ids for r in reqs]


def test_levels() -> None:
    assert [level(batch(0, 1, n)) for n in (0, 1, 2, 3, 4, 1023, 1024)] == [-1, 0, 1, 1, 2, 9, 10]


def test_healthy_spine_requests_nothing() -> None:
    s = state_of([1024, 256, 64, 8, 1])
    assert compaction_requests(s) == []
    assert compaction_debt(s) == 0


def test_equal_neighbours_merge() -> None:
    s = state_of([8, 1, 1])
    assert windows(compaction_requests(s)) == [(2, 3)]
    assert compaction_debt(s) > 0


def test_equal_newer_batches_join_one_n_way_merge() -> None:
    assert windows(compaction_requests(state_of([8] * 8))) == [tuple(range(1, 9))]
    assert windows(compaction_requests(state_of([64, 4, 4, 8, 1]))) == [(2, 3, 4)]


def test_carry_chain_is_one_merge() -> None:
    # 8 + 4 + 2 + 1 + 1: merging the two 1s gives 2, which absorbs 2, then 4, then 8.
    s = state_of([8, 4, 2, 1, 1])
    assert windows(compaction_requests(s)) == [(1, 2, 3, 4, 5)]


def test_small_before_big_rolls_up() -> None:
    s = state_of([1024, 2, 1, 300])
    (r,) = compaction_requests(s)
    assert r.batch_ids == (2, 3, 4)
    assert r.lower == Antichain([10]) and r.upper == Antichain([40])
    assert r.num_updates == 303


def test_requests_are_disjoint_and_contiguous() -> None:
    s = state_of([100, 8, 8, 1, 1])
    reqs = compaction_requests(s)
    assert windows(reqs) == [(2, 3), (4, 5)]
    seen: set[int] = set()
    for r in reqs:
        assert not seen.intersection(r.batch_ids)
        seen.update(r.batch_ids)
        assert list(r.batch_ids) == list(range(r.batch_ids[0], r.batch_ids[-1] + 1))


def test_empty_batches_are_absorbed_for_free() -> None:
    s = state_of([64, 0, 0, 8])
    (r,) = compaction_requests(s)
    assert r.kind == "empty" and r.batch_ids == (1, 2, 3) and not r.rewrites_data
    first_empty = state_of([0, 8])
    assert compaction_requests(first_empty)[0].batch_ids == (1, 2)


def test_logical_rewrite_once_history_is_below_since() -> None:
    # A batch of 100 updates at times [0, 9]: once the shard since reaches 9 its history
    # can fold to one time.
    s = state_of([100], since=5, tspan=True)
    assert compaction_requests(s) == []  # part of it is still readable at distinct times
    s = state_of([100], since=9, tspan=True)
    (r,) = compaction_requests(s)
    assert r.kind == "logical" and r.since == Antichain([9])
    # After the rewrite every update is at one time: never requested again.
    done = state_of([100], since=50, tspan=False)
    assert compaction_requests(done) == []


def test_describe_spine() -> None:
    d = describe_spine(state_of([8, 1, 1]))
    assert [x["level"] for x in d] == [3, 0, 0]
    assert d[0]["pending_request"] is None and d[1]["pending_request"] == d[2]["pending_request"] == 0


def _apply_merges(sizes: list[int]) -> list[int]:
    """Applies the spine's requests (ideal merges: sizes add up) until none is left."""
    while True:
        s = state_of(sizes)
        reqs = compaction_requests(s)
        if not reqs:
            return sizes
        trace = [b.len for _, b in s.trace_batches()]
        merged: list[int] = []
        i = 0
        starts = {r.batch_ids[0] - 1: r for r in reqs}
        while i < len(trace):
            r = starts.get(i)
            if r is None:
                merged.append(trace[i])
                i += 1
            else:
                merged.append(sum(trace[i : i + len(r.batch_ids)]))
                i += len(r.batch_ids)
        sizes = merged


@settings(max_examples=60, deadline=None)
@given(stg.lists(stg.integers(min_value=1, max_value=5000), min_size=1, max_size=60))
def test_converges_to_logarithmic_batches(appends: list[int]) -> None:
    sizes: list[int] = []
    for n in appends:
        sizes = _apply_merges([*sizes, n])
        total = sum(sizes)
        # Levels strictly decrease: at most one batch per level.
        levels = [x.bit_length() - 1 for x in sizes]
        assert all(a > b for a, b in zip(levels, levels[1:], strict=False))
        assert len(sizes) <= healthy_batch_count(total) <= math.log2(total) + 1
