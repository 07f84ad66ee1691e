"""The one CAS loop that advances a shard's state, and the per-process state cache.

``Machine.apply`` reads the cached state, runs a pure transition, and compare-and-sets
the encoded diff at ``seqno + 1``. On an expectation mismatch it fetches the diffs it
missed and re-runs the transition; on an indeterminate error it does the same, which
is safe because every transition recognises its own already-applied effect. Nothing
else writes consensus.

Every ``rollup_interval`` seqnos the machine that committed writes a full-state rollup
to blob and links it with another transition, so that opening a shard costs one
rollup plus a bounded number of diffs however many appends it has seen.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from persist_lib.config import PersistConfig
from persist_lib.errors import (
    CorruptionError,
    Determinate,
    ExternalError,
    Indeterminate,
    PersistError,
)
from persist_lib.location.base import Blob, CaSResult, Consensus, VersionedData
from persist_lib.shard import state as st
from persist_lib.shard import transitions as tr

log = logging.getLogger(__name__)

R = TypeVar("R")
Transition = Callable[[st.ShardState, int], tuple[st.ShardState | None, R]]

_FRAME_MAGIC = b"PS\x01"
SCAN_LIMIT = 1024


def frame(payload: bytes) -> bytes:
    """Prefixes ``payload`` with a magic and its SHA-256, so corruption is detected."""
    return _FRAME_MAGIC + hashlib.sha256(payload).digest() + payload


def unframe(data: bytes, *, shard: str, what: str) -> bytes:
    if len(data) < 35 or data[:3] != _FRAME_MAGIC:
        raise CorruptionError(f"shard {shard}: {what} is truncated or not a persist state frame")
    digest, payload = data[3:35], data[35:]
    if hashlib.sha256(payload).digest() != digest:
        raise CorruptionError(
            f"shard {shard}: {what} failed its checksum (the bytes were altered); nothing was "
            "returned"
        )
    return payload


@dataclass
class MachineMetrics:
    cas_attempts: int = 0
    cas_committed: int = 0
    cas_mismatches: int = 0
    indeterminate_retries: int = 0
    noops: int = 0
    rollups_written: int = 0
    apply_lock_bypassed: int = 0  # attempts that went on without the apply lock (stalled holder)
    state_fetches: int = 0
    rollup_loads: int = 0
    committed_by: dict[str, int] = field(default_factory=dict)  # commits by transition name


class SharedShardState:
    """The one cached state of a shard in this process, shared by all its handles."""

    def __init__(self, shard_id: str) -> None:
        self.cond = threading.Condition()
        self.state = st.ShardState(shard_id)
        self.rollup_in_progress = False
        # Held by ``Machine.apply`` from reading the state through its compare-and-set:
        # the threads of this process (a writer, background merges, rollups, heartbeats)
        # then take turns instead of racing each other's CAS, which the loser pays for
        # with a re-fetch, a re-run and a second CAS. Reentrant: a transition that
        # applies another one on its thread goes on as before. Advisory: a thread that
        # waited ``PersistConfig.apply_lock_wait_s`` goes on without it (a holder stuck
        # in a CAS must not stall the shard); fresh in a forked child.
        self.apply_lock = threading.RLock()

    def current(self) -> st.ShardState:
        with self.cond:
            return self.state

    def offer(self, new: st.ShardState) -> st.ShardState:
        """Installs ``new`` if it is newer than what is cached; returns the cached state."""
        with self.cond:
            if new.seqno > self.state.seqno:
                self.state = new
                self.cond.notify_all()
            return self.state

    def wait_newer(self, seqno: int, timeout_s: float) -> st.ShardState:
        with self.cond:
            if self.state.seqno <= seqno:
                self.cond.wait(timeout_s)
            return self.state


# Weak values: a shard's cached state lives as long as some Machine (a client's, or a
# handle's) uses it, so a long-lived process that touched many shards does not keep
# them all (clients bound their machines, ``PersistConfig.max_cached_shards``).
_CACHE: weakref.WeakValueDictionary[tuple[str, str], SharedShardState] = weakref.WeakValueDictionary()
_CACHE_LOCK = threading.Lock()


def _reset_locks_in_child() -> None:
    """After ``fork``, in the child: only the forking thread survives, so a lock another
    thread held at the fork (a shard's apply lock across a CAS, its condition, the cache
    lock) would stay held forever, and every change of that shard would wait for it.
    Fresh locks; no rollup is in progress (its thread did not survive either). The
    cached states stay: each is a state that was current in consensus."""
    global _CACHE_LOCK
    _CACHE_LOCK = threading.Lock()
    for shared in list(_CACHE.values()):
        shared.apply_lock = threading.RLock()
        shared.cond = threading.Condition()
        shared.rollup_in_progress = False


os.register_at_fork(after_in_child=_reset_locks_in_child)


def shared_state_for(location_id: str, shard_id: str) -> SharedShardState:
    with _CACHE_LOCK:
        s = _CACHE.get((location_id, shard_id))
        if s is None:
            s = _CACHE[(location_id, shard_id)] = SharedShardState(shard_id)
        return s


def cached_states() -> list[st.ShardState]:
    """The state of every shard cached in this process (for metrics)."""
    with _CACHE_LOCK:
        shared = list(_CACHE.values())
    return [s.current() for s in shared]


def clear_state_cache() -> None:
    """Forgets every cached state (tests use this to simulate a process restart)."""
    with _CACHE_LOCK:
        _CACHE.clear()


def rollup_key(shard_id: str, seqno: int) -> str:
    return f"{shard_id}/rollup/{seqno}-{uuid.uuid4()}"


def rollup_seqno_of(key: str) -> int | None:
    """The seqno of a rollup key ``{shard}/rollup/{seqno}-{uuid}`` (None for other keys)."""
    segs = key.split("/")
    if len(segs) != 3 or segs[1] != "rollup":
        return None
    head = segs[2].split("-", 1)[0]
    return int(head) if head.isdigit() else None


@dataclass
class ApplyProgress:
    """What ``Machine.apply`` got to: ``cas_issued`` turns true just before the first
    compare-and-set is sent. Until then nothing of the change can be in consensus, so a
    caller may safely delete blobs it uploaded for it; afterwards it never may (the
    CAS may have landed, whatever exception follows)."""

    cas_issued: bool = False


@dataclass
class Machine:
    """Applies transitions to one shard through consensus."""

    shard_id: str
    blob: Blob
    consensus: Consensus
    config: PersistConfig
    metrics: MachineMetrics = field(default_factory=MachineMetrics)
    on_commit: list[Callable[[st.ShardState], None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.shared = shared_state_for(self.consensus.describe(), self.shard_id)
        self._rollup_thread: threading.Thread | None = None

    def wait_background(self, timeout_s: float = 10.0) -> None:
        """Waits (bounded) for this machine's background rollup, and for any rollup another
        machine of this process is writing for the shard: the client calls it before
        closing its blob and consensus, which the rollup still uses, and a quiescent leak
        sweep before listing (a rollup uploaded but not yet linked looks leaked)."""
        deadline = time.monotonic() + timeout_s
        t = self._rollup_thread
        if t is not None and t.is_alive():
            t.join(timeout_s)
        while self.shared.rollup_in_progress and time.monotonic() < deadline:
            time.sleep(0.005)

    # ----- reading state ----------------------------------------------------------------

    def cached(self) -> st.ShardState:
        return self.shared.current()

    def fetch_latest(self) -> st.ShardState:
        """Brings the cached state up to the consensus head and returns it."""
        self.metrics.state_fetches += 1
        cur = self.shared.current()
        if not cur.exists:
            # Cold cache: start from the latest rollup, not from seqno 1.
            return self.shared.offer(self._load_from_rollup())
        while True:
            entries = self.consensus.scan(self.shard_id, cur.seqno + 1, SCAN_LIMIT)
            if not entries:
                return self.shared.offer(cur)
            if entries[0].seqno != cur.seqno + 1:
                # The diffs we'd need were truncated: start over from the latest rollup.
                return self.shared.offer(self._load_from_rollup())
            cur = self.shared.offer(self._apply_entries(cur, entries))
            if len(entries) < SCAN_LIMIT:
                return cur

    def _apply_entries(self, cur: st.ShardState, entries: list[VersionedData]) -> st.ShardState:
        """Verifies (checksum) and applies consecutive consensus entries at once."""
        payloads = [
            (e.seqno, unframe(e.data, shard=self.shard_id, what=f"consensus entry {e.seqno}"))
            for e in entries
        ]
        return st.apply_diffs(cur, payloads)

    def _load_from_rollup(self) -> st.ShardState:
        self.metrics.rollup_loads += 1
        last_err: Exception | None = None
        for _ in range(20):
            head = self.consensus.head(self.shard_id)
            if head is None:
                return st.ShardState(self.shard_id)
            payload = unframe(head.data, shard=self.shard_id, what=f"consensus entry {head.seqno}")
            ptr = st.diff_rollup_pointer(payload, shard=self.shard_id)
            if ptr is None:
                cur = st.ShardState(self.shard_id)
            else:
                rseqno, rkey = ptr
                data = self.blob.get(rkey)
                if data is None:
                    # GC replaced it between our head read and the fetch: read the head again.
                    last_err = Determinate(f"shard {self.shard_id}: rollup {rkey} vanished")
                    continue
                body = unframe(data, shard=self.shard_id, what=f"rollup {rkey}")
                cur = st.ShardState.decode_rollup(body, shard=self.shard_id, key=rkey)
                if cur.seqno != rseqno:
                    raise CorruptionError(
                        f"shard {self.shard_id}: rollup {rkey} holds seqno {cur.seqno}, expected {rseqno}"
                    )
            ok = True
            while True:
                entries = self.consensus.scan(self.shard_id, cur.seqno + 1, SCAN_LIMIT)
                if entries and entries[0].seqno != cur.seqno + 1:
                    ok = False
                    break
                cur = self._apply_entries(cur, entries)
                if len(entries) < SCAN_LIMIT:
                    break
            if ok:
                return cur
            last_err = Determinate(f"shard {self.shard_id}: consensus was truncated while loading")
        raise Determinate(
            f"shard {self.shard_id}: could not load a consistent state (last problem: {last_err}); "
            "retry"
        )

    def wait_for_newer(self, seqno: int, timeout_s: float) -> st.ShardState:
        """Waits (bounded) until a state newer than ``seqno`` is known, and returns the latest."""
        deadline = time.monotonic() + timeout_s
        while True:
            cur = self.shared.current()
            if cur.seqno > seqno:
                return cur
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return cur
            # Another handle in this process may commit (in-process notification), or
            # another process may (consensus push channel or polling).
            step = min(remaining, self.config.listen_poll_max_s)
            self.consensus.wait_for_change(self.shard_id, seqno if seqno > 0 else None, step)
            cur = self.fetch_latest()
            if cur.seqno > seqno:
                return cur

    # ----- applying transitions ---------------------------------------------------------

    def apply(
        self, name: str, fn: Transition[R], progress: ApplyProgress | None = None
    ) -> tuple[R, st.ShardState]:
        """Applies ``fn`` through consensus; returns its result and the state it produced.

        Once a compare-and-set may have landed, every failure is reported as
        ``Indeterminate`` (a transition error while re-running it too: e.g. the writer
        was expired meanwhile, so its token no longer tells whether it landed).
        ``progress`` (optional) records whether a CAS was sent at all.
        """
        cur = self.shared.current()
        if not cur.exists:
            cur = self.fetch_latest()
        backoff = 0.002
        deadline = time.monotonic() + self.config.retry_deadline_s
        # Once a CAS may have been applied, any later failure must be reported as
        # Indeterminate: a Determinate error would let the caller treat a committed
        # change as never made (and, for a write, delete the blobs it references).
        maybe_applied = False
        lock = self.shared.apply_lock
        try:
            while True:
                # One attempt (state -> transition -> CAS) at a time per shard in this
                # process; the waits between attempts (backoff, re-fetch) don't hold it.
                # The turn-taking is only an optimisation (the CAS arbitrates): a holder
                # stuck longer than ``apply_lock_wait_s`` (a CAS on a dead connection) is
                # passed by, so it never stalls the shard's other changes or heartbeats.
                wait_s = min(self.config.apply_lock_wait_s, max(0.0, deadline - time.monotonic()))
                locked = lock.acquire(timeout=wait_s)
                if not locked:
                    self.metrics.apply_lock_bypassed += 1
                    log.info(
                        "shard %s: %s: another thread of this process has held the shard's "
                        "apply lock for over %.1fs (a stalled consensus call?); going on "
                        "without it", self.shard_id, name, wait_s,
                    )
                indeterminate: Indeterminate | None = None
                try:
                    # Another thread of this process may have committed since ``cur`` was
                    # read: start from its state (no consensus read needed).
                    latest = self.shared.current()
                    if latest.seqno > cur.seqno:
                        cur = latest
                    now = self.config.now_ms()
                    try:
                        new, result = fn(cur, now)
                    except PersistError as e:
                        if maybe_applied:
                            raise Indeterminate(
                                f"shard {self.shard_id}: {name}: a compare-and-set may have been "
                                f"applied, then re-running the transition failed ({e}); the "
                                "operation may or may not have happened"
                            ) from e
                        raise
                    if new is None:
                        self.metrics.noops += 1
                        return result, cur
                    new = new.evolve(seqno=cur.seqno + 1, walltime_ms=max(cur.walltime_ms + 1, now))
                    data = frame(st.encode_diff(cur, new))
                    self.metrics.cas_attempts += 1
                    if progress is not None:
                        progress.cas_issued = True
                    try:
                        res = self.consensus.compare_and_set(
                            self.shard_id, cur.seqno if cur.exists else None,
                            VersionedData(new.seqno, data),
                        )
                    except Indeterminate as e:
                        indeterminate = e
                    else:
                        if res is CaSResult.COMMITTED:
                            # Installed before the lock is released: the next attempt of
                            # any thread here starts from it.
                            installed = self.shared.offer(new)
                finally:
                    if locked:
                        lock.release()
                if indeterminate is not None:
                    # It may have been applied. Re-read and re-run: the transition recognises
                    # its own effect if it landed.
                    self.metrics.indeterminate_retries += 1
                    maybe_applied = True
                    if time.monotonic() > deadline:
                        raise Indeterminate(
                            f"shard {self.shard_id}: {name}: consensus kept failing indeterminately "
                            f"({indeterminate}); the operation may or may not have happened"
                        ) from None
                    time.sleep(backoff)
                    backoff = min(backoff * 2, 0.5)
                    cur = self._fetch_with_retry(deadline)
                    continue
                if res is CaSResult.COMMITTED:
                    self.metrics.cas_committed += 1
                    by = self.metrics.committed_by
                    by[name] = by.get(name, 0) + 1
                    self._after_commit(new)
                    return result, installed if installed.seqno == new.seqno else new
                self.metrics.cas_mismatches += 1
                before = cur.seqno
                cur = self._fetch_with_retry(deadline)
                if cur.seqno <= before:
                    self._check_head_not_behind(cur)
        except ExternalError as e:
            if maybe_applied and not isinstance(e, Indeterminate):
                raise Indeterminate(
                    f"shard {self.shard_id}: {name}: a compare-and-set may have been applied, then "
                    f"re-reading the state failed ({e}); the operation may or may not have happened"
                ) from None
            raise

    def _check_head_not_behind(self, cur: st.ShardState) -> None:
        """A CAS lost but no newer entry exists: the log must not be *behind* our cache
        (a log replaced under a live process, or two logs sharing a cache key), or the
        loop would spin forever."""
        head = self.consensus.head(self.shard_id)
        if head is None or head.seqno < cur.seqno:
            raise CorruptionError(
                f"shard {self.shard_id}: the consensus head is at "
                f"{head.seqno if head else 'nothing'} but this process has seen seqno "
                f"{cur.seqno}: the log was replaced or truncated past its head under a live "
                "process; stop and investigate the consensus location"
            )

    def _fetch_with_retry(self, deadline: float) -> st.ShardState:
        backoff = 0.005
        while True:
            try:
                return self.fetch_latest()
            except ExternalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(backoff)
                backoff = min(backoff * 2, 1.0)

    def _rollup_due(self, new: st.ShardState) -> bool:
        """Every ``rollup_interval`` seqnos; and sooner (after an eighth of it) when the
        latest rollup was written while the state was large (a long merge running, the
        appends behind it waiting, their parts inline) and the state has since shrunk to
        under half of it: every cold open until the next rollup would otherwise decode
        the large one."""
        interval = self.config.rollup_interval
        if interval <= 0:
            return False
        latest = new.latest_rollup()
        if latest is None:
            return new.seqno >= interval
        seqno, ref = latest
        since = new.seqno - seqno
        if since >= interval:
            return True
        return (
            ref.size >= ROLLUP_SHRINK_MIN_BYTES
            and since >= max(1, interval // 8)
            and 2 * estimated_rollup_bytes(new) < ref.size
        )

    def _after_commit(self, new: st.ShardState) -> None:
        if self._rollup_due(new):
            if self.config.rollup_in_background:
                if not self.shared.rollup_in_progress:
                    t = threading.Thread(
                        target=self.write_rollup, name=f"persist-rollup-{self.shard_id}", daemon=True
                    )
                    self._rollup_thread = t
                    t.start()
            else:
                try:
                    self.write_rollup()
                except Exception as e:  # the change committed: never fail the caller for this
                    log.warning("shard %s: inline rollup failed: %r", self.shard_id, e)
        for cb in list(self.on_commit):
            try:
                cb(new)
            except Exception as e:  # maintenance must never fail the user's operation
                log.warning("shard %s: post-commit maintenance failed: %r", self.shard_id, e)

    def write_rollup(self) -> bool:
        """Writes a rollup of the current state and links it. Returns whether it linked."""
        with self.shared.cond:
            if self.shared.rollup_in_progress:
                return False
            self.shared.rollup_in_progress = True
        try:
            state = self.shared.current()
            key = rollup_key(self.shard_id, state.seqno)
            data = frame(state.encode_rollup())
            try:
                self.blob.set(key, data)
                linked, _ = self.apply(
                    "add_rollup",
                    lambda s, now: tr.add_rollup(s, now, seqno=state.seqno, key=key, size=len(data)),
                )
            except ExternalError as e:
                log.warning("shard %s: writing rollup at %s failed: %s", self.shard_id, state.seqno, e)
                return False
            if linked:
                self.metrics.rollups_written += 1
            else:
                try:
                    self.blob.delete(key)
                except ExternalError:
                    pass  # the leaked-blob sweeper will find it
            return bool(linked)
        finally:
            with self.shared.cond:
                self.shared.rollup_in_progress = False


# A rollup smaller than this is never replaced early (``Machine._rollup_due``).
ROLLUP_SHRINK_MIN_BYTES = 64 << 10


def estimated_rollup_bytes(s: st.ShardState) -> int:
    """A rough size of ``s`` encoded as a rollup (inline parts in base64, ~300 bytes per
    part and per reader/writer, ~150 per garbage entry, the schemas as encoded), without
    encoding it. The schemas count: a wide shard's (1,500 columns: ~110 KB) are most of
    its rollup, and an estimate without them looked like a state that had shrunk to a
    fifth of its latest rollup, replacing the rollup early every ``interval // 8`` seqnos
    forever (60 rollups per 1,024 commits instead of 8)."""
    parts = sum(len(b.parts) for b in s.batches.values())
    entries = len(s.writers) + len(s.leased_readers) + len(s.critical_readers) + len(s.rollups)
    return (
        s.inline_bytes * 4 // 3
        + 300 * (parts + entries)
        + 60 * len(s.batches)
        + 150 * len(s.garbage)
        + schemas_bytes(s.schemas)
        + 1024
    )


# id(schemas dict) -> (the dict, its encoded size). States evolved from one another share
# the schemas dict, so its size is computed once, not at every commit. The dict is kept
# referenced, so its id is never reused while it is here.
_SCHEMAS_BYTES: dict[int, tuple[object, int]] = {}
_SCHEMAS_BYTES_MAX = 256


def schemas_bytes(schemas: dict[str, Any] | None) -> int:
    """The size of ``schemas`` as a rollup encodes it (compact JSON), memoized."""
    if not schemas:
        return 0
    hit = _SCHEMAS_BYTES.get(id(schemas))
    if hit is not None and hit[0] is schemas:
        return hit[1]
    n = len(json.dumps(schemas, separators=(",", ":")))
    if len(_SCHEMAS_BYTES) >= _SCHEMAS_BYTES_MAX:
        _SCHEMAS_BYTES.clear()
    _SCHEMAS_BYTES[id(schemas)] = (schemas, n)
    return n


def describe_state(s: st.ShardState) -> dict[str, Any]:
    """The JSON document ``persist inspect`` prints."""
    trace = s.trace_batches()
    return {
        "shard": s.shard_id,
        "seqno": s.seqno,
        "walltime_ms": s.walltime_ms,
        "code_version": s.code_version,
        "tombstone": s.tombstone,
        "since": s.since.elements,
        "upper": s.upper.elements,
        "seqno_since": s.seqno_since(),
        "batches": [
            {
                "id": bid,
                "lower": b.lower.elements,
                "upper": b.upper.elements,
                "since": b.since.elements,
                "len": b.len,
                "bytes": b.size,
                "parts": [
                    {"key": p.location, "bytes": p.size, "len": p.count, "tmin": p.tmin, "tmax": p.tmax}
                    for p in b.parts
                ],
            }
            for bid, b in trace
        ],
        "num_batches": len(trace),
        "num_updates": sum(b.len for _, b in trace),
        "bytes": sum(b.size for _, b in trace),
        "leased_readers": {
            rid: {
                "since": r.since.elements,
                "seqno": r.seqno,
                "last_heartbeat_ms": r.last_heartbeat_ms,
                "lease_duration_ms": r.lease_duration_ms,
                "purpose": r.purpose,
            }
            for rid, r in sorted(s.leased_readers.items())
        },
        "critical_readers": {
            rid: {"since": r.since.elements, "opaque": r.opaque, "purpose": r.purpose}
            for rid, r in sorted(s.critical_readers.items())
        },
        "writers": {
            wid: {
                "last_heartbeat_ms": w.last_heartbeat_ms,
                "lease_duration_ms": w.lease_duration_ms,
                "most_recent_write_upper": w.most_recent_write_upper.elements,
                "purpose": w.purpose,
            }
            for wid, w in sorted(s.writers.items())
        },
        "rollups": {str(k): v.key for k, v in sorted(s.rollups.items())},
        "garbage": {"blobs": len(s.garbage), "bytes": sum(g.size for g in s.garbage.values())},
        "quarantined_merges": describe_state_quarantine(s),
        **_spine_info(s),
    }


def describe_state_quarantine(s: st.ShardState) -> list[dict[str, Any]]:
    """Quarantined merges (``maintenance`` module docstring) as JSON."""
    return [
        {
            "batch_ids": list(e.batch_ids),
            "error": e.error,
            "failures": e.failures,
            "first_failure_ms": e.first_failure_ms,
            "last_failure_ms": e.last_failure_ms,
        }
        for _, e in sorted(s.quarantined_merges.items())
    ]


def _spine_info(s: st.ShardState) -> dict[str, Any]:
    """Compaction debt and the spine's levels/pending merges (for ``persist inspect``)."""
    from persist_lib.shard.spine import compaction_debt, describe_spine

    return {"compaction_debt": compaction_debt(s), "spine": describe_spine(s)}
