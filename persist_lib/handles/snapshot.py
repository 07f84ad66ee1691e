"""Snapshots and time-range reads of a leased reader, within a memory budget.

**Memory.** Reads have a budget (``memory_budget``, default
``PersistConfig.read_memory_budget``). A read whose parts, decoded whole, fit it is
done the simple way (fetch every part in parallel, one consolidate). A larger one
streams: ``snapshot_batches`` / ``updates_between_batches`` yield record batches from
the compactor's k-way merge of the parts' sorted runs (``read_merge.stream_merge``),
holding about one decoded part per run plus the merge's chunks; runs that don't fit
together are first merged into spill files in the local temporary directory
(``$TMPDIR``), deleted when the stream ends. The stream holds its seqno hold
until it is exhausted, closed or garbage collected. ``snapshot`` and
``updates_between`` build their table from the stream when the read is large.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pyarrow as pa

from persist_lib.errors import BlobNotFound
from persist_lib.frontier import check_time
from persist_lib.handles.batch_stream import BatchStream
from persist_lib.handles.leased_reader import LeasedReader
from persist_lib.handles.pushdown import ReadPushdown
from persist_lib.handles.read_plan import (
    batch_overlaps,
    concat_updates,
    concatenating_read,
    decoded_bytes,
    part_overlaps,
    parts_in_range,
    row_width,
    sorted_run_read_bytes,
    whole_read_bytes,
)
from persist_lib.shard import state as st
from persist_lib.shard.batch_meta import PartMeta
from persist_lib.shard.codec import to_user_table
from persist_lib.shard.consolidate import consolidate
from persist_lib.shard.disjoint_runs import chain_disjoint_runs, footers_confirm_chain
from persist_lib.shard.kway_merge import FEW_RUNS, merges_linearly
from persist_lib.shard.memory_plan import MergeStats
from persist_lib.shard.ranged_fetch import fetch_part_groups
from persist_lib.shard.read_merge import merge_decoded_runs, stream_merge
from persist_lib.shard.runs import RunOrderViolation, batch_runs
from persist_lib.shard.sorted_run_stream import (
    read_sorted_runs,
    sorted_run_stream_bytes,
    sorted_runs_read_bytes,
    stream_sorted_run,
)
from persist_lib.shard.time_filters import snapshot_at, time_range

# Whole (in-memory) snapshots of at most this many sorted runs merge them instead of
# sorting their concatenation (``read_merge.merge_decoded_runs``).
MERGE_DECODED_MAX_RUNS = FEW_RUNS


class SnapshotReader(LeasedReader):
    """The snapshot and time-range reads of a ``ReadHandle`` (whole or streamed)."""

    def snapshot(
        self, as_of: int, timeout_s: float | None = None, *, memory_budget: int | None = None,
        columns: Sequence[str] | None = None, filter: Any = None,
    ) -> pa.Table:
        """The shard's contents at ``as_of``: every update at ``t <= as_of``, consolidated.

        Waits (up to ``timeout_s``) while ``as_of`` is not yet complete (``as_of >= upper``);
        ``as_of`` below this reader's since is an ``InvalidUsage``. The table is whole in
        memory; when decoding every part at once would need more than ``memory_budget``
        beyond the table itself it is built from ``snapshot_batches`` (the table plus
        about the budget at peak either way).

        ``columns``: the key/value fields to return (``ts`` and ``diff`` always come
        back); ``filter``: a ``shard.predicate.Predicate`` or ``[(column, op, value),
        ...]`` (a conjunction) the returned rows satisfy. Parts whose statistics rule
        the filter out are not fetched (``handles.pushdown``); the result equals the
        full snapshot filtered and projected afterwards.
        """
        self._check_open()
        as_of = check_time(as_of, "as_of")
        budget = self._read_budget(memory_budget)
        pd = ReadPushdown.plan(self.schemas, columns, filter, shard=self.shard_id)
        with self._hold():
            state = self._wait_for_upper_beyond(as_of, timeout_s)
            self._check_as_of(state, as_of)
            tables = list(self._snapshot_tables(state, as_of, budget, result_held=True, pd=pd))
        return pd.project(to_user_table(concat_updates(tables, self.schemas), self.schemas))

    def snapshot_batches(
        self, as_of: int, *, memory_budget: int | None = None, timeout_s: float | None = None,
        columns: Sequence[str] | None = None, filter: Any = None,
    ) -> BatchStream:
        """``snapshot(as_of)`` as a stream of record batches, within ``memory_budget``
        (default ``PersistConfig.read_memory_budget``, at least 1 MiB) however large the
        shard: the same rows (each ``(k, v)`` at most once, nonzero diffs, ``ts`` =
        ``as_of``), in ``(k, v)`` order.

        Arguments are checked, and the wait for the upper done, before this returns
        (``InvalidUsage``, ``Timeout`` as for ``snapshot``); parts are fetched as the
        stream is iterated. The stream holds this reader's seqno hold until it is
        exhausted, closed or garbage collected: close it when stopping early (``with``).
        ``columns`` and ``filter`` as for ``snapshot``.
        """
        self._check_open()
        as_of = check_time(as_of, "as_of")
        budget = self._read_budget(memory_budget)
        pd = ReadPushdown.plan(self.schemas, columns, filter, shard=self.shard_id)
        seqno = self._take_hold()
        try:
            state = self._wait_for_upper_beyond(as_of, timeout_s)
            self._check_as_of(state, as_of)
        except BaseException:
            self._release_hold(seqno)
            raise
        stats = MergeStats()
        return self._stream(self._snapshot_tables(state, as_of, budget, stats, pd=pd), budget, seqno, stats, pd)

    def _snapshot_tables(
        self, state: st.ShardState, as_of: int, budget: int, stats: MergeStats | None = None, *,
        result_held: bool = False, pd: ReadPushdown | None = None,
    ) -> Iterator[pa.Table]:
        """The snapshot at ``as_of`` as consolidated tables (internal layout), filtered
        by ``pd``'s filter (not yet projected); parts ``pd``'s statistics rule out are
        not fetched.
        ``result_held``: the caller holds the whole result anyway (``snapshot``): the
        budget bounds the memory beyond it (``read_plan.whole_read_bytes``).

        Three ways, cheapest first (docs/benchmarks.md, issue 28), after one shortcut:
        when the read keeps parts of one batch only and that batch's runs are marked
        (k, v)-disjoint (``HollowBatch.runs_concatenate``: (k, v)-whole time layers),
        each run is read as a sorted run below and the outputs concatenated, not
        merged (the result is then not in (k, v) order across runs; the streamed
        ``snapshot_batches``, which promises that order, merges);
        - one sorted run (a compacted shard, or a single sorted batch part) that fits the
          budget: its parts fetched, verified, decoded, times forwarded and each
          consolidated by ``consolidate_sorted`` on the fetch threads — a linear check
          that hands the decoded columns back as they are when no two rows share a
          ``(k, v)`` (no sort, no merge, no copy); equal neighbours are summed in place,
          across part boundaries too (``sorted_run_stream``);
        - otherwise, when decoding everything fits: a few sorted runs are merged
          without sorting them again; when a part is unsorted (a bulk write's) the lot
          is concatenated (no copy) and consolidated by one sort;
        - beyond the budget: the streaming k-way merge."""
        stats = stats if stats is not None else MergeStats()
        pd = pd if pd is not None else ReadPushdown(self.schemas, None, None)
        if not pd.snapshot_time_ok(as_of):
            return
        runs = [
            [p for p in run if p.tmin <= as_of and pd.keeps_part(p)]
            for _, b in state.trace_batches()
            if b.lower.less_equal(as_of)
            for run in batch_runs(b)
        ]
        listed = [run for run in runs if run]
        if result_held and len(listed) > 1 and concatenating_read(state, as_of, pd.keeps_part):
            # One (k, v)-disjoint layered batch: each run read as a sorted run, their
            # outputs concatenated (no merge); read as below if a run is not sorted.
            got = self._concatenated_runs(listed, as_of, budget, pd)
            if got is not None:
                stats.runs += len(listed)
                for t in got:
                    stats.output_rows += t.num_rows
                    yield t
                return
        # Runs whose statistics prove disjoint key ranges read as one (``disjoint_runs``).
        runs = chain_disjoint_runs(listed, self.schemas)
        chained = len(runs) < len(listed)  # (some runs' order rests on recorded ranges)
        parts = [p for run in runs for p in run]
        linear = merges_linearly(self.schemas)

        def at_as_of(t: pa.Table, p: PartMeta) -> pa.Table:
            return pd.filter_data(snapshot_at(t, as_of, all_at_or_before=p.tmax <= as_of))

        blob, schemas, shard = self._client.blob, self.schemas, self.shard_id

        def fetch(p: PartMeta) -> pa.Table:
            # Indexed parts: only the row groups that may hold times <= as_of and rows
            # passing the filter (``shard.ranged_fetch``); others whole.
            return fetch_part_groups(blob, p, schemas, shard, pd.snapshot_groups(p, as_of))

        one_sorted_run = len(runs) == 1 and linear and all(p.sorted for p in parts)
        if one_sorted_run and sorted_run_read_bytes(parts, self.schemas, beyond_result=result_held) <= budget:
            # Read whole: every part forwarded, filtered and consolidated on the fetch
            # threads (two at a time), the boundaries folded here; nothing is handed on
            # before the run proved sorted.
            try:
                tables = list(self._guard_missing(stream_sorted_run(
                    parts, as_of, fetch, shard, self._fetch_pool(), post=pd.filter_data, restartable=True,
                )))
            except RunOrderViolation:
                # The run claimed to be sorted but is not (a faulty compactor): read it
                # as one run per part below.
                runs = [[p] for p in parts]
            else:
                stats.runs += 1
                for t in tables:
                    stats.output_rows += t.num_rows
                    yield t
                return
        elif one_sorted_run and sorted_run_stream_bytes(
            [decoded_bytes(p, self.schemas) for p in parts], [p.count for p in parts]
        ) <= budget:
            # Larger than the budget whole: streamed part by part, still linear. A chain's
            # order is first checked against its parts' verified footers where they have
            # them: once rows are handed out, a lying range could only stop the read.
            if chained and not self._footers_allow(parts):
                runs = [[p] for p in parts]
            else:
                try:
                    for t in self._guard_missing(stream_sorted_run(parts, as_of, fetch, shard, self._fetch_pool())):
                        t = pd.filter_data(t)
                        stats.output_rows += t.num_rows
                        if t.num_rows:
                            yield t
                    stats.runs += 1
                    return
                except RunOrderViolation:  # (raised before any row was yielded)
                    runs = [[p] for p in parts]
        if whole_read_bytes(parts, self.schemas, beyond_result=result_held) <= budget:
            stats.runs += len(runs)
            if all(p.sorted for p in parts) and 1 <= len(runs) <= MERGE_DECODED_MAX_RUNS and linear:
                # A few sorted runs: merged, not sorted again.
                fetched = iter(self._fetch_all(parts, at_as_of, fetch))
                run_tables = [concat_updates([next(fetched) for _ in run], self.schemas) for run in runs]
                before = stats.output_rows
                merged = merge_decoded_runs(self.schemas, self.shard_id, run_tables, budget, stats)
                if merged is not None:
                    yield from (t for t in merged if t.num_rows)
                    return
                stats.output_rows = before
                tables = run_tables  # a run was not sorted: consolidate the lot
            else:
                # Unsorted parts (or many runs): one sort of everything, on two threads
                # (``consolidation_plan``), rather than a sort per part and a merge.
                tables = self._fetch_all(parts, at_as_of, fetch)
            out = consolidate(concat_updates(tables, self.schemas))
            stats.output_rows += out.num_rows
            if out.num_rows:
                yield out
            return
        streamed = self._guard_missing(
            stream_merge(
                self._client.blob, self.schemas, shard=self.shard_id, runs=runs, memory_budget=budget,
                since=as_of, upper=as_of + 1, stats=stats, purpose="snapshot read",
            )
        )
        yield from (f for f in (pd.filter_data(t) for t in streamed) if f.num_rows)

    def _concatenated_runs(
        self, runs: list[list[PartMeta]], as_of: int, budget: int, pd: ReadPushdown
    ) -> list[pa.Table] | None:
        """The snapshot of (k, v)-disjoint runs (``concatenating_read``): each run read
        whole as one sorted run (fetched, verified, forwarded and consolidated on the
        fetch threads), the outputs concatenated. None when that doesn't apply (types
        without linear kernels, unsorted parts, over the budget) or a run turns out not
        to be sorted: the caller reads the runs another way."""
        parts = [p for run in runs for p in run]
        if not merges_linearly(self.schemas) or not all(p.sorted for p in parts):
            return None
        # (the result is held anyway: beyond it, the read holds what one sorted run's
        # read holds, whole or part by part; runs are read one after the other)
        whole = max(sorted_run_read_bytes(run, self.schemas, beyond_result=True) for run in runs)
        streamed = max(
            sorted_run_stream_bytes([decoded_bytes(p, self.schemas) for p in run], [p.count for p in run])
            for run in runs
        )
        workers = self._client.config.fetch_parallelism
        at_once = sorted_runs_read_bytes([decoded_bytes(p, self.schemas) for p in parts], [p.count for p in parts], workers)
        if min(whole, streamed, at_once) > budget:
            return None
        blob, schemas, shard = self._client.blob, self.schemas, self.shard_id

        def fetch(p: PartMeta) -> pa.Table:
            return fetch_part_groups(blob, p, schemas, shard, pd.snapshot_groups(p, as_of))

        tables: list[pa.Table] = []
        try:
            if at_once <= budget:
                # Every run's parts on the pool at once: no thread idles at a run's end.
                try:
                    got = read_sorted_runs(runs, as_of, fetch, shard, self._fetch_pool(), post=pd.filter_data)
                except BlobNotFound:
                    self._blob_missing()
                    raise
                tables = [t for run_tables in got for t in run_tables]
            else:
                for run in runs:
                    tables.extend(self._guard_missing(stream_sorted_run(
                        run, as_of, fetch, shard, self._fetch_pool(), post=pd.filter_data, restartable=True,
                    )))
        except RunOrderViolation:
            return None
        return [t for t in tables if t.num_rows]

    def _footers_allow(self, parts: list[PartMeta]) -> bool:
        """Whether a chain may be streamed: False when its parts' verified footers
        contradict the recorded key ranges it was chained by (``disjoint_runs``)."""
        try:
            return footers_confirm_chain(self._client.blob, parts, self.schemas, self.shard_id) is not False
        except BlobNotFound:
            self._blob_missing()
            raise

    def _range_tables(
        self, state: st.ShardState, lower: int, upper: int | None, budget: int, *, sort_by_time: bool,
        stats: MergeStats | None = None, pd: ReadPushdown | None = None,
    ) -> Iterator[pa.Table]:
        """The updates at times in ``[lower, upper)`` as consolidated tables (internal
        layout), batch by batch of the trace, so in time order across tables (batches
        hold disjoint time ranges, so nothing consolidates across them); each table is
        sorted by time if ``sort_by_time``, else by ``(k, v, t)``; filtered by ``pd``'s
        filter (not yet projected)."""
        stats = stats if stats is not None else MergeStats()
        pd = pd if pd is not None else ReadPushdown(self.schemas, None, None)
        parts = [p for p in parts_in_range(state, lower, upper) if pd.keeps_range_part(p)]
        if whole_read_bytes(parts, self.schemas) <= budget:
            blob, schemas, shard = self._client.blob, self.schemas, self.shard_id
            tables = self._fetch_all(
                parts,
                lambda t, p: pd.filter_range(time_range(t, lower, upper)),
                lambda p: fetch_part_groups(blob, p, schemas, shard, pd.range_groups(p, lower, upper)),
            )
            out = consolidate(concat_updates(tables, self.schemas))
            stats.output_rows += out.num_rows
            if out.num_rows:
                yield out.sort_by([("t", "ascending")]) if sort_by_time else out
            return
        for _, b in state.trace_batches():
            if not batch_overlaps(b, lower, upper):
                continue
            runs = [
                [p for p in run if part_overlaps(p, lower, upper) and pd.keeps_range_part(p)]
                for run in batch_runs(b)
            ]
            for t in self._guard_missing(
                stream_merge(
                    self._client.blob, self.schemas, shard=self.shard_id, runs=runs,
                    memory_budget=budget, lower=lower, upper=upper, stats=stats, purpose="range read",
                )
            ):
                t = pd.filter_range(t)
                if not t.num_rows:
                    continue
                yield t.sort_by([("t", "ascending")]) if sort_by_time else t

    def _stream(
        self, tables: Iterator[pa.Table], budget: int, seqno: int, stats: MergeStats, pd: ReadPushdown
    ) -> BatchStream:
        """Wraps internal tables as a ``BatchStream`` (projected by ``pd``) that releases
        ``seqno`` when done."""
        schemas = self.schemas
        max_rows = max(1024, (budget // 32) // max(1, row_width(schemas)))

        def batches() -> Iterator[pa.RecordBatch]:
            for t in tables:
                self._check_open()
                yield from pd.project(to_user_table(t, schemas)).to_batches(max_chunksize=max_rows)

        return BatchStream(batches(), pd.user_schema(), lambda: self._release_hold(seqno), stats)

    def updates_between(
        self, lower: int, upper: int, timeout_s: float | None = None, *, memory_budget: int | None = None,
        columns: Sequence[str] | None = None, filter: Any = None,
    ) -> pa.Table:
        """Every update at times in ``[lower, upper)``, consolidated (times not forwarded),
        sorted by time.

        Waits until the shard upper reaches ``upper``. ``lower`` must be *beyond* this
        reader's since (or both 0): compaction forwards older updates to the since, so the
        updates at the since itself are not the ones that happened then. The building
        block of incremental (listen-range) reads. ``columns`` and ``filter`` as for
        ``snapshot`` (a conjunct on ``ts`` compares each update's own time).
        """
        self._check_open()
        lower, upper = self._check_range_args(lower, upper)
        budget = self._read_budget(memory_budget)
        pd = ReadPushdown.plan(self.schemas, columns, filter, shard=self.shard_id)
        if upper == lower:
            return pd.project(to_user_table(concat_updates([], self.schemas), self.schemas))
        with self._hold():
            state = self._wait_for_upper_beyond(upper - 1, timeout_s)
            self._check_range_lower(state, lower)
            tables = list(self._range_tables(state, lower, upper, budget, sort_by_time=False, pd=pd))
        internal = concat_updates(tables, self.schemas)
        return pd.project(to_user_table(internal.sort_by([("t", "ascending")]), self.schemas))

    def updates_between_batches(
        self, lower: int, upper: int, *, memory_budget: int | None = None, timeout_s: float | None = None,
        columns: Sequence[str] | None = None, filter: Any = None,
    ) -> BatchStream:
        """``updates_between(lower, upper)`` as a stream of record batches within
        ``memory_budget``: the same rows, in time order batch by batch of the shard's
        trace (each batch of the trace covers its own time range) and sorted by time
        within each record batch, but not globally (one large trace batch comes out in
        several record batches, each sorted by time).

        Arguments are checked and the upper waited for before this returns; the stream
        holds this reader's seqno hold until it is exhausted, closed or collected.
        ``columns`` and ``filter`` as for ``updates_between``.
        """
        self._check_open()
        lower, upper = self._check_range_args(lower, upper)
        budget = self._read_budget(memory_budget)
        pd = ReadPushdown.plan(self.schemas, columns, filter, shard=self.shard_id)
        seqno = self._take_hold()
        try:
            if upper > lower:
                state = self._wait_for_upper_beyond(upper - 1, timeout_s)
                self._check_range_lower(state, lower)
        except BaseException:
            self._release_hold(seqno)
            raise
        stats = MergeStats()
        tables: Iterator[pa.Table] = (
            self._range_tables(state, lower, upper, budget, sort_by_time=True, stats=stats, pd=pd)
            if upper > lower
            else iter(())
        )
        return self._stream(tables, budget, seqno, stats, pd)

