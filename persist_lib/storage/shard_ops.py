"""Shard-level operations STORAGE needs beyond the handles: releasing and retiring.

``force_release`` closes a shard for good on behalf of its owner (the controller
deleting a collection or retiring a rendition): it drops every reader and writer
(their next call fails with ``LeaseExpired``) and sets since and upper to the empty
frontier, after which ``maintenance.finalize`` deletes its blobs and leaves a
tombstone. It is idempotent, so a controller that crashes midway simply runs it again.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from persist_lib.frontier import Antichain
from persist_lib.shard.state import ShardState

if TYPE_CHECKING:  # pragma: no cover
    from persist_lib.handles.client import PersistClient


def force_release_transition(state: ShardState, now_ms: int) -> tuple[ShardState | None, Any]:
    if not state.exists or state.tombstone:
        return None, False
    if (
        state.since.is_empty()
        and state.upper.is_empty()
        and not state.leased_readers
        and not state.critical_readers
        and not state.writers
    ):
        return None, False
    batches = dict(state.batches)
    trace = state.trace_batches()
    if trace and not trace[-1][1].upper.is_empty():
        last_id, last = trace[-1]
        batches[last_id] = replace(last, upper=Antichain.empty())
    return (
        replace(
            state,
            leased_readers={},
            critical_readers={},
            writers={},
            since=Antichain.empty(),
            upper=Antichain.empty(),
            batches=batches,
        ),
        True,
    )


def shard_exists(client: PersistClient, shard: str) -> bool:
    return client.consensus.head(shard) is not None


def release_and_finalize(client: PersistClient, shard: str) -> dict[str, Any]:
    """Drops every handle of ``shard``, empties its frontiers and finalizes it."""
    from persist_lib.handles import maintenance

    if not shard_exists(client, shard):
        return {"shard": shard, "existed": False, "blobs_deleted": 0}
    m = client.machine(shard)
    s = m.fetch_latest()
    if not s.tombstone:
        m.apply("force_release", force_release_transition)
    res = maintenance.finalize(client, shard)
    res["existed"] = True
    return res
