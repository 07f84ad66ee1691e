"""The spine's compaction rules (``persist_lib.shard.spine``) on hand-built traces, with the
merges each rule must ask for worked out by hand from the rules in its docstring:
levels (``floor(log2(len))``) strictly decreasing from oldest to newest, empty batches
absorbed into a neighbour, logical rewrites below the since, sorts of unsorted parts,
and the debt figure built from them."""

from __future__ import annotations

from typing import Any

import pytest

from persist_lib import Antichain
from persist_lib.shard.batch_meta import HollowBatch, PartMeta
from persist_lib.shard.spine import (
    BATCH_DEBT_WEIGHT,
    compaction_debt,
    compaction_requests,
    describe_spine,
    healthy_batch_count,
    level,
)
from persist_lib.shard.state import QuarantineEntry, ShardState


def b(lower: int, n: int, *, tmin: int | None = None, tmax: int | None = None, sorted_: bool = True,
      size: int = 10) -> HollowBatch:
    """A batch of ``n`` updates over ``[lower, lower + 1)`` (one part, or none when empty)."""
    lo = lower if tmin is None else tmin
    hi = lower if tmax is None else tmax
    parts = (PartMeta(f"s/w/p{lower}", size, n, "00", lo, hi, None, sorted_),) if n else ()
    return HollowBatch(Antichain([lower]), Antichain([lower + 1]), Antichain([0]), parts)


def state(sizes: list[int], *, since: int = 0, **kw: Any) -> ShardState:
    batches = {i + 1: b(i, n) for i, n in enumerate(sizes)}
    return ShardState(shard_id="s", seqno=5, since=Antichain([since]), upper=Antichain([len(sizes)]),
                      batches=batches, **kw)


def plan(s: ShardState, **kw: Any) -> list[tuple[str, tuple[int, ...]]]:
    return [(r.kind, r.batch_ids) for r in compaction_requests(s, **kw)]


def test_level_and_healthy_count() -> None:
    assert [level(b(0, n)) for n in (0, 1, 2, 3, 4, 1023, 1024)] == [-1, 0, 1, 1, 2, 9, 10]
    assert [healthy_batch_count(n) for n in (0, 1, 2, 3, 4, 1023, 1024)] == [1, 1, 2, 2, 3, 10, 11]


@pytest.mark.parametrize(
    ("sizes", "expected"),
    [
        ([8, 4, 2, 1], []),  # levels 3 2 1 0: healthy
        ([4, 4], [("merge", (1, 2))]),  # 2 2
        ([1, 2], [("merge", (1, 2))]),  # 0 1: a newer batch above an older one
        ([16, 2, 2, 2], [("merge", (2, 3, 4))]),  # the newer equal levels join; 16 stays
        ([3, 2, 8], [("merge", (1, 2, 3))]),  # 1 1 3: the bigger newer one joins too
        ([4, 2, 1, 1], [("merge", (1, 2, 3, 4))]),  # the binary-counter cascade in one merge
        ([64, 4, 2, 1, 1], [("merge", (2, 3, 4, 5))]),  # ... which stops below a bigger level
        ([4, 1, 1, 2], [("merge", (1, 2, 3, 4))]),  # newer ones joined count towards the cascade
        ([1] * 6, [("merge", (1, 2, 3, 4, 5, 6))]),
        ([5, 0, 0, 3], [("empty", (1, 2, 3))]),  # empties absorbed into the older neighbour
        ([5, 0, 0], [("empty", (1, 2, 3))]),
        ([8, 4, 0], [("empty", (2, 3))]),
        ([0, 5], [("empty", (1, 2))]),  # ... or the newer one for the first batch
        ([0, 8, 3], [("empty", (1, 2))]),
        ([4, 4, 8, 0], [("merge", (1, 2)), ("empty", (3, 4))]),
        ([5, 0, 2, 2], [("empty", (1, 2)), ("merge", (3, 4))]),
        ([0], []),
        ([], []),
    ],
)
def test_merge_rules(sizes: list[int], expected: list[tuple[str, tuple[int, ...]]]) -> None:
    assert plan(state(sizes)) == expected


def test_claimed_and_quarantined_batches_are_barriers() -> None:
    assert plan(state([4, 4]), claimed={1}) == []
    assert plan(state([4, 4]), claimed={2}) == []
    # Around a claimed batch, the rules run on the batches on either side.
    assert plan(state([4, 4, 1, 1]), claimed={2}) == [("merge", (3, 4))]
    assert plan(state([4, 4, 1, 1]), claimed={3}) == [("merge", (1, 2))]
    # Empties are absorbed only when no batch of the merge is claimed.
    assert plan(state([5, 0, 3]), claimed={1}) == [("merge", (2, 3))]  # (the level rule)
    assert plan(state([5, 0]), claimed={2}) == []
    assert plan(state([5, 0, 3]), claimed={3}) == [("empty", (1, 2))]
    assert plan(state([5, 7, 0]), claimed={1}) == [("empty", (2, 3))]
    # A merge does not extend into a claimed batch.
    assert plan(state([2, 2, 2]), claimed={3}) == [("merge", (1, 2))]
    q = {"1-2": QuarantineEntry((1, 2), "corrupt", 3, 0, 0)}
    assert plan(state([4, 4], quarantined_merges=q)) == []
    assert plan(state([4, 4], quarantined_merges=q), include_quarantined=True) == [("merge", (1, 2))]
    assert plan(state([4, 4], tombstone=True)) == []


def test_logical_rewrites_and_sorts() -> None:
    hist = {1: b(0, 8, tmin=0, tmax=3)}
    base = dict(shard_id="s", seqno=5, upper=Antichain([4]))
    for since, want in ((3, [("logical", (1,))]), (9, [("logical", (1,))]), (2, [])):
        s = ShardState(since=Antichain([since]), batches=hist, **base)  # type: ignore[arg-type]
        assert plan(s) == want, since
    one_time = {1: b(0, 8, tmin=2, tmax=2)}
    assert plan(ShardState(since=Antichain([5]), batches=one_time, **base)) == []  # type: ignore[arg-type]
    two = {1: b(0, 2, tmin=0, tmax=1)}
    assert plan(ShardState(since=Antichain([5]), batches=two, **base)) == [("logical", (1,))]  # type: ignore[arg-type]
    single = {1: b(0, 1, tmin=0, tmax=3)}
    assert plan(ShardState(since=Antichain([5]), batches=single, **base)) == []  # type: ignore[arg-type]
    assert plan(ShardState(since=Antichain(), batches=hist, **base)) == []  # type: ignore[arg-type]
    unsorted = {1: b(0, 8), 2: b(1, 2, sorted_=False)}
    s = ShardState(since=Antichain([0]), batches=unsorted, **base)  # type: ignore[arg-type]
    assert plan(s) == [("sort", (2,))]
    # A batch that needs both a logical rewrite and a sort gets one request; requests
    # carry the shard since.
    both = {1: b(0, 8), 2: b(1, 4, tmin=0, tmax=1, sorted_=False)}
    s = ShardState(since=Antichain([3]), batches=both, **base)  # type: ignore[arg-type]
    assert [(r.kind, r.batch_ids, r.since) for r in compaction_requests(s)] == [("logical", (2,), Antichain([3]))]
    srt = {1: b(0, 8), 2: b(1, 4, sorted_=False)}
    s = ShardState(since=Antichain([0]), batches=srt, **base)  # type: ignore[arg-type]
    assert [(r.kind, r.batch_ids, r.since) for r in compaction_requests(s)] == [("sort", (2,), Antichain([0]))]
    first = {1: b(0, 16, sorted_=False), 2: b(1, 4), 3: b(2, 4)}
    s = ShardState(since=Antichain([0]), batches=first, **base)  # type: ignore[arg-type]
    assert plan(s) == [("sort", (1,)), ("merge", (2, 3))]
    # The requests come out oldest first whatever rule made them.
    mixed = {1: b(0, 8, tmin=0, tmax=1), 2: b(1, 4, sorted_=False), 3: b(2, 1), 4: b(3, 1)}
    s = ShardState(since=Antichain([1]), batches=mixed, **base)  # type: ignore[arg-type]
    assert plan(s) == [("logical", (1,)), ("sort", (2,)), ("merge", (3, 4))]


def test_request_description() -> None:
    (r,) = compaction_requests(state([4, 4], since=1))
    assert r.describe() == {
        "batch_ids": [1, 2], "lower": [0], "upper": [2], "since": [1], "kind": "merge",
        "updates": 8, "bytes": 20,
    }
    assert r.rewrites_data and r.num_updates == 8 and r.num_bytes == 20
    (e,) = compaction_requests(state([5, 0], since=1))
    assert not e.rewrites_data and e.kind == "empty" and e.since == Antichain([1])


def test_compaction_debt() -> None:
    assert compaction_debt(state([8, 4, 2, 1])) == 0
    assert compaction_debt(state([4, 4])) == 8  # the merge rewrites 8; 2 batches <= 4 healthy
    # Ten single updates: one merge of 10, and 10 batches where 4 are healthy.
    assert compaction_debt(state([1] * 10)) == 10 + BATCH_DEBT_WEIGHT * 6
    assert compaction_debt(state([5, 0, 0, 3])) == 1  # a free merge of empties counts 1
    assert compaction_debt(state([4, 4], tombstone=True)) == 0


def test_describe_spine() -> None:
    assert describe_spine(state([16, 4, 4])) == [
        {"id": 1, "level": 4, "len": 16, "lower": [0], "upper": [1], "since": [0], "pending_request": None},
        {"id": 2, "level": 2, "len": 4, "lower": [1], "upper": [2], "since": [0], "pending_request": 0},
        {"id": 3, "level": 2, "len": 4, "lower": [2], "upper": [3], "since": [0], "pending_request": 0},
    ]
