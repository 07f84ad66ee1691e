"""A Hypothesis state machine of transactional collections against ``model.CollectionsModel``.

Two transactional collections (``a`` with 3 shards, ``b`` with 1) on ``mem://``. Rules:
``ctl.insert`` into one, ``ctl.transaction()`` over both, ``CollectionWriter
.compare_and_append`` with the right and a stale lower, a committer *killed* (a
``BaseException``, in-process so planted bugs apply) before its commit CAS, right after
it, between two applies, or before/after tidy's log CAS — its controller is then
abandoned; maintenance ``apply_all`` / ``tidy``; a handover of ``a`` to a copy of it made
at its upper; ``snapshot`` at every time below the upper and a ``listen`` to the upper,
each through a fresh controller (as another process would).

Invariants after every step: every collection's logical upper (committed, applied or
not) equals the model's; its rows at each time are exactly the model's (all of a
transaction or nothing); the log holds no entry that is already applied once
maintenance tidied.
"""

from __future__ import annotations

import uuid
from collections import Counter
from typing import Any

import pyarrow as pa
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from persist_lib.config import PersistConfig
from persist_lib.errors import UpperMismatch
from persist_lib.handles.client import PersistClient
from persist_lib.storage.controller import StorageController
from persist_lib.testing import model
from persist_lib.testing.txn_config import committed_upper

KEY = pa.schema([pa.field("k", pa.string(), nullable=False)])
VAL = pa.schema([pa.field("v", pa.int64(), nullable=False)])
SHARDS = {"a": 3, "b": 1}
KILLS = ("before_commit_cas", "after_commit_cas", "between_applies", "before_tidy_cas", "after_tidy_cas")


class Killed(BaseException):  # noqa: N818 - the kill -9 it stands for
    pass


class _Kill:
    """Raises ``Killed`` at one point of the protocol while armed (patches, undone after)."""

    def __init__(self, point: str) -> None:
        self.point = point
        self.applies = 0
        self._undo: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> _Kill:
        from persist_lib.txn import apply as ap
        from persist_lib.txn.log import TxnLog
        from persist_lib.txn.txns import Txns

        point = self.point
        publish, apply_entry, append = Txns._publish, ap.apply_entry, TxnLog.append

        def publish_(txns: Any, *a: Any, **kw: Any) -> Any:
            if point == "before_commit_cas":
                raise Killed(point)
            out = publish(txns, *a, **kw)
            if point == "after_commit_cas":
                raise Killed(point)
            return out

        def apply_(machine: Any, entry: Any) -> bool:
            self.applies += 1
            if point == "between_applies" and self.applies == 2:
                raise Killed(point)
            return apply_entry(machine, entry)

        def append_(log: Any, rows: Any, at: int, **kw: Any) -> None:
            tidy = any(d < 0 for _kv, _t, d in rows)
            if tidy and point == "before_tidy_cas":
                raise Killed(point)
            append(log, rows, at, **kw)
            if tidy and point == "after_tidy_cas":
                raise Killed(point)

        for obj, name, new in ((Txns, "_publish", publish_), (ap, "apply_entry", apply_), (TxnLog, "append", append_)):
            self._undo.append((obj, name, getattr(obj, name)))
            setattr(obj, name, new)
        return self

    def __exit__(self, *exc: object) -> None:
        for obj, name, old in reversed(self._undo):
            setattr(obj, name, old)


class TxnStateMachine(RuleBasedStateMachine):
    """Transactional collections driven by Hypothesis, checked against a pure model."""

    @initialize()
    def setup(self) -> None:
        self.mem_name = uuid.uuid4().hex  # an in-memory location of this machine's own
        self.ctl = self._controller()
        for coll, n in SHARDS.items():
            self.ctl.create_collection(coll, KEY, VAL, num_shards=n, transactional=True)
        self.model = model.CollectionsModel(uppers=dict.fromkeys(SHARDS, 0))
        self.n = 0
        self.renditions = 0

    def _controller(self) -> StorageController:
        where = f"mem://{self.mem_name}"
        client = PersistClient.open(where, where, PersistConfig.for_tests())
        return StorageController(client, recover=False)

    def _rows(self, coll: str, count: int) -> list[tuple[str, int]]:
        self.n += 1
        return [(f"{self.n}/{coll}/{i}", i) for i in range(count)]

    @staticmethod
    def _table(rows: list[tuple[str, int]]) -> pa.Table:
        return pa.table({"k": pa.array([k for k, _ in rows], pa.string()), "v": pa.array([v for _, v in rows], pa.int64())})

    def _commit_insert(self, plan: dict[str, list[tuple[str, int]]], kill: str | None) -> None:
        """One controller-timed transaction over ``plan``'s collections, maybe killed."""
        at = max(self.model.uppers[c] for c in plan)
        ctl = self._controller() if kill else self.ctl
        tx = ctl.transaction()
        for coll, rows in sorted(plan.items()):
            tx.insert(coll, self._table(rows))
        committed = True
        if kill:
            with _Kill(kill):
                try:
                    tx.commit()
                    committed = True
                except Killed:
                    committed = kill != "before_commit_cas"
        else:
            assert tx.commit() == at, "the controller picks the largest upper of the collections"
        if committed:
            self.model.commit(
                {c: [(k, v, at, 1) for k, v in rows] for c, rows in plan.items()},
                dict.fromkeys(plan, at + 1),
            )

    @rule(coll=st.sampled_from(sorted(SHARDS)), count=st.integers(1, 4), kill=st.sampled_from((None, *KILLS)))
    def insert(self, coll: str, count: int, kill: str | None) -> None:
        self._commit_insert({coll: self._rows(coll, count)}, kill)

    @rule(counts=st.tuples(st.integers(1, 3), st.integers(1, 3)), kill=st.sampled_from((None, *KILLS)))
    def transaction(self, counts: tuple[int, int], kill: str | None) -> None:
        self._commit_insert({c: self._rows(c, n) for c, n in zip(sorted(SHARDS), counts, strict=True)}, kill)

    @rule(coll=st.sampled_from(sorted(SHARDS)), count=st.integers(0, 4), stale=st.booleans())
    def compare_and_append(self, coll: str, count: int, stale: bool) -> None:
        lower = self.model.uppers[coll] + (1 if stale else 0)
        rows = self._rows(coll, count)
        w = self.ctl.open_writer(coll)
        try:
            w.compare_and_append([(((k,), (v,)), lower + v % 2, 1) for k, v in rows], lower, lower + 2)
            assert not stale, f"a compare-and-append at {lower} above the upper {lower - 1} was accepted"
            self.model.commit({coll: [(k, v, lower + v % 2, 1) for k, v in rows]}, {coll: lower + 2})
        except UpperMismatch:
            assert stale, f"a compare-and-append at the upper {lower} was refused"
        finally:
            w.expire()

    @rule(tidy=st.booleans())
    def maintenance(self, tidy: bool) -> None:
        self.ctl.txns.apply_all()
        if tidy:
            self.ctl.txns.tidy()
            view = self.ctl.txns.log.read()
            assert view.pending == () and view.advances == (), f"applied, tidied, still in the log: {view}"

    @precondition(lambda self: self.model.uppers["a"] > 0)
    @rule()
    def handover(self) -> None:
        at = self.model.uppers["a"]
        rows = self._controller().acquire_read_handle("a").snapshot(at - 1, timeout_s=2.0).to_pylist()
        self.renditions += 1
        to = f"r{self.renditions}x"
        self.ctl.create_rendition("a", to, 2)
        w = self.ctl.open_writer("a", to)
        w.compare_and_append([(((x["k"],), (x["v"],)), at, x["diff"]) for x in rows], 0, at + 1)
        w.expire()
        self.ctl.handover("a", to, at)
        self.model.uppers["a"] = at + 1

    @precondition(lambda self: any(self.model.uppers.values()))
    @rule(data=st.data())
    def read(self, data: st.DataObject) -> None:
        """A snapshot at every time below the upper, and a listen to it, from a fresh
        controller (another process: it must finish what dead committers left)."""
        coll = data.draw(st.sampled_from([c for c, u in self.model.uppers.items() if u > 0]))
        upper = self.model.uppers[coll]
        r = self._controller().acquire_read_handle(coll)
        for t in range(upper):
            got: Counter[tuple[str, int, int]] = Counter()
            for x in r.snapshot(t, timeout_s=2.0).to_pylist():
                got[(x["k"], x["v"], t)] += x["diff"]
            want = self.model.snapshot(coll, t)
            assert +got == want, f"{coll} at {t}: {model.counter_diff(+got, want)}"
        as_of = data.draw(st.integers(0, upper - 1))
        with r.listen(as_of) as listen:
            out = listen.read_until(upper, timeout_s=2.0).to_pylist()
        got = model.consolidate((x["k"], x["v"], x["ts"], x["diff"]) for x in out)
        want = self.model.listen_slice(coll, as_of, upper)
        assert got == want, f"listen on {coll} from {as_of}: {model.counter_diff(got, want)}"
        r.expire()

    @invariant()
    def logical_uppers_match(self) -> None:
        if not hasattr(self, "model"):
            return
        for coll, u in self.model.uppers.items():
            got = committed_upper(self.ctl, coll)
            assert got == u, f"{coll}: committed upper {got}, model {u}"
