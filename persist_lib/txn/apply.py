"""Applying a committed transaction's batch to its data shard: idempotent, by anyone.

``apply_transition`` is the pure state change: it links the batch iff the shard's upper
is the batch's ``lower`` and unregisters the batch's part writer in the same state
change; a shard already at or past the batch's ``upper`` has it (only transactions write
a registered shard, applied in log order), so applying again is a no-op. A shard whose
upper is below the batch's ``lower`` has an earlier entry unapplied: that is a caller's
bug (entries of a shard are applied in the order of their ``lower``), refused.

``advance_transition`` applies a follow-up (``Advance``): it moves the shard's upper to
the follow-up's upper with an empty append (the last batch widened, no blob), or does
nothing when the upper is there already or the shard is gone (finalized).
"""

from __future__ import annotations

from dataclasses import replace

from persist_lib.errors import LeaseExpired, PersistError
from persist_lib.shard import transitions as tr
from persist_lib.shard.batch_meta import HollowBatch
from persist_lib.shard.machine import Machine
from persist_lib.shard.state import ShardState
from persist_lib.txn.log import Advance, Pending

# Txn batches carry no inline parts (built with inlining off): nothing to bound here.
_NO_INLINE_BOUND = 1 << 62


class TxnApplyOutOfOrder(PersistError):
    """A transaction batch was applied before an earlier one of the same shard."""


def apply_transition(state: ShardState, now_ms: int, *, entry: Pending) -> tr.Result:
    """Links ``entry.batch`` into ``state`` (``(None, False)``: it is there already)."""
    batch = entry.batch
    if state.upper >= batch.upper and batch.upper != batch.lower:
        return None, False
    if state.upper != batch.lower:
        raise TxnApplyOutOfOrder(
            f"shard {state.shard_id}: transaction {entry.txn} covers [{batch.lower}, "
            f"{batch.upper}) but the shard's upper is {state.upper}: an earlier transaction "
            "of this shard is not applied yet (apply a shard's entries in order)"
        )
    writer = entry.part_writer
    new, res = tr.compare_and_append(
        state, now_ms, writer_id=writer, batch=batch, token=entry.txn,
        inline_max_total=_NO_INLINE_BOUND,
    )
    if new is None:
        if res.outcome is tr.CaaOutcome.ALREADY_COMMITTED:
            return None, False
        raise TxnApplyOutOfOrder(
            f"shard {state.shard_id}: transaction {entry.txn} could not be applied ({res.outcome.value})"
        )
    writers = {k: v for k, v in new.writers.items() if k != writer}
    return new.evolve(writers=writers), True


def apply_entry(machine: Machine, entry: Pending) -> bool:
    """Applies one entry with one CAS on its shard; True iff this call linked it.

    The transition first runs on this process's cached state, which may be older than
    what other processes did: older than the part writer's registration (the writer looks
    unknown: ``LeaseExpired``), or older than the apply of the shard's previous entry,
    already tidied from the log (the shard looks behind: ``TxnApplyOutOfOrder``). So on
    those errors the shard is read again and the apply retried once; a current state
    that still says so is a real error."""

    def fn(s: ShardState, now: int) -> tr.Result:
        return apply_transition(s, now, entry=entry)

    try:
        res, _ = machine.apply("txn_apply", fn)
    except (LeaseExpired, TxnApplyOutOfOrder):
        machine.fetch_latest()
        res, _ = machine.apply("txn_apply", fn)
    return bool(res)


def advance_transition(state: ShardState, now_ms: int, *, entry: Advance) -> tr.Result:
    """Moves ``state``'s upper to ``entry.upper`` (``(None, False)``: it is there already)."""
    if not state.exists or state.tombstone or state.upper >= entry.upper:
        return None, False
    batches = dict(state.batches)
    trace = state.trace_batches()
    next_id = state.next_id
    if trace:
        last_id, last = trace[-1]
        batches[last_id] = replace(last, upper=entry.upper)
    else:
        batches[next_id] = HollowBatch(state.upper, entry.upper, state.since)
        next_id += 1
    return state.evolve(batches=batches, next_id=next_id, upper=entry.upper), True


def apply_advance(machine: Machine, entry: Advance) -> bool:
    """Applies one follow-up with one CAS on its shard; True iff this call moved it."""
    res, _ = machine.apply("txn_advance", lambda s, now: advance_transition(s, now, entry=entry))
    return bool(res)
