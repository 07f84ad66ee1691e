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
from persist_lib.shard.runs import RunOrderViolation, RunSource, SpilledRun

log = logging.getLogger(__name__)

MiB = 1 << 20


def merge_decoded_runs(
    schemas: Schemas, shard: str, runs: list[pa.Table], memory_budget: int, stats: MergeStats
) -> list[pa.Table] | None:
    """Merges runs already decoded (each sorted by ``(k, v, t)``, times already forwarded)
    into consolidated tables, without sorting them again: the k-way merge over in-memory
    runs. For a few runs of flat key types (``merges_linearly``) this beats one
    ``consolidate`` of their concatenation, which sorts every row (a compacted shard is
    one sorted run: its read then costs linear checks). Returns None when a run turns
    out not to be sorted (the caller consolidates instead)."""
    sources = [RunSource.of_table(t) for t in runs if t.num_rows]
    if not sources:
        return []
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
    tmpdir: str | None = None
    schema = internal_schema(schemas)
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

    def to_local_file(group: list[RunSource]) -> RunSource | None:
        nonlocal tmpdir
        if tmpdir is None:
            tmpdir = tempfile.mkdtemp(prefix="persist-merge-", dir=spill_dir)
        path = os.path.join(tmpdir, f"run-{uuid.uuid4().hex}.arrow")
        rows = batches = max_bytes = total = 0
        opts = pa.ipc.IpcWriteOptions(compression="lz4" if pa.Codec.is_available("lz4") else None)
        with pa.OSFile(path, "wb") as f, pa.ipc.new_file(f, schema, options=opts) as w:
            for t in ctx.iter_pass(group):
                for b in t.to_batches():
                    w.write_batch(b)
                    rows += b.num_rows
                    batches += 1
                    max_bytes = max(max_bytes, b.nbytes)
                    total += b.nbytes
        stats.intermediate_bytes += os.path.getsize(path)
        for src in group:  # a spilled input run is no longer needed
            if src.spill is not None:
                os.unlink(src.spill.path)
        if rows == 0:
            os.unlink(path)
            return None
        return RunSource(None, None, rows, max_bytes, total, SpilledRun(path, batches))

    try:
        level = ctx.fold_smallest(sources)
        level = ctx.reduce_to_fit(level, plan, to_local_file)
        stats.passes += 1
        yield from ctx.iter_pass(level)
    finally:
        if tmpdir is not None:
            shutil.rmtree(tmpdir, ignore_errors=True)

