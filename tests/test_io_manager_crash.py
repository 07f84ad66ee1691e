"""kill -9 of a real child process at points of a PersistIOManager write and its ledger
entry (one transaction over a 2-shard data collection and the ledger).

The child stores an append-mode output (the mode where writing twice doubles rows) and
stops, blocked, after its N-th durable operation (a blob write or delete, a consensus CAS
or truncate): before the commit CAS on the txn log, on it, between the applies, during
tidy. Then: the data holds the output iff the ledger holds the write's entry (both or
neither), and the same step retried (the same write identity) leaves the output in the
collection exactly once, with one ledger entry, whatever point the kill hit.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pyarrow as pa
import pytest

from dagster_project.io_manager.ledger import WriteLedger
from dagster_project.io_manager.manager import PersistIOManagerImpl
from dagster_project.io_manager.settings import OutputSettings
from dagster_project.resources import PersistResource
from persist_lib import PersistClient, PersistConfig
from persist_lib.storage import StorageController
from tests.support.kill_at_op import commit_point, phase_points, run_until_stopped

NAME, LEDGER, WRITE_ID = "crash.orders", "dagster_io.writes", "run-1/orders_step/crash/orders/"
ROWS = pa.table({"id": pa.array(range(30), pa.int64()), "v": [f"r{i}" for i in range(30)]})
SETTINGS = OutputSettings(["id"], "append", None, {}, 2)

CHILD = """
    from tests.test_io_manager_crash import open_ctl, store
    ctl = open_ctl(blob, cons)
    ctl.list_collections()
    counting[0] = True
    _, _, replayed = store(ctl)
    print("done", ops[0], replayed, flush=True)
    """


def open_ctl(blob: str, cons: str) -> StorageController:
    return StorageController(PersistClient.open(blob, cons, PersistConfig.for_tests(compaction_enabled=False)))


def store(ctl: StorageController) -> tuple[object, dict[str, int], bool]:
    """The I/O manager's store of the output (what ``handle_output`` does after its checks)."""
    impl = PersistIOManagerImpl(PersistResource(home="unused"), "append", 2, "", LEDGER)
    return impl.store(ctl, NAME, ROWS, SETTINGS, None, "asset crash/orders", WRITE_ID)


def _location(tmp: Path) -> tuple[str, str]:
    (tmp / "blob").mkdir(parents=True)
    blob, cons = f"file://{tmp / 'blob'}", f"sqlite:///{tmp / 'c.db'}"
    with open_ctl(blob, cons) as ctl:
        ctl.create_collection(NAME, ROWS.schema.remove(1), ROWS.schema.remove(0), num_shards=2, transactional=True)
        WriteLedger(ctl, LEDGER).ensure()
    return blob, cons


def _run_child(blob: str, cons: str, stop_at: int) -> list[str]:
    return run_until_stopped(CHILD, blob, cons, stop_at)


def _contents(ctl: StorageController, name: str) -> Counter:
    """The collection at its logical upper (committed transactions included: a killed
    committer did not advance the metadata upper, so that is moved first)."""
    with ctl.open_writer(name) as w:
        upper = w.upper
        w.advance_metadata(upper)
    assert upper.time is not None
    if upper.time == 0:
        return Counter()
    with ctl.acquire_read_handle(name) as r:
        snap = r.snapshot(upper.time - 1, timeout_s=30)
    c: Counter = Counter()
    for row in snap.to_pylist():
        c[tuple(v for k, v in row.items() if k not in ("ts", "diff", "time", "upper"))] += row["diff"]
    return +c


def _calibrate(tmp: Path) -> tuple[int, int]:
    """(ops of a whole store, op index of its commit CAS), from an uncrashed run."""
    blob, cons = _location(tmp)
    return commit_point(_run_child(blob, cons, 10**9))


def _kill_then_retry(tmp: Path, stop_at: int) -> bool:
    """Kills the child after op ``stop_at``; checks both-or-neither, retries the step,
    checks exactly once. Returns whether the killed attempt's write had landed."""
    blob, cons = _location(tmp)
    lines = _run_child(blob, cons, stop_at)
    assert lines and lines[-1] == "stopped", lines[-3:]
    want = Counter({(r["id"], r["v"]): 1 for r in ROWS.to_pylist()})
    with open_ctl(blob, cons) as ctl:
        data, ledger = _contents(ctl, NAME), _contents(ctl, LEDGER)
        landed = bool(data)
        assert data in (Counter(), want), f"a partial write after a kill at op {stop_at}"
        assert ledger == (Counter({(NAME, WRITE_ID): 1}) if landed else Counter()), (
            f"kill at op {stop_at}: data landed={landed} but the ledger holds {dict(ledger)}"
        )
        _, _, replayed = store(ctl)  # the retried step
        assert replayed == landed
        assert _contents(ctl, NAME) == want, f"kill at op {stop_at}: the retry wrote a row twice or lost one"
        assert _contents(ctl, LEDGER) == Counter({(NAME, WRITE_ID): 1})
    return landed


def test_killed_store_leaves_data_and_ledger_entry_both_or_neither(tmp_path: Path) -> None:
    total, commit = _calibrate(tmp_path / "calibrate")
    points = phase_points(total, commit)
    landed = {p: _kill_then_retry(tmp_path / f"k{p}", p) for p in points}
    assert landed == {p: p >= commit for p in points}, (commit, landed)


@pytest.mark.slow
def test_kill_after_every_durable_operation_of_a_store(tmp_path: Path) -> None:
    total, commit = _calibrate(tmp_path / "calibrate")
    for p in range(1, total + 1):
        assert _kill_then_retry(tmp_path / f"k{p}", p) == (p >= commit), (p, commit)
