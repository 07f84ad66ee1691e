"""The shared plumbing of every actor: its log, location, faults and logged operations.

``Actor`` runs one logged operation at a time (``run_op``: invoke/complete records with
the Jepsen outcome from ``classify``), injects heartbeat faults and total outages, and
reports a dead heartbeat thread. The roles subclass it (``writer_actor``,
``reader_actor``, the maintenance actors in ``actors``).
"""

from __future__ import annotations

import contextlib
import os
import random
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from persist_lib.errors import (
    CorruptionError,
    Determinate,
    Indeterminate,
    InvalidUsage,
    PersistError,
    Timeout,
    UpperMismatch,
)
from persist_lib.testing.actor_location import build_location
from persist_lib.testing.history import FAIL, INFO, OK, EventLog
from persist_lib.testing.history_config import HistoryConfig, actor_seed


def classify(e: BaseException) -> str:
    """Jepsen outcome of an operation that raised ``e``."""
    from persist_lib.ingest.errors import NeedsNewRendition, ReplayUnverifiable
    from persist_lib.testing.hooks import INTERRUPTS

    if isinstance(e, INTERRUPTS):
        return INFO  # interrupted: it may or may not have happened
    if isinstance(e, NeedsNewRendition | ReplayUnverifiable):
        return FAIL  # a verified append that stopped: it wrote nothing
    if isinstance(e, UpperMismatch | InvalidUsage | Timeout):
        return FAIL
    if isinstance(e, Indeterminate):
        return INFO
    if isinstance(e, Determinate):
        return FAIL
    return INFO  # CorruptionError, bugs: we don't know what happened


class Actor:
    """Shared plumbing: the log, the location, outages, and running one logged op."""

    def __init__(self, cfg: HistoryConfig, actor: str, incarnation: int) -> None:
        self.cfg = cfg
        self.actor = actor
        self.inc = incarnation
        self.seed = actor_seed(cfg.seed, actor, incarnation)
        self.rng = random.Random(self.seed)
        self.log = EventLog(os.path.join(cfg.log_dir, f"{actor}.{incarnation}.jsonl"), actor, incarnation)
        from persist_lib.testing.hooks import InterruptPlan, skewed_clock

        self.skew_ms = self.clock_skew_ms()
        self.interrupts = (
            InterruptPlan(self.seed ^ 0x1A7, cfg.interrupt_rate, main_thread_only=True)
            if cfg.interrupt_rate > 0
            else None
        )
        self.loc = build_location(
            cfg, self.log, f"{actor}.{incarnation}.jsonl", faults=True, seed=self.seed,
            now_ms=skewed_clock(_system_ms, self.skew_ms) if self.skew_ms else None,
            interrupts=self.interrupts,
        )
        self.client = self.loc.client
        self.shard = cfg.shard_id
        self.hb_dead_reported = False

    def clock_skew_ms(self) -> int:
        """This actor's fixed clock offset (subclasses: maintenance runs ahead)."""
        x = self.cfg.actor_clock_skew_ms
        return int(random.Random(self.seed ^ 0xC10C).uniform(-x, x)) if x else 0

    def faulty_heartbeats(self, h: Any) -> None:
        """Makes ``h.heartbeat`` raise unexpected errors in the heartbeat thread."""
        rate = self.cfg.heartbeat_fault_rate
        if rate <= 0:
            return
        orig = h.heartbeat
        rng = random.Random(self.seed ^ 0x4EA7)
        lock = threading.Lock()

        def heartbeat() -> None:
            if threading.current_thread().name == "persist-heartbeat":
                with lock:
                    x = rng.random()
                if x < rate:
                    self.log.note("heartbeat_fault_injected")
                    raise (RuntimeError if x < rate / 2 else CorruptionError)("injected heartbeat fault")
            orig()

        h.heartbeat = heartbeat

    def check_heartbeat_thread(self) -> None:
        """The client's heartbeat thread must be alive while it has handles to keep."""
        c = self.client
        if self.hb_dead_reported or not c.config.background_heartbeats or not len(c._handles):
            return
        t = c._hb_thread
        if t is None or not t.is_alive():
            self.hb_dead_reported = True
            self.log.note("heartbeat_thread_dead", handles=len(c._handles))

    def stopped(self) -> bool:
        return os.path.exists(self.cfg.stop_path)

    def sleep(self, lo: float, hi: float) -> None:
        time.sleep(self.rng.uniform(lo, hi))

    def start_outages(self) -> None:
        """A background thread that makes this actor's location totally unavailable at
        random times, asynchronously to its operations (the handle also starts outages
        right after some injected timeouts: ``PartitioningHandle``)."""
        h = self.loc.handle
        if h is None:
            return
        h.on_outage = lambda kind, d: self.log.note("outage", fault=kind, duration_s=d)
        if self.cfg.outage_mean_interval_s <= 0:
            return
        rng = random.Random(self.seed ^ 0x5EED)

        def loop() -> None:
            while not self.stopped() and h.enabled:
                time.sleep(rng.expovariate(1.0 / self.cfg.outage_mean_interval_s))
                h.outage(rng.choice(["timeout_only", "determinate"]), rng.uniform(*self.cfg.outage_s))

        threading.Thread(target=loop, name="outages", daemon=True).start()

    def step(self) -> None:
        """One operation of this role (subclasses)."""
        raise NotImplementedError

    def faults(self) -> dict[str, int]:
        h = self.loc.handle
        out = dict(h.snapshot_counts()) if h is not None else {}
        if self.interrupts is not None:
            out["interrupt_before"] = self.interrupts.counts["before"]
            out["interrupt_after"] = self.interrupts.counts["after"]
        return out

    def run_op(
        self,
        op: str,
        args: dict[str, Any],
        fn: Callable[[], Any],
        op_id: str | None = None,
    ) -> tuple[str, Any, BaseException | None]:
        """Runs ``fn`` as a logged operation; returns (outcome, result, error)."""
        from persist_lib.testing.hooks import INTERRUPTS

        oid = self.log.invoke(op, args, op_id)
        try:
            res = fn()
        except INTERRUPTS as e:
            self.log.complete(oid, INFO, error=str(e), error_type=type(e).__name__, faults=self.faults())
            self.after_interrupt()
            return INFO, None, e
        except Exception as e:  # noqa: BLE001 - every outcome is logged
            outcome = classify(e)
            tb = None if isinstance(e, PersistError) else traceback.format_exc()
            self.log.complete(
                oid,
                outcome,
                error=f"{e}" + (f"\n{tb}" if tb else ""),
                error_type=type(e).__name__,
                faults=self.faults(),
                **({"current_upper": e.current.to_json()} if isinstance(e, UpperMismatch) else {}),
            )
            return outcome, None, e
        self.log.complete(oid, OK, result=res, faults=self.faults())
        return OK, res, None

    def after_interrupt(self) -> None:
        """Like a program that caught the interrupt: carry on (subclasses may drop handles)."""

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.client.close()
        self.log.close()


def _system_ms() -> int:
    return int(time.time() * 1000)
