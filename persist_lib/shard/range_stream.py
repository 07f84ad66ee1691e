"""Streaming a few sorted runs merged by key ranges, the ranges consolidated on two threads.

The streamed read of a bulk-written shard (a few batches, each one sorted run of parts
sorted across part boundaries) used to go through the k-way merge (``kway_merge``) on
the caller's thread alone: every step ranks, sorts and gathers a few tens of thousands
of rows while the other core idles. Here the runs are cut at leading keys instead:

1. Each run holds its current part, fetched, verified and decoded (the run that will
   need its next part soonest has it decoded ahead, on a thread of its own), filtered
   to the time range and forwarded to ``since``; its rows are checked to be sorted by
   ``(k, v, t)``, and its first row against the previous part's last one (a run that is
   not sorted raises ``RunOrderViolation``, as the k-way merge does).
2. ``F`` is the smallest *last* leading key (``range_merge.leading_keys``: the leading
   sort column as int64 in persist's order) of the current parts of the runs that have
   parts left to read: every row yet to be read is ``>= F``, so the rows with a leading
   key ``< F`` of every run are complete. Each run's are cut out by a binary search
   (a slice, no copy).
3. That region is cut again at leading-key quantiles into key ranges of about
   ``RANGE_ROWS`` rows; rows equal in ``(k, v, t)`` share their leading key, hence their
   range, so consolidating each range is consolidating the region, and the ranges in
   key order are the merge's output in ``(k, v, t)`` order. A range is consolidated on
   the range pool (two threads; numpy, Arrow and polars release the GIL): one sorted
   piece linearly (``consolidate_sorted``), several pieces by one sort of their
   concatenation (``consolidate_pieces``).
4. The runs whose current part ended at ``F`` keep their rows at ``F`` and append their
   next part; the loop goes on until every part is read.

Memory (``range_stream_rows``): per run its current part (and a remainder of it), one
part decoded ahead with its encoded bytes, and ``RANGES_IN_FLIGHT + 1`` ranges'
working sets (the one yielded last is held by the caller).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future

import numpy as np
import pyarrow as pa

from persist_lib.location.base import Blob
from persist_lib.shard.batch_meta import PartMeta
from persist_lib.shard.codec import D_COL, Schemas, internal_schema
from persist_lib.shard.consolidate import consolidate_pieces, consolidate_sorted
from persist_lib.shard.disjoint_runs import _part_bounds
from persist_lib.shard.memory_plan import MergeStats, decoded_bytes_or_estimate, row_layout
from persist_lib.shard.part_fetch import decode_whole, fetch_part_bytes, release_unused_memory
from persist_lib.shard.range_merge import RANGES_IN_FLIGHT, applies, leading_keys, range_bytes
from persist_lib.shard.runs import RunOrderViolation
from persist_lib.shard.sorted_checks import UNSORTED, linear_kernels_apply, sorted_state
from persist_lib.shard.thread_pools import SharedPool, cancel_and_wait
from persist_lib.shard.time_filters import advance_to_since, time_range

#: Rows per key range consolidated as one task (fewer when the budget is tight).
RANGE_ROWS = 1 << 17
MIN_RANGE_ROWS = 1 << 10

_RANGE_POOL = SharedPool(RANGES_IN_FLIGHT, "persist-stream-range")
_DECODE_POOL = SharedPool(1, "persist-stream-decode")


def range_stream_applies(schemas: Schemas, runs: list[list[PartMeta]]) -> bool:
    """Whether ``stream_by_key_ranges`` may merge these runs: every part sorted (a run's
    rows in ``(k, v, t)`` order), flat key types (linear checks) and a leading sort
    column that maps to integers."""
    schema = internal_schema(schemas)
    return (
        applies(schemas)
        and linear_kernels_apply(f.type for f in schema if f.name != D_COL)
        and all(p.sorted for run in runs for p in run)
    )


def range_stream_rows(runs: list[list[PartMeta]], schemas: Schemas, budget: int) -> int | None:
    """Rows per key range for ``stream_by_key_ranges`` within ``budget`` (at most
    ``RANGE_ROWS``), or None when even ``MIN_RANGE_ROWS`` would not fit. What the merge
    holds: a decoded part per run (a run's previous part is let go before its next one
    is taken: what is left of it, rows at one leading key, is copied), one part decoded
    ahead with its encoded bytes, and the ranges in flight plus the one yielded."""
    parts = [p for run in runs for p in run]
    if not parts:
        return None
    dec = [decoded_bytes_or_estimate(p, schemas) for p in parts]
    per_row = sum(dec) / max(1, sum(p.count for p in parts))
    held = sum(max(decoded_bytes_or_estimate(p, schemas) for p in run) for run in runs if run)
    ahead = max(dec) + max(p.size for p in parts)
    one_row = range_bytes(1_000, per_row, row_layout(schemas)[1]) / 1_000
    rows = int((budget - held - ahead) / ((RANGES_IN_FLIGHT + 1) * max(one_row, 1.0)))
    return min(rows, RANGE_ROWS) if rows >= MIN_RANGE_ROWS else None


class _Cursor:
    """One run being read: its current rows (the rest of a part, with its leading keys)
    and the parts still to read."""

    def __init__(self, parts: list[PartMeta]) -> None:
        self.parts = parts
        self.next_part = 0
        self.table: pa.Table | None = None
        self.keys = np.zeros(0, dtype=np.int64)
        self.offset = 0
        self.last_row: pa.Table | None = None  # the previous part's last row (order check)
        self.ahead: Future[tuple[pa.Table, int]] | None = None

    @property
    def more_parts(self) -> bool:
        return self.next_part < len(self.parts)

    @property
    def remaining(self) -> int:
        return len(self.keys) - self.offset

    def last_key(self) -> int:
        return int(self.keys[-1])


class _KeyRangeStream:
    def __init__(
        self, blob: Blob, schemas: Schemas, shard: str, runs: list[list[PartMeta]], since: int | None,
        lower: int | None, upper: int | None, stats: MergeStats, purpose: str, range_rows: int,
    ) -> None:
        self.blob, self.schemas, self.shard = blob, schemas, shard
        self.since, self.lower, self.upper = since, lower, upper
        self.stats, self.purpose, self.range_rows = stats, purpose, range_rows
        self.key_cols = [n for n in internal_schema(schemas).names if n != D_COL]
        self.cursors = [_Cursor(run) for run in runs if run]

    # -- reading parts ----------------------------------------------------------------

    def _prepare(self, p: PartMeta) -> tuple[pa.Table, int]:
        """A part fetched, verified, decoded, filtered and forwarded (any thread)."""
        data = fetch_part_bytes(self.blob, p, self.shard, self.purpose)
        n = len(data)
        t = decode_whole(data, p, self.schemas, self.shard)
        del data
        if (self.lower is not None and p.tmin < self.lower) or (self.upper is not None and p.tmax >= self.upper):
            t = time_range(t, self.lower, self.upper)
        if self.since is not None:
            t = advance_to_since(t, self.since)
        return t, n

    def _decode_ahead(self, c: _Cursor) -> None:
        if c.ahead is None and c.more_parts:
            c.ahead = _DECODE_POOL.get().submit(self._prepare, c.parts[c.next_part])

    def _load_next(self, c: _Cursor) -> None:
        """Appends the run's next part to what is left of its current rows."""
        self._decode_ahead(c)
        assert c.ahead is not None
        t, n = c.ahead.result()
        c.ahead = None
        c.next_part += 1
        if c.remaining == 0:
            c.table, c.keys, c.offset = None, np.zeros(0, dtype=np.int64), 0
        self.stats.bytes_read += n
        self.stats.rows_read += t.num_rows
        release_unused_memory()  # (the previous part's pages back to the OS)
        if t.num_rows == 0:
            return
        self._check_order(c, t)
        keys = leading_keys(t.column(0))
        if c.table is None or c.remaining == 0:
            c.table, c.keys = t, keys
        else:  # (the rest: rows at one leading key, copied so the old part can go)
            assert c.table is not None
            rest = c.table.take(pa.array(np.arange(c.offset, len(c.keys), dtype=np.int64)))
            c.table = pa.concat_tables([rest, t])
            c.keys = np.concatenate([c.keys[c.offset:], keys])
        c.offset = 0

    def _check_order(self, c: _Cursor, t: pa.Table) -> None:
        """The part's rows are sorted by ``(k, v, t)`` (ties allowed: forwarding makes
        them) and its first row is not below the run's row before it."""
        cols = self.key_cols
        if sorted_state([t.column(n) for n in cols]) == UNSORTED:
            raise RunOrderViolation()
        if c.last_row is not None:
            pair = pa.concat_tables([c.last_row, t.slice(0, 1).select(c.last_row.column_names)])
            if sorted_state([pair.column(n) for n in cols]) == UNSORTED:
                raise RunOrderViolation()
        c.last_row = t.slice(t.num_rows - 1, 1)

    # -- the merge --------------------------------------------------------------------

    def _recorded_order_broken(self) -> bool:
        """Whether a run's parts are out of order by their recorded leading-key bounds
        (a faulty writer's run, found before anything is read: the caller may then read
        a run per part; the bounds are not trusted otherwise, every row is checked)."""
        f = internal_schema(self.schemas).field(0)
        for c in self.cursors:
            prev = None
            for p in c.parts:
                b = _part_bounds(p, f.name, f.type)
                if b is not None and prev is not None and prev[1] > b[0]:
                    return True
                prev = b
        return False

    def tables(self) -> Iterator[pa.Table]:
        if self._recorded_order_broken():
            raise RunOrderViolation()
        pending: deque[Future[pa.Table]] = deque()
        pool = _RANGE_POOL.get()
        try:
            while True:
                for c in self.cursors:
                    while c.remaining == 0 and c.more_parts:
                        self._load_next(c)
                live = [c for c in self.cursors if c.remaining]
                if not live:
                    break
                reading = [c for c in live if c.more_parts]
                bound = min(c.last_key() for c in reading) if reading else None
                # The run whose part ends first needs its next part soonest: decode it now.
                for c in reading:
                    if c.last_key() == bound:
                        self._decode_ahead(c)
                        break
                pieces = []  # (the region's rows: every run's rows below the bound)
                for c in live:
                    end = len(c.keys) if bound is None else c.offset + int(
                        np.searchsorted(c.keys[c.offset:], bound, side="left")
                    )
                    if end > c.offset:
                        assert c.table is not None
                        pieces.append((c.table.slice(c.offset, end - c.offset), c.keys[c.offset:end]))
                        c.offset = end
                self.stats.steps += 1
                ranges = _key_ranges(pieces, self.range_rows)
                self.stats.key_ranges += len(ranges)
                self._account(pieces)
                for rng in ranges:
                    pending.append(pool.submit(_consolidate_range, rng))
                    while len(pending) > RANGES_IN_FLIGHT:
                        yield from self._take(pending.popleft())
                ending = [c for c in reading if c.last_key() == bound]
                if ending:  # only rows at the bound are left of their parts: read on,
                    while pending:  # once the ranges holding the old parts are done
                        yield from self._take(pending.popleft())
                    for c in ending:
                        self._load_next(c)
            while pending:
                yield from self._take(pending.popleft())
        finally:  # (the tables must outlive the threads reading them)
            cancel_and_wait(list(pending) + [c.ahead for c in self.cursors if c.ahead is not None])
            for c in self.cursors:
                c.table = c.ahead = None

    def _account(self, pieces: list[tuple[pa.Table, np.ndarray]]) -> None:
        """Peak rows and bytes held by the runs' current rows (the region's pieces are
        slices of them; the ranges' working sets are not counted here)."""
        s = self.stats
        held = [c.table for c in self.cursors if c.table is not None]
        s.peak_rows_held = max(s.peak_rows_held, sum(t.num_rows for t in held))
        s.peak_bytes_held = max(s.peak_bytes_held, sum(t.get_total_buffer_size() for t in held))

    def _take(self, f: Future[pa.Table]) -> Iterator[pa.Table]:
        out = f.result()
        if out.num_rows:
            self.stats.output_rows += out.num_rows
            yield out


def _key_ranges(pieces: list[tuple[pa.Table, np.ndarray]], range_rows: int) -> list[list[pa.Table]]:
    """The region's pieces (each sorted, with its leading keys) cut into key ranges of
    about ``range_rows`` rows at leading keys taken from the largest piece: range ``r``
    holds every piece's rows with a leading key in ``[pivot[r-1], pivot[r])``."""
    rows = sum(len(k) for _, k in pieces)
    if not pieces:
        return []
    n_ranges = -(-rows // range_rows)
    if n_ranges <= 1:
        return [[t for t, _ in pieces]]
    big = max(pieces, key=lambda p: len(p[1]))[1]
    piv = np.unique(big[(np.arange(1, n_ranges) * len(big)) // n_ranges])
    out: list[list[pa.Table]] = [[] for _ in range(len(piv) + 1)]
    for t, k in pieces:
        cuts = np.concatenate([[0], np.searchsorted(k, piv, side="left"), [len(k)]])
        for r in range(len(piv) + 1):
            lo, hi = int(cuts[r]), int(cuts[r + 1])
            if hi > lo:
                out[r].append(t.slice(lo, hi - lo))
    return [r for r in out if r]


def _consolidate_range(pieces: list[pa.Table]) -> pa.Table:
    """One key range consolidated: a single sorted piece linearly, several by one sort."""
    if len(pieces) == 1:
        done = consolidate_sorted(pieces[0])
        if done is not None:
            return done
    return consolidate_pieces(pa.concat_tables(pieces))


def merge_decoded_by_ranges(
    runs: list[pa.Table], schemas: Schemas, stats: MergeStats, range_rows: int = RANGE_ROWS
) -> list[pa.Table] | None:
    """Runs a read already decoded whole (each sorted by ``(k, v, t)``, times forwarded;
    ``range_stream_applies``) merged by key ranges of ``range_rows`` rows consolidated on
    the range pool: the consolidated rows in ``(k, v, t)`` order across tables. None
    when a run turns out not to be sorted (the caller consolidates instead)."""
    cols = [n for n in internal_schema(schemas).names if n != D_COL]
    pieces = []
    for t in runs:
        if t.num_rows:
            if sorted_state([t.column(n) for n in cols]) == UNSORTED:
                return None
            pieces.append((t, leading_keys(t.column(0))))
    ranges = _key_ranges(pieces, range_rows)
    stats.key_ranges += len(ranges)
    out = [t for t in _RANGE_POOL.get().map(_consolidate_range, ranges) if t.num_rows]
    stats.output_rows += sum(t.num_rows for t in out)
    return out


def stream_by_key_ranges(
    blob: Blob, schemas: Schemas, shard: str, runs: list[list[PartMeta]], *, since: int | None,
    lower: int | None, upper: int | None, stats: MergeStats, purpose: str, range_rows: int = RANGE_ROWS,
) -> Iterator[pa.Table]:
    """The consolidated updates of ``runs`` (each a list of sorted parts, sorted across
    part boundaries; ``range_stream_applies``) filtered to ``[lower, upper)`` and
    forwarded to ``since``, in ``(k, v, t)`` order across tables (see the module doc),
    consolidated in key ranges of about ``range_rows`` rows (``range_stream_rows``).
    Raises ``RunOrderViolation`` when a run turns out not to be sorted. A generator:
    nothing is fetched before the first ``next``."""
    stats.passes += 1
    stats.fan_in = max(stats.fan_in, len(runs))
    yield from _KeyRangeStream(blob, schemas, shard, runs, since, lower, upper, stats, purpose, range_rows).tables()
