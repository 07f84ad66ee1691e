"""``persist schema show|evolve`` and ``persist sql`` over an evolved collection."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pytest

from persist_lib import PersistClient, PersistConfig
from persist_lib.cli.main import main
from persist_lib.cli.schema import BadColumnSpec, parse_type
from persist_lib.storage import StorageController

K = pa.schema([pa.field("id", pa.int64(), nullable=False)])
V1 = pa.schema([("qty", pa.int32()), ("note", pa.string())])


@dataclass
class Ran:
    returncode: int
    stdout: str
    stderr: str


def run(args: list[str], home: Path) -> Ran:
    """``persist ARGS`` in this process (the CLI's own entry point, exit code and output)."""
    out, err = io.StringIO(), io.StringIO()
    old = os.environ.get("PERSIST_HOME")
    os.environ["PERSIST_HOME"] = str(home)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(args)
            except SystemExit as e:  # --help
                code = int(e.code or 0)
    finally:
        if old is None:
            os.environ.pop("PERSIST_HOME", None)
        else:
            os.environ["PERSIST_HOME"] = old
    return Ran(code, out.getvalue(), err.getvalue())


def test_parse_type() -> None:
    assert parse_type("int64", "x") == pa.int64()
    assert parse_type("double", "x") == pa.float64()
    assert parse_type("decimal(12, 2)", "x") == pa.decimal128(12, 2)
    assert parse_type("decimal256(40,3)", "x") == pa.decimal256(40, 3)
    with pytest.raises(BadColumnSpec, match="unknown type 'integer'"):
        parse_type("integer", "--add x:integer")


def test_persist_schema_evolve_and_sql_before_and_after(tmp_path: Path) -> None:
    home = tmp_path / "home"
    client = PersistClient.default(home, PersistConfig.for_tests())
    with StorageController(client) as ctl:
        ctl.create_collection("orders", K, V1, num_shards=2)
        w = ctl.open_writer("orders")
        w.append([(((i,), (i, f"n{i}")), 0, 1) for i in range(4)], 0, 1)
        w.expire()
    client.close()

    out = run(["schema", "evolve", "--help"], home)
    assert out.returncode == 0 and "--add COL:TYPE" in out.stdout and "build a" in out.stdout
    # Refused, typed, nothing changed.
    out = run(["schema", "evolve", "orders", "--widen", "qty:int16"], home)
    assert out.returncode == 2 and "can't change from int32 to int16" in out.stderr
    assert "build a new rendition" in out.stderr
    out = run(["schema", "evolve", "orders", "--drop", "nope"], home)
    assert out.returncode == 2 and "no such value column" in out.stderr
    out = run(["schema", "evolve", "orders", "--add", "price:float64", "--dry-run", "--json"], home)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["changes"] == ["add price: double"]
    out = run(["schema", "show", "orders", "--json"], home)
    assert json.loads(out.stdout)["version"] == 0

    # This one in another process (as an operator would): this process's cached states
    # of the shards still say version 0, and opening a writer of version 1 here must
    # look at the latest state, not refuse on the cached one.
    p = subprocess.run(
        [sys.executable, "-m", "persist_lib.cli.main", "schema", "evolve", "orders", "--add", "price:float64", "--json"],
        env={**os.environ, "PERSIST_HOME": str(home)}, capture_output=True, text=True, timeout=120,
    )
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["version"] == 1

    client = PersistClient.default(home, PersistConfig.for_tests())
    with StorageController(client) as ctl:
        w = ctl.open_writer("orders")
        w.append([(((9,), (9, "n9", 2.5)), 1, 1)], 1, 2)
        w.expire()
    client.close()
    out = run(["schema", "evolve", "orders", "--widen", "qty:int64", "--drop", "note", "--json"], home)
    assert out.returncode == 0, out.stderr
    assert sorted(json.loads(out.stdout)["changes"]) == ["drop note (string)", "widen qty: int32 -> int64"]
    out = run(["schema", "show", "orders", "--json"], home)
    doc = json.loads(out.stdout)
    assert doc["version"] == 2 and len(doc["versions"]) == 3
    assert doc["schemas"] == "key(id: int64 not null) val(qty: int64, price: double)"

    out = run(["sql", "--json", "SELECT id, qty, price FROM orders AS OF 0 ORDER BY id"], home)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [{"id": i, "qty": i, "price": None} for i in range(4)]
    out = run(["sql", "--json", "SELECT id, qty, price FROM orders AS OF 1 WHERE price IS NOT NULL"], home)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [{"id": 9, "qty": 9, "price": 2.5}]
    out = run(["sql", "--json", "SELECT count(*) AS n FROM orders AS OF 1"], home)
    assert json.loads(out.stdout) == [{"n": 5}]
