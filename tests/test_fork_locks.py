"""A process forked while other threads hold persist's locks (issue 26, defect 8).

Only the forking thread survives a ``fork``: a lock another thread held at that moment
stays held in the child forever. The child must still make progress: the shard's apply
lock (``machine.SharedShardState``), the SQLite write lock of its database file and
the Kafka reader's pause of Python's garbage collector are reset in the child
(``os.register_at_fork``).

The parent keeps the locks held by a helper thread, forks, and waits (bounded) for the
child, which writes to the shard and reports through its exit code; ``os._exit`` always.
"""

from __future__ import annotations

import gc
import os
import signal
import threading
import time
from pathlib import Path

import pyarrow as pa
import pytest

from persist_lib import PersistClient, PersistConfig, ShardId
from persist_lib.ingest.kafka import prefetch as kafka
from persist_lib.location import sqlite_consensus

KEY = pa.schema([("k", pa.string())])
VAL = pa.schema([("v", pa.int64())])

# Child exit codes.
OK, NO_GC, GC_HELD, LOCK_HELD, BYPASSED, RAISED = 0, 10, 11, 12, 13, 14


def _child(client: PersistClient, shard: ShardId) -> int:
    w = client.open_writer(shard, KEY, VAL)
    m = client.machine(shard)
    if not gc.isenabled():
        return NO_GC  # the pause of a thread that no longer exists was inherited
    if not kafka._gc_lock.acquire(timeout=2):
        return GC_HELD
    kafka._gc_lock.release()
    if not m.shared.apply_lock.acquire(timeout=2):
        return LOCK_HELD
    m.shared.apply_lock.release()
    w.compare_and_append([((("child",), (1,)), 1, 1)], 1, 2)
    if m.metrics.apply_lock_bypassed:
        return BYPASSED  # it got through only by passing a lock nobody will release
    return OK


def _wait_child(pid: int, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail(f"the forked child did not finish within {timeout_s}s")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_child_forked_while_other_threads_hold_the_locks_makes_progress(
    tmp_path: Path,
) -> None:
    cfg = PersistConfig.for_tests(retry_deadline_s=8.0, apply_lock_wait_s=8.0)
    cons = f"sqlite:///{tmp_path}/consensus.db?busy_timeout_ms=2000"
    client = PersistClient.open(f"file://{tmp_path}/blob", cons, cfg)
    shard = ShardId.new()
    w = client.open_writer(shard, KEY, VAL)
    w.compare_and_append([((("parent",), (1,)), 0, 1)], 0, 1)
    m = client.machine(shard)
    db = client.raw_consensus.path  # type: ignore[attr-defined]

    held, release = threading.Event(), threading.Event()

    def holder() -> None:
        kafka._gc_hold()  # a Kafka reader converting a batch: collector paused...
        with kafka._gc_lock, m.shared.apply_lock, sqlite_consensus._write_lock(db):
            held.set()  # ...and mid-way through a CAS
            release.wait(60)
        kafka._gc_release()

    t = threading.Thread(target=holder, daemon=True)
    t.start()
    try:
        assert held.wait(10)
        pid = os.fork()
        if pid == 0:  # the child: never returns into pytest
            code = RAISED
            try:
                signal.alarm(30)
                code = _child(client, shard)
            except BaseException:  # noqa: BLE001 - reported through the exit code
                code = RAISED
            finally:
                os._exit(code)
        code = _wait_child(pid, 60)
    finally:
        release.set()
        t.join(10)
    assert code == OK, f"child exit code {code}"
    assert gc.isenabled()

    # The child's write is in the shard, after the parent's.
    state = m.fetch_latest()
    assert state.upper.elements == [2]
    r = client.open_leased_reader(shard, KEY, VAL)
    got = sorted((x["k"], x["diff"]) for x in r.snapshot(1).to_pylist())
    assert got == [("child", 1), ("parent", 1)]
    client.close()
