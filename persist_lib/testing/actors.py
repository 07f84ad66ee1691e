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
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from persist_lib.errors import (
    BlobNotFound,
    CorruptionError,
    Determinate,
    Indeterminate,
    InvalidUsage,
    LeaseExpired,
    PersistError,
    Timeout,
    UpperMismatch,
)
from persist_lib.testing.history import FAIL, INFO, OK, EventLog

KEY_SCHEMA = pa.schema([("k", pa.string())])
VAL_SCHEMA = pa.schema([("v", pa.int64())])

Update = tuple[tuple[tuple[str], tuple[int]], int, int]


@dataclass
class HistoryConfig:
    """Everything one history needs; JSON-serializable (it is passed to every actor)."""

    seed: int
    root: str
    consensus_uri: str
    shard_id: str
    target_ops: int = 300
    writers: int = 3
    readers: int = 2
    compactor: bool = True
    gc: bool = True
    expirer: bool = True
    unreliability: float = 0.05
    stall_rate: float = 0.01
    stall_s: float = 0.02
    outage_mean_interval_s: float = 5.0  # per actor: total outages start at random times
    outage_s: tuple[float, float] = (0.3, 1.5)
    partition_after_timeout: float = 0.2  # chance an injected timeout starts an outage
    crash_mean_interval_s: float = 1.5
    max_crashes: int = 6
    retry_deadline_s: float = 1.0
    reader_lease_ms: int = 2500
    writer_lease_ms: int = 4000
    inline_threshold: int = 4096
    inline_max_total: int = 1 << 20
    rollup_interval: int = 16
    background_compaction: bool = False
    time_limit_s: float = 120.0
    planted: list[str] = field(default_factory=list)
    # Issue 13's wider fault model (module docstring).
    interrupt_rate: float = 0.0
    actor_clock_skew_ms: int = 0
    expirer_clock_ahead_ms: int = 0
    sweeper_clock_ahead_ms: int = 0
    sweep_rate: float = 0.0
    long_write_rate: float = 0.0
    long_write_pause_s: tuple[float, float] = (0.05, 0.5)
    heartbeat_fault_rate: float = 0.0
    fresh_start: bool = False
    # Parts of at least this many Arrow bytes are written unsorted (None: all sorted).
    unsorted_min_bytes: int | None = None
    # Merges that fit their budget run in memory (False: always the streaming merge).
    compaction_in_memory: bool = True
    # Writer steps that replay committed times with divergent updates through a
    # verified append (module docstring).
    verified_append_rate: float = 0.0

    @property
    def lease_slack_ms(self) -> float:
        """How early a lease may lapse in wall time: clocks ahead expire sooner, clocks
        behind record older heartbeats."""
        return 100.0 + self.expirer_clock_ahead_ms + self.actor_clock_skew_ms

    def __repr__(self) -> str:  # the consensus URI may hold a password
        from persist_lib.location.redaction import redacted_dataclass_repr

        return redacted_dataclass_repr(self)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, s: str) -> HistoryConfig:
        d = json.loads(s)
        d["outage_s"] = tuple(d["outage_s"])
        if "long_write_pause_s" in d:
            d["long_write_pause_s"] = tuple(d["long_write_pause_s"])
        return cls(**d)

    # Paths inside ``root``.
    @property
    def blob_dir(self) -> str:
        return os.path.join(self.root, "blob")

    @property
    def graveyard_dir(self) -> str:
        return os.path.join(self.root, "graveyard")

    @property
    def log_dir(self) -> str:
        return os.path.join(self.root, "logs")

    @property
    def archive_dir(self) -> str:
        return os.path.join(self.root, "archive")

    @property
    def stop_path(self) -> str:
        return os.path.join(self.root, "STOP")


def definite_records(seed: int, t: int) -> list[tuple[str, int]]:
    """The deterministic stream every definite appender writes at time ``t``."""
    rng = random.Random(f"definite/{seed}/{t}")
    return [(f"d/{t}/{j}", rng.randint(0, 999)) for j in range(rng.randint(0, 2))]


def definite_updates(seed: int, lo: int, hi: int) -> list[Update]:
    return [(((k,), (v,)), t, 1) for t in range(lo, hi) for k, v in definite_records(seed, t)]


def actor_seed(seed: int, actor: str, incarnation: int) -> int:
    return random.Random(f"{seed}/{actor}/{incarnation}").getrandbits(48)


# ----- building the location ------------------------------------------------------------


@dataclass
class Location:
    """A client plus the wrappers a history needs to look at."""

    client: Any
    handle: Any  # UnreliableHandle (None when fault-free)
    audit_blob: Any
    audit_consensus: Any
    raw_consensus: Any


def build_location(
    cfg: HistoryConfig,
    log: EventLog | None,
    archive_name: str,
    *,
    faults: bool,
    seed: int,
    now_ms: Callable[[], int] | None = None,
    interrupts: Any = None,
) -> Location:
    """A ``PersistClient`` on the history's location: audit wrappers under fault injection."""
    from persist_lib.config import PersistConfig
    from persist_lib.handles.client import PersistClient
    from persist_lib.location.file_blob import FileBlob
    from persist_lib.location.unreliable import FaultRates, UnreliableBlob, UnreliableConsensus
    from persist_lib.testing import planted
    from persist_lib.testing.audit import AuditBlob, AuditConsensus
    from persist_lib.testing.faults import PartitioningHandle

    raw_cons = planted.open_consensus(cfg.consensus_uri, cfg.planted)
    audit_cons = AuditConsensus(raw_cons, os.path.join(cfg.archive_dir, archive_name), log)
    audit_blob = AuditBlob(FileBlob(cfg.blob_dir), FileBlob(cfg.graveyard_dir), raw_cons, log)
    config = PersistConfig.for_tests(
        retry_deadline_s=cfg.retry_deadline_s,
        snapshot_timeout_s=2.0,
        reader_lease_ms=cfg.reader_lease_ms,
        writer_lease_ms=cfg.writer_lease_ms,
        background_heartbeats=True,
        inline_threshold=cfg.inline_threshold,
        inline_max_total=cfg.inline_max_total,
        rollup_interval=cfg.rollup_interval,
        unsorted_min_bytes=cfg.unsorted_min_bytes,
        compaction_in_memory=cfg.compaction_in_memory,
        compaction_enabled=cfg.background_compaction,
        listen_poll_max_s=0.2,
        rng=random.Random(seed),
    )
    if now_ms is not None:
        config.now_ms = now_ms
    handle = None
    blob: Any = audit_blob
    cons: Any = audit_cons
    if faults:
        base = FaultRates.from_unreliability(cfg.unreliability)
        rates = FaultRates(
            determinate=base.determinate,
            applied_then_timeout=base.applied_then_timeout,
            timeout_only=base.timeout_only,
            stall=cfg.stall_rate,
        )
        handle = PartitioningHandle(
            seed,
            rates,
            stall_s=cfg.stall_s,
            partition_after_timeout=cfg.partition_after_timeout,
            partition_s=cfg.outage_s,
        )
        blob = UnreliableBlob(audit_blob, handle)
        cons = UnreliableConsensus(audit_cons, handle)
    if interrupts is not None:
        from persist_lib.testing.hooks import InterruptingBlob, InterruptingConsensus

        blob = InterruptingBlob(blob, interrupts)
        cons = InterruptingConsensus(cons, interrupts)
    client = PersistClient(
        blob, cons, config, blob_uri=f"file://{cfg.blob_dir}", consensus_uri=cfg.consensus_uri
    )
    return Location(client, handle, audit_blob, audit_cons, raw_cons)


# ----- outcomes -----------------------------------------------------------------------------


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


# ----- writers ------------------------------------------------------------------------------


class Writer(Actor):
    def __init__(self, cfg: HistoryConfig, actor: str, incarnation: int) -> None:
        super().__init__(cfg, actor, incarnation)
        self.w: Any = None
        self.acked: list[tuple[str, int]] = []  # inserted records we may retract

    def open(self) -> None:
        while self.w is None and not self.stopped():

            def do() -> dict[str, Any]:
                self.w = self.client.open_writer(
                    self.shard, KEY_SCHEMA, VAL_SCHEMA, purpose=f"{self.actor}.{self.inc}"
                )
                self.faulty_heartbeats(self.w)
                return {"writer_id": self.w.writer_id}

            outcome, _, _ = self.run_op("open_writer", {}, do)
            if outcome != OK:
                self.w = None
                self.sleep(0.05, 0.2)

    def step(self) -> None:
        if self.w is None:
            self.open()
            return
        w = self.w
        try:
            upper_t = (w.fetch_recent_upper() if self.rng.random() < 0.5 else w.upper).time
        except PersistError:
            self.sleep(0.01, 0.05)
            return
        if upper_t is None:
            return
        r = self.rng.random()
        if self.rng.random() < self.cfg.long_write_rate:
            self.long_write(upper_t)
        elif self.cfg.verified_append_rate > 0 and self.rng.random() < self.cfg.verified_append_rate:
            self.verified_append()
        elif r < 0.55:
            self.caa(upper_t, stale=False)
        elif r < 0.62:
            self.caa(upper_t, stale=True)
        elif r < 0.95:
            self.definite_append(upper_t)
        else:
            _, _, e = self.run_op("writer_heartbeat", {"writer_id": w.writer_id}, w.heartbeat)
            self.after(e)
        self.sleep(0.0, 0.03)

    def caa(self, upper_t: int, *, stale: bool) -> None:
        w = self.w
        if stale:
            if upper_t == 0:
                return
            expected = max(0, upper_t - self.rng.randint(1, 3))
            new = expected + 1
        else:
            expected = upper_t
            new = expected + self.rng.randint(1, 3)
        oid = self.log.new_op_id()
        ups: list[Update] = []
        for i in range(self.rng.choice([0, 1, 1, 2, 3, 4])):
            ups.append(((((f"{oid}/{i}",), (self.rng.randint(0, 999),))), self.rng.randrange(expected, new), 1))
        retracted: tuple[str, int] | None = None
        if self.acked and self.rng.random() < 0.3:
            retracted = self.acked.pop(self.rng.randrange(len(self.acked)))
            ups.append((((retracted[0],), (retracted[1],)), self.rng.randrange(expected, new), -1))
        args = {
            "writer_id": w.writer_id,
            "expected": expected,
            "new": new,
            "stale": stale,
            "updates": [[u[0][0][0], u[0][1][0], u[1], u[2]] for u in ups],
        }
        def do_caa() -> dict[str, Any]:
            w.compare_and_append(ups, expected, new)
            return {"seqno": w.last_commit_seqno}

        outcome, _, e = self.run_op("caa", args, do_caa, op_id=oid)
        if outcome == OK:
            self.acked += [(u[0][0][0], u[0][1][0]) for u in ups if u[2] > 0]
        elif outcome == FAIL and retracted is not None:
            self.acked.append(retracted)  # definitely not retracted: may retract later
        self.after(e)

    def long_write(self, upper_t: int) -> None:
        """A batch built slowly, part by part, then committed with one CAS: through the
        handle's own builder, or Spark-style (parts under a separately registered part
        writer, released by the commit). Sweeps with a clock hours ahead run meanwhile."""
        from persist_lib.shard.batch_builder import BatchBuilder
        from persist_lib.shard.part_writers import PartWriter

        w = self.w
        expected, new = upper_t, upper_t + self.rng.randint(1, 3)
        oid = self.log.new_op_id()
        ups: list[Update] = [
            ((((f"{oid}/{i}",), (self.rng.randint(0, 999),))), self.rng.randrange(expected, new), 1)
            for i in range(self.rng.randint(1, 6))
        ]
        spark_style = self.rng.random() < 0.5
        pauses = [self.rng.uniform(*self.cfg.long_write_pause_s) for _ in range(len(ups) + 1)]
        args = {
            "writer_id": w.writer_id,
            "expected": expected,
            "new": new,
            "stale": False,
            "long": "spark" if spark_style else "builder",
            "updates": [[u[0][0][0], u[0][1][0], u[1], u[2]] for u in ups],
        }

        def do() -> dict[str, Any]:
            pw = None
            if spark_style:
                pw = PartWriter.register(
                    self.client.machine(self.shard), purpose="spark-style", client=self.client
                )
            b = BatchBuilder(
                self.client.blob, w.schemas, shard=w.shard_id,
                writer=pw.writer_id if pw is not None else w.writer_id,
                lower=_frontier(expected), target_part_bytes=1, max_inflight_uploads=1,
                inline_threshold=0, executor=self.client.upload_executor(),
            )
            try:
                for u, pause in zip(ups, pauses, strict=False):
                    b.add(w.normalize([u]))  # a part per update (target 1 byte)
                    time.sleep(pause)
                batch = b.finish(new)
            except Exception:
                if pw is not None:
                    pw.release()
                raise
            time.sleep(pauses[-1])
            w.compare_and_append_batch(
                batch, expected, new, release_part_writer=pw.writer_id if pw is not None else None
            )
            if pw is not None:
                pw.release()
            return {"seqno": w.last_commit_seqno}

        outcome, _, e = self.run_op("caa", args, do, op_id=oid)
        if outcome == OK:
            self.acked += [(u[0][0][0], u[0][1][0]) for u in ups]
        self.after(e)

    def after_interrupt(self) -> None:
        if self.rng.random() < 0.3:
            self.w = None  # the program abandons the handle (its lease lapses)

    def definite_append(self, upper_t: int) -> None:
        w = self.w
        lo = max(0, upper_t - self.rng.randint(0, 2))
        hi = max(lo + 1, upper_t) + self.rng.randint(0, 3)
        ups = definite_updates(self.cfg.seed, lo, hi)
        args = {"writer_id": w.writer_id, "lower": lo, "upper": hi, "n": len(ups)}
        def do_append() -> dict[str, Any]:
            w.append(ups, lo, hi)
            return {"seqno": w.last_commit_seqno, "skipped": w.last_append_skipped}

        _, _, e = self.run_op("append", args, do_append)
        self.after(e)

    def verified_append(self) -> None:
        """A divergent verified append (``testing.divergent``): it must never return."""
        from persist_lib.testing.divergent import divergent_verified_append

        divergent_verified_append(self)

    def after(self, e: BaseException | None) -> None:
        # A lapsed lease (expired after an outage or a stall) needs a new handle.
        if isinstance(e, LeaseExpired):
            self.w = None

    def shutdown(self) -> None:
        if self.w is not None:
            w = self.w
            self.run_op("expire_writer", {"writer_id": w.writer_id}, w.expire)


# ----- readers ------------------------------------------------------------------------------


class Reader(Actor):
    def __init__(self, cfg: HistoryConfig, actor: str, incarnation: int) -> None:
        super().__init__(cfg, actor, incarnation)
        self.r: Any = None
        self.listen: Any = None
        self.listen_id: str | None = None

    def open(self) -> None:
        while self.r is None and not self.stopped():
            def do() -> dict[str, Any]:
                self.r = self.client.open_leased_reader(
                    self.shard, KEY_SCHEMA, VAL_SCHEMA, purpose=f"{self.actor}.{self.inc}"
                )
                self.faulty_heartbeats(self.r)
                return {"reader_id": self.r.reader_id}

            outcome, _, _ = self.run_op("open_reader", {}, do)
            if outcome != OK:
                self.r = None
                self.sleep(0.05, 0.2)
        self.listen = None

    def step(self) -> None:
        if self.r is None:
            self.open()
            return
        r = self.r
        x = self.rng.random()
        if x < 0.24:
            e = self.snapshot()
        elif x < 0.30:
            e = self.snapshot_splits()
        elif x < 0.70:
            e = self.listen_step()
        elif x < 0.85:
            e = self.downgrade()
        elif x < 0.90:
            e = self.backward_downgrade()
        else:
            _, _, e = self.run_op("reader_heartbeat", {"reader_id": r.reader_id}, r.heartbeat)
        if isinstance(e, LeaseExpired):
            self.r = None
            self.listen = None
        self.sleep(0.0, 0.03)

    def _since_upper(self) -> tuple[int, int]:
        r = self.r
        s = r.since.time
        u = r.upper.time
        return (s if s is not None else 0), (u if u is not None else 0)

    def snapshot(self) -> BaseException | None:
        r = self.r
        try:
            since, upper = self._since_upper()
        except PersistError as err:
            return err
        as_of = self.rng.randint(since, upper - 1) if upper - 1 >= since else since

        def do() -> Any:
            t = r.snapshot(as_of, timeout_s=1.0)
            cols = t.to_pydict()
            return [list(x) for x in zip(cols["k"], cols["v"], cols["ts"], cols["diff"], strict=True)]

        _, _, e = self.run_op("snapshot", {"reader_id": r.reader_id, "as_of": as_of}, do)
        return e

    def snapshot_splits(self) -> BaseException | None:
        """Splits (as Spark executors get them) fetched after a pause: the read handle's
        seqno hold must keep their parts alive meanwhile."""
        r = self.r
        try:
            since, upper = self._since_upper()
        except PersistError as err:
            return err
        as_of = self.rng.randint(since, upper - 1) if upper - 1 >= since else since
        n = self.rng.randint(1, 3)
        pause = self.rng.uniform(0.05, 0.6)

        def do() -> Any:
            splits = r.snapshot_splits(as_of, n, timeout_s=1.0)
            try:
                time.sleep(pause)
                out: list[list[Any]] = []
                for sp in splits:
                    try:
                        t = sp.fetch(self.client.blob)
                    except BlobNotFound:
                        r._me(r._machine.fetch_latest())  # LeaseExpired if the lease lapsed
                        raise
                    c = t.to_pydict()
                    out += [list(x) for x in zip(c["k"], c["v"], c["ts"], c["diff"], strict=True)]
                return out
            finally:
                r.release_splits()

        _, _, e = self.run_op(
            "snapshot_splits", {"reader_id": r.reader_id, "as_of": as_of, "splits": n, "pause_s": pause}, do
        )
        return e

    def listen_step(self) -> BaseException | None:
        r = self.r
        if self.listen is None or self.rng.random() < 0.03:
            try:
                since, upper = self._since_upper()
            except PersistError as err:
                return err
            as_of = self.rng.randint(since, max(since, upper))
            lid = self.log.new_op_id()

            def do_open() -> Any:
                self.listen = r.listen(as_of)
                return {"listen_id": lid}

            outcome, _, e = self.run_op(
                "listen_open", {"reader_id": r.reader_id, "as_of": as_of, "listen_id": lid}, do_open, op_id=lid
            )
            if outcome != OK:
                self.listen = None
                return e
            self.listen_id = lid
            return None
        lst = self.listen
        frontier = lst.frontier.time

        def do() -> Any:
            from persist_lib.handles.listen import ListenUpdates

            out = []
            for ev in lst.next(timeout_s=0.2):
                if isinstance(ev, ListenUpdates):
                    c = ev.table.to_pydict()
                    out.append(
                        {
                            "kind": "updates",
                            "lower": ev.lower.time,
                            "upper": ev.upper.time,
                            "rows": [list(x) for x in zip(c["k"], c["v"], c["ts"], c["diff"], strict=True)],
                        }
                    )
                else:
                    out.append({"kind": "progress", "upper": ev.upper.time})
            return out

        outcome, _, e = self.run_op(
            "listen_next",
            {"reader_id": r.reader_id, "listen_id": self.listen_id, "as_of": lst.as_of, "frontier": frontier},
            do,
        )
        return e

    def downgrade(self) -> BaseException | None:
        r = self.r
        try:
            since, upper = self._since_upper()
        except PersistError as err:
            return err
        cap = upper - 1
        if self.listen is not None and self.listen.frontier.time is not None:
            cap = min(cap, self.listen.frontier.time - 1)  # listen needs times >= frontier intact
        if cap < since:
            return None
        new = self.rng.randint(since, cap)
        _, _, e = self.run_op(
            "downgrade_since", {"reader_id": r.reader_id, "new_since": new}, lambda: r.downgrade_since(new)
        )
        return e

    def backward_downgrade(self) -> BaseException | None:
        r = self.r
        try:
            since, _ = self._since_upper()
        except PersistError as err:
            return err
        if since == 0:
            return None
        new = since - 1
        _, _, e = self.run_op(
            "downgrade_since_backward",
            {"reader_id": r.reader_id, "new_since": new, "since": since},
            lambda: r.downgrade_since(new),
        )
        return e

    def shutdown(self) -> None:
        if self.r is not None:
            r = self.r
            self.run_op("expire_reader", {"reader_id": r.reader_id}, r.expire)


# ----- maintenance ------------------------------------------------------------------------------


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


def _frontier(t: int) -> Any:
    from persist_lib.frontier import Antichain

    return Antichain([t])


def _schemas() -> Any:
    from persist_lib.shard.codec import Schemas

    return Schemas.create(KEY_SCHEMA, VAL_SCHEMA)


def _jsonable(x: Any) -> Any:
    return json.loads(json.dumps(x, default=str))


def actor_main(cfg_json: str, actor: str, incarnation: int) -> None:
    """Process entry point: run ``actor`` until the stop file appears."""
    cfg = HistoryConfig.from_json(cfg_json)
    from persist_lib.testing import planted

    stack = contextlib.ExitStack()
    stack.enter_context(planted.activate([p for p in cfg.planted if p not in planted.CONSENSUS_BUGS]))
    a = ROLES[role_of(actor)](cfg, actor, incarnation)
    a.log.note("start", role=role_of(actor), seed=a.seed)
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


def prepare_dirs(cfg: HistoryConfig) -> None:
    for d in (cfg.blob_dir, cfg.graveyard_dir, cfg.log_dir, cfg.archive_dir):
        Path(d).mkdir(parents=True, exist_ok=True)
