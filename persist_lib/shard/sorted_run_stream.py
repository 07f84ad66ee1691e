"""Streaming one sorted run at an as-of, part by part, in linear time.

A compacted shard is one sorted run (``runs.batch_runs``): its snapshot needs no merge.
``stream_sorted_run`` fetches, verifies and decodes its parts, forwards each part's
times to the as-of and consolidates it (``sorted_as_of.consolidate_sorted_at``: a
neighbour check, one copy of the rows kept when some are dropped; the decoded columns
are handed on as they are when none is dropped and no two rows share a ``(k, v)``),
two parts at a time on the read's pool (the process's shared fetch threads), so that
both cores work while the caller takes the parts in order. Equal rows can also meet
across a part boundary: the last row of each part is held back and summed into the
next part's first row when they are equal. Memory: about three decoded parts
(``sorted_run_stream_bytes``), whatever the run's length.

Every row is checked against the one before it, across parts too: a run that is not
sorted raises ``RunOrderViolation`` (nothing yielded yet: the caller may read it
another way) or ``CorruptionError`` (rows already yielded can't be taken back).
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import NoReturn

import pyarrow as pa

from persist_lib.errors import CorruptionError
from persist_lib.shard.batch_meta import PartMeta
from persist_lib.shard.codec import D_COL
from persist_lib.shard.runs import RunOrderViolation
from persist_lib.shard.sorted_as_of import consolidate_sorted_at
from persist_lib.shard.sorted_checks import sorted_ties

# Per row of the part being checked: its forwarded time and the comparison masks
# (``read_plan.sorted_run_read_bytes`` counts the same).
ROW_BYTES = 32

#: Parts fetched, decoded and consolidated at once, ahead of the one being handed on.
AHEAD = 2


def sorted_run_stream_bytes(decoded: list[int], rows: list[int]) -> int:
    """Peak memory of ``stream_sorted_run`` over parts of these decoded sizes and row
    counts: the ``AHEAD`` largest being loaded at once, each with a filtered copy while
    it consolidates and its masks, and the one handed on."""
    top = sorted(decoded, reverse=True)[: AHEAD + 1]
    return 2 * sum(top[:AHEAD]) + sum(top[AHEAD:]) + AHEAD * ROW_BYTES * max(rows, default=0)


def _key_names(table: pa.Table) -> list[str]:
    return [n for n in table.column_names if n != D_COL]


def _fold_into_first(carry: pa.Table, t: pa.Table) -> pa.Table:
    """``t`` with ``carry``'s diff added to its first row (equal to ``carry``); the row
    dropped if the sum is zero."""
    di = t.schema.get_field_index(D_COL)
    d = t.column(D_COL).to_pylist()[0] + carry.column(D_COL).to_pylist()[0]
    if d == 0:
        return t.slice(1)
    first = t.slice(0, 1)
    first = first.set_column(di, t.schema.field(di), pa.array([d], pa.int64()))
    return pa.concat_tables([first, t.slice(1)])


def stream_sorted_run(
    parts: list[PartMeta],
    as_of: int,
    fetch: Callable[[PartMeta], pa.Table],
    shard: str,
    pool: Executor | None = None,
    *,
    post: Callable[[pa.Table], pa.Table] | None = None,
    restartable: bool = False,
) -> Iterator[pa.Table]:
    """The snapshot at ``as_of`` of one sorted run (``parts`` in order), as consolidated
    tables in ``(k, v)`` order; ``fetch(part)`` returns a part verified and decoded
    (internal layout). A generator: nothing is fetched before the first ``next``.

    ``pool``: where parts are fetched, forwarded and consolidated, ``AHEAD`` of them at
    once (the caller's thread only folds part boundaries and hands tables on); default
    a pool of ``AHEAD`` threads for this read. Nothing run on it may wait on it.
    ``post``: applied to each part's rows once their times are forwarded, before they
    are consolidated (a read's row filter). ``restartable``: the caller keeps every
    table until the run is done (a whole snapshot), so a run found unsorted raises
    ``RunOrderViolation`` however far it got, and the caller may read it another way."""

    def load(p: PartMeta) -> pa.Table | None:
        return _load(p, as_of, fetch, post)

    with contextlib.ExitStack() as stack:
        if pool is None:
            pool = stack.enter_context(ThreadPoolExecutor(max_workers=AHEAD, thread_name_prefix="persist-run-read"))
        pending: deque[Future[pa.Table | None]] = deque(pool.submit(load, p) for p in parts[:AHEAD])
        stack.callback(lambda: [f.cancel() for f in pending])

        def take(i: int) -> pa.Table | None:
            t = pending.popleft().result()
            if i + AHEAD < len(parts):
                pending.append(pool.submit(load, parts[i + AHEAD]))
            return t

        yield from _fold_boundaries(len(parts), take, shard, restartable)


def _load(
    p: PartMeta, as_of: int, fetch: Callable[[PartMeta], pa.Table], post: Callable[[pa.Table], pa.Table] | None
) -> pa.Table | None:
    """Part ``p`` fetched, filtered by ``post``, forwarded to ``as_of`` and consolidated
    (None: its rows are not sorted)."""
    # (``post`` keeps rows by key and value only, so it commutes with forwarding and
    # consolidating: applied first, the one-copy pass below sees only its rows.)
    t = fetch(p)
    return consolidate_sorted_at(post(t) if post is not None else t, as_of, all_at_or_before=p.tmax <= as_of)


def sorted_runs_read_bytes(decoded: list[int], rows: list[int], workers: int) -> int:
    """Peak memory of ``read_sorted_runs`` beyond its result, over parts of these decoded
    sizes and row counts: the ``workers`` largest being loaded at once, each with a
    filtered copy while it consolidates and its masks (a part's output is the result)."""
    top = sorted(decoded, reverse=True)[: max(1, workers)]
    return 2 * sum(top) + max(1, workers) * ROW_BYTES * max(rows, default=0)


def read_sorted_runs(
    runs: list[list[PartMeta]],
    as_of: int,
    fetch: Callable[[PartMeta], pa.Table],
    shard: str,
    pool: Executor,
    *,
    post: Callable[[pa.Table], pa.Table] | None = None,
) -> list[list[pa.Table]]:
    """The snapshot at ``as_of`` of several sorted runs read whole, per run its
    consolidated tables in ``(k, v)`` order (``stream_sorted_run``'s, with
    ``restartable``): for runs whose outputs the caller concatenates (a (k, v)-disjoint
    layered batch, ``time_layers``). Every part of every run is submitted to ``pool``
    at once, largest first, and each run's parts are then taken in order and folded at
    their boundaries. Read run after run, ``AHEAD`` parts at a time, a run's last large
    part was decoded alone while the other threads waited for the next run to start
    (issue 28: the as-of-1 read of the 1M-row scaling shard is two layers of one large
    and one small part each, so half its decode ran on one thread). Memory beyond the
    result: the parts the pool's threads load at once (``sorted_runs_read_bytes``).
    Raises ``RunOrderViolation`` when a run is not sorted (the parts not yet started
    are cancelled; the caller may read the runs another way)."""
    order = sorted(
        ((r, i) for r, run in enumerate(runs) for i in range(len(run))),
        key=lambda ri: -runs[ri[0]][ri[1]].count,
    )
    futures: dict[tuple[int, int], Future[pa.Table | None]] = {}
    try:
        for r, i in order:
            futures[r, i] = pool.submit(_load, runs[r][i], as_of, fetch, post)
        out: list[list[pa.Table]] = []
        for r, run in enumerate(runs):

            def take(i: int, r: int = r) -> pa.Table | None:
                return futures[r, i].result()

            out.append(list(_fold_boundaries(len(run), take, shard, True)))
        return out
    finally:
        for f in futures.values():
            f.cancel()


def _fold_boundaries(
    n: int, take: Callable[[int], pa.Table | None], shard: str, restartable: bool,
) -> Iterator[pa.Table]:
    """The ``n`` consolidated parts of one run in order (``take(i)``: part ``i``'s,
    None when its rows are not sorted), the last row of each held back and summed into
    the next part's first row when they are equal. ``restartable``: see
    ``stream_sorted_run``."""
    yielded = False  # (stays False for a restartable read: its caller holds the rows)
    carry: pa.Table | None = None  # the last row so far, held back
    for i in range(n):
        t = take(i)
        if t is None:
            _violation(shard, yielded)
        if t.num_rows == 0:
            continue
        if carry is not None:
            pair = pa.concat_tables([carry, t.slice(0, 1)])
            ties = sorted_ties([pair.column(n) for n in _key_names(pair)])
            if ties is None:
                _violation(shard, yielded)
            elif len(ties):
                t = _fold_into_first(carry, t)
            else:
                yielded = not restartable
                yield carry
            carry = None
            if t.num_rows == 0:
                continue
        carry = t.slice(t.num_rows - 1, 1)
        if t.num_rows > 1:
            yielded = not restartable
            yield t.slice(0, t.num_rows - 1)
    if carry is not None:
        yield carry


def _violation(shard: str, yielded: bool) -> NoReturn:
    if not yielded:
        raise RunOrderViolation()
    raise CorruptionError(
        f"shard {shard}: parts read as one sorted run (a batch written by the compactor, or "
        "parts whose recorded key ranges claim to be disjoint) are not in order; the read "
        "stopped after returning part of its rows. Read again with a snapshot() (it "
        "re-merges with a run per part) and investigate the writer of those parts"
    )

