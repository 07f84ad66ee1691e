"""What a transaction leaves for others to finish, and what deleting forgets (issue 27).

* A committer killed right after its commit CAS never moved its collection's metadata
  upper; the move is a committed follow-up in the txn log (``log.Advance``), so whoever
  applies the transaction (a reader, the next writer, maintenance) makes the time
  readable.
* Deleting a transactional collection (or rolling one back) forgets its shards'
  registrations in the txn log, also when the controller is killed midway.
"""

from __future__ import annotations

import uuid
from collections import Counter

import pyarrow as pa
import pytest

from persist_lib import PersistClient, PersistConfig
from persist_lib.frontier import Antichain
from persist_lib.storage import StorageController
from persist_lib.txn import apply as ap
from persist_lib.txn.txns import Txns

K = pa.schema([("k", pa.int64())])
V = pa.schema([("v", pa.string())])


class Killed(BaseException):  # noqa: N818 - stands for the kill
    pass


def mem_client() -> PersistClient:
    n = uuid.uuid4().hex
    return PersistClient.open(f"mem://{n}", f"mem://{n}", PersistConfig.for_tests())


def table(keys: range, v: str) -> pa.Table:
    return pa.table({"k": pa.array(list(keys), pa.int64()), "v": [v] * len(keys)})


def acc(t: pa.Table) -> Counter:
    c: Counter = Counter()
    for r in t.to_pylist():
        c[(r["k"], r["v"])] += r["diff"]
    return +c


def _dead_insert(ctl: StorageController, name: str, rows: pa.Table) -> None:
    with pytest.MonkeyPatch.context() as m:
        m.setattr(ap, "apply_entry", lambda *a, **k: (_ for _ in ()).throw(Killed()))
        with pytest.raises(Killed):
            ctl.insert(name, rows)


def test_a_reader_finishes_the_metadata_move_of_a_committer_killed_after_its_commit_cas() -> None:
    client = mem_client()
    ctl = StorageController(client)
    ctl.create_collection("c", K, V, num_shards=3, transactional=True)
    assert ctl.insert("c", table(range(5), "a")) == 0
    _dead_insert(ctl, "c", table(range(5, 9), "b"))  # committed at 1, nothing applied
    view = ctl.txns.log.read()
    assert len(view.pending) == 3
    other = StorageController(client)
    assert other.describe("c")["metadata_upper"] == [1]  # behind: the committer died
    r = other.acquire_read_handle("c")
    # Without the follow-up the metadata stays at 1: this read would time out.
    want = Counter({(k, "a"): 1 for k in range(5)}) + Counter({(k, "b"): 1 for k in range(5, 9)})
    assert acc(r.snapshot(1, timeout_s=2.0)) == want
    assert r.upper == Antichain([2])
    assert other.describe("c")["metadata_upper"] == [2]
    # Maintenance tidies it all: the log holds registrations only.
    other.txns.tidy()
    view = other.txns.log.read()
    assert view.pending == () and view.advances == ()


def test_a_collection_writer_killed_after_its_commit_cas_leaves_a_readable_time() -> None:
    client = mem_client()
    ctl = StorageController(client)
    ctl.create_collection("c", K, V, num_shards=4, transactional=True)
    w = ctl.open_writer("c")
    w.compare_and_append([], 0, 1)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(ap, "apply_entry", lambda *a, **k: (_ for _ in ()).throw(Killed()))
        with pytest.raises(Killed):
            w.compare_and_append([(((k,), ("a",)), 1, 1) for k in range(20)], 1, 3)
    r = StorageController(client).acquire_read_handle("c")
    assert r.upper == Antichain([3])
    assert acc(r.snapshot(2, timeout_s=2.0)) == Counter({(k, "a"): 1 for k in range(20)})


def test_a_backfill_of_a_rendition_that_is_not_active_moves_no_metadata() -> None:
    ctl = StorageController(mem_client())
    ctl.create_collection("c", K, V, num_shards=2, transactional=True)
    ctl.create_rendition("c", "r1", 2)
    w = ctl.open_writer("c", "r1")
    w.compare_and_append([(((k,), ("x",)), 4, 1) for k in range(3)], 0, 5)
    assert w.metadata_advances(Antichain([5])) == []
    assert ctl.txns.log.read().advances == ()
    assert ctl.describe("c")["metadata_upper"] == [1]  # a handover at 1..4 stays possible


def _registered(client: PersistClient) -> frozenset[str]:
    return Txns(client, read_only=True).log.read().registered


def _shards(ctl: StorageController, name: str) -> set[str]:
    return {s for r in ctl.describe(name)["renditions"].values() for s in r["shards"]}


def test_deleting_a_transactional_collection_forgets_its_registrations() -> None:
    client = mem_client()
    ctl = StorageController(client)
    ctl.create_collection("gone", K, V, num_shards=3, transactional=True)
    ctl.create_collection("kept", K, V, num_shards=2, transactional=True)
    ctl.create_rendition("gone", "r1", 2)
    gone, kept = _shards(ctl, "gone"), _shards(ctl, "kept")
    ctl.insert("gone", table(range(4), "a"))
    _dead_insert(ctl, "gone", table(range(4, 6), "b"))  # an untidied entry of it, too
    assert _registered(client) == gone | kept
    ctl.delete_collection("gone")
    assert _registered(client) == kept
    view = ctl.txns.log.read()
    assert view.pending == () and view.advances == ()  # its entries went with it
    ctl.insert("kept", table(range(3), "k"))  # the others carry on


def test_a_delete_killed_before_it_forgot_is_finished_by_recovery(monkeypatch: pytest.MonkeyPatch) -> None:
    client = mem_client()
    ctl = StorageController(client)
    ctl.create_collection("gone", K, V, num_shards=2, transactional=True)
    ctl.insert("gone", table(range(4), "a"))
    gone = _shards(ctl, "gone")
    with monkeypatch.context() as m:
        m.setattr(Txns, "forget", lambda self, shards: (_ for _ in ()).throw(Killed()))
        with pytest.raises(Killed):
            ctl.delete_collection("gone")
    assert _registered(client) == gone  # finalized, still registered: the crash window
    report = StorageController(client, recover=False).recover()
    assert report["deleted"] == ["gone"]
    assert _registered(client) == frozenset()


def test_a_listen_reads_the_txn_log_only_when_it_cannot_move_without_it() -> None:
    client = mem_client()
    ctl = StorageController(client)
    ctl.create_collection("c", K, V, num_shards=2, transactional=True)
    listener = StorageController(client)
    listen = listener.acquire_read_handle("c").listen(0)
    reads = [0]
    real = listener.txns.log.read

    def counted() -> object:
        reads[0] += 1
        return real()

    listener.txns.log.read = counted  # type: ignore[method-assign]
    ctl.insert("c", table(range(3), "x"))  # at 0: before the listen's as_of
    seen: Counter = Counter()
    for i in range(1, 9):
        assert ctl.insert("c", table(range(10 * i, 10 * i + 3), str(i))) == i
        before = reads[0]
        for ev in listen.next(timeout_s=1.0):
            if hasattr(ev, "table"):
                for r in ev.table.to_pylist():
                    seen[(r["k"], r["v"], r["ts"])] += r["diff"]
        assert listen.frontier == Antichain([i + 1])
        assert reads[0] == before, "the listen read the txn log though its data was applied"
    assert seen == Counter({(k, str(i), i): 1 for i in range(1, 9) for k in range(10 * i, 10 * i + 3)})


def test_a_listen_never_shows_a_time_until_every_shard_of_it_is_applied() -> None:
    client = mem_client()
    ctl = StorageController(client)
    ctl.create_collection("c", K, V, num_shards=3, transactional=True)
    ctl.insert("c", table(range(3), "x"))
    listener = StorageController(client)
    listen = listener.acquire_read_handle("c").listen(0)
    calls = [0]
    real_apply = ap.apply_entry

    def one_then_die(machine: object, entry: object) -> bool:
        calls[0] += 1
        if calls[0] > 1:
            raise Killed("killed between applies")
        return real_apply(machine, entry)  # type: ignore[arg-type]

    rows = table(range(100, 130), "t1")
    meta = ctl._spec("c")["metadata_shard"]  # (describe would finish the transaction)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(ap, "apply_entry", one_then_die)
        with pytest.raises(Killed):
            ctl.insert("c", rows)  # committed at 1; one of its three shards applied
        # Its metadata move is applied (so only the shards' uppers hold the listen back).
        listener.txns.ensure_applied([meta])
        assert client.machine(meta).fetch_latest().upper == Antichain([2])
        real_ensure = listener.txns.ensure_applied
        m.setattr(listener.txns, "ensure_applied", lambda *a, **k: 0)  # nobody finishes it
        for _ in range(3):
            for ev in listen.next(timeout_s=0.2):
                assert not hasattr(ev, "table"), f"a half-applied time was handed out: {ev}"
        assert listen.frontier == Antichain([1])
        m.setattr(listener.txns, "ensure_applied", real_ensure)
    got: Counter = Counter()
    for _ in range(20):
        if listen.frontier > Antichain([1]):
            break
        for ev in listen.next(timeout_s=0.5):
            if hasattr(ev, "table"):
                for r in ev.table.to_pylist():
                    got[(r["k"], r["v"])] += r["diff"]
    assert listen.frontier == Antichain([2]) and got == acc(rows.append_column("diff", pa.array([1] * 30, pa.int64())))


def test_nothing_after_the_commit_cas_reports_a_failed_write() -> None:
    """A committed transaction is never reported as a definite failure: not when moving
    the metadata upper hits a location error (found by the transactions soak:
    ``txn_failed_committed``), not when the apply after the commit raises a usage error."""
    from persist_lib.errors import Determinate, LeaseExpired
    from persist_lib.storage.writer import CollectionWriter

    client = mem_client()
    ctl = StorageController(client)
    ctl.create_collection("c", K, V, num_shards=2, transactional=True)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(CollectionWriter, "advance_metadata", lambda self, u: (_ for _ in ()).throw(Determinate("down")))
        assert ctl.insert("c", table(range(3), "a")) == 0
        w = ctl.open_writer("c")
        w.compare_and_append([(((9,), ("b",)), 1, 1)], 1, 2)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(ap, "apply_entry", lambda *a, **k: (_ for _ in ()).throw(LeaseExpired("gone")))
        assert ctl.insert("c", table(range(20, 22), "c")) == 2
    r = StorageController(client).acquire_read_handle("c")
    want = Counter({(k, "a"): 1 for k in range(3)}) + Counter({(9, "b"): 1, (20, "c"): 1, (21, "c"): 1})
    assert acc(r.snapshot(2, timeout_s=2.0)) == want
