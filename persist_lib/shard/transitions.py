"""Pure state transitions: ``(state, now, args) -> (new state | None, result)``.

Nothing here does I/O. A transition returns ``None`` as the new state when there is
nothing to write (a no-op), or raises an ``InvalidUsage`` when the call can never
succeed. The ``Machine`` applies them in a compare-and-set loop; after an
indeterminate CAS it re-runs the transition against fresh state, so every transition
must recognise its own already-applied effect (idempotency): compare-and-append by
the writer's token, registration by the pre-minted id, and so on.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum
from typing import Any

from persist_lib.errors import (
    InvalidUsage,
    LeaseExpired,
    SchemaMismatch,
    ShardTombstoned,
    StaleSchema,
)
from persist_lib.frontier import Antichain
from persist_lib.shard.batch_meta import HollowBatch
from persist_lib.shard.codec import Schemas
from persist_lib.shard.state import (
    CriticalReaderState,
    LeasedReaderState,
    RollupRef,
    ShardState,
    WriterState,
)

Result = tuple[ShardState | None, Any]

# Tiny parts may live inline in state; this bounds the total so state stays small.
DEFAULT_INLINE_MAX_TOTAL = 1 << 20


def _check_not_tombstone(state: ShardState) -> None:
    if state.tombstone:
        raise ShardTombstoned(
            f"shard {state.shard_id} was finalized (its since and upper are empty) and is now "
            "a tombstone: it can't be opened, read or written; use a new shard id"
        )


def _check_schemas(state: ShardState, schemas: Schemas, changes: dict[str, Any]) -> None:
    if state.schemas is None:
        changes["schemas"] = schemas.to_json()
        return
    recorded = Schemas.from_json(state.schemas)
    if recorded != schemas:
        if any(h == schemas for h in recorded.history):
            raise stale_schema(state.shard_id, recorded, schemas)
        raise SchemaMismatch(
            f"shard {state.shard_id} was created with schemas {recorded.describe()} but was "
            f"opened with {schemas.describe()}; open it with the recorded schemas (or write "
            "to a new shard)"
        )


def stale_schema(shard: str, recorded: Schemas, schemas: Schemas) -> StaleSchema:
    """The error for a handle of an earlier version of ``recorded`` (the shard's current)."""
    old = next((i for i, h in enumerate(recorded.history) if h == schemas), None)
    was = f"version {old}" if old is not None else "an earlier version"
    return StaleSchema(
        f"shard {shard}: its schemas evolved to version {recorded.version} "
        f"({recorded.describe()}); this handle uses {was} ({schemas.describe()}). Nothing was "
        "written: reopen with the current schemas (`persist schema show`)",
        current_version=recorded.version,
    )


def check_schemas(state: ShardState, schemas: Schemas) -> None:
    """``SchemaMismatch`` unless ``schemas`` are the ones recorded in ``state`` (a state
    without recorded schemas accepts any): for reads that register nothing."""
    _check_schemas(state, schemas, {})


def _require_writer(state: ShardState, writer_id: str) -> WriterState:
    _check_not_tombstone(state)
    w = state.writers.get(writer_id)
    if w is None:
        raise LeaseExpired(
            f"shard {state.shard_id}: writer {writer_id} is not registered (its lease expired or "
            "it was expired explicitly); open a new write handle"
        )
    return w


def _require_reader(state: ShardState, reader_id: str) -> LeasedReaderState:
    _check_not_tombstone(state)
    r = state.leased_readers.get(reader_id)
    if r is None:
        raise LeaseExpired(
            f"shard {state.shard_id}: reader {reader_id} is not registered (its lease expired or "
            "it was expired explicitly); open a new read handle"
        )
    return r


def recompute_since(state: ShardState) -> Antichain:
    """The shard since: the meet of every reader's since; it never moves backwards."""
    sinces = [r.since for r in state.leased_readers.values()]
    sinces += [r.since for r in state.critical_readers.values()]
    if not sinces:
        return state.since
    return max(state.since, min(sinces))


# ----- registration ----------------------------------------------------------------


def register(
    state: ShardState,
    now_ms: int,
    *,
    schemas: Schemas,
    writer_id: str | None,
    writer_lease_ms: int,
    reader_id: str | None,
    reader_lease_ms: int,
    purpose: str,
) -> Result:
    """Creates the shard if needed, checks schemas, registers a writer and/or a reader."""
    _check_not_tombstone(state)
    changes: dict[str, Any] = {}
    _check_schemas(state, schemas, changes)
    writers = state.writers
    readers = state.leased_readers
    if writer_id is not None and writer_id not in writers:
        writers = dict(writers)
        writers[writer_id] = WriterState(
            last_heartbeat_ms=now_ms,
            lease_duration_ms=writer_lease_ms,
            most_recent_write_upper=state.upper,
            purpose=purpose,
        )
        changes["writers"] = writers
    if reader_id is not None and reader_id not in readers:
        if state.since.is_empty():
            raise InvalidUsage(
                f"shard {state.shard_id}: its since is the empty frontier (every reader released "
                "it), so it can no longer be read; no new reader can be registered"
            )
        readers = dict(readers)
        readers[reader_id] = LeasedReaderState(
            since=state.since,
            seqno=state.seqno + 1,
            last_heartbeat_ms=now_ms,
            lease_duration_ms=reader_lease_ms,
            purpose=purpose,
        )
        changes["leased_readers"] = readers
    if not changes:
        return None, None  # already registered (a retry after an indeterminate CAS)
    return state.evolve(**changes), None


def register_critical_reader(
    state: ShardState,
    now_ms: int,
    *,
    schemas: Schemas,
    reader_id: str,
    initial_opaque: str,
    purpose: str,
) -> Result:
    """Registers a critical since handle (idempotent: an existing one is returned as is)."""
    _check_not_tombstone(state)
    changes: dict[str, Any] = {}
    _check_schemas(state, schemas, changes)
    if reader_id in state.critical_readers:
        if not changes:
            return None, state.critical_readers[reader_id]
    else:
        crit = dict(state.critical_readers)
        crit[reader_id] = CriticalReaderState(since=state.since, opaque=initial_opaque, purpose=purpose)
        changes["critical_readers"] = crit
    new = state.evolve(**changes)
    return new, new.critical_readers[reader_id]


def register_part_writer(
    state: ShardState, now_ms: int, *, writer_id: str, lease_ms: int, purpose: str
) -> Result:
    """Registers a writer that only uploads parts (a compactor, a Spark job's executors).

    Its parts can be linked while it is registered, and the leaked-blob sweeper leaves
    them alone until then (``persist_lib.shard.part_writers``). Idempotent.
    """
    _check_not_tombstone(state)
    if not state.exists:
        raise InvalidUsage(f"shard {state.shard_id} does not exist; open it before writing parts")
    if writer_id in state.writers:
        return None, None
    writers = dict(state.writers)
    writers[writer_id] = WriterState(
        last_heartbeat_ms=now_ms,
        lease_duration_ms=lease_ms,
        most_recent_write_upper=state.upper,
        purpose=purpose,
    )
    return state.evolve(writers=writers), None


def unregistered_part_writers(state: ShardState, keys: Any) -> list[str]:
    """The writers of ``keys`` (part blob keys) that are not registered in ``state``.

    A part may be linked only while its writer is registered: the leaked-blob sweeper
    deletes unreferenced parts of writers that are not (``persist_lib.shard.part_writers``).
    """
    from persist_lib.shard.parts import part_writer_of

    missing: list[str] = []
    for k in keys:
        w = part_writer_of(k)
        if w is None or w not in state.writers:
            missing.append(w if w is not None else k)
    return missing


def _check_parts_linkable(state: ShardState, batch: HollowBatch) -> None:
    missing = unregistered_part_writers(state, batch.blob_keys())
    if missing:
        raise LeaseExpired(
            f"shard {state.shard_id}: the batch's parts were written by {sorted(set(missing))}, "
            "which is not registered (any more): its lease expired, or the parts were written "
            "under a key no registered writer owns. The leaked-blob sweeper may already have "
            "deleted them, so the batch can't be linked; nothing was committed. Write the "
            "batch again with a live handle."
        )


# ----- writes ---------------------------------------------------------------------


class CaaOutcome(Enum):
    APPLIED = "applied"
    ALREADY_COMMITTED = "already_committed"
    UPPER_MISMATCH = "upper_mismatch"
    INLINE_BACKPRESSURE = "inline_backpressure"


@dataclass(frozen=True)
class CaaResult:
    outcome: CaaOutcome
    current_upper: Antichain


def inline_bytes(state: ShardState) -> int:
    """Encoded bytes of the parts inlined in ``state`` (memoized per state value)."""
    return state.inline_bytes


def compare_and_append(
    state: ShardState,
    now_ms: int,
    *,
    writer_id: str,
    batch: HollowBatch,
    token: str,
    inline_max_total: int = DEFAULT_INLINE_MAX_TOTAL,
    release_writer: str | None = None,
    schemas: Schemas | None = None,
) -> Result:
    """Appends ``batch`` iff the shard upper equals ``batch.lower``.

    ``schemas`` (a write handle's): refused with ``StaleSchema`` unless they are the
    shard's current schemas (it evolved since the handle was opened). Without it (a
    committed transaction being applied) the batch is linked whatever its version.

    ``release_writer`` (a part writer whose parts the batch links, e.g. a Spark job's)
    is unregistered by the same state change when the append applies.

    The writer's idempotency token is checked first: if it matches, this exact write
    already committed (we are retrying after an indeterminate error) and nothing is
    done. A batch with no updates advances the upper by widening the trace's last
    batch (no new batch, no blob).
    """
    w = _require_writer(state, writer_id)
    if w.most_recent_write_token == token:
        return None, CaaResult(CaaOutcome.ALREADY_COMMITTED, state.upper)
    if schemas is not None and state.schemas is not None:
        recorded = Schemas.from_json(state.schemas)
        # (schemas newer than this state, a stale cached one: the CAS fails and re-runs)
        if recorded.history and any(h == schemas for h in recorded.history):
            raise stale_schema(state.shard_id, recorded, schemas)
    if state.upper != batch.lower:
        return None, CaaResult(CaaOutcome.UPPER_MISMATCH, state.upper)
    if batch.upper < batch.lower:
        raise InvalidUsage(
            f"shard {state.shard_id}: new upper {batch.upper} is before the expected upper "
            f"{batch.lower}; an upper never moves backwards"
        )
    _check_parts_linkable(state, batch)
    writers = dict(state.writers)
    writers[writer_id] = replace(
        w, last_heartbeat_ms=now_ms, most_recent_write_token=token, most_recent_write_upper=batch.upper
    )
    if release_writer is not None and release_writer != writer_id:
        writers.pop(release_writer, None)
    if batch.upper == batch.lower:
        if batch.parts:
            raise InvalidUsage(
                f"shard {state.shard_id}: a batch with an empty time interval "
                f"[{batch.lower}, {batch.upper}) can't contain updates"
            )
        return state.evolve(writers=writers), CaaResult(CaaOutcome.APPLIED, state.upper)
    new_inline = sum(p.size for p in batch.parts if p.inline is not None)
    if new_inline and inline_bytes(state) + new_inline > inline_max_total:
        return None, CaaResult(CaaOutcome.INLINE_BACKPRESSURE, state.upper)
    batches = dict(state.batches)
    next_id = state.next_id
    if not batch.parts and batches:
        # Progress only: widen the last batch instead of adding an empty one.
        last_id, last = state.trace_batches()[-1]
        batches[last_id] = replace(last, upper=batch.upper)
    else:
        batches[next_id] = replace(batch, since=max(batch.since, state.since))
        next_id += 1
    new = state.evolve(writers=writers, batches=batches, next_id=next_id, upper=batch.upper)
    return new, CaaResult(CaaOutcome.APPLIED, batch.upper)


def heartbeat_writer(state: ShardState, now_ms: int, *, writer_id: str) -> Result:
    w = _require_writer(state, writer_id)
    writers = dict(state.writers)
    writers[writer_id] = replace(w, last_heartbeat_ms=max(w.last_heartbeat_ms, now_ms))
    return state.evolve(writers=writers), None


def expire_writer(state: ShardState, now_ms: int, *, writer_id: str) -> Result:
    if writer_id not in state.writers:
        return None, False
    writers = dict(state.writers)
    del writers[writer_id]
    return state.evolve(writers=writers), True


# ----- reads ----------------------------------------------------------------------


def downgrade_since(
    state: ShardState, now_ms: int, *, reader_id: str, new_since: Antichain, seqno_hold: int
) -> Result:
    """Moves a leased reader's since forward (or keeps it: a heartbeat) and its seqno hold."""
    r = _require_reader(state, reader_id)
    if new_since < r.since:
        raise InvalidUsage(
            f"shard {state.shard_id}: reader {reader_id} can't downgrade its since to {new_since}: "
            f"it is already {r.since} and a since never moves backwards"
        )
    readers = dict(state.leased_readers)
    readers[reader_id] = replace(
        r,
        since=new_since,
        seqno=max(r.seqno, min(seqno_hold, state.seqno + 1)),
        last_heartbeat_ms=max(r.last_heartbeat_ms, now_ms),
    )
    new = state.evolve(leased_readers=readers)
    return new.evolve(since=recompute_since(new)), None


def expire_reader(state: ShardState, now_ms: int, *, reader_id: str) -> Result:
    if reader_id not in state.leased_readers:
        return None, False
    readers = dict(state.leased_readers)
    del readers[reader_id]
    new = state.evolve(leased_readers=readers)
    return new.evolve(since=recompute_since(new)), True


@dataclass(frozen=True)
class CriticalDowngradeResult:
    ok: bool
    current_opaque: str
    since: Antichain


def compare_and_downgrade_since(
    state: ShardState,
    now_ms: int,
    *,
    reader_id: str,
    expected_opaque: str,
    new_opaque: str,
    new_since: Antichain,
) -> Result:
    """Fenced since downgrade of a critical reader: applies iff its opaque is ``expected``."""
    _check_not_tombstone(state)
    r = state.critical_readers.get(reader_id)
    if r is None:
        raise InvalidUsage(
            f"shard {state.shard_id}: critical reader {reader_id} is not registered; open it with "
            "open_critical_since first"
        )
    if r.opaque != expected_opaque:
        if r.opaque == new_opaque and r.since == new_since:
            return None, CriticalDowngradeResult(True, r.opaque, r.since)  # our retry applied
        return None, CriticalDowngradeResult(False, r.opaque, r.since)
    if new_since < r.since:
        raise InvalidUsage(
            f"shard {state.shard_id}: critical reader {reader_id} can't downgrade its since to "
            f"{new_since}: it is already {r.since} and a since never moves backwards"
        )
    crit = dict(state.critical_readers)
    crit[reader_id] = replace(r, since=new_since, opaque=new_opaque)
    new = state.evolve(critical_readers=crit)
    return new.evolve(since=recompute_since(new)), CriticalDowngradeResult(True, new_opaque, new_since)


def expire_critical_reader(state: ShardState, now_ms: int, *, reader_id: str) -> Result:
    if reader_id not in state.critical_readers:
        return None, False
    crit = dict(state.critical_readers)
    del crit[reader_id]
    new = state.evolve(critical_readers=crit)
    return new.evolve(since=recompute_since(new)), True


# ----- maintenance ------------------------------------------------------------------


@dataclass(frozen=True)
class ExpiredLeases:
    readers: tuple[str, ...]
    writers: tuple[str, ...]


def expire_leases(state: ShardState, now_ms: int) -> Result:
    """Expires readers and writers whose last heartbeat is older than their lease.

    Heartbeat times were recorded in consensus by the handles; they are judged here by
    the expirer's clock (``now_ms``).
    """
    if not state.exists or state.tombstone:
        return None, ExpiredLeases((), ())
    dead_r = tuple(
        rid for rid, r in state.leased_readers.items() if r.last_heartbeat_ms + r.lease_duration_ms < now_ms
    )
    dead_w = tuple(
        wid for wid, w in state.writers.items() if w.last_heartbeat_ms + w.lease_duration_ms < now_ms
    )
    if not dead_r and not dead_w:
        return None, ExpiredLeases((), ())
    readers = {k: v for k, v in state.leased_readers.items() if k not in dead_r}
    writers = {k: v for k, v in state.writers.items() if k not in dead_w}
    new = state.evolve(leased_readers=readers, writers=writers)
    return new.evolve(since=recompute_since(new)), ExpiredLeases(dead_r, dead_w)


# A rollup of seqno S is linked only while the state is at most this many seqnos past
# S; the leaked-blob sweeper never deletes an unlinked rollup within twice this many
# seqnos of the head (unless a newer rollup is linked: then it can never be linked).
ROLLUP_LINK_WINDOW = 4096


def add_rollup(state: ShardState, now_ms: int, *, seqno: int, key: str, size: int) -> Result:
    """Links a rollup of this shard at ``seqno``; a no-op if one at or after it is linked,
    or if the state moved more than ``ROLLUP_LINK_WINDOW`` seqnos past it.

    The result tells the caller whether its blob was linked (if not, it deletes it).
    """
    latest = state.latest_rollup()
    if latest is not None and latest[0] >= seqno:
        return None, state.rollups.get(seqno) == RollupRef(key, size)
    if seqno > state.seqno:
        raise InvalidUsage(f"shard {state.shard_id}: rollup seqno {seqno} is beyond state {state.seqno}")
    if state.seqno - seqno > ROLLUP_LINK_WINDOW:
        return None, False  # too old: the sweeper may consider it leaked
    rollups = dict(state.rollups)
    rollups[seqno] = RollupRef(key, size)
    return state.evolve(rollups=rollups), True
