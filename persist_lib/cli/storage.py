"""``persist collections`` and ``persist describe NAME``.

Both only read: they use a read-only controller, which registers nothing it keeps (a
reader left behind on a metadata shard would hold back the collection of retired
renditions until its lease lapsed).
"""

from __future__ import annotations

import argparse
from typing import Any

from persist_lib.cli.main import command
from persist_lib.handles.client import PersistClient


def _ctl(client: PersistClient) -> Any:
    from persist_lib.storage import StorageController

    return StorageController(client, read_only=True)


def _human_collections(client: PersistClient, ns: argparse.Namespace, doc: Any) -> str:
    from persist_lib.cli.human import collections_table

    with _ctl(client) as ctl:
        descs = {c["name"]: ctl.describe(c["name"]) for c in doc}
    return collections_table(doc, descs)


def _human_describe(client: PersistClient, ns: argparse.Namespace, doc: Any) -> str:
    from persist_lib.cli.human import describe_text

    return describe_text(doc)


@command("collections", "list the STORAGE collections", human=_human_collections)
def _collections(client: PersistClient, ns: argparse.Namespace) -> Any:
    with _ctl(client) as ctl:
        return [
            {"name": n, "active_rendition": d["active_rendition"], "renditions": sorted(d["renditions"])}
            for n in ctl.list_collections()
            for d in [ctl.describe(n)]
        ]


def _name_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", help="collection name")


@command(
    "describe",
    "describe a STORAGE collection: renditions, shards, frontiers, handovers",
    _name_arg,
    human=_human_describe,
)
def _describe(client: PersistClient, ns: argparse.Namespace) -> Any:
    with _ctl(client) as ctl:
        return ctl.describe(ns.name)
