"""Applying a committed transaction's batch to its data shard: idempotent, by anyone.

``apply_transition`` is the pure state change: it links the batch iff the shard's upper
is the batch's ``lower`` and unregisters the batch's part writer in the same state
change; a shard already at or past the batch's ``upper`` has it (only transactions write
a registered shard, applied in log order), so applying again is a no-op. A shard whose
upper is below the batch's ``lower`` has an earlier entry unapplied: that is a caller's
bug (entries of a shard are applied in the order of their ``lower``), refused.
"""

from __future__ import annotations

from persist_lib.errors import LeaseExpired, PersistError
from persist_lib.shard import transitions as tr
from persist_lib.shard.machine import Machine
from persist_lib.shard.state import ShardState
from persist_lib.txn.log import Pending

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

    The transition first runs against this process's cached state, which may be older
    than the shard: another process may have applied the entry (its part writer gone,
    ``LeaseExpired``) or earlier ones (``TxnApplyOutOfOrder``) since. Such a refusal is
    judged again once against the shard's latest state."""

    def fn(s: ShardState, now: int) -> tr.Result:
        return apply_transition(s, now, entry=entry)

    try:
        res, _ = machine.apply("txn_apply", fn)
    except (TxnApplyOutOfOrder, LeaseExpired):
        machine.fetch_latest()
        res, _ = machine.apply("txn_apply", fn)
    return bool(res)
