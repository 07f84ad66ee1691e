"""The earliest time a collection reader can actually read (``readable_since``).

A collection is read through its metadata shard (which rendition is active at each
time) and the shards of the rendition active then. A time ``t`` is readable iff ``t`` is
at or past the metadata shard's since and the rendition active at ``t`` still exists
with its since at or before ``t``. The since of any one of these alone overstates the
history: after a handover at ``h`` the backfill lets the collection compact to ``h + 1``
and the old rendition is dropped, so ``AS OF`` a time before ``h + 1`` fails even though
the new rendition's shards hold data from earlier (they were rebuilt at the raw
records' times). ``persist collections``/``describe`` and the Dagster metadata report
this time, the one a reader gets.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def _t(frontier: Sequence[int] | None) -> int | None:
    """The time of a one-dimensional frontier (None: empty frontier or no shard left)."""
    return int(frontier[0]) if frontier else None


def readable_since(
    metadata_since: Sequence[int] | None,
    timeline: Sequence[Mapping[str, Any]],
    renditions: Mapping[str, Mapping[str, Any]],
) -> int | None:
    """The earliest time from which every time up to the latest is readable (None: no
    time is, e.g. no handover yet or the active rendition has no live shard).

    ``timeline``: every handover (``at``, ``to``) in time order; ``renditions``: each
    rendition's ``since`` (the largest since of its live shards, None when none is left)
    and ``status``."""
    meta = _t(metadata_since)
    if meta is None or not timeline:
        return None
    earliest: int | None = None
    # segments [at_i, at_{i+1}) served by timeline[i]["to"], latest first
    for i in range(len(timeline) - 1, -1, -1):
        start = int(timeline[i]["at"])
        end = int(timeline[i + 1]["at"]) if i + 1 < len(timeline) else None
        info = renditions.get(timeline[i]["to"]) or {}
        since = _t(info.get("since"))
        if since is None or info.get("status") in ("dropping", "dropped"):
            return earliest
        lo = max(start, since, meta)
        if end is not None and lo >= end:
            return earliest  # nothing of this segment is readable
        earliest = lo
        if lo > start:
            return earliest  # the segment is readable only from lo on
    return earliest
