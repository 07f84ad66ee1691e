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


def test_txns_shows_and_finishes_what_a_dead_committer_left(tmp_path: Path) -> None:
    home = tmp_path / "home"
    with StorageController(PersistClient.default(home, PersistConfig.for_tests())) as ctl:
        ctl.create_collection("t", pa.schema([("k", pa.int64())]), pa.schema([("v", pa.string())]), 2, transactional=True)
        ctl.txns.ensure_applied = lambda *a, **k: 0  # type: ignore[method-assign]
        ctl.open_writer("t").compare_and_append([(((k,), ("x",)), 0, 1) for k in range(4)], 0, 1)
    out = run(["--json", "txns"], home)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["registered_shards"] == 2 and len(doc["pending"]) == 2
    assert sum(p["updates"] for p in doc["pending"]) == 4
    out = run(["--json", "txns", "--finish"], home)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["applied"] == 2 and doc["tidied"] == 2 and doc["pending"] == []
    client = PersistClient.default(home, PersistConfig.for_tests())
    shards = StorageController(client, read_only=True).describe("t")["renditions"]["r0"]["shards"]
    assert [client.machine(s).fetch_latest().upper.time for s in shards] == [1, 1]


def test_txn_commands_never_create_a_location(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-home"
    for args, stdin in ((["txns"], None), (["insert", "t"], '{"k": 1, "v": "x"}\n')):
        out = run(args, missing, stdin)
        assert out.returncode == 2 and "LocationNotFound" in out.stderr, (args, out.stderr)
        assert not missing.exists(), args


def test_make_transactional_command(tmp_path: Path) -> None:
    home = tmp_path / "home"
    with StorageController(PersistClient.default(home, PersistConfig.for_tests())) as ctl:
        ctl.create_collection("old", pa.schema([("k", pa.int64())]), pa.schema([("v", pa.string())]), 2,
                              transactional=False)
    refused = run(["insert", "old"], home, '{"k": 1, "v": "x"}\n')
    assert refused.returncode == 2 and "make-transactional" in refused.stderr, refused.stderr
    out = run(["--json", "make-transactional", "old"], home)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["converted"] is True
    again = run(["--json", "make-transactional", "old"], home)
    assert json.loads(again.stdout)["converted"] is False
    assert run(["insert", "old"], home, '{"k": 1, "v": "x"}\n').returncode == 0
