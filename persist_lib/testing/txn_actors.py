"""The actors of a transactions history: real OS processes writing and reading
transactional collections through their own ``StorageController``.

Roles (``txn_actor_main(cfg_json, actor, incarnation)``; names ``tw<i>``, ``tr<i>``,
``th``, ``tm``):

- **writer** (``tw``): ``insert`` (``ctl.insert`` of 1-4 rows into one collection),
  ``txn`` (``ctl.transaction()`` over 2-3 collections), ``caa`` (``CollectionWriter
  .compare_and_append`` at the collection's upper, rows at two times) and ``caa_stale``
  (one below it: must fail). Every row is traceable (``txn_config.row_key``).
- **reader** (``tr``): ``snapshot`` of a collection at a *committed* time (read from the
  txn log, not through the reader path: ``txn_config.committed_upper``), often the
  newest one, with a bounded wait; one ``listen`` at a time, stepped by ``listen_next``.
- **handover** (``th``): copies collection ``a`` at its committed upper ``U`` into a new
  rendition (``create_rendition``, a transactional backfill) and hands over at ``U``.
  Writers of ``a`` hold a shared ``flock`` during an op, the handover an exclusive one,
  so no write to ``a`` lands between the copy and the handover (a rendition that is not
  active takes writes nobody reads: that is the handover's contract, not a bug).
- **maintenance** (``tm``): ``apply_all``, ``tidy`` and ``recover_orphans`` on the log.

**Kill -9 at every step** (``KillSwitch``): a writer op (and a maintenance tidy) arms,
with probability ``txn_kill_rate``, a kill at one of ``txn_config.KILL_POINTS``: right
after the commit CAS landed, before the 2nd-4th apply to a data shard, before or after
tidy's log CAS. The process then sends itself SIGKILL (its op stays ``info``); the runner
restarts it, and the others must finish what it left. The runner's nemesis kills random
actors on top of that. Faults: the location is wrapped as in the shard histories
(``actor_location``), at ``unreliability``.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
from typing import Any

from persist_lib.errors import PersistError
from persist_lib.testing.actor_base import Actor
from persist_lib.testing.txn_config import (
    COLLECTIONS,
    HANDOVER_COLLECTION,
    TxnHistoryConfig,
    caa_updates,
    committed_upper,
    rows_table,
)

# A stale compare-and-append on an empty collection expects this far ahead of the
# upper: no history of a few hundred operations reaches it (each moves it by 1 or 2).
STALE_AHEAD = 1_000_000


class KillSwitch:
    """Kills this process (SIGKILL) at an armed point of the transaction protocol."""

    def __init__(self, actor: TxnActor) -> None:
        self.actor = actor
        self.armed: str | None = None
        self.applies = 0
        self.target = 0

    def arm(self, point: str, target: int = 0) -> None:
        self.armed, self.applies, self.target = point, 0, target

    def disarm(self) -> None:
        self.armed = None

    def hit(self, point: str) -> None:
        if self.armed == point:
            self.die(point)

    def die(self, point: str) -> None:
        self.actor.log.note("self_kill", point=point)
        os.kill(os.getpid(), signal.SIGKILL)

    def install(self) -> None:
        """Wraps the protocol's steps (after the planted bugs, so it wraps them too)."""
        from persist_lib.txn import apply as ap
        from persist_lib.txn.log import TxnLog
        from persist_lib.txn.txns import Txns

        real_publish = Txns._publish
        real_apply = ap.apply_entry
        real_append = TxnLog.append

        def publish(txns: Any, *a: Any, **kw: Any) -> Any:
            out = real_publish(txns, *a, **kw)
            self.hit("after_commit_cas")
            return out

        def apply(machine: Any, entry: Any) -> bool:
            if self.armed == "between_applies":
                self.applies += 1
                if self.applies == self.target:
                    self.die("between_applies")
            return real_apply(machine, entry)

        def append(log: Any, rows: Any, at: int, **kw: Any) -> None:
            tidy = any(d < 0 for _kv, _t, d in rows)
            if tidy:
                self.hit("before_tidy_cas")
            real_append(log, rows, at, **kw)
            if tidy:
                self.hit("after_tidy_cas")

        Txns._publish = publish  # type: ignore[method-assign,assignment]
        ap.apply_entry = apply  # type: ignore[assignment]
        TxnLog.append = append  # type: ignore[assignment]


class TxnActor(Actor):
    """An actor with its own ``StorageController`` on the history's location."""

    cfg: TxnHistoryConfig

    def __init__(self, cfg: TxnHistoryConfig, actor: str, incarnation: int) -> None:
        super().__init__(cfg, actor, incarnation)
        from persist_lib.storage.controller import StorageController

        # No recovery: another actor's half-made rendition is not ours to roll back.
        self.ctl = StorageController(self.client, recover=False)
        self.kills = KillSwitch(self)

    def maybe_arm(self, points: list[str]) -> None:
        pts = [p for p in self.cfg.txn_kill_points if p in points]
        if pts and self.rng.random() < self.cfg.txn_kill_rate:
            self.kills.arm(self.rng.choice(pts), self.rng.randint(2, 4))  # after >= 1 apply

    def shutdown(self) -> None:
        with contextlib.suppress(PersistError):
            self.ctl.close()


class HandoverLock:
    """Writers of collection ``a`` share it, the handover takes it alone. A *gate* taken
    briefly before the shared lock keeps a waiting handover from starving (flock grants
    new shared locks past a waiting exclusive one). Both are flocks: the kernel releases
    them when their holder is killed."""

    def __init__(self, cfg: TxnHistoryConfig) -> None:
        self._gate = os.open(cfg.lock_path + ".gate", os.O_RDWR | os.O_CREAT, 0o644)
        self._lock = os.open(cfg.lock_path, os.O_RDWR | os.O_CREAT, 0o644)

    @contextlib.contextmanager
    def shared(self) -> Any:
        fcntl.flock(self._gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_SH)
        finally:
            fcntl.flock(self._gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(self._lock, fcntl.LOCK_UN)

    @contextlib.contextmanager
    def exclusive(self) -> Any:
        fcntl.flock(self._gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._lock, fcntl.LOCK_UN)
        finally:
            fcntl.flock(self._gate, fcntl.LOCK_UN)


class TxnWriter(TxnActor):
    def __init__(self, cfg: TxnHistoryConfig, actor: str, incarnation: int) -> None:
        super().__init__(cfg, actor, incarnation)
        self._lock = HandoverLock(cfg)

    @contextlib.contextmanager
    def _shared(self, colls: list[str]) -> Any:
        if HANDOVER_COLLECTION not in colls:
            yield
            return
        with self._lock.shared():
            yield

    def step(self) -> None:
        self.sleep(*self.cfg.txn_writer_pause_s)
        names = sorted(COLLECTIONS)
        kind = self.rng.choice(["insert", "insert", "txn", "txn", "caa", "caa", "caa_stale"])
        oid = self.log.new_op_id()
        if kind == "txn":
            plan = {c: self.rng.randint(1, 4) for c in self.rng.sample(names, self.rng.randint(2, 3))}
        else:
            plan = {self.rng.choice(names): self.rng.randint(1, 4)}
        with self._shared(sorted(plan)):
            self.maybe_arm(["after_commit_cas", "between_applies", "before_tidy_cas", "after_tidy_cas"])
            try:
                self.run_op(kind, {"rows": plan}, lambda: self._write(kind, oid, plan), op_id=oid)
            finally:
                self.kills.disarm()

    def _write(self, kind: str, oid: str, plan: dict[str, int]) -> Any:
        if kind == "insert":
            ((coll, n),) = plan.items()
            return self.ctl.insert(coll, rows_table(oid, coll, n))
        if kind == "txn":
            tx = self.ctl.transaction()
            try:
                for coll, n in sorted(plan.items()):
                    tx.insert(coll, rows_table(oid, coll, n))
            except BaseException:
                tx.abandon()
                raise
            return tx.commit()
        ((coll, n),) = plan.items()
        w = self.ctl.open_writer(coll)
        try:
            upper = w.upper.time
            assert upper is not None
            lower = upper - 1 if kind == "caa_stale" and upper > 0 else upper
            if kind == "caa_stale" and lower == upper:
                # Nothing below it yet: a lower far ahead is stale too. Not just ahead by
                # one: an insert racing this op lands at [0, 1) (inserts write at the
                # upper), and then a lower of 1 is the upper and rightly succeeds (the
                # SEEDS=30 soak's seed 4003 hit that).
                lower = upper + STALE_AHEAD
            w.compare_and_append(caa_updates(oid, coll, n, lower), lower, lower + 2)
            return lower
        finally:
            with contextlib.suppress(PersistError):
                w.expire()


class TxnReader(TxnActor):
    def __init__(self, cfg: TxnHistoryConfig, actor: str, incarnation: int) -> None:
        super().__init__(cfg, actor, incarnation)
        self.readers: dict[str, Any] = {}
        self.listen: tuple[str, str, int, Any, int] | None = None  # id, coll, as_of, listen, steps left

    def _reader(self, coll: str) -> Any:
        r = self.readers.get(coll)
        if r is None:
            r = self.readers[coll] = self.ctl.acquire_read_handle(coll)
        return r

    def _drop(self, coll: str) -> None:
        r = self.readers.pop(coll, None)
        if r is not None:
            with contextlib.suppress(PersistError):
                r.expire()

    def step(self) -> None:
        self.sleep(0.05, 0.3)
        self.maybe_arm(["between_applies"])  # a reader finishing a dead committer's applies
        try:
            if self.listen is not None or self.rng.random() < 0.3:
                self._listen_step()
            else:
                self._snapshot()
        finally:
            self.kills.disarm()

    def _committed(self, coll: str) -> int | None:
        try:
            u = committed_upper(self.ctl, coll)
        except PersistError as e:
            self.log.note("step_error", error=str(e)[:300], error_type=type(e).__name__)
            return None
        return u if u > 0 else None

    def _snapshot(self) -> None:
        coll = self.rng.choice(sorted(COLLECTIONS))
        upper = self._committed(coll)
        if upper is None:
            return
        as_of = upper - 1 if self.rng.random() < 0.6 else self.rng.randint(0, upper - 1)

        def read() -> list[Any]:
            t = self._reader(coll).snapshot(as_of, timeout_s=self.cfg.txn_read_timeout_s)
            return sorted([r["k"], r["v"], r["diff"]] for r in t.to_pylist())

        out, _, err = self.run_op("snapshot", {"coll": coll, "as_of": as_of, "committed_upper": upper}, read)
        if err is not None:
            self._drop(coll)

    def _listen_step(self) -> None:
        if self.listen is None:
            coll = self.rng.choice(sorted(COLLECTIONS))
            upper = self._committed(coll)
            if upper is None:
                return
            as_of = self.rng.randint(max(0, upper - 8), upper - 1)
            oid = self.log.new_op_id()
            holder: list[Any] = []

            def open_() -> int:
                holder.append(self._reader(coll).listen(as_of))
                return as_of

            outcome, _, err = self.run_op("listen_open", {"coll": coll, "as_of": as_of}, open_, op_id=oid)
            if err is None:
                self.listen = (oid, coll, as_of, holder[0], self.rng.randint(3, 12))
            else:
                self._drop(coll)
            return
        lid, coll, as_of, listen, left = self.listen

        def step() -> list[Any]:
            from persist_lib.handles.listen import ListenUpdates

            out: list[Any] = []
            for e in listen.next(0.3):
                if isinstance(e, ListenUpdates):
                    out += [["u", r["k"], r["v"], r["ts"], r["diff"]] for r in e.table.to_pylist()]
                else:
                    out.append(["p", e.upper.time])
            return out

        _, _, err = self.run_op("listen_next", {"listen": lid, "coll": coll, "as_of": as_of}, step)
        if err is not None or left <= 1:
            listen.close()
            self.listen = None
            if err is not None:
                self._drop(coll)
        else:
            self.listen = (lid, coll, as_of, listen, left - 1)

    def shutdown(self) -> None:
        if self.listen is not None:
            self.listen[3].close()
        for c in list(self.readers):
            self._drop(c)
        super().shutdown()


class TxnHandover(TxnActor):
    """Copies collection ``a`` at its committed upper into a new rendition, hands over."""

    def __init__(self, cfg: TxnHistoryConfig, actor: str, incarnation: int) -> None:
        super().__init__(cfg, actor, incarnation)
        self._lock = HandoverLock(cfg)
        self.made = 0

    def step(self) -> None:
        self.sleep(1.0, 3.0)
        if self.stopped():
            return
        with self._lock.exclusive():
            self.made += 1
            to = f"h{self.inc}x{self.made}"
            self.run_op("handover", {"coll": HANDOVER_COLLECTION, "to": to}, lambda: self._handover(to))

    def _handover(self, to: str) -> dict[str, Any]:
        coll = HANDOVER_COLLECTION
        at = committed_upper(self.ctl, coll)
        if at < 1:
            return {"skipped": at}
        r = self.ctl.acquire_read_handle(coll)
        try:
            rows = r.snapshot(at - 1, timeout_s=self.cfg.txn_read_timeout_s).to_pylist()
        finally:
            with contextlib.suppress(PersistError):
                r.expire()
        self.ctl.create_rendition(coll, to, self.rng.choice([1, 2, 3]))
        w = self.ctl.open_writer(coll, to)
        try:
            w.compare_and_append([(((x["k"],), (x["v"],)), at, x["diff"]) for x in rows], 0, at + 1)
        finally:
            with contextlib.suppress(PersistError):
                w.expire()
        self.ctl.handover(coll, to, at)
        return {"at": at, "rows": len(rows)}


class TxnMaintenance(TxnActor):
    def step(self) -> None:
        self.sleep(0.3, 1.2)
        x = self.rng.random()
        txns = self.ctl.txns
        if x < 0.4:
            self.run_op("apply_all", {}, txns.apply_all)
        elif x < 0.85:
            self.maybe_arm(["before_tidy_cas", "after_tidy_cas"])
            try:
                self.run_op("tidy", {}, txns.tidy)
            finally:
                self.kills.disarm()
        else:
            self.run_op("recover_orphans", {}, txns.recover_orphans)


ROLES: dict[str, type[TxnActor]] = {"tw": TxnWriter, "tr": TxnReader, "th": TxnHandover, "tm": TxnMaintenance}


def txn_actor_main(cfg_json: str, actor: str, incarnation: int) -> None:
    """Process entry point: run ``actor`` until the stop file appears."""
    cfg = TxnHistoryConfig.from_json(cfg_json)
    from persist_lib.testing import planted
    from persist_lib.testing.actors import run_actor

    stack = contextlib.ExitStack()
    stack.enter_context(planted.activate([p for p in cfg.planted if p not in planted.CONSENSUS_BUGS]))
    a = ROLES[actor[:2]](cfg, actor, incarnation)
    a.kills.install()
    run_actor(a, actor[:2], stack)
