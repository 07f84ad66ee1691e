"""The actors of a history: each one is a real OS process driving one shard.

``actor_main(cfg_json, actor, incarnation)`` is the process entry point (the runner
starts it through a multiprocessing ``forkserver`` context, so a restart after a
``kill -9`` costs a fork, not a Python start-up). Every actor:

- opens the location through the audit wrappers (``persist_lib.testing.audit``) under a
  seeded ``UnreliableHandle`` (5% faults by default: Materialize's split), plus a
  seeded schedule of total outages (longer than the client's retry deadline, so some
  operations surface ``Determinate``/``Indeterminate`` errors to the caller);
- logs every client operation as invoke/complete records (``persist_lib.testing.history``);
- runs until the runner creates the stop file, then releases its handles and exits.

Roles: ``writer`` (compare_and_append with good and stale bounds, definite ``append``
of a deterministic stream, heartbeats, and *long writes*: a batch built part by part
with pauses, through the handle's builder or Spark-style under a separately
registered part writer, then committed with ``compare_and_append_batch``), ``reader``
(snapshots, one listen at a time, since downgrades, backward downgrades that must
fail), ``compactor``, ``gc`` (GC runs, and leaked-blob *sweeps* that delete, with a
clock hours ahead) and ``expirer`` (with a clock somewhat ahead). Writers write
unique, traceable records: the key of every inserted record is ``{op id}/{i}``, and
the definite stream's records are ``d/{t}/{j}``.

The fault model beyond location errors and kill -9 (issue 13):

- **interrupts**: a seeded ``InterruptPlan`` raises BaseExceptions shaped like
  KeyboardInterrupt and a run cancellation inside client calls, before a blob write
  or a compare-and-set, or after it took effect (a CAS that landed; post-commit work
  such as an inline rollup included). The op is logged ``info``; the actor carries on
  with the same client (and sometimes drops its handle);
- **clock skew**: writers and readers run with a fixed skew in
  ``[-actor_clock_skew_ms, +actor_clock_skew_ms]``, the expirer ahead by up to
  ``expirer_clock_ahead_ms`` and the sweeper ``sweeper_clock_ahead_ms`` ahead;
- **long writes** overlapping sweeps (``long_write_rate``, ``long_write_pause_s``);
- **heartbeat faults**: a handle's heartbeat raises an unexpected error
  (``heartbeat_fault_rate``) in the heartbeat thread, which must survive it: an actor
  that finds the thread dead while it holds handles logs ``heartbeat_thread_dead``;
- **concurrent first opens**: with ``fresh_start`` nothing creates the location or the
  shard before the actors, which all start at once;
- **divergent verified appends** (``verified_append_rate``, issue 26; ``divergent``): a
  writer replays committed times through an ingestion output's verified append with
  updates that differ from the committed ones, often from below the since; it must
  stop (``NeedsNewRendition`` or ``ReplayUnverifiable``), never return normally.

This module holds the entry point and the maintenance roles; the writer and reader
roles are in ``writer_actor`` and ``reader_actor``, their shared plumbing in
``actor_base``, the location stack in ``actor_location`` and ``HistoryConfig`` in
``history_config``.
"""

from __future__ import annotations

import contextlib
import json
import random
import time
import traceback
from typing import Any

from persist_lib.errors import BlobNotFound, CorruptionError, PersistError
from persist_lib.testing.actor_base import Actor
from persist_lib.testing.history_config import HistoryConfig
from persist_lib.testing.reader_actor import Reader
from persist_lib.testing.writer_actor import Writer


class Compactor(Actor):
    def step(self) -> None:
        self.run_op("compact", {}, lambda: _jsonable(self.client.compact(self.shard)))
        self.sleep(0.05, 0.3)


class Gc(Actor):
    """GC runs, leak reports, and (``sweep_rate``) sweeps that delete, with the clock
    ``sweeper_clock_ahead_ms`` ahead: only the in-flight guard protects writes then.
    (Only the sweeps run ahead: a GC state change would carry the skewed walltime into
    every later state version.)"""

    def step(self) -> None:
        if self.rng.random() < self.cfg.sweep_rate:
            from persist_lib.testing.hooks import clock_skew

            ahead = self.cfg.sweeper_clock_ahead_ms

            def sweep() -> int:
                with clock_skew(self.client.config, ahead):
                    return len(self.client.unreferenced_blobs(self.shard, 60_000, delete=True))

            self.run_op("sweep", {"clock_ahead_ms": ahead}, sweep)
        elif self.rng.random() < 0.15:
            self.run_op(
                "leak_report",
                {},
                lambda: len(self.client.unreferenced_blobs(self.shard, 60_000, delete=False)),
            )
        else:
            self.run_op("gc", {}, lambda: _jsonable(self.client.gc(self.shard)))
        self.sleep(0.05, 0.3)


class Expirer(Actor):
    def clock_skew_ms(self) -> int:
        x = self.cfg.expirer_clock_ahead_ms
        return int(random.Random(self.seed ^ 0xE7).uniform(0, x)) if x else 0

    def step(self) -> None:
        self.run_op("expire_leases", {}, lambda: _jsonable(self.client.expire_leases(self.shard)))
        self.sleep(0.1, 0.4)


ROLES: dict[str, type[Actor]] = {
    "writer": Writer,
    "reader": Reader,
    "compactor": Compactor,
    "gc": Gc,
    "expirer": Expirer,
}


def role_of(actor: str) -> str:
    return {"w": "writer", "r": "reader"}.get(actor[0], actor) if actor[:1] in "wr" and actor[1:].isdigit() else actor


def _jsonable(x: Any) -> Any:
    return json.loads(json.dumps(x, default=str))


def actor_main(cfg_json: str, actor: str, incarnation: int) -> None:
    """Process entry point: run ``actor`` until the stop file appears."""
    cfg = HistoryConfig.from_json(cfg_json)
    from persist_lib.testing import planted

    stack = contextlib.ExitStack()
    stack.enter_context(planted.activate([p for p in cfg.planted if p not in planted.CONSENSUS_BUGS]))
    run_actor(ROLES[role_of(actor)](cfg, actor, incarnation), role_of(actor), stack)


def run_actor(a: Actor, role: str, stack: contextlib.ExitStack) -> None:
    """Runs ``a``'s steps until the stop file appears, then releases its handles; closes
    ``stack`` (its planted bugs) at the end."""
    a.log.note("start", role=role, seed=a.seed)
    a.start_outages()
    try:
        while not a.stopped():
            try:
                a.step()
                a.check_heartbeat_thread()
            except PersistError as e:  # outside a logged op (e.g. reading frontiers)
                a.log.note("step_error", error=str(e)[:500], error_type=type(e).__name__)
                if isinstance(e, CorruptionError | BlobNotFound):
                    a.log.note("unexpected_error", error=str(e)[:500], error_type=type(e).__name__)
                time.sleep(0.05)
        shutdown = getattr(a, "shutdown", None)
        if shutdown is not None:
            # Released without faults, so a clean stop leaves no lease behind.
            if a.loc.handle is not None:
                a.loc.handle.disable()
            shutdown()
        a.log.note("stop", faults=a.faults())
    except Exception as e:  # noqa: BLE001 - logged for the checker, then the process exits
        a.log.note("crash_unexpected", error=f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        raise
    finally:
        a.close()
        stack.close()
