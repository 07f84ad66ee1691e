"""Controller-timed writes: ``ctl.insert`` and multi-collection ``ctl.transaction()``."""

from __future__ import annotations

import threading
from collections import Counter

import pyarrow as pa
import pytest

from persist_lib import PersistClient, PersistConfig
from persist_lib.errors import InvalidUsage
from persist_lib.frontier import Antichain
from persist_lib.storage import StorageController
from tests.test_txn import acc, mem_client

K = pa.schema([("k", pa.int64())])
V = pa.schema([("v", pa.string())])


def mem_ctl() -> StorageController:
    return StorageController(mem_client())


def test_transaction_over_two_collections_is_visible_at_one_time() -> None:
    ctl = mem_ctl()
    ctl.create_collection("a", K, V, num_shards=4, transactional=True)
    ctl.create_collection("b", K, V, num_shards=2, transactional=True)
    ctl.open_writer("b").compare_and_append([(((1,), ("old",)), 4, 1)], 0, 5)
    with ctl.transaction() as tx:
        tx.insert("a", [((k,), ("x",)) for k in range(30)])
        tx.insert("b", pa.table({"k": [7, 8], "v": ["y", "z"]}))
    at = tx.committed_at
    assert at == 5  # the largest upper of the collections touched: no time goes backwards
    ra, rb = ctl.acquire_read_handle("a"), ctl.acquire_read_handle("b")
    assert ra.upper == rb.upper == Antichain([6])
    assert acc(ra.snapshot(at)) == Counter({(k, "x"): 1 for k in range(30)})
    assert acc(rb.snapshot(at)) == Counter({(1, "old"): 1, (7, "y"): 1, (8, "z"): 1})
    assert acc(ra.snapshot(at - 1)) == Counter()
    assert acc(rb.snapshot(at - 1)) == Counter({(1, "old"): 1})
    t2 = ctl.insert("a", [((99,), ("w",))])
    assert t2 == at + 1
    assert acc(ra.snapshot(t2))[(99, "w")] == 1


def test_refusals_write_nothing() -> None:
    ctl = mem_ctl()
    ctl.create_collection("a", K, V, num_shards=2, transactional=True)
    ctl.create_collection("plain", K, V, num_shards=2, transactional=False)
    with pytest.raises(InvalidUsage, match="not transactional"):
        ctl.insert("plain", [((1,), ("x",))])
    with pytest.raises(InvalidUsage):
        ctl.insert("a", [(("not an int",), ("x",))])
    with pytest.raises(InvalidUsage, match="no 'ts' column"):
        ctl.insert("a", pa.table({"k": [1], "v": ["x"], "ts": [3]}))
    with pytest.raises(RuntimeError), ctl.transaction() as tx:
        tx.insert("a", [((1,), ("x",))])
        raise RuntimeError("the caller changed its mind")
    assert ctl.txns.log.read().pending == ()
    w = ctl.open_writer("a")
    assert w.upper == Antichain([0])
    with pytest.raises(InvalidUsage, match="committed or abandoned"):
        tx.insert("a", [((1,), ("x",))])


def test_concurrent_inserts_from_two_controllers_all_land_once(location: tuple[str, str]) -> None:
    """Two controllers (two clients) on each kind of location, S3 + Postgres included."""
    clients = [PersistClient.open(*location, PersistConfig.for_tests()) for _ in range(2)]
    ctls = [StorageController(c) for c in clients]
    ctls[0].create_collection("a", K, V, num_shards=3, transactional=True)
    times: list[list[int]] = [[], []]

    def run(i: int) -> None:
        for j in range(8):
            times[i].append(ctls[i].insert("a", [((i * 100 + j,), (f"c{i}",))]))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    all_times = times[0] + times[1]
    assert len(set(all_times)) == 16  # every insert has its own time
    got = acc(ctls[0].acquire_read_handle("a").snapshot(max(all_times)))
    assert got == Counter({(i * 100 + j, f"c{i}"): 1 for i in range(2) for j in range(8)})
