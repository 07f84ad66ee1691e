"""Divergent verified appends: a history op that must always stop (issue 26).

An ingestion output's verified append (``ingest.outputs.ShardOutput``) may return only
once every time range it covers is written by it or checked equal to what is
committed. This op replays committed times with updates that differ from the committed
ones (the definite stream plus one extra record), as a changed or non-deterministic
pipeline would. In 70% of the steps the output's reader first moves its since into the
replayed range, as for an instance the since has passed: compaction may then have
folded the committed updates into the since. Either way the append must stop
(``NeedsNewRendition``, or ``ReplayUnverifiable`` where nothing can decide) and writes
nothing; the checker reports one that returned normally (``unverified_replay_accepted``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pyarrow as pa

from persist_lib.errors import PersistError
from persist_lib.testing.history_config import KEY_SCHEMA, VAL_SCHEMA, Update, definite_updates

if TYPE_CHECKING:  # pragma: no cover
    from persist_lib.testing.actor_base import Actor


def user_table(ups: list[Update]) -> pa.Table:
    """Updates in the user layout (``k``, ``v``, ``ts``, ``diff``)."""
    return pa.table({
        "k": pa.array([u[0][0][0] for u in ups], pa.string()),
        "v": pa.array([u[0][1][0] for u in ups], pa.int64()),
        "ts": pa.array([u[1] for u in ups], pa.int64()),
        "diff": pa.array([u[2] for u in ups], pa.int64()),
    })


def divergent_verified_append(actor: Actor) -> None:
    """One logged ``verified_append`` op of ``actor``: opens its own output (a writer,
    and a reader registered at the shard's since), replays, releases the output."""
    from persist_lib.ingest.outputs import ShardOutput

    rng = actor.rng
    try:
        s = actor.client.machine(actor.shard).fetch_latest()
    except PersistError:
        return
    upper = s.upper.time
    if upper is None or upper <= 0:
        return  # nothing committed yet: nothing to replay
    lo = rng.randint(max(0, upper - 6), upper - 1)
    hi = min(upper, lo + rng.randint(1, 4))
    since = rng.randint(lo, hi) if rng.random() < 0.7 else None
    ups = definite_updates(actor.cfg.seed, lo, hi) + [(((f"div/{lo}",), (0,)), lo, 1)]

    def do() -> dict[str, Any]:
        out = ShardOutput(
            actor.client, actor.shard, KEY_SCHEMA, VAL_SCHEMA, role="data",
            label=f"{actor.actor}.{actor.inc}/verified",
        )
        try:
            if since is not None:
                out.downgrade_since(since)  # (never backwards: a no-op if behind)
            out.append(user_table(ups), lo, hi)
            return {"since": out.since()}
        finally:
            out.close()

    actor.run_op("verified_append", {"lower": lo, "upper": hi, "since": since}, do)
