"""A snapshot without a registered reader: ``PersistClient.snapshot``.

Opening a leased reader costs two durable consensus writes (the registration and the
expiry), each a compare-and-set with an fsync: for a cold read of an old time they cost
more than the read (docs/benchmarks.md, issue 28). A one-shot read writes nothing: it
loads the state, checks that the shard's since is at or before ``as_of``, and reads
the parts that state version references.

**Why that never returns wrong rows.** The rows come only from the parts of one state
version ``S`` whose since is ``<= as_of`` and whose upper is beyond it. Compaction
forwards times only up to the since a merge was planned under, which is at most
``S.since`` for every batch of ``S``; so the accumulation at ``as_of`` of ``S``'s
batches is the shard's contents at ``as_of``, whatever happens to the shard after
``S`` (its contents at a time ``>=`` the since it had are definite). Every part fetched
is verified against the checksum ``S`` records for it, and part keys are never reused,
so a part is either exactly what ``S`` says or an error.

**What a read without a lease risks, and how it is handled.** Nothing holds the since
or a seqno for it: while it runs, the since may pass ``as_of``, a merge may replace
``S``'s parts, and GC (which deletes a replaced part once every *registered* reader's
seqno hold is past the version that replaced it) may delete a part before it is
fetched. That shows as ``BlobNotFound``. The read then fetches the latest state: if it
is newer than ``S``, the read starts over from it; if its since has passed ``as_of`` it
fails with ``SincePassed`` (typed, nothing returned); if it is not newer, the part is
really lost and ``BlobNotFound`` propagates. A read that must not fail this way holds
the since with a leased reader (or a critical since handle) instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pyarrow as pa

from persist_lib.errors import Determinate, InvalidUsage, SincePassed
from persist_lib.handles.snapshot import SnapshotReader
from persist_lib.shard import state as st

#: How many times a one-shot read starts over on a newer state after a part it needed
#: was collected, before giving up (each start-over means a merge and a GC finished
#: during the read).
MAX_ATTEMPTS = 5

#: The reader id a one-shot read is known by in messages (it is never registered).
ONE_SHOT_READER = "one-shot"


class _StateMoved(Exception):
    """A part was gone and a newer state exists: start the read over from it."""


class OneShotSnapshot(SnapshotReader):
    """One snapshot of one shard, read without registering a reader (see the module
    docstring). Not a handle: ``PersistClient.snapshot`` builds one per call."""

    _reading: st.ShardState | None = None

    def read(
        self, as_of: int, timeout_s: float | None, *, memory_budget: int | None,
        columns: Sequence[str] | None, filter: Any,
    ) -> pa.Table:
        """The shard's contents at ``as_of`` (as ``ReadHandle.snapshot``)."""
        for _ in range(MAX_ATTEMPTS):
            try:
                return self.snapshot(
                    as_of, timeout_s, memory_budget=memory_budget, columns=columns, filter=filter
                )
            except _StateMoved:
                continue  # the cached state is the newer one now: since checked again
        raise Determinate(
            f"shard {self.shard_id}: a one-shot read as of {as_of} found parts it needed "
            f"collected {MAX_ATTEMPTS} times in a row (merges and GC kept replacing them); "
            "retry, or read through a leased reader (open_leased_reader), which holds them"
        )

    # ----- what differs from a leased reader --------------------------------------------

    def _wait_for_upper_beyond(self, as_of: int, timeout_s: float | None) -> st.ShardState:
        s = super()._wait_for_upper_beyond(as_of, timeout_s)
        self._reading = s  # the state version this attempt reads
        return s

    def _check_as_of(self, s: st.ShardState, as_of: int) -> None:
        if not s.since.less_equal(as_of):
            raise SincePassed(
                f"shard {self.shard_id}: can't read as of {as_of}: the shard's since is "
                f"{s.since} (history before it may have been compacted away; nothing was "
                "returned); read as of a time >= the since, or hold the since with a leased "
                "reader or a critical since handle while reading old times"
            )

    def _blob_missing(self) -> None:
        reading = self._reading
        latest = self._machine.fetch_latest()
        if reading is not None and latest.seqno > reading.seqno:
            raise _StateMoved()
        # Not newer: the state still references the part, so it is really lost
        # (``BlobNotFound`` propagates).

    def _me(self, s: st.ShardState) -> st.LeasedReaderState:
        raise InvalidUsage(
            f"shard {self.shard_id}: a one-shot read has no registered reader (no since, no "
            "lease); open a leased reader for that"
        )

    def __repr__(self) -> str:
        return f"OneShotSnapshot(shard={self.shard_id})"
