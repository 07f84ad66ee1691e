"""The compactor: merges a compaction request's batches into one and applies it.

``merge_batches`` merges the inputs (the runs of ``runs.batch_runs``) into one batch
written to blob: in memory with one sort when everything fits the budget
(``in_memory_merge``), else with the streaming k-way merge (``kway_merge``), whose
intermediate runs, when the runs don't fit the budget together, go to blob and are
deleted afterwards. The output goes through a ``BatchBuilder`` with a small part
target.

**Applying.** The output is written under a part writer registered for the merge
(``persist_lib.shard.part_writers``), so the leaked-blob sweeper leaves it alone however
long the merge runs. One ``apply_merge_res`` transition replaces exactly the inputs
and releases that registration. If it doesn't apply (the inputs changed), the
output's blobs are deleted; if applying fails in a way that leaves its outcome
unknown, the output is kept (a leak, for the sweeper, beats a dangling reference).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import pyarrow as pa

from persist_lib.config import PersistConfig
from persist_lib.errors import BlobNotFound, ExternalError, InvalidUsage
from persist_lib.frontier import Antichain
from persist_lib.location.base import Blob
from persist_lib.shard import maintenance_transitions as mt
from persist_lib.shard.batch_builder import BatchBuilder
from persist_lib.shard.batch_meta import HollowBatch, PartMeta
from persist_lib.shard.codec import Schemas
from persist_lib.shard.compaction_writers import CompactionWriters
from persist_lib.shard.consolidate import gather_updates
from persist_lib.shard.context import ShardContext
from persist_lib.shard.in_memory_merge import (
    IN_MEMORY_PART_BYTES,
    may_merge_in_memory,
    plan_in_memory,
    row_slices,
)
from persist_lib.shard.kway_merge import MergeCtx
from persist_lib.shard.machine import Machine
from persist_lib.shard.memory_plan import MemoryPlan, MergeStats
from persist_lib.shard.part_fetch import DECODED_CACHE
from persist_lib.shard.part_writers import PartWriter
from persist_lib.shard.parts import blob_form, part_blob_key
from persist_lib.shard.range_merge import may_merge_by_ranges, plan_by_ranges
from persist_lib.shard.runs import (
    RunOrderViolation,
    RunSource,
    batch_runs,
    is_layered_writer,
    new_compactor_writer_id,
)
from persist_lib.shard.spine import CompactionRequest
from persist_lib.shard.thread_pools import SharedPool
from persist_lib.shard.time_layers import (
    LayeredOutput,
    layer_bounds,
    planning_parts,
    split_rows_by_layer,
)

log = logging.getLogger(__name__)


# One process-wide pool for output part uploads (a pool per merge costs more than a
# small merge itself). Builders bound their own in-flight uploads.
_UPLOADS = SharedPool(4, "persist-compactor-upload")


def _upload_pool() -> ThreadPoolExecutor:
    return _UPLOADS.get()


# Finishing a layered output's builders at once (``_finish_layers``): not the upload
# pool, whose tasks the finishing builders wait for.
_FINISHERS = SharedPool(4, "persist-compactor-finish")


def _finish_layers(layered: LayeredOutput, upper: Antichain, since: Antichain) -> None:
    """Finishes every layer of ``layered`` at once. A builder's last part is encoded
    and written on the thread that finishes it (a batch of one part, like every layer
    below ``IN_MEMORY_PART_BYTES``, has no other): finished one after the other, the
    small layers' parts were encoded and fsynced in turn on the merge's thread at the
    very end of the merge. Waits for all of them; then raises the first error (the
    caller aborts the output)."""
    pool = _FINISHERS.get()
    futures = [pool.submit(layered.finish_layer, i, upper, since) for i in range(layered.num_layers)]
    try:
        errors = [e for e in (f.exception() for f in futures) if e is not None]
    finally:
        wait(futures)  # (interrupted: the caller's abort must not race a finishing builder)
    if errors:
        raise errors[0]


def forward_time(since: Antichain, upper: Antichain) -> int | None:
    """The time history is forwarded to: ``since``, but never past ``upper - 1``.

    Every time of a batch ``[lower, upper)`` below ``min(since, upper - 1)`` collapses to
    that one time, which consolidates exactly as much as forwarding to ``since`` would
    (readers read at ``as_of >= since``; listeners never revisit a batch below their
    frontier) while keeping every update time inside the batch's description.
    """
    candidates = [t for t in (since.time, None if upper.time is None else upper.time - 1) if t is not None]
    return min(candidates) if candidates else None


@dataclass
class MergeOutput:
    batch: HollowBatch
    stats: MergeStats
    intermediate_keys: list[str] = field(default_factory=list)


def merge_batches(
    blob: Blob,
    schemas: Schemas,
    *,
    shard: str,
    inputs: tuple[HollowBatch, ...],
    lower: Antichain,
    upper: Antichain,
    since: Antichain,
    memory_budget: int,
    target_part_bytes: int,
    inline_threshold: int,
    writer: str | None = None,
    in_memory: bool | None = None,
    time_layers: tuple[int, ...] = (),
) -> MergeOutput:
    """Merges ``inputs`` into one batch ``[lower, upper)`` forwarded to ``since``.

    Output parts are written to blob (tiny ones inline) under a compactor writer id;
    intermediate runs are deleted before returning. On error, everything written is
    deleted (best effort) and the error re-raised. ``in_memory``: None chooses by the
    budget (``may_merge_in_memory``); False forces the streaming k-way merge (tests).
    ``time_layers``: the output is one sorted run per time layer starting at these
    times (``time_layers.layer_bounds`` plans them; ``writer`` must then be a
    layered writer id, ``runs.new_compactor_writer_id(layered=True)``).
    """
    writer = writer or new_compactor_writer_id(layered=bool(time_layers))
    if time_layers and not is_layered_writer(writer):
        raise InvalidUsage(f"shard {shard}: a merge in time layers must write under a layered writer id, not {writer}")
    since_t = forward_time(since, upper)
    runs_parts: list[list[PartMeta]] = [run for b in inputs for run in batch_runs(b)]
    try:
        return _merge(
            blob, schemas, shard, runs_parts, lower, upper, since, since_t, memory_budget,
            target_part_bytes, inline_threshold, writer, check_order=True, in_memory=in_memory,
            time_layers=time_layers,
        )
    except RunOrderViolation:
        log.warning("shard %s: compactor runs were not sorted; merging with a run per part", shard)
        per_part = [[p] for b in inputs for p in b.parts]
        out = _merge(
            blob, schemas, shard, per_part, lower, upper, since, since_t, memory_budget,
            target_part_bytes, inline_threshold, writer, check_order=False, in_memory=in_memory,
            time_layers=time_layers,
        )
        out.stats.restarted_per_part = True
        return out


def _merge(
    blob: Blob,
    schemas: Schemas,
    shard: str,
    runs_parts: list[list[PartMeta]],
    lower: Antichain,
    upper: Antichain,
    since: Antichain,
    since_t: int | None,
    budget: int,
    target_part_bytes: int,
    inline_threshold: int,
    writer: str,
    *,
    check_order: bool,
    in_memory: bool | None = None,
    time_layers: tuple[int, ...] = (),
) -> MergeOutput:
    max_encoded = max((p.size for run in runs_parts for p in run), default=0)
    sources = [RunSource.of_parts(run, schemas) for run in runs_parts]
    plan = MemoryPlan.for_runs(budget, [r.max_decoded for r in sources], max_encoded, target_part_bytes)
    stats = MergeStats(runs=len(runs_parts), output_reserve_bytes=8 * plan.output_part_bytes)
    intermediate: list[str] = []
    ctx = MergeCtx(blob, schemas, shard, since_t, budget, max_encoded, target_part_bytes, stats, check_order)

    def builder(inline: int, part_bytes: int = plan.output_part_bytes) -> BatchBuilder:
        return BatchBuilder(
            blob, schemas, shard=shard, writer=writer, lower=lower,
            target_part_bytes=part_bytes, max_inflight_uploads=1,
            inline_threshold=inline, executor=_upload_pool(), consolidated=True,
        )

    # Parts of at most IN_MEMORY_PART_BYTES: two encode while the next is gathered,
    # the last one alone is short, and readers decode such parts in parallel.
    part_bytes = min(plan.output_part_bytes, IN_MEMORY_PART_BYTES)

    def in_memory_builder() -> BatchBuilder:
        return BatchBuilder(
            blob, schemas, shard=shard, writer=writer, lower=lower,
            target_part_bytes=part_bytes, max_inflight_uploads=2,
            inline_threshold=inline_threshold, executor=_upload_pool(), consolidated=True,
        )

    # (no builder exists until rows are added: unused if the merge streams)
    layered = LayeredOutput(time_layers, in_memory_builder) if time_layers else None
    ranged = None
    if in_memory is not False and may_merge_by_ranges(runs_parts, sources, schemas, budget, plan):
        # The decoded parts fit: key ranges consolidated on two threads (range_merge),
        # grouped by time layer as they are cut.
        ranged = plan_by_ranges(
            blob, schemas, shard, runs_parts, since_t, stats, plan, budget,
            layered.cut_layer_of if layered is not None else None,
            layered.cut_layers if layered is not None else 1,
        )
    planned = None
    if ranged is None and in_memory is not False and may_merge_in_memory(runs_parts, sources, schemas, budget, plan):
        # Everything may fit: decode every part (in parallel) while the decoded bytes
        # stay within the budget, sort all rows once, and gather the output slice by
        # slice while earlier slices encode. If the parts decode larger than the budget
        # allows, the decoded data is dropped and the streaming merge runs instead.
        planned = plan_in_memory(blob, schemas, shard, runs_parts, since_t, stats, plan, budget)
    if planned is not None or ranged is not None:
        stats.passes = 1
        merged: pa.Table | None = None
        if layered is not None:
            # One run per time layer: the key ranges' output, already grouped by layer,
            # added to every layer's builder at once, or the one sort's written layer
            # after layer.
            try:
                if ranged is not None:
                    for layer, merged in ranged.tables():
                        layered.add_merged(layer, merged)
                    del ranged
                    _finish_layers(layered, upper, since)
                else:
                    assert planned is not None
                    source, rows, diffs = planned
                    del planned
                    stats.output_rows = len(rows)
                    for layer, (l_rows, l_diffs) in enumerate(split_rows_by_layer(layered, source.table, rows, diffs)):
                        for lo, hi in row_slices(len(l_rows), source.table, part_bytes):
                            merged = gather_updates(source, l_rows[lo:hi], l_diffs[lo:hi])
                            layered.add(layer, merged)
                        layered.finish_layer(layer, upper, since)
                    del source
                batch = layered.finish(lower, upper, since)
            except BaseException:
                layered.abort()
                raise
            stats.bytes_written = batch.size
            return MergeOutput(batch, stats, [])
        out = in_memory_builder()
        try:
            if ranged is not None:
                for _, merged in ranged.tables():  # (one layer)
                    out.add(merged)
                del ranged
            else:
                assert planned is not None
                source, rows, diffs = planned
                del planned
                stats.output_rows = len(rows)
                for lo, hi in row_slices(len(rows), source.table, part_bytes):
                    merged = gather_updates(source, rows[lo:hi], diffs[lo:hi])
                    out.add(merged)
                del source
            batch = out.finish(upper, since)
        except BaseException:
            out.abort()
            raise
        stats.bytes_written = batch.size
        if merged is not None and len(batch.parts) == 1 and batch.parts[0].count == merged.num_rows:
            DECODED_CACHE.put(batch.parts[0].sha256, schemas.fingerprint(), merged)
        return MergeOutput(batch, stats, [])

    def to_blob(group: list[RunSource]) -> RunSource | None:
        # An intermediate run: written to blob, deleted once the merge is done.
        b = builder(0)
        try:
            for t in ctx.iter_pass(group):
                b.add(t)
            hb = b.finish(upper)
        except BaseException:
            b.abort()
            raise
        intermediate.extend(hb.blob_keys())
        stats.intermediate_bytes += hb.size
        stats.bytes_written += hb.size
        return RunSource.of_parts(list(hb.parts), schemas) if hb.parts else None

    try:
        level = ctx.fold_smallest(sources)
        level = ctx.reduce_to_fit(level, plan, to_blob)
        stats.passes += 1
        if time_layers:
            # Every layer's builder open at once, the merge's output routed by time: each
            # buffers a part of the plan's output part size shared among the layers.
            layer_part = max(1, plan.output_part_bytes // (len(time_layers) + 1))
            layered = LayeredOutput(time_layers, lambda: builder(inline_threshold, layer_part))
            try:
                for t in ctx.iter_pass(level):
                    layered.add_routed(t)
                batch = layered.finish(lower, upper, since)
            except BaseException:
                layered.abort()
                raise
            stats.bytes_written += batch.size
            return MergeOutput(batch, stats, intermediate)
        out = builder(inline_threshold)
        try:
            for t in ctx.iter_pass(level):
                out.add(t)
            batch = out.finish(upper, since)
        except BaseException:
            out.abort()
            raise
        stats.bytes_written += batch.size
        return MergeOutput(batch, stats, intermediate)
    finally:
        for k in intermediate:
            try:
                blob.delete(k)
            except ExternalError as e:  # the leaked-blob sweeper finds it later
                log.warning("shard %s: could not delete intermediate run part %s: %s", shard, k, e)





@dataclass
class CompactionResult:
    request: CompactionRequest
    outcome: mt.MergeOutcome
    output: HollowBatch | None
    stats: MergeStats
    seconds: float
    deleted_output: bool = False

    @property
    def applied(self) -> bool:
        return self.outcome in (mt.MergeOutcome.APPLIED, mt.MergeOutcome.ALREADY_APPLIED)

    def to_json(self) -> dict[str, Any]:
        return {
            "request": self.request.describe(),
            "outcome": self.outcome.value,
            "output_updates": self.output.len if self.output is not None else 0,
            "output_bytes": self.output.size if self.output is not None else 0,
            "output_parts": len(self.output.parts) if self.output is not None else 0,
            "seconds": round(self.seconds, 4),
            "stats": self.stats.to_json(),
        }


def _metadata_only_output(req: CompactionRequest) -> HollowBatch:
    """For a request with at most one non-empty input: widen it, reuse its parts."""
    non_empty = [b for b in req.inputs if b.parts]
    assert len(non_empty) <= 1
    since = non_empty[0].since if non_empty else req.since
    parts = non_empty[0].parts if non_empty else ()
    splits = non_empty[0].run_splits if non_empty else None
    kv_disjoint = non_empty[0].kv_disjoint if non_empty else False
    return HollowBatch(
        lower=req.lower, upper=req.upper, since=since, parts=parts, run_splits=splits, kv_disjoint=kv_disjoint
    )


def request_time_layers(req: CompactionRequest, config: PersistConfig) -> tuple[int, ...]:
    """Where the output of ``req`` starts a new time layer (``time_layers``); empty: one run."""
    return layer_bounds(
        planning_parts(req.inputs, kv_whole=config.compaction_layer_kv_whole), forward_time(req.since, req.upper),
        max_layers=config.compaction_time_layers, min_rows=config.compaction_layer_min_rows,
        max_first_share=config.compaction_layer_max_first_share, kv_whole=config.compaction_layer_kv_whole,
    )


def compact_request(
    machine: Machine,
    schemas: Schemas,
    config: PersistConfig,
    req: CompactionRequest,
    *,
    context: ShardContext | None = None,
    writers: CompactionWriters | None = None,
) -> CompactionResult:
    """Runs one merge and applies it with one transition (or deletes its output).

    A merge that rewrites data first registers a part writer (``part_writers``): its
    output is linked only while that registration holds, so the leaked-blob sweeper can
    never delete output that is about to be linked, however long the merge takes.
    ``context`` (optional; a ``PersistClient``) heartbeats the registration during long
    merges. With ``writers`` (a background compactor's ``CompactionWriters``) the merge
    uploads under the shard's shared registration instead, which the apply keeps; any
    outcome but "applied" retires it.
    """
    t0 = time.monotonic()
    stats = MergeStats()
    pw: PartWriter | None = None
    release: Callable[[], None] = _no_op
    if not req.rewrites_data or sum(1 for b in req.inputs if b.parts) == 0:
        output = _metadata_only_output(req)
        produced_keys: list[str] = []
    else:
        layers = request_time_layers(req, config)
        if writers is not None:
            pw = writers.acquire(machine, layered=bool(layers))
        else:
            pw = PartWriter.register(
                machine, purpose="compaction", context=context,
                writer_id=new_compactor_writer_id(layered=bool(layers)),
            )
        release = pw.release if writers is None else partial(writers.retire, pw)
        try:
            merged = merge_batches(
                machine.blob, schemas, shard=machine.shard_id, inputs=req.inputs, lower=req.lower,
                upper=req.upper, since=req.since, memory_budget=config.compaction_memory_budget,
                target_part_bytes=config.blob_target_size, inline_threshold=config.inline_threshold,
                writer=pw.writer_id, in_memory=None if config.compaction_in_memory else False,
                time_layers=layers,
            )
        except BlobNotFound:
            # The compactor holds no seqno: an input may have been replaced by another
            # merge and collected meanwhile. Then this merge is moot (and wrote nothing:
            # the merge deletes its partial output); otherwise a live blob is missing.
            release()
            if inputs_still_current(machine.fetch_latest(), req):
                raise
            return CompactionResult(
                req, mt.MergeOutcome.NOT_APPLIED_NO_MATCH, None, stats, time.monotonic() - t0, True
            )
        except Exception:
            release()
            raise
        output, stats = merged.batch, merged.stats
        reused = {k for b in req.inputs for k in b.blob_keys()}
        produced_keys = [k for k in output.blob_keys() if k not in reused]
    writer_id = pw.writer_id if pw is not None else None
    shared = pw is not None and writers is not None
    try:
        res = _apply(machine, config, req, output, writer_id, release_writer=not shared)
        if res.outcome is mt.MergeOutcome.NOT_APPLIED_INLINE_BUDGET:
            output = _uninline(machine, output, writer_id)
            reused = {k for b in req.inputs for k in b.blob_keys()}
            produced_keys = [k for k in output.blob_keys() if k not in reused]
            res = _apply(machine, config, req, output, writer_id, release_writer=not shared)
    except Exception:
        # It is unknown whether the merge landed: the output is kept (a leak, for the
        # sweeper once the registration is gone, beats a dangling reference).
        if pw is not None:
            release()  # harmless if the merge landed (its output is linked)
        raise
    if pw is not None and not shared:
        pw.mark_released()  # every outcome of apply_merge_res released (or lost) it
    elif pw is not None and not res.applied:
        release()  # retire the shared writer: this merge's output is never linked
    # "Not applied" is definite: the transition ran against a state without our output
    # (our own earlier landed CAS would show as ALREADY_APPLIED), and our part writer is
    # unregistered now, so nothing can link the output any more.
    deleted = False
    if not res.applied:
        _delete_keys(machine, produced_keys)
        deleted = True
    return CompactionResult(req, res.outcome, output, stats, time.monotonic() - t0, deleted)


def _no_op() -> None:
    pass


def _delete_keys(machine: Machine, keys: list[str]) -> None:
    for k in keys:
        try:
            machine.blob.delete(k)
        except ExternalError as e:  # the leaked-blob sweeper finds it later
            log.warning("shard %s: could not delete unapplied output %s: %s", machine.shard_id, k, e)


def inputs_still_current(state: Any, req: CompactionRequest) -> bool:
    """Whether every input batch of ``req`` is still in ``state`` with the same parts."""
    for bid, want in zip(req.batch_ids, req.inputs, strict=True):
        cur = state.batches.get(bid)
        if cur is None or [p.key for p in cur.parts] != [p.key for p in want.parts]:
            return False
    return True


def _apply(
    machine: Machine, config: PersistConfig, req: CompactionRequest, output: HollowBatch,
    part_writer: str | None,
    *,
    release_writer: bool = True,
) -> mt.MergeResult:
    res, _ = machine.apply(
        "apply_merge_res",
        lambda s, now: mt.apply_merge_res(
            s, now, input_ids=req.batch_ids, inputs=req.inputs, output=output,
            inline_max_total=config.inline_max_total, part_writer=part_writer,
            release_writer=release_writer,
        ),
    )
    assert isinstance(res, mt.MergeResult)
    return res


def _uninline(machine: Machine, batch: HollowBatch, writer: str | None) -> HollowBatch:
    """Moves inline output parts to blob, under the merge's registered part writer."""
    if writer is None:
        raise InvalidUsage(
            f"shard {machine.shard_id}: a metadata-only merge can't need more inline room"
        )
    parts: list[PartMeta] = []
    for p in batch.parts:
        if p.inline is None:
            parts.append(p)
            continue
        key = part_blob_key(machine.shard_id, writer)
        data, as_blob = blob_form(p, machine.shard_id)  # an IPC inline part: as Parquet
        machine.blob.set(key, data)
        parts.append(replace(as_blob, key=key, inline=None))
    return replace(batch, parts=tuple(parts))
