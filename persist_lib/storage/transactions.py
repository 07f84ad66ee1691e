"""Controller-level writes where the controller picks the time: ``insert`` and
``transaction`` (the seed's table-like write path, issue 27).

``ctl.insert(name, rows)`` and ``with ctl.transaction() as tx: tx.insert(a, rows);
tx.insert(b, rows)`` write transactional collections (every multi-shard collection by
default, ``create_collection(..., transactional=True)``, ``make_transactional``) as ONE transaction of the location's txn log (``persist_lib.txn``):
every row of every collection becomes visible at one time ``T``, all or nothing.

``T`` is the largest logical upper of the shards touched (so no collection's time goes
backwards); each shard's batch covers ``[its upper, T + 1)`` with every row at ``T``. If
another writer commits to one of these shards first, the commit is refused definitely
(``UpperMismatch``), ``T`` is chosen again and the rows are written again at the new
time: our parts carry their times inside them (the Parquet ``t`` column) and a batch has
no time-rewrite field, so a retry at a new time rewrites the parts (at most
``MAX_ATTEMPTS`` tries, then ``TransactionContended``). The rows are checked against the
collection's schema when they are added (``tx.insert``), so a bad row fails there, before
anything is written.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import pyarrow as pa

from persist_lib.errors import InvalidUsage, PersistError, UpperMismatch
from persist_lib.frontier import Antichain
from persist_lib.shard.codec import (
    KEY_PREFIX,
    CheckedUpdates,
    Schemas,
    check_updates,
    normalize_checked,
)
from persist_lib.storage.routing import split_by_shard
from persist_lib.storage.writer import CollectionWriter
from persist_lib.txn.txns import ShardWrite, Txns

MAX_ATTEMPTS = 20


class TransactionContended(PersistError):
    """A controller-timed transaction lost its commit to other writers too often."""


class TxnController(Protocol):
    """What a transaction needs of the ``StorageController``."""

    @property
    def txns(self) -> Txns: ...

    def is_transactional(self, name: str) -> bool: ...

    def open_writer(self, name: str, rendition: str | None = None) -> CollectionWriter: ...


@dataclass
class _Target:
    name: str
    writer: CollectionWriter
    rows: list[Any]


class Transaction:
    """Rows for any number of transactional collections, committed at one time."""

    def __init__(self, ctl: TxnController) -> None:
        self._ctl = ctl
        self._targets: dict[str, _Target] = {}
        self.committed_at: int | None = None
        self._closed = False

    def insert(self, name: str, rows: Any) -> None:
        """Adds ``rows`` (a pyarrow Table of the collection's key and value columns, with an
        optional ``diff`` column, or a list of ``(key_tuple, value_tuple)``) to collection
        ``name``. Checked now; written at commit."""
        if self._closed:
            raise InvalidUsage("this transaction was committed or abandoned; start a new one")
        if not self._ctl.is_transactional(name):
            raise InvalidUsage(
                f"collection {name!r} is not transactional: only transactional collections "
                "(every multi-shard one by default) take inserts and transactions; convert it "
                f"with ctl.make_transactional({name!r}) or `persist make-transactional {name}`"
            )
        target = self._targets.get(name)
        if target is None:
            target = self._targets[name] = _Target(name, self._ctl.open_writer(name), [])
        _updates_at(rows, 0, target.writer.schemas, name)  # check now: fail before writing
        target.rows.append(rows)

    def commit(self) -> int:
        """Commits every insert as one transaction; returns the time ``T`` it is visible at."""
        if self._closed:
            raise InvalidUsage("this transaction was committed or abandoned already")
        try:
            if not self._targets:
                raise InvalidUsage("a transaction with no inserts has nothing to commit")
            txns = self._ctl.txns
            for _ in range(MAX_ATTEMPTS):
                view = txns.log.read()
                lowers = {
                    s: txns.logical_upper(s, view) for t in self._targets.values() for s in t.writer.shard_ids
                }
                if any(lo.time is None for lo in lowers.values()):
                    raise InvalidUsage("a collection of this transaction is closed for writes")
                at = max(lo.time or 0 for lo in lowers.values())
                writes = [w for t in self._targets.values() for w in _shard_writes(t, at, lowers)]
                follow = [a for t in self._targets.values() for a in t.writer.metadata_advances(Antichain([at + 1]))]
                try:
                    txns.commit(writes, follow)
                except UpperMismatch:
                    continue  # another writer was first: a new time, the rows rewritten
                for t in self._targets.values():
                    t.writer.advance_metadata_after_commit(Antichain([at + 1]))
                self.committed_at = at
                return at
            raise TransactionContended(
                f"the transaction on {sorted(self._targets)} lost its commit {MAX_ATTEMPTS} times "
                "to other writers; nothing was written, retry it later"
            )
        finally:
            self._close()

    def abandon(self) -> None:
        """Drops the inserts; nothing was written."""
        self._close()

    def _close(self) -> None:
        self._closed = True
        for t in self._targets.values():
            t.writer.expire()
        self._targets.clear()

    def __enter__(self) -> Transaction:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abandon()


def _shard_writes(t: _Target, at: int, lowers: dict[str, Antichain]) -> list[ShardWrite]:
    schemas = t.writer.schemas
    parts = [_updates_at(rows, at, schemas, t.name) for rows in t.rows]
    merged = check_updates(pa.concat_tables([p.table for p in parts]), schemas, shard=t.name)
    pieces = split_by_shard(merged, [KEY_PREFIX + n for n in schemas.key_names], t.writer.num_shards)
    return [
        ShardWrite(s, schemas, piece, lowers[s], Antichain([at + 1]))
        for s, piece in zip(t.writer.shard_ids, pieces, strict=True)
    ]


def _updates_at(rows: Any, at: int, schemas: Schemas, name: str) -> CheckedUpdates:
    """``rows`` as checked updates at time ``at`` with diff +1 (or the rows' ``diff``)."""
    if isinstance(rows, pa.RecordBatch):
        rows = pa.Table.from_batches([rows])
    if isinstance(rows, pa.Table):
        if "ts" in rows.column_names:
            raise InvalidUsage(
                f"collection {name!r}: inserted rows carry no 'ts' column: the controller picks "
                "the time of an insert"
            )
        t = rows.append_column("ts", pa.array([at] * rows.num_rows, pa.int64()))
        if "diff" not in t.column_names:
            t = t.append_column("diff", pa.array([1] * rows.num_rows, pa.int64()))
        return normalize_checked(t, schemas, shard=name)
    try:
        updates = [((tuple(k), tuple(v)), at, 1) for k, v in rows]
    except (TypeError, ValueError) as e:
        raise InvalidUsage(
            f"collection {name!r}: insert takes a pyarrow Table or a list of (key_tuple, "
            f"value_tuple), got {type(rows).__name__}: {e}"
        ) from e
    return normalize_checked(updates, schemas, shard=name)
