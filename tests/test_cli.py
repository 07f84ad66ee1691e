"""The ``persist`` console script: shards and inspect, with env/flag locations."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa

from persist_lib import PersistClient, PersistConfig, ShardId

PERSIST = [sys.executable, "-m", "persist_lib.cli"]


def run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(PERSIST + args, env={**os.environ, **env}, capture_output=True, text=True, timeout=60)


def test_shards_and_inspect(tmp_path: Path) -> None:
    home = tmp_path / "home"
    client = PersistClient.default(home, PersistConfig.for_tests())
    shard = ShardId.new()
    w, r = client.open(shard, pa.schema([("k", pa.int64())]), pa.schema([]))
    w.compare_and_append([(((1,), ()), 0, 1)], 0, 3)
    env = {"PERSIST_HOME": str(home)}
    out = run(["shards"], env)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [str(shard)]
    out = run(["inspect", str(shard)], env)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["upper"] == [3] and doc["since"] == [0] and doc["num_batches"] == 1
    assert set(doc) >= {"seqno", "batches", "leased_readers", "writers", "rollups"}
    assert doc["batches"][0]["len"] == 1 and doc["batches"][0]["parts"]
    # flags override the environment
    out = run(["--blob", f"file://{home / 'blob'}", "--consensus", f"sqlite:///{home / 'consensus.db'}", "shards"], {})
    assert json.loads(out.stdout) == [str(shard)]


def test_cli_errors_are_one_clear_line(tmp_path: Path) -> None:
    env = {"PERSIST_HOME": str(tmp_path)}
    out = run(["inspect", "not-a-shard"], env)
    assert out.returncode == 2
    assert "not a valid shard id" in out.stderr and "Traceback" not in out.stderr
    out = run(["inspect", str(ShardId.new())], env)
    assert out.returncode == 2 and "does not exist" in out.stderr
    out = run(["--timeout", "2", "--consensus", "postgresql://u:canary-pw@127.0.0.1:1/db", "shards"], env)
    assert out.returncode != 0 and "canary-pw" not in out.stderr + out.stdout
    out = run(["--blob", "bogus://x", "shards"], env)
    assert out.returncode == 2 and "bogus" in out.stderr
