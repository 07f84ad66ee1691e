"""Boundaries of the pure state transitions (``persist_lib.shard.transitions``), through the
public client API where there is one, on an injected clock.

A lease of ``L`` ms heartbeated at ``t0`` is alive up to and including ``t0 + L`` and
expired from ``t0 + L + 1`` on: checked for leased readers, writers and part writers,
one ms either side of the boundary.
"""

from __future__ import annotations

import uuid
from dataclasses import replace

import pyarrow as pa
import pytest

from persist_lib import Antichain, PersistClient, PersistConfig, ShardId
from persist_lib.errors import InvalidUsage, LeaseExpired, SchemaMismatch, ShardTombstoned
from persist_lib.shard import transitions as tr
from persist_lib.shard.batch_meta import HollowBatch, PartMeta
from persist_lib.shard.codec import Schemas
from persist_lib.shard.part_writers import PartWriter
from persist_lib.shard.state import (
    CriticalReaderState,
    LeasedReaderState,
    RollupRef,
    ShardState,
    WriterState,
)

KEY = pa.schema([("k", pa.int64())])
VAL = pa.schema([("v", pa.string())])
T0 = 1_000_000
LEASE = 1_000


class Clock:
    def __init__(self, t: int) -> None:
        self.t = t

    def __call__(self) -> int:
        return self.t


def mem_client(clock: Clock) -> PersistClient:
    name = uuid.uuid4().hex
    cfg = PersistConfig.for_tests(now_ms=clock, reader_lease_ms=LEASE, writer_lease_ms=LEASE)
    return PersistClient.open(f"mem://{name}", f"mem://{name}", cfg)


def test_leased_reader_is_kept_at_the_end_of_its_lease_and_expired_one_ms_later() -> None:
    clock = Clock(T0)
    client = mem_client(clock)
    shard = ShardId.new()
    w, r = client.open(shard, KEY, VAL)
    w.compare_and_append([(((1,), ("a",)), 0, 1)], 0, 1)
    # The writer heartbeats much later, so only the reader's lease is at stake.
    clock.t = T0 + 100 * LEASE
    w.compare_and_append([], 1, 2)
    clock.t = T0 + LEASE
    assert client.expire_leases(shard) == {}
    assert r.snapshot(0).num_rows == 1, "a reader at the end of its lease still reads"
    clock.t = T0 + LEASE + 1
    assert client.expire_leases(shard) == {str(shard): {"readers": [r.reader_id], "writers": []}}
    with pytest.raises(LeaseExpired, match=r.reader_id):
        r.snapshot(0)


def test_writer_is_kept_at_the_end_of_its_lease_and_expired_one_ms_later() -> None:
    clock = Clock(T0)
    client = mem_client(clock)
    shard = ShardId.new()
    w = client.open_writer(shard, KEY, VAL)
    clock.t = T0 + LEASE
    assert client.expire_leases(shard) == {}
    # The append at T0 + LEASE is also a heartbeat: the lease now runs to T0 + 2 * LEASE.
    w.compare_and_append([(((1,), ("a",)), 0, 1)], 0, 1)
    clock.t = T0 + 2 * LEASE
    assert client.expire_leases(shard) == {}
    clock.t = T0 + 2 * LEASE + 1
    assert client.expire_leases(shard) == {str(shard): {"readers": [], "writers": [w.writer_id]}}
    with pytest.raises(LeaseExpired, match=w.writer_id):
        w.compare_and_append([(((2,), ("b",)), 1, 1)], 1, 2)
    assert client.inspect(shard)["upper"] == [1]


def test_part_writer_is_kept_at_the_end_of_its_lease_and_expired_one_ms_later() -> None:
    clock = Clock(T0)
    client = mem_client(clock)
    shard = ShardId.new()
    w = client.open_writer(shard, KEY, VAL)
    clock.t = T0 + 500
    pw = PartWriter.register(client.machine(str(shard)), purpose="test", lease_ms=300)
    # The handle's writer lease ends at T0 + LEASE, the part writer's at T0 + 800.
    clock.t = T0 + 800
    assert client.expire_leases(shard) == {}
    assert pw.writer_id in client.machine(str(shard)).fetch_latest().writers
    clock.t = T0 + 801
    assert client.expire_leases(shard) == {str(shard): {"readers": [], "writers": [pw.writer_id]}}
    state = client.machine(str(shard)).fetch_latest()
    assert set(state.writers) == {w.writer_id}
    with pytest.raises(LeaseExpired, match=pw.writer_id):
        pw.heartbeat()


# ----- the pure transitions, state in, state out ---------------------------------------

SCHEMAS = Schemas.create(KEY, VAL)
SHARD = "s00000000-0000-0000-0000-000000000001"
W = "w00000000-0000-0000-0000-0000000000aa"


def fresh(**kw: object) -> ShardState:
    return ShardState(shard_id=SHARD, **kw)  # type: ignore[arg-type]


def registered(now: int = T0) -> ShardState:
    s, _ = tr.register(
        fresh(seqno=1), now, schemas=SCHEMAS, writer_id=W, writer_lease_ms=LEASE,
        reader_id="r1", reader_lease_ms=2 * LEASE, purpose="test",
    )
    assert s is not None
    return s.evolve(seqno=2)


def part(writer: str = W, *, tmin: int = 0, tmax: int = 0, count: int = 3, inline: bytes | None = None) -> PartMeta:
    key = None if inline is not None else f"{SHARD}/{writer}/p{uuid.uuid4()}"
    return PartMeta(key, 100 if inline is None else len(inline), count, "00", tmin, tmax, inline)


def batch(lower: int, upper: int | None, *parts: PartMeta, since: int = 0) -> HollowBatch:
    return HollowBatch(Antichain([lower]), Antichain.of(upper), Antichain([since]), tuple(parts))


def test_register_records_schemas_writer_and_reader_and_is_idempotent() -> None:
    s0 = fresh(seqno=1, since=Antichain([4]), upper=Antichain([9]))
    s, res = tr.register(
        s0, T0, schemas=SCHEMAS, writer_id=W, writer_lease_ms=LEASE,
        reader_id="r1", reader_lease_ms=2 * LEASE, purpose="job",
    )
    assert s is not None and res is None
    assert Schemas.from_json(s.schemas) == SCHEMAS  # type: ignore[arg-type]
    assert s.writers[W] == WriterState(T0, LEASE, None, Antichain([9]), "job")
    assert s.leased_readers["r1"] == LeasedReaderState(Antichain([4]), 2, T0, 2 * LEASE, "job")
    assert s0.writers == {} and s0.leased_readers == {}, "the input state is not modified"
    assert tr.register(
        s, T0 + 5, schemas=SCHEMAS, writer_id=W, writer_lease_ms=LEASE,
        reader_id="r1", reader_lease_ms=LEASE, purpose="again",
    ) == (None, None)
    only_w, _ = tr.register(
        s, T0, schemas=SCHEMAS, writer_id="w2", writer_lease_ms=7, reader_id=None,
        reader_lease_ms=0, purpose="",
    )
    assert only_w is not None and set(only_w.writers) == {W, "w2"} and set(only_w.leased_readers) == {"r1"}
    other = Schemas.create(KEY, pa.schema([("v", pa.int64())]))
    with pytest.raises(SchemaMismatch, match="was created with schemas"):
        tr.register(s, T0, schemas=other, writer_id="w3", writer_lease_ms=1, reader_id=None,
                    reader_lease_ms=1, purpose="")
    with pytest.raises(ShardTombstoned, match=f"shard {SHARD} was finalized"):
        tr.register(s.evolve(tombstone=True), T0, schemas=SCHEMAS, writer_id="w3",
                    writer_lease_ms=1, reader_id=None, reader_lease_ms=1, purpose="")
    closed = s.evolve(since=Antichain())
    with pytest.raises(InvalidUsage, match="since is the empty frontier"):
        tr.register(closed, T0, schemas=SCHEMAS, writer_id=None, writer_lease_ms=1,
                    reader_id="r2", reader_lease_ms=1, purpose="")
    w_only, _ = tr.register(closed, T0, schemas=SCHEMAS, writer_id="w4", writer_lease_ms=1,
                            reader_id=None, reader_lease_ms=1, purpose="")
    assert w_only is not None and "w4" in w_only.writers


def test_critical_reader_registration_and_fenced_downgrade() -> None:
    s = registered().evolve(since=Antichain([2]))
    s1, crit = tr.register_critical_reader(s, T0, schemas=SCHEMAS, reader_id="c", initial_opaque="o0", purpose="p")
    assert s1 is not None and crit == CriticalReaderState(Antichain([2]), "o0", "p")
    assert tr.register_critical_reader(s1, T0, schemas=SCHEMAS, reader_id="c", initial_opaque="x", purpose="q") == (
        None, crit,
    )
    # Registration on a state without schemas records them even for a known reader.
    s2, again = tr.register_critical_reader(
        s1.evolve(schemas=None), T0, schemas=SCHEMAS, reader_id="c", initial_opaque="x", purpose="q"
    )
    assert s2 is not None and s2.schemas is not None and again == crit

    def cads(st: ShardState, exp: str, new: str, since: int) -> tuple[ShardState | None, object]:
        return tr.compare_and_downgrade_since(
            st, T0, reader_id="c", expected_opaque=exp, new_opaque=new, new_since=Antichain([since])
        )

    # The same since with a new opaque applies; a wrong opaque never does, even when the
    # since matches.
    same, ok = cads(s1, "o0", "oX", 2)
    assert same is not None and ok == tr.CriticalDowngradeResult(True, "oX", Antichain([2]))
    assert cads(s1, "wrong", "o9", 2) == (None, tr.CriticalDowngradeResult(False, "o0", Antichain([2])))
    s3, ok = cads(s1, "o0", "o1", 6)
    assert s3 is not None and ok == tr.CriticalDowngradeResult(True, "o1", Antichain([6]))
    assert s3.critical_readers["c"] == CriticalReaderState(Antichain([6]), "o1", "p")
    assert s3.since == Antichain([2]), "the leased reader still holds the since at 0 -> max(2, 0)"
    assert cads(s3, "o0", "o2", 7) == (None, tr.CriticalDowngradeResult(False, "o1", Antichain([6])))
    assert cads(s3, "o0", "o1", 6) == (None, tr.CriticalDowngradeResult(True, "o1", Antichain([6]))), "our retry"
    with pytest.raises(InvalidUsage, match="never moves backwards"):
        cads(s3, "o1", "o2", 5)
    with pytest.raises(InvalidUsage, match="open_critical_since"):
        cads(s3.evolve(critical_readers={}), "o1", "o2", 7)
    with pytest.raises(ShardTombstoned):
        cads(s3.evolve(tombstone=True), "o1", "o2", 7)
    # With the leased reader gone, the since is the critical reader's.
    s4, gone = tr.expire_reader(s3, T0, reader_id="r1")
    assert gone is True and s4 is not None and s4.since == Antichain([6])
    assert tr.expire_reader(s4, T0, reader_id="r1") == (None, False)
    s5, gone = tr.expire_critical_reader(s4, T0, reader_id="c")
    assert gone is True and s5 is not None and s5.critical_readers == {} and s5.since == Antichain([6])
    assert tr.expire_critical_reader(s5, T0, reader_id="c") == (None, False)


def test_recompute_since_is_the_meet_and_never_moves_back() -> None:
    s = fresh(seqno=1, since=Antichain([3]))
    assert tr.recompute_since(s) == Antichain([3])
    r = LeasedReaderState(Antichain([5]), 1, T0, LEASE)
    s = s.evolve(leased_readers={"a": r, "b": replace(r, since=Antichain([9]))},
                 critical_readers={"c": CriticalReaderState(Antichain([7]), "o")})
    assert tr.recompute_since(s) == Antichain([5])
    assert tr.recompute_since(s.evolve(since=Antichain([6]))) == Antichain([6])


def test_downgrade_since_moves_the_reader_and_its_seqno_hold() -> None:
    s = registered().evolve(seqno=10)
    s1, _ = tr.downgrade_since(s, T0 + 7, reader_id="r1", new_since=Antichain([4]), seqno_hold=6)
    assert s1 is not None
    r = s1.leased_readers["r1"]
    assert (r.since, r.seqno, r.last_heartbeat_ms) == (Antichain([4]), 6, T0 + 7)
    assert s1.since == Antichain([4])
    # A hold beyond the next seqno is clamped to it; an older hold never moves it back;
    # an older clock never moves the heartbeat back.
    s2, _ = tr.downgrade_since(s1, T0, reader_id="r1", new_since=Antichain([4]), seqno_hold=50)
    assert s2 is not None and s2.leased_readers["r1"].seqno == 11
    assert s2.leased_readers["r1"].last_heartbeat_ms == T0 + 7
    s3, _ = tr.downgrade_since(s2, T0, reader_id="r1", new_since=Antichain([4]), seqno_hold=3)
    assert s3 is not None and s3.leased_readers["r1"].seqno == 11
    with pytest.raises(InvalidUsage, match="never moves backwards"):
        tr.downgrade_since(s1, T0, reader_id="r1", new_since=Antichain([3]), seqno_hold=6)
    with pytest.raises(LeaseExpired, match="reader r9 is not registered"):
        tr.downgrade_since(s1, T0, reader_id="r9", new_since=Antichain([5]), seqno_hold=6)
    with pytest.raises(ShardTombstoned):
        tr.downgrade_since(s1.evolve(tombstone=True), T0, reader_id="r1", new_since=Antichain([5]), seqno_hold=6)


def test_writer_heartbeat_and_expiry() -> None:
    s = registered()
    s1, _ = tr.heartbeat_writer(s, T0 + 9, writer_id=W)
    assert s1 is not None and s1.writers[W].last_heartbeat_ms == T0 + 9
    s2, _ = tr.heartbeat_writer(s1, T0 + 1, writer_id=W)
    assert s2 is not None and s2.writers[W].last_heartbeat_ms == T0 + 9, "never moves back"
    with pytest.raises(LeaseExpired, match="writer w9 is not registered"):
        tr.heartbeat_writer(s, T0, writer_id="w9")
    s3, gone = tr.expire_writer(s, T0, writer_id=W)
    assert gone is True and s3 is not None and s3.writers == {}
    assert tr.expire_writer(s3, T0, writer_id=W) == (None, False)


def test_expire_leases_judges_every_lease_by_the_given_clock() -> None:
    s = registered()  # writer lease LEASE, reader lease 2 * LEASE, both from T0
    assert tr.expire_leases(s, T0 + LEASE) == (None, tr.ExpiredLeases((), ()))
    s1, res = tr.expire_leases(s, T0 + LEASE + 1)
    assert res == tr.ExpiredLeases((), (W,)) and s1 is not None and set(s1.leased_readers) == {"r1"}
    s2, res = tr.expire_leases(s.evolve(since=Antichain([0])), T0 + 2 * LEASE + 1)
    assert res == tr.ExpiredLeases(("r1",), (W,)) and s2 is not None
    assert s2.writers == {} and s2.leased_readers == {}
    assert tr.expire_leases(fresh(), T0 + 10 * LEASE) == (None, tr.ExpiredLeases((), ()))
    assert tr.expire_leases(s.evolve(tombstone=True), T0 + 10 * LEASE) == (None, tr.ExpiredLeases((), ()))
    # Expiring the reader that held the since back lets it advance to the other's.
    r2 = LeasedReaderState(Antichain([8]), 1, T0 + 10 * LEASE, LEASE)
    s3 = s.evolve(leased_readers={**s.leased_readers, "r2": r2})
    s4, res = tr.expire_leases(s3, T0 + 3 * LEASE)
    assert res.readers == ("r1",) and s4 is not None and s4.since == Antichain([8])


def test_part_writers_register_and_only_registered_writers_parts_link() -> None:
    s = registered()
    with pytest.raises(InvalidUsage, match="does not exist"):
        tr.register_part_writer(fresh(), T0, writer_id="pw", lease_ms=5, purpose="x")
    s1, _ = tr.register_part_writer(s.evolve(upper=Antichain([3])), T0, writer_id="pw", lease_ms=5, purpose="spark")
    assert s1 is not None and s1.writers["pw"] == WriterState(T0, 5, None, Antichain([3]), "spark")
    s1 = s1.evolve(upper=Antichain([0]))
    assert tr.register_part_writer(s1, T0 + 1, writer_id="pw", lease_ms=9, purpose="y") == (None, None)
    with pytest.raises(ShardTombstoned):
        tr.register_part_writer(s1.evolve(tombstone=True), T0, writer_id="p2", lease_ms=5, purpose="x")
    ok, bad = part("pw"), part("gone")
    assert tr.unregistered_part_writers(s1, [ok.key, bad.key, f"{SHARD}/rollup/x"]) == ["gone", f"{SHARD}/rollup/x"]
    assert tr.unregistered_part_writers(s1, [ok.key]) == []
    with pytest.raises(LeaseExpired, match="gone"):
        tr.compare_and_append(s1, T0, writer_id=W, batch=batch(0, 1, bad), token="t")
    s2, res = tr.compare_and_append(s1, T0, writer_id=W, batch=batch(0, 1, ok), token="t", release_writer="pw")
    assert res.outcome is tr.CaaOutcome.APPLIED and s2 is not None and set(s2.writers) == {W}
    # Releasing oneself, or a writer that is gone, releases nothing.
    for rel in (W, "never-registered"):
        s3, res = tr.compare_and_append(s1, T0, writer_id=W, batch=batch(0, 1), token="u", release_writer=rel)
        assert res.outcome is tr.CaaOutcome.APPLIED and s3 is not None and set(s3.writers) == {W, "pw"}


def test_compare_and_append_outcomes() -> None:
    s = registered()
    b1 = batch(0, 3, part(tmax=2), since=0)
    s1, res = tr.compare_and_append(s, T0 + 4, writer_id=W, batch=b1, token="t1")
    assert res == tr.CaaResult(tr.CaaOutcome.APPLIED, Antichain([3])) and s1 is not None
    assert s1.upper == Antichain([3]) and s1.next_id == 2 and s1.batches == {1: b1}
    assert s1.writers[W] == WriterState(T0 + 4, LEASE, "t1", Antichain([3]), "test")
    # A retry of the same write (same token) is recognised; a stale expected upper is a mismatch.
    assert tr.compare_and_append(s1, T0, writer_id=W, batch=b1, token="t1") == (
        None, tr.CaaResult(tr.CaaOutcome.ALREADY_COMMITTED, Antichain([3])),
    )
    assert tr.compare_and_append(s1, T0, writer_id=W, batch=batch(0, 5, part()), token="t2") == (
        None, tr.CaaResult(tr.CaaOutcome.UPPER_MISMATCH, Antichain([3])),
    )
    with pytest.raises(InvalidUsage, match="never moves backwards"):
        tr.compare_and_append(s1, T0, writer_id=W, batch=batch(3, 2), token="t2")
    with pytest.raises(InvalidUsage, match="empty time interval"):
        tr.compare_and_append(s1, T0, writer_id=W, batch=batch(3, 3, part()), token="t2")
    with pytest.raises(LeaseExpired):
        tr.compare_and_append(s1, T0, writer_id="w9", batch=batch(3, 4), token="t2")
    # An empty interval only heartbeats (and records the token); the upper stays.
    s2, res = tr.compare_and_append(s1, T0 + 8, writer_id=W, batch=batch(3, 3), token="t2")
    assert res == tr.CaaResult(tr.CaaOutcome.APPLIED, Antichain([3])) and s2 is not None
    assert s2.batches == s1.batches and s2.upper == Antichain([3])
    assert s2.writers[W].last_heartbeat_ms == T0 + 8 and s2.writers[W].most_recent_write_token == "t2"
    # Progress without data widens the last batch instead of adding one.
    s3, res = tr.compare_and_append(s2, T0, writer_id=W, batch=batch(3, 7), token="t3")
    assert res == tr.CaaResult(tr.CaaOutcome.APPLIED, Antichain([7])) and s3 is not None
    assert list(s3.batches) == [1] and s3.batches[1].upper == Antichain([7]) and s3.next_id == 2
    # A new batch's since is at least the shard's.
    s4, _ = tr.compare_and_append(s3.evolve(since=Antichain([5])), T0, writer_id=W,
                                  batch=batch(7, 9, part(tmin=7, tmax=8), since=2), token="t4")
    assert s4 is not None and s4.batches[2].since == Antichain([5]) and s4.next_id == 3
    # The first progress-only append of an empty shard adds an (empty) batch.
    s5, _ = tr.compare_and_append(s, T0, writer_id=W, batch=batch(0, 2), token="t5")
    assert s5 is not None and list(s5.batches) == [1] and s5.upper == Antichain([2])


def test_inline_parts_are_bounded_per_shard() -> None:
    s = registered()
    small = part(inline=b"x" * 40)
    s1, res = tr.compare_and_append(s, T0, writer_id=W, batch=batch(0, 1, small), token="a", inline_max_total=100)
    assert res.outcome is tr.CaaOutcome.APPLIED and s1 is not None and tr.inline_bytes(s1) == 40
    s2, res = tr.compare_and_append(s1, T0, writer_id=W, batch=batch(1, 2, part(inline=b"y" * 60)), token="b",
                                    inline_max_total=100)
    assert res.outcome is tr.CaaOutcome.APPLIED and s2 is not None and tr.inline_bytes(s2) == 100
    assert tr.compare_and_append(s2, T0, writer_id=W, batch=batch(2, 3, part(inline=b"z")), token="c",
                                 inline_max_total=100) == (
        None, tr.CaaResult(tr.CaaOutcome.INLINE_BACKPRESSURE, Antichain([2])),
    )
    # Parts in blobs are not bounded by it.
    s3, res = tr.compare_and_append(s2, T0, writer_id=W, batch=batch(2, 3, part()), token="c", inline_max_total=100)
    assert res.outcome is tr.CaaOutcome.APPLIED and s3 is not None


def test_add_rollup_links_only_newer_rollups_within_the_window() -> None:
    s = registered().evolve(seqno=10)
    s1, linked = tr.add_rollup(s, T0, seqno=8, key="k8", size=5)
    assert linked is True and s1 is not None and s1.rollups == {8: RollupRef("k8", 5)}
    assert tr.add_rollup(s1, T0, seqno=8, key="k8", size=5) == (None, True), "a retry: ours is linked"
    assert tr.add_rollup(s1, T0, seqno=8, key="other", size=5) == (None, False)
    assert tr.add_rollup(s1, T0, seqno=6, key="k6", size=5) == (None, False), "older than the latest"
    with pytest.raises(InvalidUsage, match="beyond state 10"):
        tr.add_rollup(s1, T0, seqno=11, key="k11", size=5)
    s2, linked = tr.add_rollup(s1, T0, seqno=10, key="k10", size=7)
    assert linked is True and s2 is not None and s2.rollups == {8: RollupRef("k8", 5), 10: RollupRef("k10", 7)}
    far = s.evolve(seqno=tr.ROLLUP_LINK_WINDOW + 5)
    assert tr.add_rollup(far, T0, seqno=4, key="k4", size=1) == (None, False), "too old"
    s3, linked = tr.add_rollup(far, T0, seqno=5, key="k5", size=1)
    assert linked is True and s3 is not None
