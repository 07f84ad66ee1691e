"""``persist`` subcommands for maintenance: compact, gc, expire-leases, leaked-blobs, finalize.

Imported by ``persist_lib.cli.main`` when present. Each prints a summary (a table; ``--json``
for the JSON document). Long work (compact, gc of every shard, the leaked-blob sweep)
shows a progress bar on stderr when it is a terminal (``--progress`` / ``--no-progress``).
"""

from __future__ import annotations

import argparse
from typing import Any

from persist_lib.cli.main import command, progress_args
from persist_lib.cli.output import Progress, human_bytes, kv, render, table
from persist_lib.handles import maintenance
from persist_lib.handles.client import PersistClient

#: Leaked blob keys listed per shard in the text view (``--json`` lists them all).
KEYS_SHOWN = 20


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
    progress_args(p)


def _shards(client: PersistClient, shard: str | None) -> list[str]:
    return [shard] if shard is not None else client.list_shards()


def _compact_args(p: argparse.ArgumentParser) -> None:
    _shard(p)
    p.add_argument(
        "--retry-quarantined",
        action="store_true",
        help="also retry merges quarantined after failing deterministically (see persist "
        "inspect: quarantined merges), e.g. after restoring a corrupt or missing part",
    )
    progress_args(p)


def _bar(ns: argparse.Namespace, label: str, total: int | None = None, unit: str = "") -> Progress:
    return Progress(label, total, unit=unit, enabled=ns.progress)


def _short(shard: str) -> str:
    return shard[:9] + ".." if len(shard) > 11 else shard


def _human_compact(client: PersistClient, ns: argparse.Namespace, doc: Any) -> str:
    pairs = [
        ("shard", doc["shard"]),
        ("merges applied", doc["merges_applied"]),
        ("merges not applied", f"{doc['merges_not_applied']} (inputs changed meanwhile)"),
        ("rounds", doc["rounds"]),
        ("batches", f"{doc['batches_before']:,} -> {doc['batches_after']:,}"),
        ("compaction debt", f"{doc['compaction_debt_before']:,} -> {doc['compaction_debt_after']:,}"),
        ("updates read", doc["updates_read"]),
        ("rows rewritten", doc["rows_rewritten"]),
        ("bytes read", human_bytes(doc["bytes_read"])),
        ("bytes written", human_bytes(doc["bytes_written"])),
        ("peak memory", human_bytes(doc["peak_bytes_held"])),
        ("seconds", doc["seconds"]),
    ]
    text = kv(pairs)
    if doc.get("failed"):
        text += "\n\nfailed merges (quarantined):\n" + render(doc["failed"])
    if doc.get("quarantined_merges"):
        text += (
            "\n\nquarantined merges (run again with --retry-quarantined once the part is "
            "restored):\n" + render(doc["quarantined_merges"])
        )
    return text


@command(
    "compact", "run a shard's pending merges now (size-tiered spine)", _compact_args, human=_human_compact
)
def _cmd_compact(client: PersistClient, ns: argparse.Namespace) -> Any:
    with _bar(ns, f"compact {_short(ns.shard)}", unit="merges") as bar:
        return maintenance.compact(
            client,
            ns.shard,
            retry_quarantined=ns.retry_quarantined,
            progress=lambda done, planned: bar.update(done, planned),
        )


def _gc_args(p: argparse.ArgumentParser) -> None:
    _optional_shard(p)
    progress_args(p)


def _human_gc(client: PersistClient, ns: argparse.Namespace, doc: Any) -> str:
    if ns.shard is not None:
        return render(doc)
    if not doc:
        return "(no shards)"
    header = ["shard", "blobs_deleted", "bytes_deleted", "consensus_entries_truncated", "garbage_pending", "errors"]
    rows = [[sid, *(s.get(k) for k in header[1:-1]), len(s.get("errors") or [])] for sid, s in doc.items()]
    return table(header, rows)


@command(
    "gc",
    "garbage-collect a shard (default: every shard): delete unreachable blobs, truncate "
    "consensus, drop old rollups",
    _gc_args,
    human=_human_gc,
)
def _cmd_gc(client: PersistClient, ns: argparse.Namespace) -> Any:
    if ns.shard is not None:
        return maintenance.gc(client, ns.shard)
    shards = client.list_shards()
    out: dict[str, Any] = {}
    with _bar(ns, "gc", len(shards), unit="shards") as bar:
        for i, sid in enumerate(shards):
            st = client.machine(sid).fetch_latest()
            if st.exists and not st.tombstone:
                out[sid] = maintenance.gc(client, sid)
            bar.update(i + 1, note=_short(sid))
    return out


def _human_expire(client: PersistClient, ns: argparse.Namespace, doc: Any) -> str:
    if not doc:
        return "no lease had lapsed: nothing expired"
    rows = [[sid, ", ".join(e["readers"]) or "-", ", ".join(e["writers"]) or "-"] for sid, e in doc.items()]
    return table(["shard", "readers expired", "writers expired"], rows)


@command(
    "expire-leases",
    "expire readers and writers whose lease lapsed",
    _optional_shard,
    human=_human_expire,
)
def _cmd_expire_leases(client: PersistClient, ns: argparse.Namespace) -> Any:
    return client.expire_leases(ns.shard)


def _human_leaked(client: PersistClient, ns: argparse.Namespace, doc: Any) -> str:
    if not doc:
        return "(no shards)"
    rows = [[sid, s["blobs"], s["bytes"], s["deleted"]] for sid, s in doc.items()]
    text = table(["shard", "blobs", "bytes", "deleted"], rows)
    total = sum(s["blobs"] for s in doc.values())
    verb = "deleted" if ns.delete else "found (add --delete to delete them)"
    text += f"\n\n{total:,} leaked blob(s) {verb}, {human_bytes(sum(s['bytes'] for s in doc.values()))}"
    for sid, s in doc.items():
        if s["keys"]:
            shown = s["keys"][:KEYS_SHOWN]
            more = len(s["keys"]) - len(shown)
            text += f"\n\n{sid}:\n" + "\n".join(f"  {k}" for k in shown)
            if more:
                text += f"\n  ... and {more:,} more (--json lists every key)"
    return text


@command(
    "leaked-blobs",
    "list (and with --delete remove) blobs no live state version references",
    _leaked_args,
    human=_human_leaked,
)
def _cmd_leaked_blobs(client: PersistClient, ns: argparse.Namespace) -> Any:
    older_ms = None if ns.older_than_s is None else int(ns.older_than_s * 1000)
    out: dict[str, Any] = {}
    shards = _shards(client, ns.shard)
    label = "sweep leaked blobs" if ns.delete else "look for leaked blobs"
    with _bar(ns, label, len(shards), unit="shards") as bar:
        found_total = 0
        for i, sid in enumerate(shards):
            found = maintenance.unreferenced_blobs(client, sid, older_ms, delete=ns.delete)
            out[sid] = {
                "blobs": len(found),
                "bytes": sum(int(b["bytes"]) for b in found),
                "deleted": sum(1 for b in found if b.get("deleted")),
                "keys": [b["key"] for b in found],
            }
            found_total += len(found)
            bar.update(i + 1, note=f"{found_total:,} found")
    return out


@command(
    "finalize",
    "delete a shard whose since and upper are both empty, leaving a tombstone",
    _shard,
)
def _cmd_finalize(client: PersistClient, ns: argparse.Namespace) -> Any:
    return maintenance.finalize(client, ns.shard)
