"""Every output of a binding (data, errors, raw, state) appended as ONE transaction.

The driver's flush writes the same time range ``[lower, upper)`` to every output shard.
Committed shard by shard, a crash between outputs leaves a reader able to see a
binding's data without its errors until the ingestion restarts. Here the whole flush is
one transaction of the location's txn log (``persist_lib.txn``): every output shard is
registered there, and ``append_atomically`` commits one batch per shard with one
compare-and-set on the log, so every output shows the binding or none does.

It stays a *verified definite* append (``outputs.py``): each shard is written from its
own logical upper (committed transactions count, applied or not). Where another
instance already committed part of the range, those times are applied, read back and
compared with ours (``_verify``: ``NeedsNewRendition`` on a difference,
``ReplayUnverifiable`` where no check is possible), and only the rest is committed. A
commit that loses to another instance (``UpperMismatch``) re-reads the uppers and goes
round again, so a restarted or concurrent instance converges on identical outputs.
"""

from __future__ import annotations

from typing import Protocol

import pyarrow as pa
import pyarrow.compute as pc

from persist_lib.errors import UpperMismatch
from persist_lib.frontier import Antichain
from persist_lib.ingest.errors import IngestInvariantError
from persist_lib.shard.codec import Schemas, normalize_checked
from persist_lib.txn.txns import ShardWrite, Txns


class _Counts(Protocol):
    written: int
    verified: int


class ShardTarget(Protocol):
    """One output shard (``outputs.ShardOutput``)."""

    shard_id: str
    label: str
    schemas: Schemas
    unsorted_min_bytes: int | None

    @property
    def stats(self) -> _Counts: ...

    def _verify(self, ours: pa.Table, lo: int, hi: int) -> None: ...


def _from(part: pa.Table, lo: int, lower: int) -> pa.Table:
    return part if lo == lower or not part.num_rows else part.filter(pc.greater_equal(part["ts"], lo))


def append_atomically(
    txns: Txns, pieces: list[tuple[ShardTarget, pa.Table]], lower: int, upper: int
) -> None:
    """Verified definite append of each ``(shard, updates)`` piece over ``[lower, upper)``
    (user layout, times in the range), all committed in one transaction."""
    if upper <= lower or not pieces:
        return
    done = [lower] * len(pieces)  # per piece: written or verified up to here
    shards = [t.shard_id for t, _ in pieces]
    while True:
        view = txns.log.read()
        curs = txns.logical_uppers(shards, view)
        writes: list[ShardWrite] = []
        written: list[ShardTarget] = []
        for i, ((t, part), cur_f) in enumerate(zip(pieces, curs, strict=True)):
            cur = cur_f.time
            if cur is None or cur < done[i]:
                raise IngestInvariantError(
                    f"{t.label} (shard {t.shard_id}): its upper is {cur_f}, below {done[i]} where "
                    "this instance resumes: another writer rewound or the driver lost track; "
                    "nothing was written"
                )
            if cur > done[i]:
                hi = min(cur, upper)
                txns.ensure_applied([t.shard_id], view)  # readable before it is compared
                t._verify(_from(part, done[i], lower), done[i], hi)
                done[i] = hi
            if cur < upper:
                rows = _from(part, cur, lower)
                checked = normalize_checked(rows, t.schemas, shard=t.label)
                writes.append(ShardWrite(
                    t.shard_id, t.schemas, checked, Antichain([cur]), Antichain([upper]),
                    unsorted_min_bytes=t.unsorted_min_bytes,
                ))
                written.append(t)
        if not writes:
            return
        try:
            txns.commit(writes)
        except UpperMismatch:
            continue  # another instance committed: verify what it wrote, commit the rest
        for t in written:
            t.stats.written += 1
        return
