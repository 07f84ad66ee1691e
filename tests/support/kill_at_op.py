"""kill -9 of a child process right after its N-th durable operation (a blob write or
delete, a consensus CAS or truncate on a file blob / SQLite consensus).

The child's script starts with ``STOP_AT_DURABLE_OP`` (it reads ``blob, cons, stop_at``
from its arguments, defines ``counting`` -- set ``counting[0] = True`` where counting
starts -- and ``ops``); after op ``stop_at`` it prints ``stopped`` and blocks, so the
parent's kill lands exactly there. Each txn log append prints ``logcas commit|tidy N``
(N: the ops so far), which tells where the commit CAS was. ``run_until_stopped`` runs
such a script and kills it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

STOP_AT_DURABLE_OP = textwrap.dedent(
    """
    import sys
    from persist_lib.location.file_blob import FileBlob
    from persist_lib.location.sqlite_consensus import SqliteConsensus
    from persist_lib.txn.log import TxnLog
    blob, cons, stop_at = sys.argv[1], sys.argv[2], int(sys.argv[3])
    counting, ops = [False], [0]

    import threading
    count_lock = threading.Lock()  # a transaction runs per-shard operations in parallel

    def durable(cls, name):
        real = getattr(cls, name)
        def op(self, *a, **kw):
            out = real(self, *a, **kw)
            if counting[0]:
                with count_lock:  # held while stopped: the other threads stop too
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
    def marked(self, rows, at, **kw):
        real_append(self, rows, at, **kw)
        print("logcas", "commit" if rows and rows[0][2] == 1 else "tidy", ops[0], flush=True)
    TxnLog.append = marked
    """
)

ROOT = str(Path(__file__).resolve().parent.parent.parent)


def run_until_stopped(script: str, blob: str, cons: str, stop_at: int) -> list[str]:
    """Runs ``STOP_AT_DURABLE_OP + script`` (from the repository root, so ``tests.*``
    imports), kills it with SIGKILL once it printed ``stopped``; returns its output lines."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(
        [sys.executable, "-c", STOP_AT_DURABLE_OP + textwrap.dedent(script), blob, cons, str(stop_at)],
        cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
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


def commit_point(lines: list[str]) -> tuple[int, int]:
    """(ops of the whole uncrashed run, op index of its first commit CAS on the txn log)."""
    total = int(next(line for line in lines if line.startswith("done")).split()[1])
    commit = int(next(line for line in lines if line.startswith("logcas commit")).split()[2])
    return total, commit


def phase_points(total: int, commit: int) -> list[int]:
    """Kill points at each phase of one transactional write: before the commit CAS
    (registrations, uploads), on it, between the applies, during the tidy."""
    assert commit < total
    return sorted({commit - 1, commit, commit + 2, total - 1})
