"""kill -9 of a real child process at every step of a 4-shard transactional write.

The child writes writer A's 40 rows into a 4-shard transactional collection with one
``compare_and_append`` and stops (blocked, so the kill lands exactly there) after its
N-th durable operation (a blob write or delete, a consensus CAS or truncate) of that
write: during the part-writer registrations, between part uploads, right after the commit
CAS on the txn log, between the applies to the data shards, during tidy. Then a second
writer B writes different rows at the same time, and a reader reads: the collection at
that time holds exactly A's rows or exactly B's (A's whenever A's commit CAS landed),
never a mix, never doubled; the log ends tidied, and a transaction that never committed
leaves nothing registered once its committer's lease lapsed (``recover_orphans``).
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pytest

from persist_lib import PersistClient, PersistConfig
from persist_lib.errors import UpperMismatch
from persist_lib.storage import StorageController
from persist_lib.txn.log import default_txn_log_shard
from persist_lib.txn.txns import Txns
from tests.support.kill_at_op import commit_point, phase_points, run_until_stopped

K = pa.schema([("k", pa.int64())])
V = pa.schema([("v", pa.string())])
A = Counter({(k, "A"): 1 for k in range(40)})
B = Counter({(k, "B"): 1 for k in range(7, 47)})

CHILD = """
    from persist_lib import PersistClient, PersistConfig
    from persist_lib.storage import StorageController
    config = PersistConfig.for_tests(compaction_enabled=False)
    ctl = StorageController(PersistClient.open(blob, cons, config))
    w = ctl.open_writer("c")
    counting[0] = True
    w.compare_and_append([(((k,), ("A",)), 0, 1) for k in range(40)], 0, 1)
    print("done", ops[0], flush=True)
    """


def _location(tmp: Path) -> tuple[str, str]:
    (tmp / "blob").mkdir(parents=True)
    blob, cons = f"file://{tmp / 'blob'}", f"sqlite:///{tmp / 'c.db'}"
    with StorageController(PersistClient.open(blob, cons, PersistConfig.for_tests())) as ctl:
        ctl.create_collection("c", K, V, num_shards=4, transactional=True)
    return blob, cons


def _run_child(blob: str, cons: str, stop_at: int) -> list[str]:
    return run_until_stopped(CHILD, blob, cons, stop_at)


def _acc(table: pa.Table) -> Counter:
    c: Counter = Counter()
    for r in table.to_pylist():
        c[(r["k"], r["v"])] += r["diff"]
    return c


def _calibrate(tmp: Path) -> tuple[int, int]:
    """(ops of a whole write, op index of its commit CAS), from an uncrashed run."""
    blob, cons = _location(tmp)
    return commit_point(_run_child(blob, cons, 10**9))


def _kill_then_second_writer(tmp: Path, stop_at: int) -> str:
    blob, cons = _location(tmp)
    lines = _run_child(blob, cons, stop_at)
    assert lines and lines[-1] == "stopped", lines[-3:]
    committed = any(line.startswith("logcas commit") for line in lines)
    client = PersistClient.open(blob, cons, PersistConfig.for_tests(compaction_enabled=False))
    ctl = StorageController(client)
    w = ctl.open_writer("c")
    rows_b = [(((k,), ("B",)), 0, 1) for k in range(7, 47)]
    try:
        w.compare_and_append(rows_b, 0, 1)
    except UpperMismatch:
        # What a retrying writer does after a lost CAS (the scenario): a definite
        # append, which writes only the times the collection does not hold yet.
        w.append(rows_b, 0, 1)
    got = _acc(ctl.acquire_read_handle("c").snapshot(0, timeout_s=30))
    assert +got == got, f"a retraction or a doubled row after a kill at op {stop_at}: {got}"
    assert got in (A, B), f"a mix of writers after a kill at op {stop_at}: {sorted(got)[:5]}..."
    won = "A" if got == A else "B"
    if committed:
        assert won == "A", f"A's commit landed (op {stop_at}) but its rows were lost"
    ctl.txns.apply_all()
    ctl.txns.tidy()
    assert ctl.txns.log.read().pending == (), "the log was not tidied"
    shards = ctl.describe("c")["renditions"]["r0"]["shards"]
    ctl.close()
    # The dead child's log writer lapses; its uncommitted transaction is then released.
    later = int(time.time() * 1000) + 2 * 3600 * 1000
    client.expire_leases(default_txn_log_shard(), now=later)
    txns = Txns(client)
    txns.recover_orphans()
    for s in shards:
        left = [w.purpose for w in client.machine(s).fetch_latest().writers.values()]
        assert not [p for p in left if p.startswith("txn ")], f"orphaned part writers: {left}"
    txns.close()
    client.close()
    return won


def test_kill_at_each_phase_of_a_four_shard_transaction(tmp_path: Path) -> None:
    total, commit = _calibrate(tmp_path / "calibrate")
    points = phase_points(total, commit)
    outcomes = {p: _kill_then_second_writer(tmp_path / f"k{p}", p) for p in points}
    assert outcomes[commit] == "A" and outcomes[commit - 1] == "B", outcomes


@pytest.mark.slow
def test_kill_after_every_durable_operation(tmp_path: Path) -> None:
    total, commit = _calibrate(tmp_path / "calibrate")
    for p in range(1, total + 1):
        won = _kill_then_second_writer(tmp_path / f"k{p}", p)
        assert won == ("A" if p >= commit else "B"), (p, commit, won)
