"""``persist`` subcommands for maintenance: compact, gc, expire-leases, leaked-blobs, finalize.

Imported by ``persist_lib.cli`` when present; each prints a JSON summary.
"""

from __future__ import annotations

import argparse
from typing import Any

from persist_lib import maintenance
from persist_lib.cli import command
from persist_lib.client import PersistClient


def _shard(p: argparse.ArgumentParser) -> None:
    p.add_argument("shard", help="shard id (s<uuid>)")


def _optional_shard(p: argparse.ArgumentParser) -> None:
    p.add_argument("shard", nargs="?", default=None, help="shard id (default: every shard)")


def _leaked_args(p: argparse.ArgumentParser) -> None:
    _optional_shard(p)
    p.add_argument(
        "--older-than-s",
        type=float,
        default=None,
        help="grace period in seconds: younger blobs are never reported (default 3600; use 0 "
        "only when no writer or compactor is running)",
    )
    p.add_argument("--delete", action="store_true", help="delete the blobs found")


def _shards(client: PersistClient, shard: str | None) -> list[str]:
    return [shard] if shard is not None else client.list_shards()


def _compact_args(p: argparse.ArgumentParser) -> None:
    _shard(p)
    p.add_argument(
        "--retry-quarantined",
        action="store_true",
        help="also retry merges quarantined after failing deterministically (see `persist "
        "inspect`: quarantined_merges), e.g. after restoring a corrupt or missing part",
    )


@command("compact", "run a shard's pending merges now (size-tiered spine)", _compact_args)
def _cmd_compact(client: PersistClient, ns: argparse.Namespace) -> Any:
    return maintenance.compact(client, ns.shard, retry_quarantined=ns.retry_quarantined)


@command(
    "gc",
    "garbage-collect a shard: delete unreachable blobs, truncate consensus, drop old rollups",
    _shard,
)
def _cmd_gc(client: PersistClient, ns: argparse.Namespace) -> Any:
    return maintenance.gc(client, ns.shard)


@command("expire-leases", "expire readers and writers whose lease lapsed", _optional_shard)
def _cmd_expire_leases(client: PersistClient, ns: argparse.Namespace) -> Any:
    return client.expire_leases(ns.shard)


@command(
    "leaked-blobs",
    "list (and with --delete remove) blobs no live state version references",
    _leaked_args,
)
def _cmd_leaked_blobs(client: PersistClient, ns: argparse.Namespace) -> Any:
    older_ms = None if ns.older_than_s is None else int(ns.older_than_s * 1000)
    out: dict[str, Any] = {}
    for sid in _shards(client, ns.shard):
        found = maintenance.unreferenced_blobs(client, sid, older_ms, delete=ns.delete)
        out[sid] = {
            "blobs": len(found),
            "bytes": sum(int(b["bytes"]) for b in found),
            "deleted": sum(1 for b in found if b.get("deleted")),
            "keys": [b["key"] for b in found],
        }
    return out


@command(
    "finalize",
    "delete a shard whose since and upper are both empty, leaving a tombstone",
    _shard,
)
def _cmd_finalize(client: PersistClient, ns: argparse.Namespace) -> Any:
    return maintenance.finalize(client, ns.shard)
