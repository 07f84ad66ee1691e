"""Which batches to merge: a size-tiered spine over a shard's trace (docs/design.md section 8).

Pure functions of a ``ShardState``; nothing here does I/O.

**Physical compaction.** Like differential dataflow's Spine, every batch has a
*level* ``floor(log2(len))`` (its number of updates). The spine is healthy when the
levels strictly decrease from the oldest batch to the newest: then a trace of ``N``
updates has at most ``log2(N) + 1`` batches. Wherever two neighbours violate that
(``level(older) <= level(newer)``) we request a merge of the two, extended to the
newer batches that would violate against it too, and to every directly older batch
whose level is not above the level the merge produces (the whole carry chain of a
binary counter in one N-way merge, like Spine's roll-up).
Merging batches of level ``k`` yields level ``k + 1``, so each update is rewritten at
most about ``log2(N)`` times in total, and fewer thanks to the roll-up.

**Logical compaction.** Merges forward times below the shard ``since`` to it. A batch
that no merge touches would keep its history forever, so a batch whose update times
(the parts' ``tmin``/``tmax``) have all fallen to or below the since, but are not yet
one single time, gets one single-batch rewrite that forwards them to one time. Each
batch earns at most one such rewrite (afterwards all its updates share one time),
which bounds the extra write amplification to one; the shrunken result then merges
with its neighbours through the ordinary level rule.

**Empty batches** (no updates) are merged into a neighbour for free: the merge only
widens the neighbour's description and reuses its parts (no data is rewritten).

Requests never overlap, so they can run concurrently; a request is matched against the
state by batch ids *and* descriptions when its result is applied.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from persist_lib.frontier import Antichain
from persist_lib.shard.batch_meta import HollowBatch
from persist_lib.shard.state import ShardState

# A batch in excess of the healthy count (levels strictly decreasing) weighs as much
# as this many updates in ``compaction_debt`` (Materialize skips merges under 1024
# updates: below that, metadata costs more than the rewrite).
BATCH_DEBT_WEIGHT = 1024


@dataclass(frozen=True)
class CompactionRequest:
    """Merge the contiguous batches ``batch_ids`` (oldest first) into one batch.

    ``inputs`` are the batches as the planner saw them: the result is applied only if
    the state still holds exactly these (ids and descriptions). ``since`` is the shard
    since to forward times to. ``kind`` is ``"merge"`` (level rule), ``"logical"`` (a
    rewrite to fold history below the since), ``"sort"`` (a batch holding unsorted
    parts, rewritten as one sorted run) or ``"empty"`` (absorb empty batches: no data
    rewritten).
    """

    batch_ids: tuple[int, ...]
    lower: Antichain
    upper: Antichain
    since: Antichain
    inputs: tuple[HollowBatch, ...]
    kind: str = "merge"

    @property
    def num_updates(self) -> int:
        """Updates the merge reads (and, before consolidation, rewrites)."""
        return sum(b.len for b in self.inputs)

    @property
    def num_bytes(self) -> int:
        return sum(b.size for b in self.inputs)

    @property
    def rewrites_data(self) -> bool:
        """False when at most one input has parts and no forwarding is needed."""
        return self.kind != "empty"

    def describe(self) -> dict[str, Any]:
        return {
            "batch_ids": list(self.batch_ids),
            "lower": self.lower.elements,
            "upper": self.upper.elements,
            "since": self.since.elements,
            "kind": self.kind,
            "updates": self.num_updates,
            "bytes": self.num_bytes,
        }


def level(b: HollowBatch) -> int:
    """``floor(log2(len))``; -1 for an empty batch."""
    n = b.len
    return n.bit_length() - 1 if n > 0 else -1


def _request(
    trace: list[tuple[int, HollowBatch]], lo: int, hi: int, since: Antichain, kind: str
) -> CompactionRequest:
    window = trace[lo : hi + 1]
    return CompactionRequest(
        batch_ids=tuple(bid for bid, _ in window),
        lower=window[0][1].lower,
        upper=window[-1][1].upper,
        since=since,
        inputs=tuple(b for _, b in window),
        kind=kind,
    )


def _needs_logical(b: HollowBatch, since: Antichain) -> bool:
    """Whether forwarding ``b`` to ``since`` would fold distinct times together.

    True when every update time of ``b`` is at or below the since but they are not all
    one time. A rewrite forwards them all to one time, so a batch earns this at most
    once (until a merge mixes in newer history).
    """
    if b.len < 2 or not b.parts or since.is_empty():
        return False
    assert since.time is not None
    tmin = min(p.tmin for p in b.parts)
    tmax = max(p.tmax for p in b.parts)
    return tmin < tmax and since.time >= tmax


def quarantined_batch_ids(state: ShardState) -> set[int]:
    """Batches of merges quarantined after failing deterministically (``state.quarantined_merges``)."""
    return {b for e in state.quarantined_merges.values() for b in e.batch_ids}


def compaction_requests(
    state: ShardState,
    claimed: frozenset[int] | set[int] = frozenset(),
    *,
    include_quarantined: bool = False,
) -> list[CompactionRequest]:
    """The merges the spine wants now (non-overlapping, oldest first).

    ``claimed`` batch ids (inputs of merges already running, or backing off after a
    failure) are barriers: the rules run on the batches around them, so a long merge
    doesn't stop the tail from compacting. The batches of quarantined merges are
    barriers too, unless ``include_quarantined`` (an operator's retry).
    """
    if state.tombstone:
        return []
    if state.quarantined_merges and not include_quarantined:
        claimed = set(claimed) | quarantined_batch_ids(state)
    trace = state.trace_batches()
    since = state.since
    out: list[CompactionRequest] = []
    used: set[int] = {i for i, (bid, _) in enumerate(trace) if bid in claimed}
    n = len(trace)
    # 1. Empty batches: absorb into the older neighbour (or the newer one for the first).
    i = 0
    while i < n and n > 1:
        if trace[i][1].len == 0:
            j = i
            while j + 1 < n and trace[j + 1][1].len == 0:
                j += 1
            lo, hi = (i - 1, j) if i > 0 else (i, min(j + 1, n - 1))
            if lo != hi and not any(k in used for k in range(lo, hi + 1)):
                out.append(_request(trace, lo, hi, since, "empty"))
                used.update(range(lo, hi + 1))
            i = j + 1
        else:
            i += 1
    # 2. Level rule: levels must strictly decrease from oldest to newest.
    levels = [level(b) for _, b in trace]
    start = 0  # first index of the current strictly decreasing run
    for i in range(1, n):
        if i in used or (i - 1) in used:
            start = i
            continue
        if levels[i - 1] > levels[i]:
            continue
        # Violation: merge batch i with its older neighbour, and keep absorbing older
        # batches while they are not above the level of what the merge produces (the
        # whole binary-counter cascade in one merge, like Spine's roll-up).
        lo = i - 1
        acc = trace[i][1].len + trace[lo][1].len
        # Newer batches at least as big as batch i would violate against it too: take
        # them now (one N-way merge rewrites each update once, pairs would do it twice).
        hi = i
        while hi + 1 < n and (hi + 1) not in used and levels[hi + 1] >= levels[i]:
            hi += 1
            acc += trace[hi][1].len
        while (
            lo - 1 >= start
            and (lo - 1) not in used
            and levels[lo - 1] <= max(acc, 1).bit_length() - 1
        ):
            lo -= 1
            acc += trace[lo][1].len
        out.append(_request(trace, lo, hi, since, "merge"))
        used.update(range(lo, hi + 1))
        start = hi + 1
    # 3. Logical rewrites of batches that fell below the since.
    for i, (_, b) in enumerate(trace):
        if i not in used and _needs_logical(b, since):
            out.append(_request(trace, i, i, since, "logical"))
            used.add(i)
    # 4. Batches holding parts a bulk write stored unsorted: sort them (one sorted run),
    # off the writer's path, so that reads don't sort them again and again.
    for i, (_, b) in enumerate(trace):
        if i not in used and any(not p.sorted for p in b.parts):
            out.append(_request(trace, i, i, since, "sort"))
            used.add(i)
    out.sort(key=lambda r: r.lower.time or 0)
    return out


def healthy_batch_count(num_updates: int) -> int:
    """Batches a healthy spine of ``num_updates`` updates may have: ``log2(N) + 1``."""
    return max(1, math.floor(math.log2(num_updates)) + 1) if num_updates > 0 else 1


def compaction_debt(state: ShardState) -> int:
    """A single number a sensor can watch (0 = nothing to do), in updates.

    ``debt = (updates the pending merges would read and rewrite)
           + BATCH_DEBT_WEIGHT * max(0, batches - healthy_batch_count(updates))``

    The first term is the work compaction owes right now; the second grows with how
    far the trace's *metadata* is from logarithmic (every excess batch costs readers a
    part fetch and state a batch entry). Free merges of empty batches count one batch
    each. It is a monotone-ish signal, not an exact cost: a threshold of a few
    thousand means "run compaction".
    """
    if state.tombstone:
        return 0
    reqs = compaction_requests(state)
    rewrite = sum(r.num_updates for r in reqs if r.rewrites_data)
    trace = state.trace_batches()
    total = sum(b.len for _, b in trace)
    excess = max(0, len(trace) - healthy_batch_count(total))
    empties = sum(1 for r in reqs if not r.rewrites_data)
    return rewrite + BATCH_DEBT_WEIGHT * excess + empties


def describe_spine(state: ShardState) -> list[dict[str, Any]]:
    """Per batch (oldest first): id, level, updates, and the request that covers it."""
    owner: dict[int, int] = {}
    for n, r in enumerate(compaction_requests(state)):
        for bid in r.batch_ids:
            owner[bid] = n
    return [
        {
            "id": bid,
            "level": level(b),
            "len": b.len,
            "lower": b.lower.elements,
            "upper": b.upper.elements,
            "since": b.since.elements,
            "pending_request": owner.get(bid),
        }
        for bid, b in state.trace_batches()
    ]
