"""The merges a read runs: the k-way merge engine with its output handed to the caller.

``stream_merge`` streams the consolidated updates of a shard's runs (filtered to a
time range, forwarded to a since) under a memory budget, spilling intermediate runs to
local Arrow IPC files, never to blob. ``merge_decoded_runs`` merges runs a read has
already decoded without sorting them again. Both share the compactor's engine
(``kway_merge``) and memory planning (``memory_plan``); the read handle calls them.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from typing import Any

import pyarrow as pa

from persist_lib.errors import CorruptionError, InvalidUsage
from persist_lib.location.base import Blob
from persist_lib.shard.batch_meta import PartMeta
from persist_lib.shard.codec import Schemas, internal_schema
from persist_lib.shard.kway_merge import MergeCtx, Merger, Run, few_linear_runs, fold_in_memory
from persist_lib.shard.memory_plan import MemoryPlan, MergeStats
from persist_lib.shard.range_stream import (
    merge_decoded_by_ranges,
    range_stream_applies,
    range_stream_rows,
    stream_by_key_ranges,
)
from persist_lib.shard.runs import RunOrderViolation, RunSource, SpilledRun

log = logging.getLogger(__name__)

MiB = 1 << 20
# Streams of at most this many sorted runs go by key ranges (``range_stream``).
RANGE_STREAM_MAX_RUNS = 8
# Decoded runs of at least this many rows are merged by key ranges (``range_stream``).
RANGE_MERGE_MIN_ROWS = 1 << 17


def merge_decoded_runs(
    schemas: Schemas, shard: str, runs: list[pa.Table], memory_budget: int, stats: MergeStats
) -> list[pa.Table] | None:
    """Merges runs already decoded (each sorted by ``(k, v, t)``, times already forwarded)
    into consolidated tables, without sorting them again: the k-way merge over in-memory
    runs. For a few runs of flat key types (``merges_linearly``) this beats one
    ``consolidate`` of their concatenation, which sorts every row (a compacted shard is
    one sorted run: its read then costs linear checks). Two or more runs of
    ``RANGE_MERGE_MIN_ROWS`` rows or more whose leading column maps to integers are cut
    into key ranges consolidated on two threads instead (``range_stream``). Returns None
    when a run turns out not to be sorted (the caller consolidates instead)."""
    sources = [RunSource.of_table(t) for t in runs if t.num_rows]
    if not sources:
        return []
    big = len(sources) >= 2 and sum(s.rows for s in sources) >= RANGE_MERGE_MIN_ROWS
    if big and range_stream_applies(schemas, []):  # (no parts: each run is checked sorted)
        return merge_decoded_by_ranges(runs, schemas, stats)
    plan = MemoryPlan.for_runs(memory_budget, [s.max_decoded for s in sources], 0, memory_budget)
    merger = Merger(_NO_BLOB, schemas, shard, None, plan, stats, purpose="read")
    try:
        return list(merger.iter_merge([Run(merger, src, True) for src in sources]))
    except RunOrderViolation:
        return None


class _NoBlob:
    """The blob of a merge over decoded runs: never read."""

    def get(self, key: str) -> bytes | None:  # pragma: no cover - never called
        raise AssertionError(f"merge of decoded runs fetched {key}")


_NO_BLOB: Any = _NoBlob()


def stream_merge(
    blob: Blob,
    schemas: Schemas,
    *,
    shard: str,
    runs: list[list[PartMeta]],
    memory_budget: int,
    since: int | None = None,
    lower: int | None = None,
    upper: int | None = None,
    spill_dir: str | None = None,
    stats: MergeStats | None = None,
    purpose: str = "read",
) -> Iterator[pa.Table]:
    """The updates of ``runs`` (each a list of parts sorted across part boundaries)
    filtered to times in ``[lower, upper)``, forwarded to ``since`` and consolidated, as
    a stream of tables (internal layout) in ``(k, v, t)`` order across tables — the
    compactor's k-way merge, emitting to the caller instead of to a ``BatchBuilder``.

    Memory is planned as for compaction (``MemoryPlan``): the smallest runs are folded
    in memory, and when the remaining runs don't fit the budget together they are
    merged in groups into intermediate runs written to local Arrow IPC files under
    ``spill_dir`` (a temporary directory, deleted when the stream ends or is closed);
    a reader never writes to blob. Each yielded table is one merge step's output.

    A generator: nothing is fetched before the first ``next``; ``close()`` (or dropping
    it) releases what it holds. A batch that claims to be one sorted run (a compactor
    output) but isn't is re-merged with a run per part when nothing was yielded yet;
    later, it raises ``CorruptionError`` (the rows already yielded can't be taken back).
    """
    if memory_budget < 1 * MiB:
        raise InvalidUsage(f"memory budget must be >= 1 MiB, got {memory_budget} bytes")
    st = stats if stats is not None else MergeStats()
    runs = [r for r in runs if r]
    st.runs += len(runs)  # (stats may add up several streams)
    if not runs:
        return
    yielded = False
    try:
        for t in _coalesce(
            _stream_runs(blob, schemas, shard, runs, memory_budget, since, lower, upper,
                         spill_dir, st, purpose, check_order=True),
            memory_budget // 64,
        ):
            yielded = True
            yield t
    except RunOrderViolation:
        if yielded:
            raise CorruptionError(
                f"shard {shard}: a batch written by the compactor is not one sorted run (its "
                "parts overlap); the read stopped after returning part of its rows. Read "
                "again with a snapshot() (it re-merges with a run per part) and investigate "
                "the compactor that wrote it"
            ) from None
        log.warning("shard %s: compactor runs were not sorted; reading with a run per part", shard)
        st.restarted_per_part = True
        per_part = [[p] for run in runs for p in run]
        yield from _coalesce(
            _stream_runs(blob, schemas, shard, per_part, memory_budget, since, lower, upper,
                         spill_dir, st, purpose, check_order=False),
            memory_budget // 64,
        )


def _coalesce(tables: Iterator[pa.Table], min_bytes: int) -> Iterator[pa.Table]:
    """Joins consecutive small tables (merge steps near the end of a run emit a few rows
    each) until they hold ``min_bytes``; larger ones pass through."""
    pending: list[pa.Table] = []
    held = 0
    for t in tables:
        pending.append(t)
        held += t.nbytes
        if held >= min_bytes:
            yield pending[0] if len(pending) == 1 else pa.concat_tables(pending).combine_chunks()
            pending, held = [], 0
    if pending:
        yield pending[0] if len(pending) == 1 else pa.concat_tables(pending).combine_chunks()


def _stream_runs(
    blob: Blob, schemas: Schemas, shard: str, runs_parts: list[list[PartMeta]], budget: int,
    since: int | None, lower: int | None, upper: int | None, spill_dir: str | None,
    stats: MergeStats, purpose: str, *, check_order: bool,
) -> Iterator[pa.Table]:
    max_encoded = max((p.size for run in runs_parts for p in run), default=0)
    sources = [RunSource.of_parts(run, schemas) for run in runs_parts]
    # No output parts here: the consumer holds what it is handed. The plan's share for
    # them (1/32 of the budget, ~8x) covers the yielded table and its conversions.
    target = budget
    plan = MemoryPlan.for_runs(budget, [r.max_decoded for r in sources], max_encoded, target)
    ctx = MergeCtx(
        blob, schemas, shard, since, budget, max_encoded, target, stats, check_order,
        lower=lower, upper=upper, purpose=purpose,
    )
    total_in = sum(p.size for run in runs_parts for p in run)
    if total_in <= budget // 64 and not few_linear_runs(len(runs_parts), schemas):
        stats.passes += 1
        merged = fold_in_memory(
            blob, schemas, shard, runs_parts, since, stats, lower=lower, upper=upper, purpose=purpose
        )
        stats.output_rows += merged.num_rows
        if merged.num_rows:
            yield merged
        return

    range_rows = (
        range_stream_rows(runs_parts, schemas, budget)
        if check_order and 2 <= len(runs_parts) <= RANGE_STREAM_MAX_RUNS and range_stream_applies(schemas, runs_parts)
        else None
    )
    if range_rows is not None:
        # A few sorted runs: cut at leading keys, the key ranges consolidated on two
        # threads (``range_stream``) rather than merged step by step on this one.
        yield from stream_by_key_ranges(
            blob, schemas, shard, runs_parts, since=since, lower=lower, upper=upper, stats=stats,
            purpose=purpose, range_rows=range_rows,
        )
        return
    spill = SpillDir(spill_dir)
    try:
        level = ctx.fold_smallest(sources)
        yield from merge_level(ctx, level, plan, spill)
    finally:
        spill.remove()


class SpillDir:
    """A local temporary directory for a read's intermediate runs, made on first use
    (under ``parent``, default ``$TMPDIR``); ``remove()`` deletes it and its files."""

    def __init__(self, parent: str | None = None) -> None:
        self.parent = parent
        self.path: str | None = None

    def new_file(self) -> str:
        if self.path is None:
            self.path = tempfile.mkdtemp(prefix="persist-merge-", dir=self.parent)
        return os.path.join(self.path, f"run-{uuid.uuid4().hex}.arrow")

    def remove(self) -> None:
        if self.path is not None:
            shutil.rmtree(self.path, ignore_errors=True)
            self.path = None


class SpillWriter:
    """Writes one sorted run (internal layout) to a local Arrow IPC file, batch by batch;
    ``finish()`` returns it as a ``RunSource`` (None if it has no rows: the file is then
    deleted)."""

    def __init__(self, path: str, schema: pa.Schema, stats: MergeStats) -> None:
        self.path = path
        self.stats = stats
        self.rows = self.batches = self.max_bytes = self.total = 0
        opts = pa.ipc.IpcWriteOptions(compression="lz4" if pa.Codec.is_available("lz4") else None)
        self._file = pa.OSFile(path, "wb")
        self._writer = pa.ipc.new_file(self._file, schema, options=opts)

    def write(self, t: pa.Table) -> None:
        for b in t.to_batches():
            self._writer.write_batch(b)
            self.rows += b.num_rows
            self.batches += 1
            self.max_bytes = max(self.max_bytes, b.nbytes)
            self.total += b.nbytes

    def abort(self) -> None:
        """Closes and deletes the file (the run is abandoned)."""
        self._close()
        if os.path.exists(self.path):
            os.unlink(self.path)

    def _close(self) -> None:
        if not self._file.closed:
            self._writer.close()
            self._file.close()

    def finish(self) -> RunSource | None:
        self._close()
        self.stats.intermediate_bytes += os.path.getsize(self.path)
        if self.rows == 0:
            os.unlink(self.path)
            return None
        return RunSource(None, None, self.rows, self.max_bytes, self.total, SpilledRun(self.path, self.batches))


def merge_level(ctx: MergeCtx, level: list[RunSource], plan: MemoryPlan, spill: SpillDir) -> Iterator[pa.Table]:
    """Merges ``level`` (runs of parts, decoded tables or local files) as one stream:
    while the runs don't fit ``plan`` together, the smallest are first merged into
    intermediate runs in ``spill`` (local files, deleted as they are merged on)."""
    schema = internal_schema(ctx.schemas)

    def to_local_file(group: list[RunSource]) -> RunSource | None:
        w = SpillWriter(spill.new_file(), schema, ctx.stats)
        try:
            for t in ctx.iter_pass(group):
                w.write(t)
        except BaseException:
            w.abort()
            raise
        for src in group:  # a spilled input run is no longer needed
            if src.spill is not None:
                os.unlink(src.spill.path)
        return w.finish()

    level = ctx.reduce_to_fit(level, plan, to_local_file)
    ctx.stats.passes += 1
    yield from ctx.iter_pass(level)


def merge_local_runs(
    schemas: Schemas, shard: str, sources: list[RunSource], memory_budget: int, stats: MergeStats,
    spill: SpillDir, purpose: str = "read",
) -> Iterator[pa.Table]:
    """The consolidated merge (internal layout, ``(k, v, t)`` order) of runs a read
    already holds: decoded tables and local spill files, each sorted by ``(k, v, t)``
    (never checked against blob: there are no parts). Intermediate runs go to ``spill``,
    which the caller removes."""
    ctx = MergeCtx(
        _NO_BLOB, schemas, shard, None, memory_budget, 0, memory_budget, stats, False, purpose=purpose,
    )
    plan = MemoryPlan.for_runs(memory_budget, [s.max_decoded for s in sources], 0, memory_budget)
    yield from merge_level(ctx, [s for s in sources if s.rows], plan, spill)
