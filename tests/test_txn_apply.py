"""Applying a committed transaction from a process whose cached shard state is stale.

A reader (or the next committer) in another process applies what a committer left;
its cached state of the data shard may predate the committer's part-writer
registration. The apply must read the shard again instead of failing with
``LeaseExpired`` (which a committer would report as a definite failure of a
transaction that committed). Found by the transactions soak (``txn_history``).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import uuid
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pytest

from persist_lib import PersistClient, PersistConfig
from persist_lib.storage import StorageController

K = pa.schema([("k", pa.int64())])
V = pa.schema([("v", pa.string())])

OTHER_PROCESS = """
import sys
import pyarrow as pa
import pytest
from persist_lib import PersistClient, PersistConfig
from persist_lib.storage import StorageController
ctl = StorageController(PersistClient.open(sys.argv[1], sys.argv[2], PersistConfig.for_tests()))
ctl.txns.ensure_applied = lambda *x, **k: 0  # it dies right after its commit CAS
ctl.insert("c", pa.table({"k": pa.array([3, 4, 5], pa.int64()), "v": ["b", "b", "b"]}))
"""


def test_an_apply_on_a_stale_cached_state_reads_the_shard_again(tmp_path: Path) -> None:
    (tmp_path / "blob").mkdir()
    blob, cons = f"file://{tmp_path / 'blob'}", f"sqlite:///{tmp_path / 'c.db'}"
    client = PersistClient.open(blob, cons, PersistConfig.for_tests())
    ctl = StorageController(client)
    ctl.create_collection("c", K, V, num_shards=2, transactional=True)
    ctl.insert("c", pa.table({"k": pa.array([1, 2], pa.int64()), "v": ["a", "a"]}))
    shards = ctl.open_writer("c").shard_ids
    for s in shards:  # this process's cache of each data shard: before the other's commit
        client.machine(s).fetch_latest()
    subprocess.run([sys.executable, "-c", textwrap.dedent(OTHER_PROCESS), blob, cons], check=True)
    assert len(ctl.txns.log.read().pending) == 2  # committed, applied by nobody yet
    assert ctl.txns.ensure_applied(shards) == 2
    got: Counter = Counter()
    for r in ctl.acquire_read_handle("c").snapshot(1).to_pylist():
        got[(r["k"], r["v"])] += r["diff"]
    assert got == Counter({(1, "a"): 1, (2, "a"): 1, (3, "b"): 1, (4, "b"): 1, (5, "b"): 1})


def test_an_apply_behind_a_tidied_entry_on_a_stale_cached_state_reads_the_shard_again(tmp_path: Path) -> None:
    """This process cached a data shard before another process committed, applied and
    tidied a transaction on it, then committed a second one it did not apply: the
    stale cache looks one entry behind (the first entry is gone from the log)."""
    (tmp_path / "blob").mkdir()
    blob, cons = f"file://{tmp_path / 'blob'}", f"sqlite:///{tmp_path / 'c.db'}"
    client = PersistClient.open(blob, cons, PersistConfig.for_tests())
    ctl = StorageController(client)
    ctl.create_collection("c", K, V, num_shards=1, transactional=True)
    ctl.insert("c", pa.table({"k": pa.array([1], pa.int64()), "v": ["a"]}))
    (shard,) = ctl.open_writer("c").shard_ids
    client.machine(shard).fetch_latest()
    applied_then_dead = OTHER_PROCESS.replace(
        "ctl.txns.ensure_applied = lambda *x, **k: 0  # it dies right after its commit CAS\n",
        'ctl.insert("c", pa.table({"k": pa.array([9], pa.int64()), "v": ["x"]}))\n'
        "ctl.txns.ensure_applied = lambda *x, **k: 0  # it dies right after its commit CAS\n",
    )
    subprocess.run([sys.executable, "-c", textwrap.dedent(applied_then_dead), blob, cons], check=True)
    assert len(ctl.txns.log.read().pending) == 1
    assert ctl.txns.ensure_applied([shard]) == 1
    got: Counter = Counter()
    for r in ctl.acquire_read_handle("c").snapshot(2).to_pylist():
        got[(r["k"], r["v"])] += r["diff"]
    assert got == Counter({(1, "a"): 1, (9, "x"): 1, (3, "b"): 1, (4, "b"): 1, (5, "b"): 1})


def test_recover_orphans_never_releases_the_part_writer_of_a_commit_landing_while_it_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Recovery scans the data shards while another committer starts, registers its
    part writers and commits (then dies before applying): recovery must judge that
    transaction on a log read after it saw the part writers, or the committed
    transaction can never be applied (its part writer gone). Found by the soak."""
    n = uuid.uuid4().hex
    config = PersistConfig.for_tests()
    ctl = StorageController(PersistClient.open(f"mem://{n}", f"mem://{n}", config))
    ctl.create_collection("c", K, V, num_shards=2, transactional=True)
    ctl.insert("c", pa.table({"k": pa.array([1], pa.int64()), "v": ["a"]}))
    ctl.txns.recover_orphans()  # opens everything it needs before the race
    other = StorageController(PersistClient.open(f"mem://{n}", f"mem://{n}", config))
    monkeypatch.setattr(other.txns, "ensure_applied", lambda *x, **k: 0)  # dies after the CAS
    monkeypatch.setattr(other.txns, "tidy", lambda: 0)
    data = sorted(ctl.open_writer("c").shard_ids)
    real_read = ctl.txns.log.read
    raced: list[bool] = []

    def read() -> object:
        """The recoverer's first log read; then, before it looks at the data shards,
        the other committer registers its part writers and commits."""
        view = real_read()
        if threading.current_thread().name == "recoverer" and not raced:
            raced.append(True)
            other.insert("c", pa.table({"k": pa.array([2, 3, 4], pa.int64()), "v": ["b", "b", "b"]}))
        return view

    monkeypatch.setattr(ctl.txns.log, "read", read)
    t = threading.Thread(target=ctl.txns.recover_orphans, name="recoverer")
    t.start()
    t.join(30)
    assert raced
    monkeypatch.undo()
    assert ctl.txns.ensure_applied(data) == 2  # its part writers are still there
    got: Counter = Counter()
    for r in ctl.acquire_read_handle("c").snapshot(1).to_pylist():
        got[(r["k"], r["v"])] += r["diff"]
    assert got == Counter({(1, "a"): 1, (2, "b"): 1, (3, "b"): 1, (4, "b"): 1})
