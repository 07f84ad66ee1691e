"""``persist schema show NAME`` and ``persist schema evolve NAME --add/--widen/--drop``.

``show`` only reads (a read-only controller). ``evolve`` changes the collection's
schemas in place through a writable controller (``StorageController.evolve_schema``:
the catalog and every shard, crash-safe); ``--resume`` finishes an evolution a crash
interrupted. A change that can't be made in place is refused with
``IncompatibleSchemaChange`` (exit 2) and nothing changes.
"""

from __future__ import annotations

import argparse
from typing import Any

import pyarrow as pa

from persist_lib.cli.main import command
from persist_lib.handles.client import PersistClient
from persist_lib.storage.schema_spec import TYPES_HELP, BadColumnSpec, evolved_val, parse_type

__all__ = ["BadColumnSpec", "parse_type"]

EPILOG = (
    "In place: --add a nullable value column, --widen a value column (int8/16/32 -> "
    "int64, float32 -> float64, decimal precision up at the same scale, string -> "
    "large_string, binary -> large_binary), --drop a value column. Old parts are migrated "
    "when read (nulls where a column did not exist) and rewritten by compaction. Key "
    "columns, narrowing, other type changes and not-null new columns are refused: build a "
    "new rendition with the new schemas (create_rendition, rebuild from raw, handover). "
    + TYPES_HELP
)


def _evolved(val: pa.Schema, ns: argparse.Namespace) -> pa.Schema:
    return evolved_val(val, add=ns.add or (), widen=ns.widen or (), drop=ns.drop or ())


def _args(p: argparse.ArgumentParser) -> None:
    p.epilog = EPILOG
    sub = p.add_subparsers(dest="schema_cmd", required=True)
    s = sub.add_parser("show", help="the collection's schema version, schemas and earlier versions")
    s.add_argument("name", help="collection name")
    e = sub.add_parser(
        "evolve",
        help="change a collection's schemas in place (add, widen, drop value columns)",
        description="Change a collection's schemas in place.",
        epilog=EPILOG,
    )
    e.add_argument("name", help="collection name")
    e.add_argument("--add", action="append", metavar="COL:TYPE", help="add a nullable value column")
    e.add_argument("--widen", action="append", metavar="COL:TYPE", help="widen a value column's type")
    e.add_argument("--drop", action="append", metavar="COL", help="drop a value column")
    e.add_argument(
        "--resume", action="store_true",
        help="finish an evolution that a crash interrupted (no other flag needed)",
    )
    e.add_argument(
        "--dry-run", action="store_true", help="print the schemas the change would give; change nothing",
    )


@command("schema", "show or evolve a STORAGE collection's schemas", _args)
def _schema(client: PersistClient, ns: argparse.Namespace) -> Any:
    from persist_lib.shard.codec import Schemas
    from persist_lib.shard.schema_compat import check_evolution
    from persist_lib.storage import StorageController

    if ns.schema_cmd == "show":
        with StorageController(client, read_only=True) as ro:
            return ro.schema(ns.name)
    if not (ns.add or ns.widen or ns.drop or ns.resume):
        raise BadColumnSpec("persist schema evolve: give --add, --widen, --drop or --resume")
    if ns.dry_run:
        with StorageController(client, read_only=True) as ro:
            spec = ro._spec(ns.name)
            cur = Schemas.from_json(spec["schemas"])
            new = Schemas.create(cur.key, _evolved(cur.val, ns))
            changes = check_evolution(cur, new, shard=f"collection {ns.name!r}")
            return {
                "name": ns.name, "dry_run": True, "version": cur.version + (1 if changes else 0),
                "schemas": new.describe(), "changes": [c.describe() for c in changes],
            }
    with StorageController(client) as ctl:  # recovery finishes an interrupted evolution
        if ns.resume and not (ns.add or ns.widen or ns.drop):
            info = ctl.schema(ns.name)
            return {"name": ns.name, "resumed": True, "version": info["version"], "schemas": info["schemas"]}
        cur = Schemas.from_json(ctl._spec(ns.name)["schemas"])
        return ctl.evolve_schema(ns.name, cur.key, _evolved(cur.val, ns))
