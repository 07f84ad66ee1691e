"""Materialization metadata built from persist's JSON (``inspect``, ``describe``).

Everything the UI shows about a shard, a rendition or a collection: frontiers, batches,
updates, bytes, compaction debt, and the spine as a markdown table.

Frontiers are integers (``upper``, ``since``: the UI plots int metadata over the
materializations). When a frontier is a time in ms since the epoch (ingested
collections; the rule is ``persist_lib.timefmt.is_epoch_ms``, the same as the
``persist`` CLI's) it is also recorded as Dagster timestamp metadata (``upper_time``,
``since_time``: ``MetadataValue.timestamp``, seconds), which the UI shows as a date in
its own time zone; small logical times (tests, hand-made shards) get no timestamp. The
handover times of the ``timeline`` table carry their UTC timestamp too.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import dagster as dg

from persist_lib.errors import InvalidUsage
from persist_lib.handles.client import PersistClient
from persist_lib.timefmt import epoch_seconds, is_epoch_ms, iso_utc, time_text


def frontier_text(elements: Sequence[int] | None) -> str:
    """``[5]`` -> ``"5"``; ``[]`` -> ``"closed"`` (the empty frontier); ``None`` -> ``"-"``."""
    if elements is None:
        return "-"
    if not elements:
        return "closed"
    return ", ".join(str(e) for e in elements)


def frontier_value(elements: Sequence[int] | None) -> dg.MetadataValue:
    """An int metadata value when the frontier is one time (plottable), else text."""
    if elements is not None and len(elements) == 1:
        return dg.MetadataValue.int(int(elements[0]))
    return dg.MetadataValue.text(frontier_text(elements))


def frontier_metadata(name: str, elements: Sequence[int] | None) -> dict[str, dg.MetadataValue]:
    """``{name: int}`` (``frontier_value``), plus ``{name}_time``: the same frontier as
    Dagster timestamp metadata (UNIX seconds) when it is one time in ms since the epoch."""
    out = {name: frontier_value(elements)}
    secs = epoch_seconds(None if elements is None else list(elements))
    if secs is not None:
        out[f"{name}_time"] = dg.MetadataValue.timestamp(secs)
    return out


def time_metadata(name: str, t: int | None) -> dict[str, dg.MetadataValue]:
    """``{name}_time`` for a time in ms since the epoch (e.g. ``handover_at``), else ``{}``."""
    if t is not None and is_epoch_ms(int(t)):
        return {f"{name}_time": dg.MetadataValue.timestamp(int(t) / 1000.0)}
    return {}


def time_point(name: str, t: int) -> dict[str, dg.MetadataValue]:
    """A data time as metadata: ``{name}`` a Dagster timestamp when it is ms since the
    epoch (the UI shows a date and plots no raw integer on a check's axis), else the int;
    ``{name}_time`` the exact integer with its ISO-8601 UTC timestamp, as text."""
    t = int(t)
    value = dg.MetadataValue.timestamp(t / 1000.0) if is_epoch_ms(t) else dg.MetadataValue.int(t)
    return {name: value, f"{name}_time": dg.MetadataValue.text(time_text(t))}


def utc_text(t: int | None) -> str:
    """A table cell: the ISO-8601 UTC timestamp of an epoch-ms time, else ``-``."""
    return iso_utc(int(t)) if t is not None and is_epoch_ms(int(t)) else "-"


def md_table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A GitHub-flavoured markdown table (cells are escaped for ``|``)."""

    def cell(v: Any) -> str:
        return str(v).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def spine_levels(spine: Sequence[Mapping[str, Any]]) -> str:
    """``"L12x1 L8x2"``: how many batches sit at each spine level (largest first)."""
    counts = Counter(int(b["level"]) for b in spine)
    return " ".join(f"L{lvl}x{n}" for lvl, n in sorted(counts.items(), reverse=True)) or "-"


def spine_markdown(state: Mapping[str, Any]) -> str:
    """One shard's spine, one row per batch (oldest first)."""
    sizes = {b["id"]: b["bytes"] for b in state.get("batches", [])}
    rows = [
        (
            b["id"],
            b["level"],
            b["len"],
            sizes.get(b["id"], 0),
            frontier_text(b["lower"]),
            frontier_text(b["upper"]),
            frontier_text(b["since"]),
            "-" if b.get("pending_request") is None else f"merge #{b['pending_request']}",
        )
        for b in state.get("spine", [])
    ]
    return md_table(
        ["batch", "level", "updates", "bytes", "lower", "upper", "since", "pending"], rows
    )


def shard_metadata(state: Mapping[str, Any]) -> dict[str, dg.MetadataValue]:
    """Metadata of one shard from its ``inspect`` JSON."""
    return {
        "shard": dg.MetadataValue.text(state["shard"]),
        **frontier_metadata("upper", state["upper"]),
        **frontier_metadata("since", state["since"]),
        "seqno": dg.MetadataValue.int(int(state["seqno"])),
        "batches": dg.MetadataValue.int(int(state["num_batches"])),
        "updates": dg.MetadataValue.int(int(state["num_updates"])),
        "bytes": dg.MetadataValue.int(int(state["bytes"])),
        "compaction_debt": dg.MetadataValue.int(int(state.get("compaction_debt", 0))),
        "leased_readers": dg.MetadataValue.int(len(state.get("leased_readers", {}))),
        "writers": dg.MetadataValue.int(len(state.get("writers", {}))),
        "garbage_blobs": dg.MetadataValue.int(int(state.get("garbage", {}).get("blobs", 0))),
        "spine": dg.MetadataValue.md(spine_markdown(state)),
        "quarantined_merges": dg.MetadataValue.int(len(state.get("quarantined_merges", []))),
        **(
            {"quarantine": dg.MetadataValue.md(quarantine_markdown(state["quarantined_merges"]))}
            if state.get("quarantined_merges")
            else {}
        ),
    }


def quarantine_markdown(entries: Iterable[Mapping[str, Any]]) -> str:
    """Merges that failed deterministically and are no longer retried automatically."""
    return md_table(
        ["batches", "failures", "last failure (ms)", "error"],
        [
            (
                ", ".join(str(b) for b in e["batch_ids"]),
                e["failures"],
                e["last_failure_ms"],
                str(e["error"])[:300].replace("|", "/"),
            )
            for e in entries
        ],
    )


def inspect_shards(client: PersistClient, shards: Iterable[str]) -> dict[str, dict[str, Any]]:
    """``inspect`` of every existing shard in ``shards`` (missing ones are skipped)."""
    out: dict[str, dict[str, Any]] = {}
    for s in shards:
        try:
            out[s] = client.inspect(s)
        except InvalidUsage:
            continue
    return out


def collection_metadata(
    client: PersistClient, desc: Mapping[str, Any], *, rendition: str | None = None
) -> dict[str, dg.MetadataValue]:
    """Metadata of a collection (its active rendition, or ``rendition``) from ``describe``.

    Frontiers and sizes are those of the rendition; ``spine`` is a markdown table with a
    row per shard (frontiers, batches, updates, bytes, debt, batches per spine level).
    """
    r = rendition or desc.get("active_rendition") or next(iter(desc["renditions"]), None)
    info = desc["renditions"].get(r, {}) if r else {}
    readable = None if desc.get("readable_since") is None else [int(desc["readable_since"])]
    states = inspect_shards(client, info.get("shards", []))
    rows = [
        (
            i,
            sid,
            frontier_text(st["upper"]),
            frontier_text(st["since"]),
            st["num_batches"],
            st["num_updates"],
            st["bytes"],
            st.get("compaction_debt", 0),
            spine_levels(st.get("spine", [])),
        )
        for i, (sid, st) in enumerate(states.items())
    ]
    timeline = md_table(
        ["at", "from", "to", "at (UTC)"],
        [(h["at"], h["from"] or "-", h["to"], utc_text(h["at"])) for h in desc["timeline"]],
    )
    renditions = md_table(
        ["rendition", "status", "shards", "upper", "since", "batches", "bytes", "retired at"],
        [
            (
                name,
                ri["status"],
                ri["num_shards"],
                frontier_text(ri["upper"]),
                frontier_text(ri["since"]),
                ri["batches"],
                ri["bytes"],
                "-" if ri.get("retired_at") is None else time_text(int(ri["retired_at"])),
            )
            for name, ri in sorted(desc["renditions"].items())
        ],
    )
    return {
        "collection": dg.MetadataValue.text(desc["name"]),
        "rendition": dg.MetadataValue.text(r or "-"),
        "active_rendition": dg.MetadataValue.text(desc.get("active_rendition") or "-"),
        "num_shards": dg.MetadataValue.int(int(info.get("num_shards", 0))),
        **frontier_metadata("upper", info.get("upper")),
        # a collection's since is the one a reader gets (persist_lib.storage.readable),
        # a rendition's (``rendition=``) the since of its shards
        **frontier_metadata("since", info.get("since") if rendition else readable),
        **frontier_metadata("readable_since", readable),
        "batches": dg.MetadataValue.int(int(info.get("batches", 0))),
        "updates": dg.MetadataValue.int(int(info.get("updates", 0))),
        "bytes": dg.MetadataValue.int(int(info.get("bytes", 0))),
        "compaction_debt": dg.MetadataValue.int(
            sum(int(s.get("compaction_debt", 0)) for s in states.values())
        ),
        "spine": dg.MetadataValue.md(
            md_table(
                ["#", "shard", "upper", "since", "batches", "updates", "bytes", "debt", "levels"],
                rows,
            )
        ),
        "renditions": dg.MetadataValue.md(renditions),
        "timeline": dg.MetadataValue.md(timeline),
    }


def blob_requests(client: PersistClient) -> dict[str, float]:
    """The client's request counters so far (``persist_lib.shard.metrics``: blob requests by
    operation, their S3 cost, bytes moved, commits); empty when metrics are off. Take
    one at the start of a step and pass it to ``request_metadata`` at the end."""
    m = client.metrics
    return m.totals() if m is not None else {}


def request_metadata(client: PersistClient, start: Mapping[str, float]) -> dict[str, dg.MetadataValue]:
    """What the step cost since ``start`` (``blob_requests``): blob requests by operation
    (counted as S3 bills them), their cost at AWS S3 Standard list prices, bytes moved
    and commits. Requests of Spark executors (other processes) are not included."""
    now = blob_requests(client)
    if not now:
        return {}
    d = {k: v - start.get(k, 0.0) for k, v in now.items()}
    out = {f"blob_{op}_requests": dg.MetadataValue.int(int(d[op])) for op in ("put", "get", "list", "delete")}
    out["blob_request_cost_usd"] = dg.MetadataValue.float(round(d["cost_usd"], 9))
    out["blob_bytes_written"] = dg.MetadataValue.int(int(d["bytes_written"]))
    out["blob_bytes_read"] = dg.MetadataValue.int(int(d["bytes_read"]))
    out["persist_commits"] = dg.MetadataValue.int(int(d["commits"]))
    return out
