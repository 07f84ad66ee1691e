"""Pure maintenance transitions: applying merges, GC bookkeeping, finalization.

Same contract as ``persist_lib.shard.transitions``: ``(state, now_ms, args) -> (new state |
None, result)``, no I/O, and each one recognises its own already-applied effect, since
the ``Machine`` re-runs a transition against fresh state after an indeterminate CAS.

Epoch-based reclamation (docs/design.md section 9): a blob that the transition from version
``X`` to ``X + 1`` stops referencing is recorded in ``garbage`` as
``GarbageEntry(X, size)``, ``X`` being the current seqno when the transition runs: the
last version that references it. GC may delete it once every reader's seqno hold is
past ``X`` (``seqno_since() > X``: nobody reads version ``X`` or older any more) and
removes the entry afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum

from persist_lib.errors import InvalidUsage
from persist_lib.frontier import Antichain
from persist_lib.shard.batch_meta import HollowBatch, PartMeta
from persist_lib.shard.state import GarbageEntry, QuarantineEntry, ShardState, quarantine_key
from persist_lib.shard.transitions import (
    DEFAULT_INLINE_MAX_TOTAL,
    Result,
    inline_bytes,
    unregistered_part_writers,
)


class MergeOutcome(Enum):
    APPLIED = "applied"  # the inputs were replaced by the output
    ALREADY_APPLIED = "already_applied"  # a retry after an indeterminate CAS that landed
    NOT_APPLIED_NO_MATCH = "not_applied_no_match"  # the inputs changed meanwhile
    NOT_APPLIED_INVALID_SINCE = "not_applied_invalid_since"
    NOT_APPLIED_INLINE_BUDGET = "not_applied_inline_budget"
    NOT_APPLIED_TOMBSTONE = "not_applied_tombstone"
    # The compactor's part-writer registration lapsed: its output may have been swept.
    NOT_APPLIED_WRITER_EXPIRED = "not_applied_writer_expired"


@dataclass(frozen=True)
class MergeResult:
    outcome: MergeOutcome
    batch_id: int | None = None  # the id of the output batch when applied
    garbage_keys: tuple[str, ...] = ()  # input blobs that became garbage

    @property
    def applied(self) -> bool:
        return self.outcome in (MergeOutcome.APPLIED, MergeOutcome.ALREADY_APPLIED)


def _same_parts(a: tuple[PartMeta, ...], b: tuple[PartMeta, ...]) -> bool:
    return len(a) == len(b) and all(
        x.key == y.key and x.sha256 == y.sha256 and x.size == y.size for x, y in zip(a, b, strict=True)
    )


def _output_landed(
    state: ShardState, output: HollowBatch, input_ids: tuple[int, ...], inputs: tuple[HollowBatch, ...]
) -> bool:
    """Whether ``output`` was already applied (it may even have been merged away since).

    Blob parts have unique keys: finding one in the trace or in garbage proves it.
    Parts kept from an input (a metadata-only merge) don't count. An output without
    blob parts is recognised by an equal batch standing where the inputs were.
    """
    keys = set(output.blob_keys()).difference(k for b in inputs for k in b.blob_keys())
    if keys:
        for b in state.batches.values():
            if keys.intersection(b.blob_keys()):
                return True
        return bool(keys.intersection(state.garbage))
    if any(i in state.batches for i in input_ids):
        return False
    for b in state.batches.values():
        if b.lower == output.lower and _same_parts(b.parts, output.parts) and output.upper <= b.upper:
            return True
    return False


def apply_merge_res(
    state: ShardState,
    now_ms: int,
    *,
    input_ids: tuple[int, ...],
    inputs: tuple[HollowBatch, ...],
    output: HollowBatch,
    inline_max_total: int = DEFAULT_INLINE_MAX_TOTAL,
    part_writer: str | None = None,
    release_writer: bool = True,
) -> Result:
    """Replaces exactly ``inputs`` (by id and description) with ``output``.

    The inputs must still be contiguous in the trace with the descriptions the
    compactor read, except that the newest input may since have been *widened* by a
    progress-only append (same parts, larger upper): then the output is widened too.
    Input blobs the output doesn't reuse go to ``garbage`` at the new seqno.

    Output parts not taken from the inputs must have been written by a registered
    writer (``part_writer``, the compactor's registration); with ``release_writer``
    that registration is released in the same state change, whether the merge applies
    or not (except ``NOT_APPLIED_INLINE_BUDGET``: the compactor retries with blobs).
    Quarantine entries of the replaced batches are dropped.
    """
    if len(input_ids) != len(inputs) or not inputs:
        raise InvalidUsage(f"shard {state.shard_id}: apply_merge_res needs matching ids and inputs")
    if _output_landed(state, output, input_ids, inputs):
        return None, MergeResult(MergeOutcome.ALREADY_APPLIED)

    def refuse(outcome: MergeOutcome) -> Result:
        # Not applied: release the compactor's registration (its output is now
        # unlinkable and left to the caller's delete or the sweeper).
        if release_writer and part_writer is not None and part_writer in state.writers:
            writers = {k: v for k, v in state.writers.items() if k != part_writer}
            return replace(state, writers=writers), MergeResult(outcome)
        return None, MergeResult(outcome)

    if state.tombstone:
        return None, MergeResult(MergeOutcome.NOT_APPLIED_TOMBSTONE)
    reused = {k for b in inputs for k in b.blob_keys()}
    new_keys = [k for k in output.blob_keys() if k not in reused]
    if new_keys and unregistered_part_writers(state, new_keys):
        return None, MergeResult(MergeOutcome.NOT_APPLIED_WRITER_EXPIRED)
    trace = state.trace_batches()
    pos = {bid: n for n, (bid, _) in enumerate(trace)}
    if input_ids[0] not in pos:
        return refuse(MergeOutcome.NOT_APPLIED_NO_MATCH)
    first = pos[input_ids[0]]
    window = trace[first : first + len(input_ids)]
    if tuple(bid for bid, _ in window) != input_ids:
        return refuse(MergeOutcome.NOT_APPLIED_NO_MATCH)
    new_upper = output.upper
    for n, ((_, cur), want) in enumerate(zip(window, inputs, strict=True)):
        last = n == len(inputs) - 1
        if cur.lower != want.lower or cur.since != want.since or not _same_parts(cur.parts, want.parts):
            return refuse(MergeOutcome.NOT_APPLIED_NO_MATCH)
        if cur.upper != want.upper:
            if not (last and want.upper < cur.upper):
                return refuse(MergeOutcome.NOT_APPLIED_NO_MATCH)
            new_upper = cur.upper  # widened by a progress-only append meanwhile
    if output.lower != inputs[0].lower or output.upper != inputs[-1].upper:
        raise InvalidUsage(
            f"shard {state.shard_id}: merge output [{output.lower}, {output.upper}) doesn't cover "
            f"its inputs [{inputs[0].lower}, {inputs[-1].upper})"
        )
    if state.since < output.since:
        # Only possible if the since went backwards, which it never does: refuse.
        return refuse(MergeOutcome.NOT_APPLIED_INVALID_SINCE)
    out_inline = sum(p.size for p in output.parts if p.inline is not None)
    in_inline = sum(p.size for b in inputs for p in b.parts if p.inline is not None)
    if out_inline > in_inline and inline_bytes(state) - in_inline + out_inline > inline_max_total:
        return None, MergeResult(MergeOutcome.NOT_APPLIED_INLINE_BUDGET)

    seqno = state.seqno  # the last version that references the replaced inputs
    batches = dict(state.batches)
    for bid in input_ids:
        del batches[bid]
    out_id = state.next_id
    batches[out_id] = replace(output, upper=new_upper)
    kept = set(output.blob_keys())
    garbage = dict(state.garbage)
    dropped: list[str] = []
    for b in inputs:
        for p in b.parts:
            if p.key is not None and p.key not in kept:
                garbage[p.key] = GarbageEntry(seqno, p.size)
                dropped.append(p.key)
    changes: dict[str, object] = {}
    if release_writer and part_writer is not None and part_writer in state.writers:
        changes["writers"] = {k: v for k, v in state.writers.items() if k != part_writer}
    if state.quarantined_merges:
        gone = set(input_ids)
        q = {k: e for k, e in state.quarantined_merges.items() if gone.isdisjoint(e.batch_ids)}
        if len(q) != len(state.quarantined_merges):
            changes["quarantined_merges"] = q
    new = replace(state, batches=batches, next_id=out_id + 1, garbage=garbage, **changes)  # type: ignore[arg-type]
    return new, MergeResult(MergeOutcome.APPLIED, out_id, tuple(dropped))


def release_part_writer(state: ShardState, now_ms: int, *, writer_id: str) -> Result:
    """Unregisters a part writer (idempotent)."""
    if writer_id not in state.writers:
        return None, False
    return replace(state, writers={k: v for k, v in state.writers.items() if k != writer_id}), True


# ----- quarantine of merges that fail deterministically -----------------------------------


def quarantine_merge(
    state: ShardState, now_ms: int, *, batch_ids: tuple[int, ...], error: str, failures: int
) -> Result:
    """Records that merging ``batch_ids`` keeps failing deterministically, so that no
    compactor retries it automatically (``persist inspect`` shows it). A no-op if
    those batches are gone (then the merge is moot)."""
    if state.tombstone or any(b not in state.batches for b in batch_ids):
        return None, False
    key = quarantine_key(batch_ids)
    old = state.quarantined_merges.get(key)
    entry = QuarantineEntry(
        batch_ids=tuple(batch_ids),
        error=error[:2000],
        failures=(old.failures if old else 0) + failures,
        first_failure_ms=old.first_failure_ms if old else now_ms,
        last_failure_ms=now_ms,
    )
    q = dict(state.quarantined_merges)
    q[key] = entry
    return replace(state, quarantined_merges=q), True


def clear_quarantine(state: ShardState, now_ms: int, *, keys: tuple[str, ...] | None = None) -> Result:
    """Forgets quarantine entries (all of them when ``keys`` is None): an operator's retry."""
    if not state.quarantined_merges:
        return None, 0
    drop = set(state.quarantined_merges) if keys is None else set(keys)
    q = {k: e for k, e in state.quarantined_merges.items() if k not in drop}
    n = len(state.quarantined_merges) - len(q)
    if n == 0:
        return None, 0
    return replace(state, quarantined_merges=q), n


# ----- garbage collection ---------------------------------------------------------------


def gc_remove_garbage(
    state: ShardState, now_ms: int, *, keys: tuple[str, ...], gc_seqno: int
) -> Result:
    """Forgets garbage entries whose blobs GC deleted; records the GC progress seqno."""
    present = {k for k in keys if k in state.garbage}
    if not present and state.last_gc_seqno >= gc_seqno:
        return None, 0
    garbage = {k: v for k, v in state.garbage.items() if k not in present}
    return replace(state, garbage=garbage, last_gc_seqno=max(state.last_gc_seqno, gc_seqno)), len(
        present
    )


def gc_remove_rollups(state: ShardState, now_ms: int, *, seqnos: tuple[int, ...]) -> Result:
    """Forgets rollups GC deleted. Never the latest one (opening the shard needs it)."""
    latest = state.latest_rollup()
    drop = {s for s in seqnos if s in state.rollups and (latest is None or s != latest[0])}
    if not drop:
        return None, 0
    rollups = {s: r for s, r in state.rollups.items() if s not in drop}
    return replace(state, rollups=rollups), len(drop)


# ----- finalization -----------------------------------------------------------------------


def become_tombstone(state: ShardState, now_ms: int) -> Result:
    """Turns a shard whose since and upper are both empty into a tombstone.

    Every batch's blobs become garbage; every handle is dropped (their next call raises
    ``ShardTombstoned`` / ``LeaseExpired``). Idempotent.
    """
    if state.tombstone:
        return None, False
    if not state.exists:
        raise InvalidUsage(f"shard {state.shard_id} does not exist; there is nothing to finalize")
    check_finalizable(state)
    seqno = state.seqno
    garbage = dict(state.garbage)
    for b in state.batches.values():
        for p in b.parts:
            if p.key is not None:
                garbage[p.key] = GarbageEntry(seqno, p.size)
    new = replace(
        state,
        tombstone=True,
        batches={},
        leased_readers={},
        critical_readers={},
        writers={},
        garbage=garbage,
        since=Antichain.empty(),
        upper=Antichain.empty(),
    )
    return new, True


def check_finalizable(state: ShardState) -> None:
    """Raises ``InvalidUsage`` (saying what to do first) unless since and upper are empty."""
    problems = []
    if not state.upper.is_empty():
        problems.append(
            f"its upper is {state.upper}: close it for writes first with a compare_and_append "
            "whose new upper is the empty frontier (Antichain.empty())"
        )
    if not state.since.is_empty():
        problems.append(
            f"its since is {state.since}: every reader must release it first, by "
            "downgrade_since(Antichain.empty()) on leased readers or "
            "compare_and_downgrade_since(..., Antichain.empty()) on critical ones"
        )
    if problems:
        raise InvalidUsage(
            f"shard {state.shard_id} can't be finalized yet: " + "; ".join(problems)
        )


def tombstone_shrink(state: ShardState, now_ms: int, *, keep_rollup: int) -> Result:
    """Leaves a tombstone with no garbage and only the rollup at ``keep_rollup``."""
    if not state.tombstone:
        raise InvalidUsage(f"shard {state.shard_id} is not a tombstone")
    rollups = {s: r for s, r in state.rollups.items() if s == keep_rollup}
    if not state.garbage and rollups == dict(state.rollups):
        return None, False
    if keep_rollup not in state.rollups:
        raise InvalidUsage(f"shard {state.shard_id}: no rollup at {keep_rollup} to keep")
    return replace(state, garbage={}, rollups=rollups), True
