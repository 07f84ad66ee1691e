"""Maintenance API: compaction, garbage collection, leaked blobs, finalization.

Functions take a ``PersistClient`` and a shard, and return JSON-able summaries (what
the CLI prints and a Dagster op records as metadata). They use the client only as the
``ShardContext`` the shard machinery runs with (``persist_lib.shard.context``), and
pass it down as such. ``BackgroundCompactor`` runs the
spine's merges in-process, fed by every committed state change of the client.

**Failing merges.** A merge can fail for a passing reason (the store is down: an
``ExternalError``) or deterministically (an input part is corrupt or missing, or a
bug): retrying the latter at once only burns CPU and requests. So a failed merge is
retried with exponential backoff (``compaction_retry_backoff_s`` doubling up to
``compaction_retry_backoff_max_s``), and after ``compaction_quarantine_after``
deterministic failures it is *quarantined*: recorded in shard state
(``state.quarantined_merges``: batch ids, error, failure count, times), skipped by
every compactor's planning (``spine.compaction_requests``), shown by ``persist
inspect`` and in the Dagster compaction metadata, and logged at ERROR. An operator
retries it with ``compact(..., retry_quarantined=True)`` (``persist compact
--retry-quarantined``) once the input is repaired; a merge that then succeeds drops
its entry.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from persist_lib.errors import (
    BlobNotFound,
    CorruptionError,
    ExternalError,
    InvalidUsage,
    PersistError,
)
from persist_lib.handles.merge_deferral import DeferralPolicy, SettleTimer
from persist_lib.ids import ShardId
from persist_lib.shard import gc as gcmod
from persist_lib.shard import kernels
from persist_lib.shard import maintenance_transitions as mt
from persist_lib.shard import state as st
from persist_lib.shard.codec import Schemas
from persist_lib.shard.compaction_writers import CompactionWriters
from persist_lib.shard.compactor import CompactionResult, compact_request
from persist_lib.shard.context import ShardContext
from persist_lib.shard.machine import Machine, describe_state_quarantine
from persist_lib.shard.spine import CompactionRequest, compaction_debt, compaction_requests

log = logging.getLogger(__name__)

ShardLike = ShardId | str
DEFAULT_MAX_ROUNDS = 256


def _machine(client: ShardContext, shard: ShardLike) -> Machine:
    return client.machine(shard)


def _existing(m: Machine) -> st.ShardState:
    s = m.fetch_latest()
    if not s.exists:
        raise InvalidUsage(f"shard {m.shard_id} does not exist at this location")
    return s


def _schemas(s: st.ShardState) -> Schemas:
    if s.schemas is None:
        raise InvalidUsage(f"shard {s.shard_id} has no recorded schemas yet (nothing was written)")
    return Schemas.from_json(s.schemas)


# ----- compaction -------------------------------------------------------------------------


def is_deterministic_failure(e: BaseException) -> bool:
    """Whether retrying a merge that raised ``e`` is pointless until something changes:
    corruption, a missing input part (``compact_request`` re-raises ``BlobNotFound``
    only when the inputs are still current), a usage error, or a bug. Location errors
    (outages, timeouts) pass."""
    if isinstance(e, (CorruptionError, BlobNotFound, InvalidUsage)):
        return True
    return not isinstance(e, (ExternalError, PersistError, OSError))


def quarantine(m: Machine, req: CompactionRequest, error: BaseException, failures: int) -> bool:
    """Records ``req`` as quarantined in shard state (best effort); logs at ERROR."""
    msg = f"{type(error).__name__}: {error}"
    log.error(
        "shard %s: merge of batches %s failed %d time(s) deterministically and is quarantined "
        "(not retried automatically; see `persist inspect`, retry with `persist compact "
        "--retry-quarantined` once repaired): %s",
        m.shard_id, list(req.batch_ids), failures, msg,
    )
    try:
        done, _ = m.apply(
            "quarantine_merge",
            lambda s, now: mt.quarantine_merge(
                s, now, batch_ids=req.batch_ids, error=msg, failures=failures
            ),
        )
        return bool(done)
    except PersistError as e:
        log.warning("shard %s: recording the quarantine failed: %s", m.shard_id, e)
        return False


def compact(
    client: ShardContext,
    shard: ShardLike,
    *,
    max_rounds: int = DEFAULT_MAX_ROUNDS,
    retry_quarantined: bool = False,
    raise_on_failure: bool = True,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Runs the spine's pending merges now, round after round, until none is left.

    A merge whose inputs changed meanwhile is not applied (and its output deleted); the
    next round plans again from the new state. ``max_rounds`` bounds the work when
    writers keep appending. Quarantined merges are skipped unless ``retry_quarantined``.
    A merge that fails deterministically (corrupt or missing input) is quarantined and
    the other merges still run; then the first such error is raised
    (``raise_on_failure``), or the summary lists it under ``failed``. ``progress(done,
    planned)`` is called before the first merge and after each one (``planned`` grows
    when a later round plans more merges); it must be quick and must not raise.
    """
    m = _machine(client, shard)
    s = _existing(m)
    before = len(s.batches)
    debt_before = compaction_debt(s)
    results: list[CompactionResult] = []
    failed: list[dict[str, Any]] = []
    failed_ids: set[int] = set()
    first_error: Exception | None = None
    rounds = 0
    planned = 0
    while rounds < max_rounds:
        if s.tombstone:
            break
        reqs = compaction_requests(s, failed_ids, include_quarantined=retry_quarantined)
        if not reqs:
            break
        rounds += 1
        schemas = _schemas(s)
        planned += len(reqs)
        if progress is not None:
            progress(len(results) + len(failed), planned)
        for req in reqs:
            try:
                results.append(compact_request(m, schemas, client.config, req, context=client))
            except Exception as e:
                if not is_deterministic_failure(e):
                    raise
                quarantine(m, req, e, 1)
                first_error = first_error or e
                failed_ids.update(req.batch_ids)
                failed.append({"batch_ids": list(req.batch_ids), "error": f"{type(e).__name__}: {e}"})
            if progress is not None:
                progress(len(results) + len(failed), planned)
        s = m.fetch_latest()
    if first_error is not None and raise_on_failure:
        raise first_error
    applied = [r for r in results if r.applied]
    return {
        "shard": m.shard_id,
        "rounds": rounds,
        "merges_applied": len(applied),
        "merges_not_applied": len(results) - len(applied),
        "updates_read": sum(r.request.num_updates for r in results),
        # Rows decoded by merges, including re-reads of intermediate runs: the work.
        "rows_rewritten": sum(r.stats.rows_read for r in results),
        "bytes_read": sum(r.stats.bytes_read for r in results),
        "bytes_written": sum(r.stats.bytes_written for r in results),
        "peak_bytes_held": max((r.stats.peak_bytes_held for r in results), default=0),
        "peak_rows_held": max((r.stats.peak_rows_held for r in results), default=0),
        "batches_before": before,
        "batches_after": len(s.batches),
        "compaction_debt_before": debt_before,
        "compaction_debt_after": compaction_debt(s),
        "seconds": round(sum(r.seconds for r in results), 4),
        "failed": failed,
        "quarantined_merges": describe_quarantine(s),
    }


def describe_quarantine(s: st.ShardState) -> list[dict[str, Any]]:
    """The shard's quarantined merges as JSON (``persist inspect``, Dagster metadata)."""
    return describe_state_quarantine(s)


def compact_once(client: ShardContext, shard: ShardLike) -> list[CompactionResult]:
    """Runs the merges the spine wants right now (one round); returns their results."""
    m = _machine(client, shard)
    s = _existing(m)
    reqs = compaction_requests(s)
    if not reqs:
        return []
    schemas = _schemas(s)
    return [compact_request(m, schemas, client.config, r, context=client) for r in reqs]


# ----- garbage collection -----------------------------------------------------------------


def gc(client: ShardContext, shard: ShardLike) -> dict[str, Any]:
    """One idempotent GC run: deletes unreachable blobs, truncates consensus, old rollups."""
    m = _machine(client, shard)
    _existing(m)
    return gcmod.collect_garbage(m).to_json()


def unreferenced_blobs(
    client: ShardContext,
    shard: ShardLike,
    older_than_ms: int | None = None,
    *,
    delete: bool = False,
    quiescent: bool = False,
) -> list[dict[str, Any]]:
    """Leaked blobs of ``shard``: under ``{shard}/``, referenced by no live state version,
    that no write in flight may still link (parts of registered writers, recent unlinked
    rollups: ``gc.in_flight_reason``) and older than ``older_than_ms`` (default
    ``config.leak_grace_ms``, 1 h). ``delete=True`` deletes them. ``quiescent=True``
    drops the in-flight guard: only when nothing at all runs against the shard and
    every lease was expired (a test's final sweep)."""
    sid = str(ShardId.parse(shard))
    grace = client.config.leak_grace_ms if older_than_ms is None else older_than_ms
    if quiescent:
        # "Nothing runs against the shard" includes this process's own background rollup
        # (started by the last commit, e.g. a GC's): uploaded but not yet linked, it
        # would look leaked to a sweep without the in-flight guard.
        _machine(client, sid).wait_background()
    return gcmod.unreferenced_blobs(
        client.blob,
        client.consensus,
        sid,
        now_ms=client.config.now_ms(),
        older_than_ms=grace,
        delete=delete,
        in_flight_guard=not quiescent,
    )


# ----- finalization -----------------------------------------------------------------------


def finalize(client: ShardContext, shard: ShardLike) -> dict[str, Any]:
    """Deletes a shard whose since and upper are both empty, leaving a tombstone.

    Steps (each idempotent, so a crash anywhere is resumed by calling it again):
    become a tombstone (batches become garbage, every handle is dropped) → write a
    rollup of the tombstone → shrink state to that rollup alone → delete every other
    blob under ``{shard}/`` → truncate consensus below the tombstone rollup. What stays
    is one consensus entry and the tombstone's own rollup (opening a shard needs a
    rollup once consensus is truncated); opening it again raises ``ShardTombstoned``.
    """
    m = _machine(client, shard)
    s = _existing(m)
    if not s.tombstone:
        mt.check_finalizable(s)
        m.apply("become_tombstone", mt.become_tombstone)
    s = m.fetch_latest()
    latest = s.latest_rollup()
    rollup_written = False
    if latest is None or not _rollup_is_tombstone(m, latest):
        rollup_written = m.write_rollup()
        s = m.fetch_latest()
        latest = s.latest_rollup()
    if latest is None or not _rollup_is_tombstone(m, latest):
        raise ExternalError(
            f"shard {m.shard_id}: could not write the tombstone rollup; run finalize again"
        )
    keep_seqno, keep = latest
    m.apply("tombstone_shrink", lambda st_, now: mt.tombstone_shrink(st_, now, keep_rollup=keep_seqno))
    listed = [b.key for b in client.blob.list_keys_and_metadata(f"{m.shard_id}/")]
    summary = gcmod.GcSummary(m.shard_id)
    doomed = [k for k in listed if k != keep.key]
    deleted = gcmod._delete_all(client.blob, doomed, summary)
    truncated = client.consensus.truncate(m.shard_id, keep_seqno)
    return {
        "shard": m.shard_id,
        "tombstone": True,
        "rollup_written": rollup_written,
        "blobs_deleted": len(deleted),
        "consensus_entries_truncated": truncated,
        "kept_rollup": keep.key,
        "errors": summary.errors,
    }


def _rollup_is_tombstone(m: Machine, rollup: tuple[int, st.RollupRef]) -> bool:
    seqno, ref = rollup
    state = gcmod._load_rollup(m.blob, m.shard_id, seqno, ref.key)
    return state is not None and state.tombstone


# ----- background compaction --------------------------------------------------------------


@dataclass
class _Failure:
    """A background merge (or GC) that failed: when it may run again."""

    failures: int = 0
    deterministic: int = 0
    retry_at: float = 0.0  # time.monotonic()
    last_error: str = ""
    quarantined: bool = False


class BackgroundCompactor:
    """A small worker pool running the spine's merges for a client's shards.

    Fed by ``Machine.on_commit``: each committed state re-derives the merges it needs.
    The queue is bounded (``config.compaction_queue_max``); excess requests are dropped
    because a later commit re-derives them. A merge already queued or running for the
    same batches is not queued twice. A failed merge backs off exponentially (its
    batches are barriers meanwhile) and is re-offered by a timer when due; one failing
    deterministically ``compaction_quarantine_after`` times is quarantined (module
    docstring). When ``config.gc_in_background`` is set, a GC run is queued whenever
    one is due (``gc.gc_due``: deletable garbage, or rollups older than the oldest one
    still needed); a failed GC backs off the same way. Small merges wait out a burst of
    commits (``merge_deferral``: ``deferral``, a ``DeferralPolicy``).

    Merges never import polars inline (``kernels.no_polars_import``: ~0.1 s holding the
    GIL, which landed in a writer's burst); the first time a shard settles the
    compactor imports it in its pool (``kernels.warm``), counted by ``wait_idle``.
    """

    def __init__(self, client: ShardContext, deferral: DeferralPolicy | None = None) -> None:
        cfg = client.config
        self.client = client
        self.queue_max = cfg.compaction_queue_max
        self._pool = ThreadPoolExecutor(
            max_workers=cfg.compaction_workers, thread_name_prefix="persist-compaction"
        )
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._pending: set[tuple[str, tuple[int, ...]]] = set()
        self._claimed: dict[str, set[int]] = {}  # batch ids in queued/running merges
        self._gc_pending: set[str] = set()
        self._failures: dict[tuple[str, tuple[int, ...]], _Failure] = {}
        self._gc_failures: dict[str, _Failure] = {}
        self._timers: set[threading.Timer] = set()
        self._rng = random.Random()
        self._closed = False
        self.dropped = 0
        self.completed = 0
        self.applied = 0
        self.failed = 0
        self.gc_runs = 0
        self.gc_failed = 0
        self.quarantined = 0
        self.held_back = 0
        self.deferral = deferral if deferral is not None else DeferralPolicy()
        self._settler = SettleTimer(self._settle, self._notify_idle)
        self._warm = "no"  # kernels.warm(): "no" | "pending" | "done"
        # One registered part writer per shard for all its merges (compaction_writers).
        self.writers = CompactionWriters(client)

    def _settle(self, m: Machine) -> None:
        """A shard was quiet for ``deferral.quiet_s``: its held-back merges run now, and
        the merge kernels are warmed once per compactor (class docstring)."""
        self.offer(m, m.cached(), settle=True)
        with self._lock:
            if self._warm != "no" or self._closed:
                return
            self._warm = "pending"
        try:
            self._pool.submit(self._run_warm)
        except RuntimeError:  # the pool was shut down concurrently
            self._warm_done()

    def _run_warm(self) -> None:
        try:
            kernels.warm()
        except Exception as e:  # noqa: BLE001 - a failed import leaves the exact numpy kernels
            log.info("warming the merge kernels failed: %s", e)
        finally:
            self._warm_done()

    def _warm_done(self) -> None:
        with self._lock:
            self._warm = "done"
            self._idle.notify_all()

    def _notify_idle(self) -> None:
        with self._idle:
            self._idle.notify_all()

    def attach(self, m: Machine) -> None:
        if getattr(m, "_background_compactor", None) is self:
            return
        m._background_compactor = self  # type: ignore[attr-defined]
        m.on_commit.append(lambda s: self.offer(m, s))

    def _backing_off(self, shard: str, state: st.ShardState, now: float) -> set[int]:
        """Batch ids of failed merges not yet due again (pruning entries whose batches
        are gone: their merge is moot)."""
        out: set[int] = set()
        with self._lock:
            for key in [k for k in self._failures if k[0] == shard]:
                f = self._failures[key]
                if any(b not in state.batches for b in key[1]):
                    del self._failures[key]
                elif f.quarantined or f.retry_at > now:
                    out.update(key[1])
        return out

    def offer(self, m: Machine, state: st.ShardState, *, settle: bool = False) -> None:
        """Queues the merges ``state`` needs (never raises: it runs inside a commit).
        Small merges are held back until the shard has been quiet for a while
        (``merge_deferral``), unless ``settle`` (the quiet period has passed)."""
        try:
            if self._closed or state.tombstone or state.schemas is None:
                return
            with self._lock:
                claimed = set(self._claimed.get(m.shard_id, ()))
            claimed |= self._backing_off(m.shard_id, state, time.monotonic())
            reqs = compaction_requests(state, claimed)
            if self.client.config.gc_in_background and gcmod.gc_due(state):
                self._submit_gc(m)
            if not settle:
                reqs, held = self.deferral.split(reqs)
                if held:
                    with self._lock:
                        self.held_back += len(held)
                    self._settler.arm(m.shard_id, m, self.deferral.quiet_s)
            for req in reqs:
                self._submit(m, req)
        except Exception as e:  # maintenance must never fail the user's operation
            log.warning("shard %s: planning background compaction failed: %s", m.shard_id, e)

    def _submit(self, m: Machine, req: CompactionRequest) -> None:
        key = (m.shard_id, req.batch_ids)
        with self._lock:
            claimed = self._claimed.setdefault(m.shard_id, set())
            if self._closed or claimed.intersection(req.batch_ids):
                return  # a queued or running merge covers (some of) these batches
            if len(self._pending) >= self.queue_max:
                self.dropped += 1
                return
            self._pending.add(key)
            claimed.update(req.batch_ids)
        try:
            self._pool.submit(self._run, m, req, key)
        except RuntimeError:  # the pool was shut down concurrently
            self._release(key)

    def _release(self, key: tuple[str, tuple[int, ...]]) -> None:
        with self._lock:
            self._pending.discard(key)
            self._claimed.get(key[0], set()).difference_update(key[1])
            self._idle.notify_all()

    def _submit_gc(self, m: Machine) -> None:
        with self._lock:
            f = self._gc_failures.get(m.shard_id)
            if m.shard_id in self._gc_pending or self._closed:
                return
            if f is not None and f.retry_at > time.monotonic():
                return
            self._gc_pending.add(m.shard_id)
        try:
            self._pool.submit(self._run_gc, m)
        except RuntimeError:
            with self._lock:
                self._gc_pending.discard(m.shard_id)
                self._idle.notify_all()

    def _backoff_s(self, failures: int) -> float:
        cfg = self.client.config
        base = cfg.compaction_retry_backoff_s * (2 ** max(0, failures - 1))
        return min(cfg.compaction_retry_backoff_max_s, base) * (0.5 + self._rng.random() / 2)

    def _reoffer_later(self, m: Machine, delay_s: float) -> None:
        """Offers the shard again once a backoff has passed (no commit may come)."""
        def fire() -> None:
            with self._lock:
                self._timers.discard(timer)
            self.offer(m, m.cached())

        timer = threading.Timer(delay_s, fire)
        timer.daemon = True
        with self._lock:
            if self._closed:
                return
            self._timers.add(timer)
        timer.start()

    def _record_failure(
        self, m: Machine, req: CompactionRequest, key: tuple[str, tuple[int, ...]], e: BaseException
    ) -> None:
        deterministic = is_deterministic_failure(e)
        with self._lock:
            self.failed += 1
            f = self._failures.setdefault(key, _Failure())
            f.failures += 1
            f.deterministic += int(deterministic)
            f.last_error = f"{type(e).__name__}: {e}"
            delay = self._backoff_s(f.failures)
            f.retry_at = time.monotonic() + delay
            do_quarantine = (
                deterministic
                and not f.quarantined
                and f.deterministic >= self.client.config.compaction_quarantine_after
            )
            if do_quarantine:
                f.quarantined = True
                self.quarantined += 1
            n = f.failures
        if do_quarantine:
            quarantine(m, req, e, n)
            return
        level = logging.ERROR if isinstance(e, CorruptionError) else logging.WARNING
        log.log(
            level,
            "shard %s: background merge of batches %s failed (%d time(s); retrying in %.1f s): %s: %s",
            m.shard_id, list(req.batch_ids), n, delay, type(e).__name__, e,
            exc_info=not isinstance(e, PersistError),
        )
        self._reoffer_later(m, delay)

    def _run(self, m: Machine, req: CompactionRequest, key: tuple[str, tuple[int, ...]]) -> None:
        try:
            s = m.cached()
            with kernels.no_polars_import():
                res = compact_request(
                    m, _schemas(s), self.client.config, req, context=self.client, writers=self.writers
                )
            with self._lock:
                self.completed += 1
                self.applied += int(res.applied)
                self._failures.pop(key, None)
        except RuntimeError as e:
            if self._closed or "shutdown" in str(e) or "interpreter" in str(e):
                # The interpreter is exiting (its thread pools refuse work): the merge is
                # abandoned; its partial output is left for the leaked-blob sweeper.
                log.info("shard %s: background compaction abandoned: %s", m.shard_id, e)
            else:
                self._record_failure(m, req, key, e)
        except Exception as e:
            self._record_failure(m, req, key, e)
        finally:
            self._release(key)
            # Our commit re-derived merges while our batches were still claimed: plan
            # again now that they are free (a failed merge's batches stay barriers
            # until its backoff has passed).
            self.offer(m, m.cached())

    def _run_gc(self, m: Machine) -> None:
        try:
            summary = gcmod.collect_garbage(m)
            with self._lock:
                self.gc_runs += 1
                self._gc_failures.pop(m.shard_id, None)
            if summary.errors:
                log.warning("shard %s: background GC had errors: %s", m.shard_id, summary.errors[:5])
        except Exception as e:
            if isinstance(e, RuntimeError) and (self._closed or "shutdown" in str(e) or "interpreter" in str(e)):
                # The interpreter is exiting (its thread pools refuse work): GC is
                # abandoned, nothing was half done that a later GC won't finish.
                log.info("shard %s: background GC abandoned: %s", m.shard_id, e)
                return
            with self._lock:
                self.gc_failed += 1
                f = self._gc_failures.setdefault(m.shard_id, _Failure())
                f.failures += 1
                f.last_error = f"{type(e).__name__}: {e}"
                delay = self._backoff_s(f.failures)
                f.retry_at = time.monotonic() + delay
            level = logging.ERROR if isinstance(e, CorruptionError) else logging.WARNING
            log.log(level, "shard %s: background GC failed (retrying in %.1f s): %s: %s",
                    m.shard_id, delay, type(e).__name__, e)
            self._reoffer_later(m, delay)
        finally:
            with self._lock:
                self._gc_pending.discard(m.shard_id)
                self._idle.notify_all()

    def wait_idle(self, timeout_s: float = 30.0) -> bool:
        """Waits until nothing is queued or running (tests and benchmarks use this)."""
        with self._idle:
            return self._idle.wait_for(
                lambda: not self._pending and not self._gc_pending and self._warm != "pending"
                and self._settler.idle(),
                timeout_s,
            )

    def failures(self) -> list[dict[str, Any]]:
        """Merges currently backing off or quarantined in this process."""
        with self._lock:
            now = time.monotonic()
            return [
                {
                    "shard": k[0],
                    "batch_ids": list(k[1]),
                    "failures": f.failures,
                    "quarantined": f.quarantined,
                    "retry_in_s": None if f.quarantined else round(max(0.0, f.retry_at - now), 3),
                    "error": f.last_error,
                }
                for k, f in sorted(self._failures.items())
            ]

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "pending": len(self._pending),
                "completed": self.completed,
                "applied": self.applied,
                "failed": self.failed,
                "dropped": self.dropped,
                "gc_runs": self.gc_runs,
                "gc_failed": self.gc_failed,
                "quarantined": self.quarantined,
                "held_back": self.held_back,
                "backing_off": sum(1 for f in self._failures.values() if not f.quarantined),
            }

    def close(self) -> None:
        with self._lock:
            self._closed = True
            timers = list(self._timers)
            self._timers.clear()
        for t in timers:
            t.cancel()
        self._settler.close()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.writers.close()
