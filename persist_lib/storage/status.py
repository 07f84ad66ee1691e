"""The one vocabulary for where a rendition is in its life, as people see it.

The catalog stores a rendition's *catalog state* (``creating``, ``ready``, ``dropping``,
``dropped``) plus ``retired_at`` once it was handed over away from; which rendition is
active comes from the metadata shard. Shown apart, these contradicted each other (an
active rendition listed as ``ready`` next to ``active: true``). Every view (``persist
describe``/``collections``/``shards``, the Dagster metadata and partitions) shows the
word ``rendition_status`` derives, and exactly one applies at a time:

``creating``  being created (its shards are being registered);
``ready``     built, not handed over to yet;
``active``    the rendition the collection reads and writes now;
``retired``   handed over away from at ``retired_at``, its data kept until no reader
              needs it;
``dropping``  being collected;
``dropped``   collected: its shards are finalized and its data deleted.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

RENDITION_STATUSES = ("creating", "ready", "active", "retired", "dropping", "dropped")
#: Statuses whose shards are live (hold data a reader may use).
LIVE_STATUSES = frozenset({"ready", "active", "retired"})


def rendition_status(info: Mapping[str, Any], *, active: bool) -> str:
    """The status word of a rendition whose catalog entry is ``info`` (``status``,
    ``retired_at``); ``active``: whether it is the collection's active rendition."""
    state = str(info["status"])
    if state != "ready":
        return state
    if active:
        return "active"
    if info.get("retired_at") is not None:
        return "retired"
    return "ready"
