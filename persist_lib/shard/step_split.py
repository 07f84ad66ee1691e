"""A merge step's rows split in two by key, for both halves to be merged at once.

A step of the linear k-way merge (``kway_merge.Merger._step_linear``) takes from every
run its buffered rows below the step's bound: sorted, consolidated segments. Ranking
them (``ranks.row_keys_with_hint``) and summing equal rows (``Merger._emit``) is most of
a streaming read's time, and it is numpy and Arrow work that releases the GIL. Cut at
one row ``P`` (the middle row of the largest segment), every segment splits into its
rows ``< P`` and its rows ``>= P`` (a search, ``sorted_checks.count_less``): rows equal
in ``(k, v, t)`` land on the same side, and every row of the lower half sorts before
every row of the upper half, so merging the halves apart and laying the lower result
before the upper one is merging the step. The lower half is merged on a shared
one-thread pool while the caller's thread merges the upper half: the step's working
set is the same as merged whole (each half ranks its own rows), so the memory plan
does not change.

Tasks on the pool only compute; they never wait on a pool (no deadlock however many
merges share it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import pyarrow as pa

from persist_lib.shard.sorted_checks import count_less
from persist_lib.shard.thread_pools import SharedPool

# Steps of fewer rows are merged on one thread: handing half to another thread costs
# ~0.1 ms, more than merging a few thousand rows.
PARALLEL_STEP_ROWS = 1 << 15

_STEP_POOL = SharedPool(1, "persist-merge-step")

R = TypeVar("R")


def split_segments(
    segments: Sequence[pa.Table], key_cols: Sequence[str]
) -> tuple[list[pa.Table], list[pa.Table]] | None:
    """The rows of ``segments`` (each sorted by ``key_cols``) below and at-or-above the
    middle row of the largest segment, as zero-copy slices; None when a side would be
    empty."""
    big = max(segments, key=lambda s: s.num_rows)
    mid = big.num_rows // 2
    if mid == 0:
        return None
    pivot = big.slice(mid, 1)
    lo: list[pa.Table] = []
    hi: list[pa.Table] = []
    for s in segments:
        c = count_less(s, key_cols, pivot)
        if c:
            lo.append(s.slice(0, c))
        if c < s.num_rows:
            hi.append(s.slice(c))
    return (lo, hi) if lo and hi else None


def on_two_threads(f: Callable[[list[pa.Table]], R], a: list[pa.Table], b: list[pa.Table]) -> tuple[R, R]:
    """``(f(a), f(b))``, ``f(a)`` computed on the step pool while this thread computes
    ``f(b)``; an error of either is raised after both finished."""
    fut = _STEP_POOL.get().submit(f, a)
    try:
        rb = f(b)
    except BaseException:
        fut.exception()  # (waits: the pool task must not outlive the step's inputs)
        raise
    return fut.result(), rb
