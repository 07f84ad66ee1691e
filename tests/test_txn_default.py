"""Atomicity by default (issue 27): multi-shard collections are transactional from their
creation, one-shard ones write with one CAS and no txn log; an existing collection is
converted by ``make_transactional`` (crash-safe, idempotent), and a writer opened before
the conversion carries on through transactions."""

from __future__ import annotations

import uuid
from collections import Counter

import pyarrow as pa
import pytest

from persist_lib import PersistClient, PersistConfig
from persist_lib.errors import LeaseExpired, UpperMismatch
from persist_lib.frontier import Antichain
from persist_lib.storage import StorageController
from persist_lib.storage import make_transactional as mk

K = pa.schema([("k", pa.int64())])
V = pa.schema([("v", pa.string())])


def mem_ctl() -> StorageController:
    n = uuid.uuid4().hex
    return StorageController(PersistClient.open(f"mem://{n}", f"mem://{n}", PersistConfig.for_tests()))


def rows(keys: range, v: str, t: int) -> list:
    return [(((k,), (v,)), t, 1) for k in keys]


def acc(table: pa.Table) -> Counter:
    c: Counter = Counter()
    for r in table.to_pylist():
        c[(r["k"], r["v"])] += r["diff"]
    return c


def test_multi_shard_collections_are_transactional_by_default_one_shard_ones_pay_no_log() -> None:
    ctl = mem_ctl()
    ctl.create_collection("one", K, V)
    ctl.create_collection("many", K, V, num_shards=3)
    assert not ctl.is_transactional("one") and ctl.is_transactional("many")
    log = ctl.client.machine(ctl.txns.log.shard)
    before = log.fetch_latest().seqno
    w1 = ctl.open_writer("one")
    w1.compare_and_append(rows(range(10), "a", 0), 0, 1)
    assert log.fetch_latest().seqno == before  # one CAS on its shard, nothing on the log
    wm = ctl.open_writer("many")
    wm.compare_and_append(rows(range(30), "a", 0), 0, 1)
    view = ctl.txns.log.read()
    assert len(view.registered) == 3 and view.pending == ()
    with pytest.raises(UpperMismatch):
        wm.compare_and_append(rows(range(5), "b", 0), 0, 1)
    assert acc(ctl.acquire_read_handle("many").snapshot(0)) == Counter({(k, "a"): 1 for k in range(30)})


def test_make_transactional_fences_old_writers_and_heals_a_write_cut_between_shards() -> None:
    ctl = mem_ctl()
    ctl.create_collection("c", K, V, num_shards=3, transactional=False)
    w = ctl.open_writer("c")
    w.append(rows(range(30), "a", 0), 0, 1)
    # A writer that died between shards: the first shard has [1, 2), the others not.
    part = w._split(rows(range(30), "b", 1))[0]
    w.shard_writers[0].append(part, 1, 2)
    direct = ctl.client.open_writer(w.shard_ids[1], K, V)  # another direct writer
    report = ctl.make_transactional("c")
    assert report["converted"] and report["writers_fenced"] >= 4
    assert ctl.is_transactional("c")
    assert ctl.make_transactional("c")["converted"] is False  # idempotent
    with pytest.raises(LeaseExpired):
        direct.append(rows(range(3), "x", 1), 1, 2)  # fenced: it can't write around the log
    # The writer opened before the conversion continues through transactions: its
    # definite append brings every shard to 2, each from its own upper, once.
    w.append(rows(range(30), "b", 1), 1, 2)
    assert w.transactional and w.upper == Antichain([2])
    r = ctl.acquire_read_handle("c")
    assert acc(r.snapshot(1)) == Counter({(k, "a"): 1 for k in range(30)}) + Counter({(k, "b"): 1 for k in range(30)})
    ctl.insert("c", [((99,), ("i",))])  # inserts work now
    assert acc(r.snapshot(2))[(99, "i")] == 1


def test_a_conversion_that_crashed_before_its_flip_changes_nothing_and_is_run_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ctl = mem_ctl()
    ctl.create_collection("c", K, V, num_shards=2, transactional=False)
    ctl.open_writer("c").append(rows(range(10), "a", 0), 0, 1)

    def crash(*a: object, **k: object) -> int:
        raise RuntimeError("killed after registering, before fencing and the flip")

    monkeypatch.setattr(mk, "fence_writers", crash)
    with pytest.raises(RuntimeError):
        ctl.make_transactional("c")
    monkeypatch.undo()
    other = StorageController(ctl.client)  # e.g. a restarted process
    assert not other.is_transactional("c")
    assert len(other.txns.log.read().registered) == 2  # harmless: nothing pending
    other.open_writer("c").append(rows(range(10), "b", 1), 1, 2)  # direct writes still fine
    assert other.make_transactional("c")["converted"]
    w = other.open_writer("c")
    assert w.transactional
    w.compare_and_append(rows(range(10), "c", 2), 2, 3)
    got = acc(other.acquire_read_handle("c").snapshot(2))
    assert got == Counter({(k, v): 1 for k in range(10) for v in "abc"})


def test_a_multi_shard_rendition_makes_a_one_shard_collection_transactional() -> None:
    ctl = mem_ctl()
    ctl.create_collection("c", K, V)
    w0 = ctl.open_writer("c")
    w0.append(rows(range(10), "a", 0), 0, 2)
    ctl.create_rendition("c", "r1", 2)
    assert ctl.is_transactional("c")
    w0.append(rows(range(10, 12), "a", 2), 2, 3)  # the old r0 writer switches over
    assert w0.transactional
    w1 = ctl.open_writer("c", "r1")
    w1.compare_and_append(rows(range(12), "a", 0), 0, 4)
    ctl.handover("c", to="r1", at=3)
    assert acc(ctl.acquire_read_handle("c").snapshot(3)) == Counter({(k, "a"): 1 for k in range(12)})
