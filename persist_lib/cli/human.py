"""Text views of the ``persist`` commands' JSON documents (what people see by default).

Each function takes the document a command returns (``--json`` prints that document)
and lays it out as key/value lines and tables (``cli_output``). Only ``shards_table``
and ``shard_roles`` read more from the location; they only read (a read-only STORAGE
controller, which registers nothing it keeps).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from persist_lib.cli.fit import line_width
from persist_lib.cli.output import human_bytes, id_table, kv, nested_table, render, table
from persist_lib.errors import InvalidUsage
from persist_lib.handles.client import PersistClient


def shard_roles(client: PersistClient) -> dict[str, str]:
    """What each shard of the STORAGE catalog is, by shard id: ``orders / r1 / shard 3
    of 8``, ``orders / rendition metadata shard``, ``STORAGE catalog``, and the
    deterministic shards of an ingestion named like a collection (``orders / ingestion
    remap shard``)."""
    from persist_lib.ingest.outputs import ROLES, shard_id_for
    from persist_lib.storage import StorageController
    from persist_lib.storage.catalog import default_catalog_shard
    from persist_lib.storage.metadata import active_rendition
    from persist_lib.storage.status import rendition_status

    out = {str(default_catalog_shard()): "STORAGE catalog"}
    with StorageController(client, read_only=True) as ctl:
        cat, _ = ctl.catalog.load()
    for name in sorted({n.split(".")[0] for n in cat}):
        for role in (*ROLES, "cdc-snapshot"):
            out[str(shard_id_for(name, role))] = f"{name} / ingestion {role} shard"
    for name, spec in sorted(cat.items()):
        out[spec["metadata_shard"]] = f"{name} / rendition metadata shard"
        active = active_rendition(client, spec["metadata_shard"])
        for r, info in sorted(spec["renditions"].items()):
            status = rendition_status(info, active=r == active)
            n = len(info["shards"])
            for i, sid in enumerate(info["shards"]):
                out[sid] = f"{name} / {r} / shard {i} of {n} ({status})"
    return out


def shards_table(client: PersistClient, shards: Sequence[str]) -> str:
    """``persist shards``: one row per shard with its frontiers, size and what it is."""
    if not shards:
        return "(no shards)"
    roles = shard_roles(client)
    rows = []
    for sid in shards:
        try:
            st = client.inspect(sid)
        except InvalidUsage:
            rows.append(["(no state)", None, None, None, None, None])
            continue
        what = roles.get(sid, "-")
        if st.get("tombstone"):
            what = f"{what[:-1]}, finalized)" if what.endswith(")") else f"{what} (finalized)"
        rows.append(
            [what, st["upper"], st["since"], st["num_batches"], st["num_updates"], st["bytes"]]
        )
    # the shard id whole on its own line, its row below (fits 120 columns); times as
    # timestamps (persist inspect SHARD and --json have the integers)
    return id_table(
        "shard",
        list(shards),
        ["what", "upper", "since", "batches", "updates", "bytes"],
        rows,
        keys=["what", "upper_short", "since_short", "batches", "updates", "bytes"],
    )


def inspect_text(doc: Mapping[str, Any]) -> str:
    """``persist inspect SHARD``."""
    head = kv(
        [
            ("shard", doc["shard"]),
            ("seqno", doc["seqno"]),
            ("seqno_since", doc.get("seqno_since")),
            ("walltime_ms", doc.get("walltime_ms")),
            ("code_version", doc.get("code_version")),
            ("tombstone", doc.get("tombstone", False)),
            ("since", doc["since"]),
            ("upper", doc["upper"]),
            ("batches", doc["num_batches"]),
            ("updates", doc["num_updates"]),
            ("bytes", doc["bytes"]),
            ("compaction_debt", doc.get("compaction_debt", 0)),
            ("garbage", f"{doc['garbage']['blobs']} blobs, {human_bytes(doc['garbage']['bytes'])}"),
            ("rollups", _rollups(doc.get("rollups", {}))),
        ]
    )
    parts = [head]
    spine = {b["id"]: b for b in doc.get("spine", [])}
    if doc.get("batches"):
        rows = [
            [
                b["id"],
                spine.get(b["id"], {}).get("level"),
                b["len"],
                b["bytes"],
                len(b["parts"]),
                b["lower"],
                b["upper"],
                b["since"],
                _pending(spine.get(b["id"], {})),
            ]
            for b in doc["batches"]
        ]
        parts.append(
            "\nbatches (oldest first):\n"
            + _indent(
                nested_table(
                    ["batch", "level", "updates", "bytes", "parts", "lower", "upper", "since", "pending"],
                    rows,
                    keys=["batch", "level", "updates", "bytes", "parts", "lower", "upper", "since", "pending"],
                )
            )
        )
    readers = doc.get("leased_readers", {})
    parts.append(f"\nleased readers: {len(readers)}")
    if readers:
        parts.append(
            _indent(
                nested_table(
                    ["reader", "since", "seqno", "last heartbeat", "lease", "purpose"],
                    [
                        [
                            rid,
                            r["since"],
                            r["seqno"],
                            r["last_heartbeat_ms"],
                            _duration(r["lease_duration_ms"]),
                            r.get("purpose") or "-",
                        ]
                        for rid, r in readers.items()
                    ],
                    keys=["reader", "since", "seqno", "last_heartbeat_ms", "lease", "purpose"],
                )
            )
        )
    critical = doc.get("critical_readers", {})
    if critical:
        parts.append(f"\ncritical readers: {len(critical)}")
        parts.append(
            _indent(
                nested_table(
                    ["reader", "since", "opaque", "purpose"],
                    [[rid, r["since"], r["opaque"], r.get("purpose") or "-"] for rid, r in critical.items()],
                )
            )
        )
    writers = doc.get("writers", {})
    parts.append(f"\nwriters: {len(writers)}")
    if writers:
        parts.append(
            _indent(
                nested_table(
                    ["writer", "last heartbeat", "lease", "last write upper", "purpose"],
                    [
                        [
                            wid,
                            w["last_heartbeat_ms"],
                            _duration(w["lease_duration_ms"]),
                            w["most_recent_write_upper"],
                            w.get("purpose") or "-",
                        ]
                        for wid, w in writers.items()
                    ],
                    keys=["writer", "last_heartbeat_ms", "lease", "most_recent_write_upper", "purpose"],
                )
            )
        )
    quarantined = doc.get("quarantined_merges") or []
    if quarantined:
        parts.append(
            f"\nquarantined merges: {len(quarantined)} (retry with `persist compact "
            f"{doc['shard']} --retry-quarantined` once the part is restored)"
        )
        parts.append(
            _indent(
                nested_table(
                    ["batches", "failures", "first failure", "last failure", "error"],
                    [
                        [q["batch_ids"], q["failures"], q["first_failure_ms"], q["last_failure_ms"], str(q["error"])[:120]]
                        for q in quarantined
                    ],
                    keys=["batches", "failures", "first_failure_ms", "last_failure_ms", "error"],
                )
            )
        )
    return "\n".join(parts)


def collections_table(rows: Sequence[Mapping[str, Any]], descs: Mapping[str, Mapping[str, Any]]) -> str:
    """``persist collections``: a row per collection with its active rendition's frontiers."""
    if not rows:
        return "(no collections)"
    out = []
    for c in rows:
        d = descs.get(c["name"], {})
        info = d.get("renditions", {}).get(c["active_rendition"] or "", {})
        since = d.get("readable_since")
        out.append(
            [
                c["name"],
                c["active_rendition"],
                info.get("num_shards"),
                info.get("upper"),
                None if since is None else [since],
                info.get("bytes"),
                _renditions_text(c["renditions"], d.get("renditions", {})),
            ]
        )
    # times as timestamps alone, no updates column (persist describe NAME has both): the
    # table fits 120 columns
    return table(
        ["collection", "active", "shards", "upper", "since", "bytes", "renditions"],
        out,
        keys=["collection", "active", "shards", "upper_short", "since_short", "bytes", "renditions"],
    )


def _renditions_text(names: Sequence[str], infos: Mapping[str, Any]) -> str:
    """``r0 retired, r1 active``; dropped renditions counted, not listed (``r2 active, 2
    dropped``): ``persist describe`` lists them."""
    status = {r: infos[r]["status"] if r in infos else "?" for r in names}
    live = [f"{r} {st}" for r, st in status.items() if st != "dropped"]
    dropped = sum(1 for st in status.values() if st == "dropped")
    return ", ".join(live + ([f"{dropped} dropped"] if dropped else [])) or "-"


def describe_text(d: Mapping[str, Any]) -> str:
    """``persist describe NAME``."""
    head = kv(
        [
            ("collection", d["name"]),
            ("schemas", d["schemas"]),
            ("active rendition", d["active_rendition"]),
            ("metadata shard", d["metadata_shard"]),
            ("metadata since", _frontier(d["metadata_since"])),
            ("metadata upper", _frontier(d["metadata_upper"])),
            ("readable since", _readable_since_text(d)),
        ]
    )
    rows = [
        [
            name,
            ri["status"],
            ri["num_shards"],
            ri["upper"],
            ri["since"],
            ri["updates"],
            ri["bytes"],
            ri.get("retired_at"),
        ]
        for name, ri in d["renditions"].items()
    ]
    # times as timestamps alone (the handovers below and --json have the integers), no
    # batches column (persist shards has it): the table fits 120 columns
    parts = [
        head,
        "\nrenditions:",
        _indent(
            nested_table(
                ["name", "status", "shards", "upper", "since", "updates", "bytes", "retired at"],
                rows,
                keys=["name", "status", "shards", "upper_short", "since_short", "updates", "bytes", "retired_at_short"],
            )
        ),
        "\nhandovers (timeline):",
        _indent(
            nested_table(["at", "from", "to"], [[h["at"], h["from"], h["to"]] for h in d["timeline"]])
            if d["timeline"]
            else "(none)"
        ),
    ]
    shard_rows = [
        [name, i, sid] for name, ri in d["renditions"].items() for i, sid in enumerate(ri["shards"])
    ]
    if shard_rows:
        parts += ["\nshards:", _indent(nested_table(["rendition", "#", "shard"], shard_rows))]
    return "\n".join(parts)


def ingest_status_text(doc: Mapping[str, Any]) -> str:
    """``persist ingest status NAME``."""
    head = kv(
        [
            ("ingestion", doc["name"]),
            ("source frontier", _source_frontier(doc.get("frontier") or {})),
            ("notes", doc.get("notes", 0)),
            ("late files", doc.get("late_files") or []),
        ]
    )
    rows = [[role, s["shard"], s["upper"], s["since"]] for role, s in doc.get("shards", {}).items()]
    return head + "\n\nshards:\n" + _indent(nested_table(["role", "shard", "upper", "since"], rows))


def ingest_run_text(doc: Mapping[str, Any]) -> str:
    """The summary of ``persist ingest files|postgres``."""
    keys = [
        "name", "mode", "envelope", "resumed_at", "upper", "records", "updates", "errors", "bytes",
        "bindings_minted", "bindings_adopted", "bindings_applied", "late_files", "lag_bytes",
        "lag_ms", "duration_s", "records_per_s", "mb_per_s", "remap_shard",
    ]
    pairs = [(k, doc.get(k)) for k in keys if k in doc]
    pairs.insert(3, ("source frontier", _source_frontier(doc.get("frontier") or {})))
    text = kv(pairs)
    outs = doc.get("outputs") or {}
    if outs:
        text += "\n\noutputs:\n" + _indent(render(dict(outs), line_width() - 2))
    return text


def _source_frontier(frontier: Mapping[str, Any]) -> str:
    return ", ".join(f"{p}: {a}" for p, a in sorted(frontier.items())) or "(start)"


def _readable_since_text(d: Mapping[str, Any]) -> str:
    """``AS OF`` works from here; says which dropped renditions held the times before."""
    since = d.get("readable_since")
    text = _frontier(None if since is None else [since])
    gone = [
        h["from"]
        for h in d["timeline"]
        if h["from"] and d["renditions"].get(h["from"], {}).get("status") in ("dropping", "dropped")
    ]
    if since is not None and gone:
        text += f" (earlier times were read through {', '.join(gone)}, dropped after the handover)"
    return text


def _frontier(elements: Sequence[int] | None) -> str:
    from persist_lib.timefmt import frontier_text

    return frontier_text(list(elements) if elements is not None else None)


def _rollups(rollups: Mapping[str, str]) -> str:
    if not rollups:
        return "0"
    latest = max(int(k) for k in rollups)
    return f"{len(rollups)} (latest at seqno {latest})"


def _pending(spine_entry: Mapping[str, Any]) -> str:
    req = spine_entry.get("pending_request")
    return "-" if req is None else f"merge #{req}"


def _duration(ms: int) -> str:
    s = ms / 1000
    if s >= 3600 and s % 3600 == 0:
        return f"{int(s // 3600)} h"
    if s >= 60 and s % 60 == 0:
        return f"{int(s // 60)} min"
    return f"{s:g} s"


def _indent(text: str, by: str = "  ") -> str:
    return "\n".join(by + line if line else line for line in text.splitlines())


__all__ = [
    "collections_table",
    "describe_text",
    "ingest_run_text",
    "ingest_status_text",
    "inspect_text",
    "shard_roles",
    "shards_table",
]
