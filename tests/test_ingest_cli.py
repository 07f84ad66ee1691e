"""``persist ingest files|postgres|status`` from the command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from persist_lib.cli.ingest import parse_fields
from persist_lib.ingest.errors import IngestConfigError

PERSIST = [sys.executable, "-m", "persist_lib.cli.main"]


def run(args: list[str], home: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PERSIST_HOME": str(home)}
    env.pop("PERSIST_BLOB_URI", None)
    env.pop("PERSIST_CONSENSUS_URI", None)
    return subprocess.run(PERSIST + args, env=env, capture_output=True, text=True, timeout=120)


def test_ingest_files_status_and_errors(tmp_path: Path) -> None:
    z = tmp_path / "zone"
    z.mkdir()
    (z / "a.jsonl").write_text('{"id": 1, "name": "a"}\n{"id": 2, "name": "b"}\nnot json\n')
    (z / "b.csv").write_text("id,name\n3,c\n")
    home = tmp_path / "home"
    args = ["ingest", "files", "orders", str(z), "--key", "id:int64", "--value", "name:string", "--json", "--progress"]
    out = run(args, home)
    assert out.returncode == 0, out.stderr
    s = json.loads(out.stdout)
    assert s["records"] == 4 and s["errors"] == 1 and s["frontier"] == {"files": ["b.csv", 1]}
    assert "rec/s" in out.stderr  # the progress bar
    again = json.loads(run(args[:-1] + ["--no-progress"], home).stdout)
    assert again["records"] == 0 and again["resumed_at"] > 0
    st = run(["ingest", "status", "orders", "--json"], home)
    assert st.returncode == 0, st.stderr
    status = json.loads(st.stdout)
    assert status["frontier"] == {"files": ["b.csv", 1]}
    assert set(status["shards"]) == {"data", "errors", "remap"}
    # bad configuration: a clear message and exit status 2
    bad = run(["ingest", "files", "x", str(tmp_path / "missing"), "--key", "id:int64"], home)
    assert bad.returncode == 2 and "does not exist" in bad.stderr and "mkdir" in bad.stderr
    bad = run(["ingest", "files", "x", str(z), "--key", "id:int64", "--format", "xml"], home)
    assert bad.returncode == 2 and "unknown file format 'xml'" in bad.stderr
    bad = run(["ingest", "status", "nope"], home)
    assert bad.returncode == 2 and "no ingestion named 'nope'" in bad.stderr


def test_ingest_files_into_storage_collections_with_follow(tmp_path: Path) -> None:
    z = tmp_path / "zone"
    z.mkdir()
    (z / "a.jsonl").write_text('{"id": 1, "name": "a", "_deleted": false}\n{"id": 1, "_deleted": true}\n{"id": 2, "name": "b"}\n')
    home = tmp_path / "home"
    out = run(
        ["ingest", "files", "people", str(z), "--key", "id:int64", "--value", "name:string", "--envelope", "upsert",
         "--delete-field", "_deleted", "--storage", "--shards", "2", "--follow", "--duration", "1.5", "--poll", "0.2", "--json"],
        home,
    )
    assert out.returncode == 0, out.stderr
    s = json.loads(out.stdout)
    assert s["mode"] == "continuous" and s["updates"] == 1  # id 1: +1 then -1 in one time nets out
    cols = json.loads(run(["collections", "--json"], home).stdout)
    assert {c["name"] for c in cols} >= {"people", "people.errors", "people.state"}


def test_parse_fields() -> None:
    s = parse_fields("id:int64,price:decimal(10,2),qty:float64!", "value")
    assert [str(f.type) for f in s] == ["int64", "decimal128(10, 2)", "double"]
    assert not s.field("qty").nullable
    with pytest.raises(IngestConfigError, match="NAME:TYPE"):
        parse_fields("id", "key")
    with pytest.raises(IngestConfigError, match="unknown type"):
        parse_fields("id:varchar", "key")
