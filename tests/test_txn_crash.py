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

import os
import signal
import subprocess
import sys
import textwrap
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

K = pa.schema([("k", pa.int64())])
V = pa.schema([("v", pa.string())])
A = Counter({(k, "A"): 1 for k in range(40)})
B = Counter({(k, "B"): 1 for k in range(7, 47)})

CHILD = textwrap.dedent(
    """
    import sys
    from persist_lib import PersistClient, PersistConfig
    from persist_lib.location.file_blob import FileBlob
    from persist_lib.location.sqlite_consensus import SqliteConsensus
    from persist_lib.storage import StorageController
    from persist_lib.txn.log import TxnLog
    blob, cons, stop_at = sys.argv[1], sys.argv[2], int(sys.argv[3])
    counting, ops = [False], [0]

    def durable(cls, name):
        real = getattr(cls, name)
        def op(self, *a, **kw):
            out = real(self, *a, **kw)
            if counting[0]:
                ops[0] += 1
                print("op", ops[0], name, flush=True)
                if ops[0] == stop_at:
                    print("stopped", flush=True)
                    sys.stdin.readline()  # blocks until the parent's kill -9
            return out
        setattr(cls, name, op)

    for cls, name in ((FileBlob, "set"), (FileBlob, "delete"),
                      (SqliteConsensus, "compare_and_set"), (SqliteConsensus, "truncate")):
        durable(cls, name)
    real_append = TxnLog.append
    def marked(self, rows, at):
        real_append(self, rows, at)
        print("logcas", "commit" if rows and rows[0][2] == 1 else "tidy", ops[0], flush=True)
    TxnLog.append = marked
    config = PersistConfig.for_tests(compaction_enabled=False)
    ctl = StorageController(PersistClient.open(blob, cons, config))
    w = ctl.open_writer("c")
    counting[0] = True
    w.compare_and_append([(((k,), ("A",)), 0, 1) for k in range(40)], 0, 1)
    print("done", ops[0], flush=True)
    """
)


def _location(tmp: Path) -> tuple[str, str]:
    (tmp / "blob").mkdir(parents=True)
    blob, cons = f"file://{tmp / 'blob'}", f"sqlite:///{tmp / 'c.db'}"
    with StorageController(PersistClient.open(blob, cons, PersistConfig.for_tests())) as ctl:
        ctl.create_collection("c", K, V, num_shards=4, transactional=True)
    return blob, cons


def _run_child(blob: str, cons: str, stop_at: int) -> list[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, blob, cons, str(stop_at)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    assert proc.stdout is not None
    lines: list[str] = []
    while True:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line.strip())
        if line.startswith("stopped"):
            os.kill(proc.pid, signal.SIGKILL)
            break
    _, err = proc.communicate()
    assert "Traceback" not in err, err
    return lines


def _acc(table: pa.Table) -> Counter:
    c: Counter = Counter()
    for r in table.to_pylist():
        c[(r["k"], r["v"])] += r["diff"]
    return c


def _calibrate(tmp: Path) -> tuple[int, int]:
    """(ops of a whole write, op index of its commit CAS), from an uncrashed run."""
    blob, cons = _location(tmp)
    lines = _run_child(blob, cons, 10**9)
    total = int(next(line for line in lines if line.startswith("done")).split()[1])
    commit = int(next(line for line in lines if line.startswith("logcas commit")).split()[2])
    return total, commit


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
    assert commit < total
    # before the commit (registrations, uploads), the commit CAS itself, between the
    # applies, the tidy
    points = sorted({commit - 1, commit, commit + 2, total - 1})
    outcomes = {p: _kill_then_second_writer(tmp_path / f"k{p}", p) for p in points}
    assert outcomes[commit] == "A" and outcomes[commit - 1] == "B", outcomes


@pytest.mark.slow
def test_kill_after_every_durable_operation(tmp_path: Path) -> None:
    total, commit = _calibrate(tmp_path / "calibrate")
    for p in range(1, total + 1):
        won = _kill_then_second_writer(tmp_path / f"k{p}", p)
        assert won == ("A" if p >= commit else "B"), (p, commit, won)
