"""A Hypothesis ``RuleBasedStateMachine`` of the shard API against ``model.ShardModel``.

Rules: open writers/readers, ``compare_and_append`` with good and bad bounds, definite
``append`` (overlapping, behind and with a gap), ``snapshot`` (valid, before the since,
not yet complete), ``listen``, ``downgrade_since`` (forward and backward), heartbeats,
``compact``, ``gc``, advancing an injected clock, ``expire_leases``, a scripted
consensus fault on the next compare-and-set (applied-then-timeout, timeout,
determinate), and a restart (``clear_state_cache`` + a new client; the old handles are
gone but stay registered until their leases are expired).

Invariants after every step: the shard's upper, since, registered readers and writers
equal the model's; the consensus head never moves backwards; the trace's contents
(every part decoded and verified), forwarded to the since, equal the model's.

Everything runs in one process on ``mem://`` backends with an injected clock, so a
failure shrinks to a short, replayable program. ``planted`` (class attribute) selects
a planted consensus bug for the negative controls.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from typing import Any

import pyarrow as pa
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from persist_lib.config import PersistConfig
from persist_lib.errors import InvalidUsage, LeaseExpired, Timeout, UpperMismatch
from persist_lib.handles.client import PersistClient
from persist_lib.handles.listen import ListenProgress, ListenUpdates
from persist_lib.ids import ShardId
from persist_lib.location.mem import MemBlob
from persist_lib.shard.machine import clear_state_cache
from persist_lib.testing import model
from persist_lib.testing.audit import AuditConsensus
from persist_lib.testing.faults import ScriptedConsensus
from persist_lib.testing.history_config import TINY_TIME_LAYERS

KEY = pa.schema([("k", pa.string())])
VAL = pa.schema([("v", pa.int64())])
LEASE_MS = 10_000


def _rows(table: pa.Table) -> list[model.Row]:
    c = table.to_pydict()
    return list(zip(c["k"], c["v"], c["ts"], c["diff"], strict=True))


class ShardStateMachine(RuleBasedStateMachine):
    """The shard API driven by Hypothesis, checked against a pure model."""

    planted_consensus: tuple[str, ...] = ()
    inline_threshold: int | None = None  # None: drawn per example

    def __init__(self) -> None:
        super().__init__()
        from persist_lib.testing import planted

        self.name = uuid.uuid4().hex
        self.clock = [1_000_000]
        self.shard = str(ShardId.new())
        self.blob = MemBlob(self.name)
        base = planted.open_consensus(f"mem://{self.name}", self.planted_consensus)
        self._tmp = tempfile.mkdtemp(prefix="persist-stateful-")
        self.audit = AuditConsensus(base, os.path.join(self._tmp, "archive.jsonl"))
        self.cons = ScriptedConsensus(self.audit)
        self.model = model.ShardModel()
        self.writers: list[tuple[str, Any]] = []  # live handles of the current client
        self.readers: list[tuple[str, Any]] = []
        self.listens: list[dict[str, Any]] = []
        self.max_head = 0
        self.ops = 0
        self.inline = 0
        self.unsorted_min_bytes: int | None = None
        self.in_memory_merges = True
        self.tiny_layers = False
        self.client: Any = None  # a PersistClient once initialized

    @initialize(
        inline=st.sampled_from([0, 0, 4096]), unsorted=st.booleans(), in_memory=st.booleans(),
        time_layers=st.booleans(),
    )
    def init(self, inline: int, unsorted: bool, in_memory: bool, time_layers: bool) -> None:
        self.inline = self.inline_threshold if self.inline_threshold is not None else inline
        self.unsorted_min_bytes = 0 if unsorted else None
        self.in_memory_merges = in_memory  # else the streaming k-way merge, always
        # Merges keep retained history in time layers however small (``shard.time_layers``).
        self.tiny_layers = time_layers
        self.client = self._new_client()
        self.open_writer()
        self.open_reader()

    def _new_client(self) -> PersistClient:
        cfg = PersistConfig.for_tests(
            now_ms=lambda: self.clock[0],
            rollup_interval=4,
            inline_threshold=self.inline,
            unsorted_min_bytes=self.unsorted_min_bytes,
            compaction_in_memory=self.in_memory_merges,
            **(TINY_TIME_LAYERS if self.tiny_layers else {}),
            reader_lease_ms=LEASE_MS,
            writer_lease_ms=LEASE_MS,
            retry_deadline_s=2.0,
            snapshot_timeout_s=0.01,
        )
        return PersistClient(self.blob, self.cons, cfg, blob_uri=f"mem://{self.name}")

    def teardown(self) -> None:
        import shutil

        if self.client is not None:
            self.client.close()
        shutil.rmtree(self._tmp, ignore_errors=True)

    # ----- handles -------------------------------------------------------------------------

    @rule()
    def open_writer(self) -> None:
        w = self.client.open_writer(self.shard, KEY, VAL)
        self.writers.append((w.writer_id, w))
        self.model.writers[w.writer_id] = model.HandleModel(self.clock[0], LEASE_MS)

    @rule()
    def open_reader(self) -> None:
        r = self.client.open_leased_reader(self.shard, KEY, VAL)
        self.readers.append((r.reader_id, r))
        self.model.readers[r.reader_id] = model.HandleModel(self.clock[0], LEASE_MS, since=self.model.since)

    # ----- writes --------------------------------------------------------------------------

    def _fresh_rows(self, n: int, lo: int, width: int, draw: Any) -> list[model.Row]:
        self.ops += 1
        return [
            (f"o{self.ops}/{i}", draw(st.integers(0, 9)), lo + draw(st.integers(0, width - 1)), draw(st.sampled_from([1, 1, 2, -1])))
            for i in range(n)
        ]

    @precondition(lambda self: self.writers)
    @rule(
        i=st.integers(0, 7),
        n=st.integers(0, 4),
        width=st.integers(1, 3),
        bounds=st.sampled_from(["good", "good", "good", "behind", "ahead"]),
        fault=st.sampled_from([None, None, *ScriptedConsensus.KINDS]),
        data=st.data(),
    )
    def compare_and_append(
        self, i: int, n: int, width: int, bounds: str, fault: str | None, data: Any
    ) -> None:
        wid, w = self.writers[i % len(self.writers)]
        m = self.model
        expected = m.upper
        if bounds == "behind":
            if m.upper == 0:
                return
            expected = m.upper - data.draw(st.integers(1, m.upper))
        elif bounds == "ahead":
            expected = m.upper + data.draw(st.integers(1, 3))
        new = expected + width
        rows = self._fresh_rows(n, expected, width, data.draw)
        ups = [(((k,), (v,)), t, d) for k, v, t, d in rows]
        wm = m.writers[wid]
        if fault is not None:
            self.cons.arm(fault)  # the write must still happen exactly once
        try:
            w.compare_and_append(ups, expected, new)
        except LeaseExpired:
            assert wm.expired, f"writer {wid} got LeaseExpired but its lease is live in the model"
            return
        except UpperMismatch as e:
            assert not wm.expired, "an expired writer must get LeaseExpired"
            assert bounds != "good", f"good bounds [{expected}, {new}) got {e}"
            assert e.current.time == m.upper, f"mismatch reports {e.current}, model upper {m.upper}"
            return
        assert not wm.expired, "an expired writer's write was accepted"
        assert bounds == "good", f"bad bounds [{expected}, {new}) were accepted (upper {m.upper})"
        assert m.compare_and_append(rows, expected, new)
        wm.last_heartbeat_ms = self.clock[0]

    @precondition(lambda self: self.writers)
    @rule(
        i=st.integers(0, 7),
        n=st.integers(1, 4),
        kind=st.sampled_from(ScriptedConsensus.INTERRUPTS),
        data=st.data(),
    )
    def interrupted_append(self, i: int, n: int, kind: str, data: Any) -> None:
        """A compare_and_append interrupted (a BaseException: Ctrl-C, a run cancellation)
        before its CAS or after it landed. Whatever happened must be whole: if it landed,
        every part it references must still be readable (the invariant fetches them)."""
        from persist_lib.testing.hooks import Interrupt

        wid, w = self.writers[i % len(self.writers)]
        m = self.model
        wm = m.writers[wid]
        if wm.expired:
            return
        expected, new = m.upper, m.upper + 1
        rows = self._fresh_rows(n, expected, 1, data.draw)
        ups = [(((k,), (v,)), t, d) for k, v, t, d in rows]
        fired_before = self.cons.fired[kind]
        self.cons.arm(kind)
        try:
            w.compare_and_append(ups, expected, new)
            interrupted = False
        except Interrupt:
            interrupted = True
        finally:
            self.cons.armed = None
        fired = self.cons.fired[kind] > fired_before
        if not interrupted:
            assert not fired
            assert m.compare_and_append(rows, expected, new)
            wm.last_heartbeat_ms = self.clock[0]
        elif kind == "applied_then_interrupt":
            assert m.compare_and_append(rows, expected, new)  # it landed
            wm.last_heartbeat_ms = self.clock[0]

    @precondition(lambda self: self.writers)
    @rule(
        i=st.integers(0, 7),
        back=st.integers(-1, 3),
        width=st.integers(1, 4),
        n=st.integers(0, 3),
        fault=st.sampled_from([None, None, *ScriptedConsensus.KINDS]),
        data=st.data(),
    )
    def append(self, i: int, back: int, width: int, n: int, fault: str | None, data: Any) -> None:
        wid, w = self.writers[i % len(self.writers)]
        m = self.model
        lo = max(0, m.upper - back)
        hi = lo + width
        rows = self._fresh_rows(n, lo, width, data.draw)
        ups = [(((k,), (v,)), t, d) for k, v, t, d in rows]
        wm = m.writers[wid]
        if fault is not None:
            self.cons.arm(fault)
        try:
            w.append(ups, lo, hi)
        except LeaseExpired:
            assert wm.expired and m.upper < hi, "unexpected LeaseExpired"
            self.cons.armed = None
            return
        except UpperMismatch:
            assert lo > m.upper, f"append [{lo}, {hi}) refused at upper {m.upper}"
            return
        assert lo <= m.upper or m.upper >= hi, f"append [{lo}, {hi}) accepted with a gap at {m.upper}"
        if m.upper < hi:
            assert not wm.expired, "an expired writer's append was accepted"
            wm.last_heartbeat_ms = self.clock[0]
        assert m.append(rows, lo, hi)

    @precondition(lambda self: self.writers)
    @rule(i=st.integers(0, 7))
    def writer_heartbeat(self, i: int) -> None:
        wid, w = self.writers[i % len(self.writers)]
        wm = self.model.writers[wid]
        try:
            w.heartbeat()
        except LeaseExpired:
            assert wm.expired, "live writer got LeaseExpired on heartbeat"
            return
        assert not wm.expired, "expired writer heartbeated"
        wm.last_heartbeat_ms = max(wm.last_heartbeat_ms, self.clock[0])

    # ----- reads ---------------------------------------------------------------------------

    @precondition(lambda self: self.readers)
    @rule(i=st.integers(0, 7), where=st.sampled_from(["valid", "valid", "valid", "before_since", "not_complete"]), data=st.data())
    def snapshot(self, i: int, where: str, data: Any) -> None:
        rid, r = self.readers[i % len(self.readers)]
        rm = self.model.readers[rid]
        m = self.model
        if where == "valid":
            if m.upper - 1 < rm.since:
                return
            as_of = data.draw(st.integers(rm.since, m.upper - 1))
        elif where == "before_since":
            if rm.since == 0:
                return
            as_of = data.draw(st.integers(0, rm.since - 1))
        else:
            as_of = m.upper + data.draw(st.integers(0, 2))
        try:
            got = r.snapshot(as_of, timeout_s=0.01)
        except LeaseExpired:
            assert rm.expired, "live reader got LeaseExpired"
            return
        except InvalidUsage:
            assert where == "before_since", f"snapshot as of {as_of} refused (since {rm.since})"
            return
        except Timeout:
            assert where == "not_complete", f"snapshot as of {as_of} timed out at upper {m.upper}"
            return
        assert not rm.expired, "an expired reader read"
        assert where == "valid", f"snapshot as of {as_of} ({where}) returned data"
        rows = _rows(got)
        assert all(t == as_of for _, _, t, _ in rows)
        assert model.consolidate(rows) == model.snapshot(m.rows, as_of), (
            f"snapshot as of {as_of}: {model.counter_diff(model.consolidate(rows), model.snapshot(m.rows, as_of))}"
        )

    @precondition(lambda self: self.readers)
    @rule(i=st.integers(0, 7), ahead=st.integers(0, 2))
    def listen_open(self, i: int, ahead: int) -> None:
        rid, r = self.readers[i % len(self.readers)]
        rm = self.model.readers[rid]
        as_of = rm.since + ahead
        try:
            lst = r.listen(as_of)
        except LeaseExpired:
            assert rm.expired
            return
        assert not rm.expired
        self.listens.append({"rid": rid, "listen": lst, "as_of": as_of, "acc": []})

    @precondition(lambda self: self.listens)
    @rule(i=st.integers(0, 7))
    def listen_next(self, i: int) -> None:
        entry = self.listens[i % len(self.listens)]
        rm = self.model.readers[entry["rid"]]
        try:
            events = entry["listen"].next(timeout_s=0.01)
        except LeaseExpired:
            assert rm.expired
            self.listens.remove(entry)
            return
        for ev in events:
            if isinstance(ev, ListenUpdates):
                entry["acc"] += _rows(ev.table)
            elif isinstance(ev, ListenProgress):
                u = ev.upper.time
                assert u is not None and u <= self.model.upper
                got = model.consolidate(entry["acc"])
                want = self.model.listen_slice(entry["as_of"], u)
                assert got == want, f"listen as of {entry['as_of']} at {u}: {model.counter_diff(got, want)}"

    @precondition(lambda self: self.readers)
    @rule(i=st.integers(0, 7), delta=st.integers(-2, 5))
    def downgrade_since(self, i: int, delta: int) -> None:
        rid, r = self.readers[i % len(self.readers)]
        rm = self.model.readers[rid]
        new = min(rm.since + delta, self.model.upper)
        if new < 0:
            return
        try:
            r.downgrade_since(new)
        except LeaseExpired:
            assert rm.expired, "live reader got LeaseExpired"
            return
        except InvalidUsage:
            assert new < rm.since, f"downgrade {rm.since} -> {new} refused"
            return
        assert not rm.expired, "expired reader downgraded"
        assert self.model.downgrade_since(rid, new, self.clock[0]), f"backward downgrade {rm.since} -> {new} accepted"
        # A listen needs the times at and after its frontier intact: drop the ones passed.
        self.listens = [
            e for e in self.listens
            if e["rid"] != rid or e["listen"].frontier.time is None or new < e["listen"].frontier.time
        ]

    @precondition(lambda self: self.readers)
    @rule(i=st.integers(0, 7))
    def reader_heartbeat(self, i: int) -> None:
        rid, r = self.readers[i % len(self.readers)]
        rm = self.model.readers[rid]
        try:
            r.heartbeat()
        except LeaseExpired:
            assert rm.expired, "live reader got LeaseExpired on heartbeat"
            return
        assert not rm.expired
        rm.last_heartbeat_ms = max(rm.last_heartbeat_ms, self.clock[0])

    # ----- maintenance, time, faults, restarts ---------------------------------------------------

    @rule()
    def compact(self) -> None:
        self.client.compact(self.shard)

    @rule()
    def gc(self) -> None:
        self.client.gc(self.shard)

    @rule(ms=st.sampled_from([1, 100, 2_000, 6_000, 11_000]))
    def advance_clock(self, ms: int) -> None:
        self.clock[0] += ms

    @rule()
    def expire_leases(self) -> None:
        faulted = self.cons.armed is not None
        got = self.client.expire_leases(self.shard).get(self.shard, {"readers": [], "writers": []})
        dead_r, dead_w = self.model.expire_leases(self.clock[0])
        if faulted:
            # After an applied-then-timed-out CAS the re-run transition finds nothing left
            # to expire, so the report can under-count (the state invariant still checks
            # who is registered).
            assert set(got["readers"]) <= set(dead_r) and set(got["writers"]) <= set(dead_w)
            return
        assert sorted(got["readers"]) == sorted(dead_r), f"expired readers {got['readers']}, model {dead_r}"
        assert sorted(got["writers"]) == sorted(dead_w), f"expired writers {got['writers']}, model {dead_w}"

    @rule(kind=st.sampled_from(ScriptedConsensus.KINDS))
    def fault_next_cas(self, kind: str) -> None:
        self.cons.arm(kind)

    @rule()
    def restart(self) -> None:
        self.cons.armed = None
        assert self.client is not None
        self.client.close()
        clear_state_cache()
        self.client = self._new_client()
        self.writers, self.readers, self.listens = [], [], []

    # ----- invariants ----------------------------------------------------------------------------

    @invariant()
    def matches_model(self) -> None:
        if self.client is None:
            return
        armed, self.cons.armed = self.cons.armed, None  # the checks themselves run fault-free
        try:
            self._check()
        finally:
            self.cons.armed = armed

    def _check(self) -> None:
        assert self.audit.head_regressions == 0, "the consensus head moved backwards"
        h = self.audit.inner.head(self.shard)
        if h is None:
            return
        assert h.seqno >= self.max_head, f"consensus head went from {self.max_head} to {h.seqno}"
        self.max_head = h.seqno
        m = self.client.machine(self.shard)
        s = m.fetch_latest()
        assert s.upper.time == self.model.upper, f"upper {s.upper} != model {self.model.upper}"
        assert s.since.time == self.model.since, f"since {s.since} != model {self.model.since}"
        live_r = {k for k, v in self.model.readers.items() if not v.expired}
        live_w = {k for k, v in self.model.writers.items() if not v.expired}
        assert set(s.leased_readers) == live_r, f"readers {set(s.leased_readers)} != model {live_r}"
        assert set(s.writers) == live_w, f"writers {set(s.writers)} != model {live_w}"
        from persist_lib.shard.codec import Schemas
        from persist_lib.shard.parts import fetch_part

        schemas = Schemas.create(KEY, VAL)
        rows: list[model.Row] = []
        for _, b in s.trace_batches():
            for p in b.parts:
                t = fetch_part(self.client.blob, p, schemas, self.shard)
                cols = [c.to_pylist() for c in t.columns]
                rows += list(zip(cols[0], cols[1], cols[-2], cols[-1], strict=True))
        since = s.since.time
        got, want = model.advance(rows, since), model.advance(self.model.rows, since)
        assert got == want, f"trace contents (since {since}): {model.counter_diff(got, want)}"
