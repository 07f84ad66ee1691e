"""Streaming one sorted run at an as-of, part by part, in linear time.

A compacted shard is one sorted run (``runs.batch_runs``): its snapshot needs no merge.
``stream_sorted_run`` fetches, verifies and decodes its parts in order (the next one
on a second thread while the current one is checked), forwards each part's times to
the as-of and consolidates it with ``consolidate_sorted`` (a neighbour check; the
decoded columns are handed on as they are when no two rows share a ``(k, v)``). Equal
rows can also meet across a part boundary: the last row of each part is held back
and summed into the next part's first row when they are equal. Memory: about two
decoded parts (``sorted_run_stream_bytes``), whatever the run's length.

Every row is checked against the one before it, across parts too: a run that is not
sorted raises ``RunOrderViolation`` (nothing yielded yet: the caller may read it
another way) or ``CorruptionError`` (rows already yielded can't be taken back).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NoReturn

import pyarrow as pa

from persist_lib.errors import CorruptionError
from persist_lib.shard.batch_meta import PartMeta
from persist_lib.shard.codec import D_COL
from persist_lib.shard.consolidate import consolidate_sorted
from persist_lib.shard.runs import RunOrderViolation
from persist_lib.shard.sorted_checks import sorted_ties
from persist_lib.shard.time_filters import snapshot_at

# Per row of the part being checked: its forwarded time and the comparison masks
# (``read_plan.sorted_run_read_bytes`` counts the same).
ROW_BYTES = 32


def sorted_run_stream_bytes(decoded: list[int], rows: list[int]) -> int:
    """Peak memory of ``stream_sorted_run`` over parts of these decoded sizes and row
    counts: the largest two decoded at once (the current and the prefetched one), a
    filtered copy of the current one when rows fold, and its masks."""
    top = sorted(decoded, reverse=True)[:2]
    return 2 * top[0] + (top[1] if len(top) > 1 else 0) + ROW_BYTES * max(rows, default=0)


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
) -> Iterator[pa.Table]:
    """The snapshot at ``as_of`` of one sorted run (``parts`` in order), as consolidated
    tables in ``(k, v)`` order; ``fetch(part)`` returns a part verified and decoded
    (internal layout). A generator: nothing is fetched before the first ``next``."""
    yielded = False
    carry: pa.Table | None = None  # the last row so far, held back
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="persist-run-read") as pool:
        nxt: Future[pa.Table] | None = pool.submit(fetch, parts[0]) if parts else None
        for i, p in enumerate(parts):
            assert nxt is not None
            table = nxt.result()
            nxt = pool.submit(fetch, parts[i + 1]) if i + 1 < len(parts) else None
            t = consolidate_sorted(snapshot_at(table, as_of, all_at_or_before=p.tmax <= as_of))
            del table
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
                    yielded = True
                    yield carry
                carry = None
                if t.num_rows == 0:
                    continue
            carry = t.slice(t.num_rows - 1, 1)
            if t.num_rows > 1:
                yielded = True
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

