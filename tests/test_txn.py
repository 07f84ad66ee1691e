"""Transactions across shards (persist_lib.txn): commit, apply by anyone, tidy, orphans."""

from __future__ import annotations

import uuid
from collections import Counter

import pyarrow as pa
import pytest

from persist_lib import PersistClient, PersistConfig
from persist_lib.errors import InvalidUsage, UpperMismatch
from persist_lib.frontier import Antichain
from persist_lib.storage import StorageController
from persist_lib.txn.log import Pending
from persist_lib.txn.txns import NotRegistered, ShardWrite, Txns

K = pa.schema([("k", pa.int64())])
V = pa.schema([("v", pa.string())])


def mem_client() -> PersistClient:
    n = uuid.uuid4().hex
    return PersistClient.open(f"mem://{n}", f"mem://{n}", PersistConfig.for_tests())


def acc(table: pa.Table) -> Counter:
    c: Counter = Counter()
    for r in table.to_pylist():
        c[(r["k"], r["v"])] += r["diff"]
    return +c


def rows(keys: range, v: str, t: int) -> list:
    return [(((k,), (v,)), t, 1) for k in keys]


def test_collection_compare_and_append_commits_every_shard_in_one_transaction() -> None:
    ctl = StorageController(mem_client())
    ctl.create_collection("c", K, V, num_shards=4, transactional=True)
    w = ctl.open_writer("c")
    w.compare_and_append(rows(range(100), "a", 0), 0, 1)
    w.compare_and_append(rows(range(100, 150), "b", 1), 1, 3)
    assert w.upper == Antichain([3])
    with pytest.raises(UpperMismatch) as e:
        w.compare_and_append(rows(range(5), "x", 1), 1, 2)
    assert e.value.current == Antichain([3])
    r = ctl.acquire_read_handle("c")
    assert acc(r.snapshot(0)) == Counter({(k, "a"): 1 for k in range(100)})
    want = Counter({(k, "a"): 1 for k in range(100)}) + Counter({(k, "b"): 1 for k in range(100, 150)})
    assert acc(r.snapshot(2)) == want
    # Applied and tidied: the log holds the registrations only.
    view = ctl.txns.log.read()
    assert view.pending == () and len(view.registered) == 4
    # The shards have no direct writers: only transactions write them.
    with pytest.raises(InvalidUsage, match="transactional"):
        _ = w.shard_writers


def test_commit_survives_the_committer_stopping_after_the_commit_cas() -> None:
    """Committed but not applied (the committer's apply is skipped): a reader applies it;
    the parts stay because the part writer stays registered until the apply."""
    client = mem_client()
    ctl = StorageController(client)
    ctl.create_collection("c", K, V, num_shards=4, transactional=True)
    txns: Txns = ctl.txns
    real = txns.ensure_applied
    txns.ensure_applied = lambda *a, **k: 0  # type: ignore[method-assign]
    w = ctl.open_writer("c")
    w.compare_and_append(rows(range(40), "a", 0), 0, 1)
    txns.ensure_applied = real  # type: ignore[method-assign]
    view = txns.log.read()
    assert len(view.pending) == 4  # one entry per shard, none applied, none tidied
    shards = sorted({p.shard for p in view.pending})
    for s in shards:
        assert client.machine(s).fetch_latest().upper == Antichain([0])  # not applied
    # The sweeper leaves the unlinked parts alone: their part writer is registered.
    for p in view.pending:
        assert p.part_writer in client.machine(p.shard).fetch_latest().writers
    r = StorageController(client).acquire_read_handle("c")  # another controller reads
    assert acc(r.snapshot(0)) == Counter({(k, "a"): 1 for k in range(40)})
    assert txns.tidy() == 4
    assert txns.log.read().pending == ()
    # Applying again is a no-op; nothing doubled.
    for p in view.pending:
        assert txns.ensure_applied([p.shard], view) == 0
    assert acc(r.snapshot(0)) == Counter({(k, "a"): 1 for k in range(40)})


def test_unregistered_shard_and_bad_times_are_refused_with_nothing_written() -> None:
    client = mem_client()
    txns = Txns(client)
    w, _ = client.open("s" + str(uuid.uuid4()), K, V)
    sid = w.shard_id
    from persist_lib.shard.codec import Schemas, normalize_checked

    schemas = Schemas.create(K, V)
    up = normalize_checked(rows(range(3), "a", 0), schemas, shard=sid)
    with pytest.raises(NotRegistered):
        txns.commit([ShardWrite(sid, schemas, up, Antichain([0]), Antichain([1]))])
    txns.register([sid])
    txns.register([sid])  # idempotent
    assert len(txns.log.read().registered) == 1
    late = normalize_checked(rows(range(3), "a", 5), schemas, shard=sid)
    with pytest.raises(InvalidUsage, match="outside"):
        txns.commit([ShardWrite(sid, schemas, late, Antichain([0]), Antichain([1]))])
    up1 = normalize_checked(rows(range(3), "a", 1), schemas, shard=sid)
    with pytest.raises(UpperMismatch):
        txns.commit([ShardWrite(sid, schemas, up1, Antichain([1]), Antichain([2]))])
    state = client.machine(sid).fetch_latest()
    assert state.upper == Antichain([0])
    assert not [k for k in state.writers if k != w.writer_id]  # no part writer left behind
    assert txns.log.read().pending == ()


def test_part_writer_of_an_entry_is_derived_from_txn_and_shard() -> None:
    t = str(uuid.uuid4())
    assert Pending.txn_part_writer(t, "sA") == Pending.txn_part_writer(t, "sA")
    assert Pending.txn_part_writer(t, "sA") != Pending.txn_part_writer(t, "sB")


def test_a_listener_applies_what_a_dead_committer_left_and_sees_each_transaction_once() -> None:
    client = mem_client()
    ctl = StorageController(client)
    ctl.create_collection("c", K, V, num_shards=3, transactional=True)
    listen = StorageController(client).acquire_read_handle("c").listen(0)
    txns = ctl.txns
    txns.ensure_applied = lambda *a, **k: 0  # type: ignore[method-assign]
    txns.tidy = lambda: 0  # type: ignore[method-assign]
    w = ctl.open_writer("c")
    w.compare_and_append(rows(range(10), "a", 0), 0, 1)  # committed, never applied by it
    w.compare_and_append(rows(range(10), "b", 1), 1, 2)
    got: Counter = Counter()
    for _ in range(40):  # bounded: a listener that never sees the commits fails below
        if listen.frontier >= Antichain([2]):
            break
        for ev in listen.next(timeout_s=0.5):
            if hasattr(ev, "table"):
                for r in ev.table.to_pylist():
                    got[(r["k"], r["v"], r["ts"])] += r["diff"]
    assert listen.frontier >= Antichain([2]), "the listener never got past the dead committer's commits"
    assert got == Counter({(k, "b", 1): 1 for k in range(10)})  # after as_of 0: b's, once
    r = StorageController(client).acquire_read_handle("c")
    assert acc(r.snapshot(0)) == Counter({(k, "a"): 1 for k in range(10)})


def committed_not_applied() -> tuple[PersistClient, str]:
    """A 2-shard collection with 6 rows committed at 0 whose committer applied nothing
    (it stopped right after the commit CAS). Returns the client and the txn log's id."""
    client = mem_client()
    ctl = StorageController(client)
    ctl.create_collection("c", K, V, num_shards=2, transactional=True)
    ctl.txns.ensure_applied = lambda *a, **k: 0  # type: ignore[method-assign]
    ctl.open_writer("c").compare_and_append(rows(range(6), "a", 0), 0, 1)
    return client, ctl.txns.log.shard


def test_a_read_only_controller_applies_but_keeps_no_registration_on_the_log() -> None:
    client, log_shard = committed_not_applied()
    before = client.machine(log_shard).fetch_latest()
    ro = StorageController(client, read_only=True)
    r = ro.acquire_read_handle("c")
    assert acc(r.snapshot(0)) == Counter({(k, "a"): 1 for k in range(6)})
    r.expire()
    after = client.machine(log_shard).fetch_latest()
    assert set(after.writers) == set(before.writers)
    assert set(after.leased_readers) == set(before.leased_readers)


def test_recover_orphans_keeps_a_committed_transaction_of_a_dead_committer() -> None:
    """The committer died after its commit CAS and its log lease lapsed: its part writers
    are still needed (the log names them), so recovery must not release them."""
    import time

    client, log_shard = committed_not_applied()
    client.expire_leases(log_shard, now=int(time.time() * 1000) + 3 * 3600 * 1000)
    other = Txns(client)
    assert other.recover_orphans() == 0
    r = StorageController(client).acquire_read_handle("c")
    assert acc(r.snapshot(0)) == Counter({(k, "a"): 1 for k in range(6)})


def test_handover_between_transactional_renditions_after_a_dead_committer() -> None:
    client, _ = committed_not_applied()  # r0 holds 6 rows at 0, committed, not applied
    ctl = StorageController(client)
    ctl.create_rendition("c", "r1", 3)  # its shards are registered too
    assert len(ctl.txns.log.read().registered) == 5
    w1 = ctl.open_writer("c", "r1")
    w1.compare_and_append(rows(range(6), "a", 0) + rows(range(20, 23), "new", 1), 0, 2)
    ctl.handover("c", to="r1", at=1)  # r0 counts as complete before 1: its commit applies
    r = ctl.acquire_read_handle("c")
    assert acc(r.snapshot(0)) == Counter({(k, "a"): 1 for k in range(6)})
    assert acc(r.snapshot(1)) == Counter({(k, "a"): 1 for k in range(6)}) + Counter(
        {(k, "new"): 1 for k in range(20, 23)}
    )
