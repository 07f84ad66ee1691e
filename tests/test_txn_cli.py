"""``persist insert``: JSON-lines rows into a transactional collection, one transaction."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa

from persist_lib import PersistClient, PersistConfig
from persist_lib.storage import StorageController

PERSIST = [sys.executable, "-m", "persist_lib.cli.main"]


def run(args: list[str], home: Path, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PERSIST_HOME": str(home)}
    return subprocess.run(PERSIST + args, env=env, input=stdin, capture_output=True, text=True, timeout=60)


def test_insert_rows_and_refusals(tmp_path: Path) -> None:
    home = tmp_path / "home"
    with StorageController(PersistClient.default(home, PersistConfig.for_tests())) as ctl:
        ctl.create_collection("t", pa.schema([("k", pa.int64())]), pa.schema([("v", pa.string())]), 3, transactional=True)
    lines = "\n".join(json.dumps({"k": k, "v": f"x{k}"}) for k in range(5))
    out = run(["--json", "insert", "t"], home, lines)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"collection": "t", "time": 0, "rows": 5}
    bad = run(["insert", "t"], home, '{"k": "not a number", "v": "y"}\n')
    assert bad.returncode == 2 and "k" in bad.stderr, bad.stderr
    bad = run(["insert", "t"], home, "not json\n")
    assert bad.returncode == 2 and "not JSON" in bad.stderr, bad.stderr
    with StorageController(PersistClient.default(home, PersistConfig.for_tests())) as ctl:
        snap = ctl.acquire_read_handle("t").snapshot(0)
        assert sorted((r["k"], r["v"], r["diff"]) for r in snap.to_pylist()) == [(k, f"x{k}", 1) for k in range(5)]
        assert ctl.open_writer("t").upper.time == 1  # the refused inserts wrote nothing
