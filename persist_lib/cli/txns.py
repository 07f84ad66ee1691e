"""``persist txns [--finish]``: the location's txn log (``persist_lib.txn``); and
``persist make-transactional NAME`` (``StorageController.make_transactional``).

Shows the registered data shards and the committed transactions not applied yet. With
``--finish`` it does what any reader or writer would do after a committer died: applies
every committed transaction, tidies the log, and releases the part writers of
transactions that can never commit (their committer's log lease lapsed).
"""

from __future__ import annotations

import argparse
from typing import Any

from persist_lib.cli.main import command
from persist_lib.handles.client import PersistClient


def _args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--finish", action="store_true",
                   help="apply committed transactions, tidy the log, release dead transactions' writers")


@command("txns", "the txn log: registered shards, transactions not applied yet (--finish applies them)", _args)
def _txns(client: PersistClient, ns: argparse.Namespace) -> Any:
    from persist_lib.txn.txns import Txns

    txns = Txns(client, read_only=not ns.finish)
    try:
        doc: dict[str, Any] = {}
        if ns.finish:
            doc["applied"] = txns.apply_all()
            doc["tidied"] = txns.tidy()
            doc["released_part_writers"] = txns.recover_orphans()
        view = txns.log.read()
        doc.update({
            "log_shard": txns.log.shard,
            "log_upper": view.upper,
            "registered_shards": len(view.registered),
            "pending": [
                {"shard": p.shard, "txn": p.txn, "lower": p.batch.lower.to_json(),
                 "upper": p.batch.upper.to_json(), "updates": p.batch.len}
                for p in view.pending
            ],
        })
        return doc
    finally:
        txns.close()


def _convert_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", help="the collection to make transactional")


@command("make-transactional",
         "make an existing collection transactional (atomic writes over all its shards; fences its direct writers)",
         _convert_args)
def _make_transactional(client: PersistClient, ns: argparse.Namespace) -> Any:
    from persist_lib.storage import StorageController

    with StorageController(client) as ctl:
        return ctl.make_transactional(ns.name)
