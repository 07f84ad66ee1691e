"""The ``persist`` console script: shards and inspect, with env/flag locations."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest

from persist_lib import PersistClient, PersistConfig, ShardId

PERSIST = [sys.executable, "-m", "persist_lib.cli.main"]


def run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(PERSIST + args, env={**os.environ, **env}, capture_output=True, text=True, timeout=60)


def test_shards_and_inspect(tmp_path: Path) -> None:
    home = tmp_path / "home"
    client = PersistClient.default(home, PersistConfig.for_tests())
    shard = ShardId.new()
    w, r = client.open(shard, pa.schema([("k", pa.int64())]), pa.schema([]))
    w.compare_and_append([(((1,), ()), 0, 1)], 0, 3)
    env = {"PERSIST_HOME": str(home)}
    out = run(["shards", "--json"], env)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [str(shard)]
    out = run(["--json", "inspect", str(shard)], env)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["upper"] == [3] and doc["since"] == [0] and doc["num_batches"] == 1
    assert set(doc) >= {"seqno", "batches", "leased_readers", "writers", "rollups"}
    assert doc["batches"][0]["len"] == 1 and doc["batches"][0]["parts"]
    # flags override the environment
    out = run(["--blob", f"file://{home / 'blob'}", "--consensus", f"sqlite:///{home / 'consensus.db'}", "shards", "--json"], {})
    assert json.loads(out.stdout) == [str(shard)]


def test_cli_errors_are_one_clear_line(tmp_path: Path) -> None:
    env = {"PERSIST_HOME": str(tmp_path)}
    PersistClient.default(tmp_path, PersistConfig.for_tests()).close()  # an (empty) location
    out = run(["inspect", "not-a-shard"], env)
    assert out.returncode == 2
    assert "not a valid shard id" in out.stderr and "Traceback" not in out.stderr
    out = run(["inspect", str(ShardId.new())], env)
    assert out.returncode == 2 and "does not exist" in out.stderr
    out = run(["--timeout", "2", "--consensus", "postgresql://u:canary-pw@127.0.0.1:1/db", "shards"], env)
    assert out.returncode != 0 and "canary-pw" not in out.stderr + out.stdout
    out = run(["--blob", "bogus://x", "shards"], env)
    assert out.returncode == 2 and "bogus" in out.stderr


REPO = Path(__file__).resolve().parents[1]
READ_ONLY_COMMANDS = [
    ["shards"],
    ["collections"],
    ["describe", "orders"],
    ["inspect", "s00000000-0000-4000-8000-000000000000"],
    ["leaked-blobs"],
    ["ingest", "status", "orders"],
    ["snapshot", "orders"],
    ["snapshot", "s00000000-0000-4000-8000-000000000000", "--as-of", "2026-01-01T00:00:00Z"],
    ["tail", "orders"],
    ["shards", "--json"],
]


def test_read_only_commands_never_create_a_location(tmp_path: Path) -> None:
    """Issue defect 7: run from the wrong directory, ``persist collections`` created an
    empty ``./.persist`` and printed ``[]``. Now every command that only reads fails with
    ``LocationNotFound`` naming the location it looked for and how to point at the
    right one, and creates nothing."""
    wrong = tmp_path / "somewhere-else"
    wrong.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PERSIST_")}
    env["PYTHONPATH"] = str(REPO)  # this checkout's persist_lib, whatever the directory
    for args in READ_ONLY_COMMANDS:
        out = subprocess.run(
            PERSIST + args, env=env, cwd=wrong, capture_output=True, text=True, timeout=60
        )
        err = out.stderr
        assert out.returncode == 2, (args, out.stdout, err)
        assert out.stdout == "", args
        assert "LocationNotFound" in err and "Traceback" not in err, err
        assert str(wrong / ".persist" / "consensus.db") in err, err  # what it looked for
        assert "PERSIST_HOME" in err and "--blob" in err and "--consensus" in err, err
        assert err.count("\n") == 1, err  # one line
        assert list(wrong.iterdir()) == [], f"{args} created {list(wrong.iterdir())}"
    # the same with an explicit PERSIST_HOME that does not exist
    missing = tmp_path / "no-such-home"
    out = subprocess.run(
        [*PERSIST, "collections"], env={**env, "PERSIST_HOME": str(missing)}, cwd=wrong,
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 2 and str(missing / "consensus.db") in out.stderr, out.stderr
    assert not missing.exists() and list(wrong.iterdir()) == []
    # the library: a typed error, nothing created
    from persist_lib.errors import LocationNotFound

    with pytest.raises(LocationNotFound, match="PERSIST_HOME"):
        PersistClient.open_existing(f"file://{missing / 'blob'}", f"sqlite:///{missing / 'consensus.db'}")
    assert not missing.exists()
    # writing commands still create their location
    out = subprocess.run(
        [*PERSIST, "ingest", "files", "orders", f"file://{tmp_path / 'landing'}", "--key", "id:int64"],
        env={**env, "PERSIST_HOME": str(missing)}, cwd=wrong, capture_output=True, text=True,
        timeout=120,
    )
    assert "LocationNotFound" not in out.stderr and (missing / "consensus.db").exists(), out.stderr
