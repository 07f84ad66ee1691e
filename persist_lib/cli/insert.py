"""``persist insert NAME [ROWS.jsonl]``: rows into a transactional collection at a time the
controller picks (``StorageController.insert``: one transaction, all or nothing).

Each input line is a JSON object holding the collection's key and value fields
(``{"k": 1, "v": "x"}``); an optional ``diff`` field retracts (-1) or repeats. Reads the
file, or standard input when it is ``-`` or absent. Prints the time the rows are visible at.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from persist_lib.cli.main import command
from persist_lib.errors import InvalidUsage
from persist_lib.handles.client import PersistClient


def _args(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", help="a transactional collection")
    p.add_argument("rows", nargs="?", default="-", help="JSON lines file of rows (default: stdin)")


def _read_rows(path: str) -> list[dict[str, Any]]:
    try:
        f = sys.stdin if path == "-" else open(path, encoding="utf-8")  # noqa: SIM115
    except OSError as e:
        raise InvalidUsage(f"can't read {path}: {e.strerror}") from e
    where = "standard input" if path == "-" else path
    rows: list[dict[str, Any]] = []
    with f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise InvalidUsage(f"line {i} of {where} is not JSON: {e.msg}") from e
            if not isinstance(row, dict):
                raise InvalidUsage(f"line {i} of {where} is not a JSON object")
            rows.append(row)
    if not rows:
        raise InvalidUsage(f"{where} holds no rows; nothing was written")
    return rows


def _human(client: PersistClient, ns: argparse.Namespace, doc: Any) -> str:
    return f"{doc['rows']} rows inserted into {doc['collection']} at time {doc['time']}"


@command("insert", "insert JSON-lines rows into a transactional collection (one transaction)",
         _args, human=_human)
def _insert(client: PersistClient, ns: argparse.Namespace) -> Any:
    import pyarrow as pa

    from persist_lib.storage import StorageController

    rows = _read_rows(ns.rows)
    try:
        table = pa.Table.from_pylist(rows)
    except (pa.ArrowException, TypeError, ValueError) as e:
        raise InvalidUsage(f"the rows don't form one table: {e}") from e
    with StorageController(client) as ctl:
        at = ctl.insert(ns.name, table)
    return {"collection": ns.name, "time": at, "rows": table.num_rows}
