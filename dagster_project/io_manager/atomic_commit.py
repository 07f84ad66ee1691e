"""A write and its ledger entry as ONE transaction (both collections transactional).

The data collection's updates (at ``[data_lower, upper)``) and the ledger's entry (at
``[ledger_lower, upper)``) are committed by one ``compare_and_append`` on the location's
txn log (``persist_lib.txn``): it lands iff every shard of both collections is still at
its expected (logical) upper, all of it or nothing. So a process killed at any point
leaves either the data and its ledger entry, or neither, and a retried step either finds
its entry or finds nothing written. A lost race raises ``UpperMismatch`` (nothing was
written, the parts deleted); the caller recomputes its updates and tries again.

Unlike ``ctl.transaction()`` (which picks its own time and retries the same rows at a
new one), this commit is conditional on the uppers the caller computed its updates
against: an overwrite's difference is only right against the contents it was taken from.
"""

from __future__ import annotations

import pyarrow as pa

from persist_lib.frontier import Antichain
from persist_lib.shard.codec import KEY_PREFIX, normalize_checked
from persist_lib.storage import StorageController
from persist_lib.storage.routing import split_by_shard
from persist_lib.storage.writer import CollectionWriter
from persist_lib.txn.txns import ShardWrite


def logical_upper(w: CollectionWriter) -> int:
    """The collection's upper including committed transactions (a committer killed after
    its commit CAS left its metadata move in the log as a follow-up: whoever applies the
    transaction performs it, ``commit_with_ledger``)."""
    upper = w.upper
    assert upper.time is not None, f"collection {w.name} is closed for writes"
    return upper.time


def shard_writes(w: CollectionWriter, updates: pa.Table, lower: int, upper: int) -> list[ShardWrite]:
    """``updates`` (user layout with ``ts`` and ``diff``) as one write per shard of ``w``'s
    collection (an empty batch where no row routes: every shard moves to ``upper``)."""
    checked = normalize_checked(updates, w.schemas, shard=w.name)
    pieces = split_by_shard(checked, [KEY_PREFIX + n for n in w.schemas.key_names], w.num_shards)
    lo, hi = Antichain([lower]), Antichain([upper])
    return [ShardWrite(s, w.schemas, p, lo, hi) for s, p in zip(w.shard_ids, pieces, strict=True)]


def commit_with_ledger(
    ctl: StorageController,
    data: CollectionWriter, updates: pa.Table, data_lower: int,
    ledger: CollectionWriter, entry: pa.Table, ledger_lower: int,
    upper: int,
) -> None:
    """Commits ``updates`` and ``entry`` atomically, both collections moving to ``upper``.
    Raises ``UpperMismatch`` if either collection moved since its ``lower`` was read."""
    hi = Antichain([upper])
    ctl.txns.commit(
        [*shard_writes(data, updates, data_lower, upper), *shard_writes(ledger, entry, ledger_lower, upper)],
        advances=[*data.metadata_advances(hi), *ledger.metadata_advances(hi)],
    )
    # Committed: the metadata moves are follow-ups of the transaction (applied with it,
    # by whoever applies it); a failure to do them here is not a failed write.
    data.advance_metadata_after_commit(hi)
    ledger.advance_metadata_after_commit(hi)
