"""The transactions control: a committer killed mid-transaction, then others carry on.

A 4-shard transactional collection; writer A's ``compare_and_append`` is "killed" (a
BaseException, like the kill -9 of ``tests/test_txn_crash.py`` but in-process, so planted
bugs can be activated) at its ``kill_at``-th apply to a data shard; the dead controller
is left as it is. Then, through a second controller on the same location, one of:

* ``write``: writer B writes different rows at the same time (compare-and-append, then
  the definite append a retrying writer does), and a reader reads;
* ``tidy``: maintenance tidies the txn log, then a reader reads;
* ``read``: a reader reads.

The collection at that time must hold exactly A's rows whenever A's commit landed, or
exactly B's: never a mix, never nothing. ``txn_catches`` returns what went wrong (None:
nothing), with a planted bug active or not (``planted.activate``).
"""

from __future__ import annotations

import uuid
from collections import Counter
from typing import Any

import pyarrow as pa

from persist_lib.config import PersistConfig
from persist_lib.errors import PersistError, UpperMismatch
from persist_lib.handles.client import PersistClient
from persist_lib.storage.controller import StorageController
from persist_lib.testing import planted
from persist_lib.txn import apply as ap

K = pa.schema([("k", pa.int64())])
V = pa.schema([("v", pa.string())])
ROWS_A = [(((k,), ("A",)), 0, 1) for k in range(40)]
ROWS_B = [(((k,), ("B",)), 0, 1) for k in range(5, 45)]

# What each planted bug is caught by: (kill at the n-th apply, what comes after).
SCENARIOS: dict[str, tuple[int, str]] = {
    "txn_apply_without_commit": (3, "write"),
    "txn_tidy_before_apply": (1, "tidy"),
    "txn_reader_skips_apply": (1, "read"),
}


class Killed(BaseException):  # noqa: N818 - named like the kill it stands for
    """The committer stops here, as if its process had been killed."""


def _counts(rows: list[Any]) -> Counter:
    return Counter({(kv[0][0], kv[1][0]): d for kv, _t, d in rows})


def run_scenario(kill_at: int, then: str) -> str | None:
    """One run (see the module docstring); returns what went wrong, or None."""
    name = uuid.uuid4().hex
    def open_ctl() -> StorageController:
        return StorageController(PersistClient.open(f"mem://{name}", f"mem://{name}", PersistConfig.for_tests()))

    dead = open_ctl()
    dead.create_collection("c", K, V, num_shards=4, transactional=True)
    calls = [0]
    real = ap.apply_entry

    def dying(machine: Any, entry: Any) -> bool:
        calls[0] += 1
        if calls[0] == kill_at:
            raise Killed(f"killed at apply {kill_at}")
        return real(machine, entry)

    ap.apply_entry = dying  # type: ignore[assignment]
    try:
        dead.open_writer("c").compare_and_append(ROWS_A, 0, 1)
        return f"the committer was not killed (it applied {calls[0]} batches)"
    except Killed:
        pass
    finally:
        ap.apply_entry = real  # type: ignore[assignment]
    ctl = open_ctl()
    try:
        if then == "write":
            w = ctl.open_writer("c")
            try:
                w.compare_and_append(ROWS_B, 0, 1)
            except UpperMismatch:
                w.append(ROWS_B, 0, 1)
        elif then == "tidy":
            ctl.txns.tidy()
        got: Counter = Counter()
        for r in ctl.acquire_read_handle("c").snapshot(0, timeout_s=2.0).to_pylist():
            got[(r["k"], r["v"])] += r["diff"]
    except PersistError as e:
        return f"{type(e).__name__}: {e}"
    finally:
        ctl.close()
    if got not in (_counts(ROWS_A), _counts(ROWS_B)):
        return f"the collection at 0 is neither A's nor B's rows: {sorted(got.items())[:6]}..."
    return None


def txn_catches(name: str | None) -> str | None:
    """The scenario of planted bug ``name`` with it active (None: every scenario, clean)."""
    if name is None:
        for kill_at, then in sorted(set(SCENARIOS.values())):
            found = run_scenario(kill_at, then)
            if found is not None:
                return f"kill at apply {kill_at}, then {then}: {found}"
        return None
    kill_at, then = SCENARIOS[name]
    with planted.activate([name]):
        return run_scenario(kill_at, then)
