"""Garbage collection by exact reachability (docs/design.md section 9), and the leaked-blob sweeper.

**Epoch-based reclamation.** A blob last referenced by state version ``X`` (the
transition to ``X + 1`` replaced it) sits in state's ``garbage`` as
``GarbageEntry(X, size)``. No version after ``X`` references it, and every leased
reader promises (its seqno hold) never to read a version older than its hold. So once
``seqno_since() > X`` — and a rollup exists after ``X``, so that no future open starts
from a version that references it — nobody can reach it and it is deleted. No
retention period is involved.

One GC run, in an order that makes a crash at any point harmless and the next run
resume where it stopped (every step is idempotent):

1. delete the eligible garbage blobs (deleting a deleted blob is a no-op);
2. forget those entries in state (one transition);
3. truncate consensus below ``R``, the latest rollup at or below ``seqno_since``:
   every version a reader may still need is ``>= seqno_since >= R`` and is rebuilt from
   rollup ``R`` plus the diffs after it;
4. delete the blobs of the rollups older than ``R`` (nobody loads them any more:
   opening a shard starts from the rollup the head points to, the latest);
5. forget those rollups in state (one transition). The latest rollup is never removed.

**Leaked blobs** (crashed writers and compactors, lost races) are referenced by no
state at all, so GC never sees them. ``unreferenced_blobs`` lists ``{shard}/`` in blob,
replays every live state version (the earliest live rollup plus every diff up to the
head) and reports the blobs none of them references — except blobs that may still be
linked by a write in flight, which it never touches, whatever their age or the
clocks say (``persist_lib.shard.part_writers`` has the argument):

* a part ``{shard}/{writer}/p...`` whose writer is registered in the head state it
  read after listing (a live write handle, compactor or Spark job);
* a rollup ``{shard}/rollup/{seqno}-...`` newer than the latest linked rollup and
  within ``2 * ROLLUP_LINK_WINDOW`` seqnos of the head.

A grace period on the blob's age (default 1 h) is kept as a second guard.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from persist_lib.errors import Determinate, ExternalError
from persist_lib.location.base import Blob, Consensus
from persist_lib.shard import maintenance_transitions as mt
from persist_lib.shard import state as st
from persist_lib.shard.machine import SCAN_LIMIT, Machine, rollup_seqno_of, unframe
from persist_lib.shard.parts import part_writer_of
from persist_lib.shard.transitions import ROLLUP_LINK_WINDOW

log = logging.getLogger(__name__)

DEFAULT_LEAK_GRACE_MS = 60 * 60 * 1000
DELETE_PARALLELISM = 8


@dataclass
class GcSummary:
    """What one GC run did (all counts; zero everywhere means nothing was due)."""

    shard: str
    seqno: int = 0
    seqno_since: int = 0
    garbage_pending: int = 0  # entries still waiting for a seqno hold to pass them
    blobs_deleted: int = 0
    bytes_deleted: int = 0
    garbage_entries_removed: int = 0
    rollup_written: bool = False
    truncated_below: int | None = None
    consensus_entries_truncated: int = 0
    rollups_deleted: int = 0
    rollups_removed: int = 0
    rollup_bytes_deleted: int = 0
    errors: list[str] = field(default_factory=list)

    @property
    def changed_anything(self) -> bool:
        return bool(
            self.blobs_deleted
            or self.garbage_entries_removed
            or self.rollup_written
            or self.consensus_entries_truncated
            or self.rollups_deleted
            or self.rollups_removed
        )

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _delete_all(blob: Blob, keys: list[str], summary: GcSummary) -> list[str]:
    """Deletes ``keys`` in parallel; returns those whose deletion succeeded."""
    if not keys:
        return []

    def one(k: str) -> tuple[str, bool]:
        try:
            blob.delete(k)
            return k, True
        except ExternalError as e:
            summary.errors.append(f"delete {k}: {e}")
            return k, False

    with ThreadPoolExecutor(max_workers=min(DELETE_PARALLELISM, len(keys))) as ex:
        return [k for k, ok in ex.map(one, keys) if ok]


def eligible_garbage(state: st.ShardState) -> dict[str, st.GarbageEntry]:
    """Garbage no reader can reach: ``seqno_since() > X`` and a rollup after ``X``."""
    ss = state.seqno_since()
    top = _latest_rollup_seqno(state)
    return {k: e for k, e in state.garbage.items() if e.seqno < ss and e.seqno < top}


def oldest_needed_rollup(state: st.ShardState) -> int | None:
    """``R``: the latest rollup at or below ``seqno_since`` (None if there is none)."""
    ss = state.seqno_since()
    below = [s for s in state.rollups if s <= ss]
    return max(below) if below else None


def gc_due(state: st.ShardState) -> bool:
    """Whether a GC run would do something: deletable garbage, or rollups older than the
    oldest one still needed (then consensus can be truncated too)."""
    if eligible_garbage(state):
        return True
    r = oldest_needed_rollup(state)
    return r is not None and any(s < r for s in state.rollups)


def collect_garbage(machine: Machine, *, write_rollup_if_needed: bool = True) -> GcSummary:
    """One idempotent, resumable GC run over one shard (see the module docstring)."""
    state = machine.fetch_latest()
    summary = GcSummary(machine.shard_id, state.seqno, state.seqno_since())
    if not state.exists:
        return summary
    ss = state.seqno_since()
    # A rollup after the garbage's seqno is a precondition: write one if missing.
    blocked_on_rollup = [
        e for e in state.garbage.values() if e.seqno < ss and e.seqno >= _latest_rollup_seqno(state)
    ]
    if blocked_on_rollup and write_rollup_if_needed:
        summary.rollup_written = machine.write_rollup()
        state = machine.fetch_latest()
    # 1. + 2. Delete eligible garbage, then forget it.
    eligible = eligible_garbage(state)
    summary.garbage_pending = len(state.garbage) - len(eligible)
    deleted = _delete_all(machine.blob, sorted(eligible), summary)
    summary.blobs_deleted = len(deleted)
    summary.bytes_deleted = sum(eligible[k].size for k in deleted)
    if deleted:
        gc_seqno = state.seqno_since()
        removed, state = machine.apply(
            "gc_remove_garbage",
            lambda s, now: mt.gc_remove_garbage(s, now, keys=tuple(deleted), gc_seqno=gc_seqno),
        )
        summary.garbage_entries_removed = int(removed)
    # 3. Truncate consensus below the oldest rollup still needed.
    state = machine.fetch_latest()
    r = oldest_needed_rollup(state)
    if r is not None:
        summary.truncated_below = r
        try:
            summary.consensus_entries_truncated = machine.consensus.truncate(machine.shard_id, r)
        except ExternalError as e:
            summary.errors.append(f"truncate below {r}: {e}")
            return summary
        # 4. + 5. Delete the rollups older than R, then forget them.
        old = {s: ref for s, ref in state.rollups.items() if s < r}
        gone = _delete_all(machine.blob, [ref.key for ref in old.values()], summary)
        gone_set = set(gone)
        summary.rollups_deleted = len(gone)
        summary.rollup_bytes_deleted = sum(ref.size for ref in old.values() if ref.key in gone_set)
        seqnos = tuple(s for s, ref in old.items() if ref.key in gone_set)
        if seqnos:
            n, _ = machine.apply(
                "gc_remove_rollups", lambda s, now: mt.gc_remove_rollups(s, now, seqnos=seqnos)
            )
            summary.rollups_removed = int(n)
    return summary


def _latest_rollup_seqno(state: st.ShardState) -> int:
    latest = state.latest_rollup()
    return latest[0] if latest else -1


# ----- the leaked-blob sweeper ------------------------------------------------------------


def _load_rollup(blob: Blob, shard: str, seqno: int, key: str) -> st.ShardState | None:
    data = blob.get(key)
    if data is None:
        return None
    s = st.ShardState.decode_rollup(unframe(data, shard=shard, what=f"rollup {key}"), shard=shard, key=key)
    return s if s.seqno == seqno else None


LIVE_REPLAY_ATTEMPTS = 5


def live_blob_keys(blob: Blob, consensus: Consensus, shard: str) -> set[str]:
    """Every blob key referenced by any state version still in consensus."""
    return live_blob_keys_and_head(blob, consensus, shard)[0]


def live_blob_keys_and_head(
    blob: Blob, consensus: Consensus, shard: str
) -> tuple[set[str], st.ShardState]:
    """Every blob key referenced by any state version still in consensus, and the head
    state the replay ended at.

    Replays from the earliest rollup whose blob still exists and whose following diffs
    are all in consensus (or from the beginning, if nothing was truncated) to the head.
    A GC may truncate the log (and delete old rollups) while we replay; the replay then
    starts over (a gap in the seqnos is a concurrent truncation, not corruption).
    """
    for _ in range(LIVE_REPLAY_ATTEMPTS):
        got = _live_blob_keys_once(blob, consensus, shard)
        if got is not None:
            return got
    raise Determinate(
        f"shard {shard}: no consistent replay of the live state versions after "
        f"{LIVE_REPLAY_ATTEMPTS} attempts (consensus was truncated, or the rollup to start "
        "from vanished, each time); not sweeping, retry later"
    )


def _live_blob_keys_once(
    blob: Blob, consensus: Consensus, shard: str
) -> tuple[set[str], st.ShardState] | None:
    """One replay; ``None`` if the log was truncated under it."""
    first = consensus.scan(shard, 0, 1)
    if not first:
        return set(), st.ShardState(shard)
    head = consensus.head(shard)
    assert head is not None
    head_payload = unframe(head.data, shard=shard, what=f"consensus entry {head.seqno}")
    ptr = st.diff_rollup_pointer(head_payload, shard=shard)
    start_seqno = first[0].seqno
    cur: st.ShardState | None = None
    if start_seqno == 1:
        cur = st.ShardState(shard)
    else:
        # Candidate rollups: those the latest rollup knows about, plus the latest itself.
        candidates: dict[int, str] = {}
        if ptr is not None:
            candidates[ptr[0]] = ptr[1]
            latest = _load_rollup(blob, shard, ptr[0], ptr[1])
            if latest is not None:
                candidates.update({s: r.key for s, r in latest.rollups.items()})
        for s in sorted(candidates):
            if s < start_seqno - 1:
                continue
            cur = _load_rollup(blob, shard, s, candidates[s])
            if cur is not None:
                break
        if cur is None:
            # A concurrent GC deleted the rollups we were about to load (and truncated
            # past them): start over from a fresh look at the log.
            return None
    keys: set[str] = set(cur.blob_keys())
    prev = cur
    while True:
        entries = consensus.scan(shard, cur.seqno + 1, SCAN_LIMIT)
        if entries and entries[0].seqno != cur.seqno + 1:
            return None  # truncated since we looked: start over
        for e in entries:
            payload = unframe(e.data, shard=shard, what=f"consensus entry {e.seqno}")
            cur = st.apply_diff(cur, payload, e.seqno)
            if cur.batches is not prev.batches:
                for b in cur.batches.values():
                    keys.update(b.blob_keys())
            if cur.rollups is not prev.rollups:
                keys.update(r.key for r in cur.rollups.values())
            if cur.garbage is not prev.garbage:
                keys.update(cur.garbage)
            prev = cur
        if len(entries) < SCAN_LIMIT:
            return keys, cur


def in_flight_reason(key: str, head: st.ShardState) -> str | None:
    """Why an unreferenced ``key`` may still be linked by a write in flight (then the
    sweeper must keep it), judged against a state read *after* the blob was listed."""
    w = part_writer_of(key)
    if w is not None:
        return f"writer {w} is registered" if w in head.writers else None
    r = rollup_seqno_of(key)
    if r is not None:
        latest = head.latest_rollup()
        if latest is not None and r <= latest[0]:
            return None  # a newer rollup is linked: this one never will be
        if r > head.seqno - 2 * ROLLUP_LINK_WINDOW:
            return f"rollup of seqno {r} may still be linked (head {head.seqno})"
    return None


def unreferenced_blobs(
    blob: Blob,
    consensus: Consensus,
    shard: str,
    *,
    now_ms: int,
    older_than_ms: int = DEFAULT_LEAK_GRACE_MS,
    delete: bool = False,
    in_flight_guard: bool = True,
) -> list[dict[str, Any]]:
    """Blobs under ``{shard}/`` that no live state version references, that no write in
    flight may still link (``in_flight_reason``) and that are older than
    ``older_than_ms``; deleted too when ``delete``.

    Lists *before* replaying, so every blob it sees was written before the state it
    judges them by. ``in_flight_guard=False`` exists only for the reliability
    harness's planted bug (it is the unsafe sweeper).
    """
    listed = list(blob.list_keys_and_metadata(f"{shard}/"))
    live, head = live_blob_keys_and_head(blob, consensus, shard)
    out = [
        {"key": m.key, "bytes": m.size_in_bytes, "last_modified_ms": m.last_modified_ms}
        for m in listed
        if m.key not in live
        and now_ms - m.last_modified_ms >= older_than_ms
        and (not in_flight_guard or in_flight_reason(m.key, head) is None)
    ]
    if delete:
        dummy = GcSummary(shard)
        done = set(_delete_all(blob, [str(o["key"]) for o in out], dummy))
        for o in out:
            o["deleted"] = o["key"] in done
    return out
