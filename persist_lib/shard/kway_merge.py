"""The merge engine: a streaming k-way merge of sorted runs under a memory budget.

**Memory.** Every part is verified before a byte of it is decoded, then decoded whole
and its encoded bytes dropped (``part_fetch``; Arrow's Parquet reader materializes a
row group's decompressed column chunks even for small record batches, and our parts
are one row group: "incremental" reads would save nothing). So memory is bounded by
the number of parts open at once — one per run — as in Materialize: the merge holds
per run its decoded part, a buffer of chunks sliced from it, and its share of one
merge step's working set (ranks, sort order, the emitted copy). The smallest runs, up
to 1/16 of the budget decoded, are first folded into one in-memory run by a single
vectorized consolidate (a k-way merge of hundreds of tiny runs would spend a step per
few rows). When the remaining runs don't fit the budget together they are merged in
groups first (as many of the smallest runs as fit; where the intermediate runs go is
the caller's: blob for the compactor, local files for a read). What the open parts
leave of the budget (``memory_plan.MemoryPlan``) is shared by the runs' chunks in
proportion to their row counts, so a huge run next to small ones advances in big
chunks.

**One merge step.** Let ``F`` be the smallest *last* buffered row over the runs that
have more input: every future row of every run is ``>= F``, so all buffered rows
``< F`` can be emitted, consolidated (equal ``(k, v, t)`` summed; zeros dropped).
Rows are compared by ``ranks.row_keys`` ranks computed over one concatenation,
which is what makes rows of different chunks comparable. Times below ``since`` are
forwarded to ``since`` as chunks are read; forwarding is monotone, so runs stay sorted.

The compactor (``compactor``) and the read path (``read_merge``) both drive it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from persist_lib.errors import CorruptionError
from persist_lib.location.base import Blob
from persist_lib.shard.batch_builder import BatchBuilder
from persist_lib.shard.batch_meta import PartMeta
from persist_lib.shard.codec import D_COL, T_COL, Schemas, internal_schema
from persist_lib.shard.consolidate import consolidate
from persist_lib.shard.memory_plan import (
    MIN_CHUNK_ROWS,
    PARALLEL_DECODE_BYTES,
    STEP_BYTES_PER_ROW,
    MemoryPlan,
    MergeStats,
)
from persist_lib.shard.part_fetch import (
    decode_whole,
    fetch_part_bytes,
    fetch_small_part,
    release_unused_memory,
)
from persist_lib.shard.ranks import row_keys, row_keys_with_hint, to_numpy
from persist_lib.shard.runs import RunOrderViolation, RunSource
from persist_lib.shard.sorted_checks import (
    SORTED_WITH_TIES,
    UNSORTED,
    count_less,
    linear_kernels_apply,
    sorted_state,
)
from persist_lib.shard.time_filters import advance_to_since, time_range


def _consolidate_sorted_equal(t: pa.Table) -> pa.Table:
    """Collapses a table whose rows are all equal in ``(k, v, t)`` to one row (or none)."""
    if t.num_rows <= 1:
        return t if t.num_rows == 0 or t.column(D_COL)[0].as_py() != 0 else t.slice(0, 0)
    total = int(np.sum(to_numpy(t.column(D_COL)), dtype=np.int64))
    if total == 0:
        return t.slice(0, 0)
    one = t.slice(0, 1)
    di = one.schema.get_field_index(D_COL)
    return one.set_column(di, one.schema.field(di), pa.array([total], pa.int64()))


def _has_adjacent_equal_rows(t: pa.Table) -> bool:
    """Whether two neighbouring rows of ``t`` (sorted by ``(k, v, t)``) may be equal in
    ``(k, v, t)``: in a sorted table equal rows are neighbours, so when none are, the
    table is already consolidated (given nonzero diffs) and consolidating it again —
    a sort — would change nothing. A linear, vectorized comparison; conservative (True)
    for nested types. Equality here may differ from the ranking's on floats (NaN, -0.0):
    a missed duplicate is summed by the merge step anyway."""
    n = t.num_rows
    if n < 2:
        return False
    names = [T_COL] + [c for c in t.column_names if c not in (T_COL, D_COL)]
    mask: pa.ChunkedArray | pa.Array | None = None
    for name in names:
        col = t.column(name)
        if pa.types.is_nested(col.type):
            return True
        a, b = col.slice(0, n - 1), col.slice(1)
        try:
            eq = pc.equal(a, b)
            if col.null_count:
                eq = pc.or_kleene(pc.fill_null(eq, False), pc.and_(pc.is_null(a), pc.is_null(b)))
            mask = eq if mask is None else pc.and_(mask, eq)
            if not pc.any(mask).as_py():
                return False
        except (pa.ArrowNotImplementedError, pa.ArrowInvalid, pa.ArrowTypeError):
            return True  # a type Arrow can't compare: consolidate to be sure
    return True


def _consolidate(t: pa.Table) -> pa.Table:
    from persist_lib.shard.consolidate import consolidate

    return consolidate(t)


class Run:
    """A sorted run being read part by part, chunk by chunk, with its buffer of
    not-yet-emitted rows.

    A part is verified and decoded whole, then its encoded bytes are dropped: Arrow's
    Parquet reader materializes a row group's decompressed column chunks even when
    asked for small record batches (measured: 2.2 MB held to yield 2,000 rows of a
    2.3 MB column chunk), and our parts are one row group, so reading them
    "incrementally" saves nothing. The merge bounds memory instead by the number of
    parts open at once (one per run) and chunked merges.
    """

    def __init__(self, merger: Merger, src: RunSource, check_order: bool) -> None:
        self.m = merger
        self.parts = src.parts or []
        self.total_rows = src.rows  # for this run's share of a step
        self.check_order = check_order
        self.next_part = 0
        self.part: pa.Table | None = None  # the decoded current part
        self.offset = 0
        self.part_bytes = 0  # decoded bytes of the current part
        self.prev_last: pa.Table | None = None  # last row of the previous part (order check)
        self.buf: pa.Table | None = None
        self.exhausted = False
        self._first_of_part = False
        self.spill = src.spill
        # Whether the current part's chunks need the time filter (spilled and folded
        # runs were filtered when they were made; a part whose times lie inside the
        # range needs none).
        self._filter = False
        # Whether forwarding can make rows of the current part equal: not if the part
        # holds one time (it is consolidated, so its (k, v) are distinct).
        self._may_collide = True
        self._tied_with_prev = False  # (linear kernels) the last chunk's first row = the row before
        self._spill_file: pa.OSFile | None = None
        self._spill_reader: pa.ipc.RecordBatchFileReader | None = None
        if src.table is not None:  # already decoded (small runs folded in memory)
            self.part, self.part_bytes = src.table, src.table.nbytes
            self._first_of_part = True

    @property
    def rows(self) -> int:
        return 0 if self.buf is None else self.buf.num_rows

    def held_bytes(self) -> int:
        """The decoded part plus buffered rows (counted as copies: an upper bound)."""
        return self.part_bytes + int(self.rows * self.m.row_width)

    def close(self) -> None:
        """Drops the decoded data and closes a spilled run's file."""
        self.part = self.buf = self.prev_last = None
        self._close_spill_file()

    def _close_spill_file(self) -> None:
        self._spill_reader = None
        if self._spill_file is not None:
            self._spill_file.close()
            self._spill_file = None

    def _load_next_spilled(self) -> bool:
        """The next record batch of a run spilled to a local file (bounded in size by the
        merge step that wrote it): read on its own, not memory-mapped."""
        m = self.m
        sp = self.spill
        assert sp is not None
        if self.next_part >= sp.batches:
            self._close_spill_file()  # (its buffered rows are still to be merged)
            return False
        if self._spill_reader is None:
            self._spill_file = pa.OSFile(sp.path, "rb")
            self._spill_reader = pa.ipc.open_file(self._spill_file)
        table = pa.Table.from_batches([self._spill_reader.get_batch(self.next_part)])
        self.next_part += 1
        m.observe_row_width(table)
        m.account_transient(table.nbytes)
        self.part, self.offset, self.part_bytes = table, 0, table.nbytes
        m.stats.rows_read += table.num_rows
        self._first_of_part = True
        return True

    def next_part_is_unsorted(self) -> bool:
        return (
            self.spill is None
            and self.part is None
            and self.next_part < len(self.parts)
            and not self.parts[self.next_part].sorted
        )

    def prepare_next_part(self, use_threads: bool = False) -> tuple[pa.Table, int]:
        """Fetches, verifies, decodes (and sorts, if unsorted) the next part without
        touching shared state: safe to run for several runs at once (then without
        ``use_threads``: see ``decode_whole``)."""
        m = self.m
        p = self.parts[self.next_part]
        data = m.fetch_bytes(p)
        n = len(data)
        table = decode_whole(data, p, m.schemas, m.shard, use_threads=use_threads and n > PARALLEL_DECODE_BYTES)
        del data
        if not p.sorted:
            # A bulk write stored it in arrival order: sort and consolidate it now (the
            # sort moved here from the writer's path).
            table = consolidate(table)
        return table, n

    def _load_next_part(self, prepared: tuple[pa.Table, int] | None = None) -> bool:
        m = self.m
        self.part, self.part_bytes = None, 0
        if self.spill is not None:
            return self._load_next_spilled()
        if self.next_part >= len(self.parts):
            return False
        p = self.parts[self.next_part]
        self._filter = (m.lower is not None and p.tmin < m.lower) or (m.upper is not None and p.tmax >= m.upper)
        self._may_collide = p.tmin != p.tmax
        self.part = None  # let the previous part go before decoding the next
        table, nbytes = prepared if prepared is not None else self.prepare_next_part(use_threads=True)
        self.next_part += 1
        m.stats.bytes_read += nbytes
        m.observe_row_width(table)
        m.account_transient(nbytes + 2 * table.nbytes)
        if not p.sorted:
            m.stats.unsorted_parts_sorted += 1
        release_unused_memory()
        self.part, self.offset, self.part_bytes = table, 0, table.nbytes
        m.stats.rows_read += table.num_rows
        self._first_of_part = True
        return True

    def _next_chunk(self) -> pa.Table | None:
        m = self.m
        while True:
            if self.part is None or self.offset >= self.part.num_rows:
                if not self._load_next_part():
                    return None
                continue
            assert self.part is not None
            c = self.part.slice(self.offset, m.chunk_rows(self))
            self.offset += c.num_rows
            if self.offset >= self.part.num_rows:
                self.part, self.part_bytes = None, 0  # the slice keeps what it needs alive
            if self._filter:
                c = time_range(c, m.lower, m.upper)  # a filter: the chunk stays sorted
            if m.since is not None:
                before = c
                c = advance_to_since(c, m.since)
                if (
                    not m.linear
                    and c is not before
                    and c.num_rows > 1
                    and self._may_collide
                    and _has_adjacent_equal_rows(c)
                ):
                    c = _consolidate(c)  # forwarding made equal rows: fold them now
            if c.num_rows == 0:
                continue
            if m.linear:
                return self._checked_chunk(c)
            if self._first_of_part:
                self._first_of_part = False
                if self.check_order and self.prev_last is not None:
                    pair = pa.concat_tables([self.prev_last, c.slice(0, 1)])
                    k = row_keys([pair.column(n) for n in pair.column_names if n != D_COL], 2)
                    if k[0] > k[1]:
                        raise RunOrderViolation()
            if self.check_order:
                self.prev_last = c.slice(c.num_rows - 1, 1)
            return c

    def _order_error(self) -> Exception:
        if self.check_order:
            return RunOrderViolation()
        return CorruptionError(
            f"shard {self.m.shard}: a part of the compaction input is not sorted by "
            "(k, v, t); it was written by a faulty writer. Nothing was applied"
        )

    def _checked_chunk(self, c: pa.Table) -> pa.Table:
        """The linear kernels' order check (``Merger.linear``): the chunk is sorted and
        its first row is not below the previous chunk's last row, so every neighbouring
        pair of the run is checked once, before any of its rows is emitted (the merge
        step's bounds rely on it). A chunk with equal neighbours (forwarding to since
        made them, or a writer didn't consolidate) is consolidated: it stays sorted.
        ``_tied_with_prev`` tells ``refill`` that the first row equals the last one."""
        m = self.m
        state = sorted_state([c.column(n) for n in m.key_cols])
        if state == UNSORTED:
            raise self._order_error()
        if state == SORTED_WITH_TIES:
            c = _consolidate(c)
            if c.num_rows == 0:
                return c
        self._tied_with_prev = False
        if self.prev_last is not None:
            pair = pa.concat_tables([self.prev_last, c.slice(0, 1)])
            edge = sorted_state([pair.column(n) for n in m.key_cols])
            if edge == UNSORTED:
                raise self._order_error()
            self._tied_with_prev = edge == SORTED_WITH_TIES
        self.prev_last = c.slice(c.num_rows - 1, 1)
        self._first_of_part = False
        return c

    def refill(self) -> None:
        """Reads the next non-empty chunk into the buffer (or marks the run exhausted).

        With the linear kernels the buffer stays consolidated: a chunk whose first row
        equals the buffer's last row (equal rows across a chunk boundary, after
        forwarding) has the two summed into one."""
        if self.exhausted:
            return
        while True:
            c = self._next_chunk()
            if c is None:
                self.exhausted = True
                return
            if c.num_rows:
                break
        if self.buf is None or self.buf.num_rows == 0:
            self.buf = c
        elif self._tied_with_prev:
            nb = self.buf.num_rows
            edge = _consolidate_sorted_equal(pa.concat_tables([self.buf.slice(nb - 1, 1), c.slice(0, 1)]))
            self.buf = pa.concat_tables([self.buf.slice(0, nb - 1), edge, c.slice(1)])
        else:
            self.buf = pa.concat_tables([self.buf, c])
        self._tied_with_prev = False


class Merger:
    """One k-way merge pass of some runs, into a sink (a ``BatchBuilder``: ``merge``) or
    as an iterator of consolidated tables (``iter_merge``).

    Every chunk read is first filtered to times in ``[lower, upper)`` (when given), then
    forwarded to ``since``: both keep a sorted run sorted.
    """

    def __init__(
        self,
        blob: Blob,
        schemas: Schemas,
        shard: str,
        since: int | None,
        plan: MemoryPlan,
        stats: MergeStats,
        *,
        lower: int | None = None,
        upper: int | None = None,
        purpose: str = "compaction",
    ) -> None:
        self.blob = blob
        self.schemas = schemas
        self.shard = shard
        self.since = since
        self.lower = lower
        self.upper = upper
        self.purpose = purpose
        self.plan = plan
        self.stats = stats
        self.row_width = 64.0
        self.runs: list[Run] = []
        self.total_rows = 0
        schema = internal_schema(schemas)
        self.key_cols = self._key_cols = [n for n in schema.names if n != D_COL]
        # Flat key types: chunks are checked for order as they are read, and a step
        # finds each run's bound by a search instead of ranking every buffered row.
        self.linear = linear_kernels_apply(schema.field(n).type for n in self.key_cols)

    def fetch_bytes(self, p: PartMeta) -> bytes:
        return fetch_part_bytes(self.blob, p, self.shard, self.purpose)

    def observe_row_width(self, t: pa.Table) -> None:
        if t.num_rows:
            self.row_width = max(8.0, t.nbytes / t.num_rows)

    def account_transient(self, extra: int) -> None:
        """A part being decoded holds its encoded bytes and the decoded table at once."""
        held = sum(r.held_bytes() for r in self.runs) + extra
        self.stats.peak_bytes_held = max(self.stats.peak_bytes_held, held)

    def chunk_rows(self, run: Run) -> int:
        """Rows per chunk of ``run``: a run buffers up to ~1.5 chunks and a step works on
        them. The pass's step room is shared in proportion to the runs' row counts, so
        that every run's chunk spans about the same stretch of the key space: a huge run
        next to tiny ones then advances in big chunks (equal chunks would make it advance
        by a tiny run's chunk per step)."""
        per_row = 1.5 * self.row_width + 1.5 * (self.row_width + STEP_BYTES_PER_ROW)
        share = run.total_rows / max(self.total_rows, 1)
        return max(MIN_CHUNK_ROWS, int(self.plan.step_bytes * share / per_row))

    def _account(self, runs: list[Run], extra_rows: int = 0, extra_bytes: int = 0) -> None:
        rows = sum(r.rows for r in runs) + extra_rows
        held = sum(r.held_bytes() for r in runs) + extra_bytes
        s = self.stats
        s.peak_rows_held = max(s.peak_rows_held, rows)
        s.peak_bytes_held = max(s.peak_bytes_held, held)

    def merge(self, runs: list[Run], sink: BatchBuilder) -> None:
        for out in self.iter_merge(runs):
            sink.add(out)

    def iter_merge(self, runs: list[Run]) -> Iterator[pa.Table]:
        """The merged runs as consolidated tables (internal layout), in ``(k, v, t)``
        order across tables; each table is one step's output (bounded by the plan)."""
        self.runs = runs
        self.total_rows = sum(r.total_rows for r in runs)
        try:
            self._load_unsorted_in_parallel(runs)
            for r in runs:
                r.refill()
            while True:
                active = [r for r in runs if r.rows > 0]
                if not active:
                    if all(r.exhausted for r in runs):
                        return
                    for r in runs:
                        r.refill()
                    continue
                self._account(runs)
                self.stats.steps += 1
                out = self._step_linear(runs, active) if self.linear else self._step(runs, active)
                if out is not None:
                    yield out
        finally:
            # Runs and merger reference each other: drop the decoded data now rather
            # than when the cyclic garbage collector gets to it.
            for r in runs:
                r.close()
            self.runs = []

    def _load_unsorted_in_parallel(self, runs: list[Run]) -> None:
        """Runs that start with an unsorted part (a bulk write's) get it decoded and
        sorted on two threads at once: the sort moved off the writer's path, where a
        bulk write's parts were sorted in parallel, and must not become serial here.
        Every run holds its first part after the first refill anyway, so this holds no
        more than the sequential way (Arrow and numpy release the GIL while sorting)."""
        todo = [r for r in runs if r.next_part_is_unsorted()]
        if len(todo) < 2:
            return
        with ThreadPoolExecutor(max_workers=2, thread_name_prefix="persist-sort") as pool:
            prepared = list(pool.map(lambda r: r.prepare_next_part(), todo))
        for r, prep in zip(todo, prepared, strict=True):
            r._load_next_part(prep)
            r._first_of_part = True

    def _step(self, runs: list[Run], active: list[Run]) -> pa.Table | None:
        # Rank the first and last buffered row of every active run together.
        out: pa.Table | None = None
        ends = []
        for r in active:
            assert r.buf is not None
            ends += [r.buf.slice(0, 1), r.buf.slice(r.buf.num_rows - 1, 1)]
        et = pa.concat_tables(ends)
        ek = row_keys([et.column(n) for n in self._key_cols], et.num_rows)
        firsts, lasts = ek[0::2], ek[1::2]
        open_idx = [i for i, r in enumerate(active) if not r.exhausted]
        if open_idx:
            f_i = min(open_idx, key=lambda i: lasts[i])
            kf_end = lasts[f_i]
            included = [i for i in range(len(active)) if firsts[i] < kf_end]
        else:
            f_i, kf_end = -1, None
            included = list(range(len(active)))
        if included:
            tables = [active[i].buf for i in included]
            if f_i >= 0:
                fb = active[f_i].buf
                assert fb is not None
                tables.append(fb.slice(fb.num_rows - 1, 1))  # F itself, as a ranking sentinel
            cat = pa.concat_tables(tables)  # type: ignore[arg-type]
            n = cat.num_rows
            keys = row_keys([cat.column(c) for c in self._key_cols], n)
            kf = keys[-1] if f_i >= 0 else None
            self._account(runs, extra_rows=n, extra_bytes=n * (int(self.row_width) + STEP_BYTES_PER_ROW))
            off = 0
            take_masks = []
            for i in included:
                r = active[i]
                assert r.buf is not None
                m = r.buf.num_rows
                rk = keys[off : off + m]
                if m > 1 and not bool(np.all(rk[1:] >= rk[:-1])):
                    raise RunOrderViolation() if r.check_order else CorruptionError(
                        f"shard {self.shard}: a part of the compaction input is not sorted by "
                        "(k, v, t); it was written by a faulty writer. Nothing was applied"
                    )
                cnt = m if kf is None else int(np.count_nonzero(rk < kf))
                take_masks.append((off, cnt))
                r.buf = r.buf.slice(cnt)
                off += m
            idx = np.concatenate([np.arange(o, o + c, dtype=np.int64) for o, c in take_masks])
            if len(idx):
                out = self._emit(cat, keys, idx)
        # Runs whose last row is F hold only rows equal to F now: fold them, refill.
        for i, r in enumerate(active):
            if r.buf is not None and r.buf.num_rows and kf_end is not None and lasts[i] == kf_end:
                r.buf = _consolidate_sorted_equal(r.buf)
        # Top up every run below half a chunk, so that all runs advance together and a
        # step emits about half a chunk per run (refilling only the run that bounded F
        # would rank every buffer again to emit one chunk: O(runs) work per row).
        for r in runs:
            if not r.exhausted and r.rows < max(2, self.chunk_rows(r) // 2):
                r.refill()
        return out

    def _step_linear(self, runs: list[Run], active: list[Run]) -> pa.Table | None:
        """``_step`` for flat key types, whose runs were checked for order as they were
        read (``Run._checked_chunk``) and whose buffers are consolidated: each run's
        rows below ``F`` are found by a search (``count_less``), and only the rows
        emitted are ranked — once, as a concatenation of sorted runs, which numpy's
        stable sort merges in near-linear time. Rows coming from a single run need no
        ranking at all."""
        ends = []
        for r in active:
            assert r.buf is not None
            ends += [r.buf.slice(0, 1), r.buf.slice(r.buf.num_rows - 1, 1)]
        et = pa.concat_tables(ends)
        ek = row_keys([et.column(n) for n in self.key_cols], et.num_rows)
        firsts, lasts = ek[0::2], ek[1::2]
        open_idx = [i for i, r in enumerate(active) if not r.exhausted]
        f_row: pa.Table | None = None
        kf_end = None
        if open_idx:
            f_i = min(open_idx, key=lambda i: lasts[i])
            kf_end = lasts[f_i]
            included = [i for i in range(len(active)) if firsts[i] < kf_end]
            fb = active[f_i].buf
            assert fb is not None
            f_row = fb.slice(fb.num_rows - 1, 1)
        else:
            included = list(range(len(active)))
        segments: list[pa.Table] = []
        for i in included:
            r = active[i]
            assert r.buf is not None
            m = r.buf.num_rows
            cnt = m if f_row is None else count_less(r.buf, self.key_cols, f_row)
            if cnt:
                segments.append(r.buf.slice(0, cnt))
                r.buf = r.buf.slice(cnt)
        out: pa.Table | None = None
        if len(segments) == 1:
            out = self._emit_consolidated(segments[0])
        elif segments:
            cat = pa.concat_tables(segments)
            n = cat.num_rows
            self._account(runs, extra_rows=n, extra_bytes=n * (int(self.row_width) + STEP_BYTES_PER_ROW))
            keys, _ = row_keys_with_hint([cat.column(c) for c in self.key_cols], n, presorted_runs=True)
            out = self._emit(cat, keys, None)
        # Runs whose last row is F hold only rows equal to F now (they are sorted): fold.
        for i, r in enumerate(active):
            if r.buf is not None and r.buf.num_rows and kf_end is not None and lasts[i] == kf_end:
                r.buf = _consolidate_sorted_equal(r.buf)
        for r in runs:
            if not r.exhausted and r.rows < max(2, self.chunk_rows(r) // 2):
                r.refill()
        return out

    def _emit_consolidated(self, t: pa.Table) -> pa.Table | None:
        """Rows of one run's consolidated buffer: emitted as they are, minus zero diffs
        (a writer that left some, or sums folded to zero)."""
        d = t.column(D_COL)
        if pc.any(pc.equal(d, 0)).as_py():
            t = t.filter(pc.not_equal(d, 0))
        if t.num_rows == 0:
            return None
        self.stats.output_rows += t.num_rows
        return t

    def _emit(self, cat: pa.Table, keys: np.ndarray, idx: np.ndarray | None) -> pa.Table | None:
        if idx is None:
            idx = np.arange(cat.num_rows, dtype=np.int64)
        k = keys[idx]
        order = np.argsort(k, kind="stable")
        sk = k[order]
        n = len(sk)
        boundary = np.empty(n, dtype=bool)
        boundary[0] = True
        np.not_equal(sk[1:], sk[:-1], out=boundary[1:])
        starts = np.flatnonzero(boundary)
        d = to_numpy(cat.column(D_COL))[idx][order]
        sums = np.add.reduceat(d, starts)
        keep = sums != 0
        if not keep.any():
            return None
        rows = idx[order[starts[keep]]]
        out = cat.take(pa.array(rows))
        di = out.schema.get_field_index(D_COL)
        out = out.set_column(di, out.schema.field(di), pa.array(sums[keep], pa.int64()))
        self.stats.output_rows += out.num_rows
        return out


@dataclass
class MergeCtx:
    """What every pass of one merge shares: the plan's inputs and the chunk transform
    (time filter ``[lower, upper)``, then forwarding to ``since``)."""

    blob: Blob
    schemas: Schemas
    shard: str
    since: int | None
    budget: int
    max_encoded: int
    target_part_bytes: int
    stats: MergeStats
    check_order: bool
    lower: int | None = None
    upper: int | None = None
    purpose: str = "compaction"

    def iter_pass(self, group: list[RunSource]) -> Iterator[pa.Table]:
        """One k-way merge pass of ``group`` (planned for just these runs)."""
        # Forwarding and filtering are idempotent, so every pass applies them
        # (intermediate runs are cheap to re-filter).
        p = MemoryPlan.for_runs(
            self.budget, [r.max_decoded for r in group], self.max_encoded, self.target_part_bytes
        )
        self.stats.fan_in = max(self.stats.fan_in, len(group))
        merger = Merger(
            self.blob, self.schemas, self.shard, self.since, p, self.stats,
            lower=self.lower, upper=self.upper, purpose=self.purpose,
        )
        return merger.iter_merge([Run(merger, src, self.check_order) for src in group])

    def fold_smallest(self, sources: list[RunSource]) -> list[RunSource]:
        """The smallest runs, up to 1/16 of the budget decoded, folded into one in-memory
        run with a single consolidate: a k-way merge of many tiny runs costs a step per
        few rows, a consolidate ~0.3 us per row. Returns the runs to merge."""
        level = sorted(sources, key=lambda r: r.total_decoded)
        folded = 0
        est = 0
        while folded < len(level) and est + level[folded].total_decoded <= self.budget // 16:
            est += level[folded].total_decoded
            folded += 1
        if folded >= 2 and not few_linear_runs(len(level), self.schemas):
            self.stats.passes += 1
            groups = [r.parts or [] for r in level[:folded]]
            table = fold_in_memory(
                self.blob, self.schemas, self.shard, groups, self.since, self.stats,
                lower=self.lower, upper=self.upper, purpose=self.purpose,
            )
            level = [RunSource.of_table(table)] + level[folded:]
        return level

    def reduce_to_fit(
        self,
        level: list[RunSource],
        plan: MemoryPlan,
        write_run: Callable[[list[RunSource]], RunSource | None],
    ) -> list[RunSource]:
        """While the runs don't fit the plan together, merges as many of the smallest as
        fit (at least two) into an intermediate run (``write_run``: to blob or a local
        file); returns runs that fit (or two that don't)."""
        while not plan.fits([r.max_decoded for r in level]) and len(level) > 2:
            level.sort(key=lambda r: r.total_decoded)
            g = 2
            while g < len(level) and plan.fits([r.max_decoded for r in level[: g + 1]]):
                g += 1
            group, level = level[:g], level[g:]
            self.stats.passes += 1
            new = write_run(group)
            if new is not None:
                level.append(new)
        return level



def fold_in_memory(
    blob: Blob, schemas: Schemas, shard: str, runs: list[list[PartMeta]], since_t: int | None,
    stats: MergeStats, *, lower: int | None = None, upper: int | None = None,
    purpose: str = "compaction",
) -> pa.Table:
    """Decodes every part of ``runs`` whole, filters to ``[lower, upper)``, forwards and
    consolidates them at once."""
    tables = []
    enc = 0
    for run in runs:
        for p in run:
            t = fetch_small_part(blob, p, schemas, shard, purpose)
            enc += p.size
            stats.bytes_read += p.size
            stats.rows_read += t.num_rows
            if lower is not None or upper is not None:
                t = time_range(t, lower, upper)
            tables.append(advance_to_since(t, since_t) if since_t is not None else t)
    rows = sum(t.num_rows for t in tables)
    decoded = sum(t.nbytes for t in tables)
    stats.peak_rows_held = max(stats.peak_rows_held, rows)
    stats.peak_bytes_held = max(stats.peak_bytes_held, enc + 2 * decoded + rows * STEP_BYTES_PER_ROW)
    if not tables:
        return internal_schema(schemas).empty_table()
    return _consolidate(pa.concat_tables(tables))


# Bytes per row of the in-memory merge's working set beside the decoded rows, measured
# (tracemalloc and RSS, 5.2M rows of (int64, string)): the sort's numpy arrays peak at
# ~50 (packed keys, the permutation, tie groups, the diffs gathered and summed) with


# Up to this many sorted runs of flat key types are merged (linear kernels) rather
# than decoded whole and consolidated at once: merging a few sorted runs costs less
# than sorting all their rows.
FEW_RUNS = 4


def few_linear_runs(n_runs: int, schemas: Schemas) -> bool:
    return n_runs <= FEW_RUNS and merges_linearly(schemas)


def merges_linearly(schemas: Schemas) -> bool:
    """Whether merges of this shard's runs use the linear kernels (flat key types)."""
    schema = internal_schema(schemas)
    return linear_kernels_apply(f.type for f in schema if f.name != D_COL)
