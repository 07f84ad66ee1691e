"""The txn log: the one shard per location that says which transactions committed.

Rows are ``((shard, txn), (batch,))`` with diff +1:

* ``(data shard, "")`` with batch ``""``: the data shard is registered (written only
  through transactions from then on);
* ``(data shard, txn id)`` with a serialized ``HollowBatch``: a committed transaction's
  batch for that shard that may not be applied yet; tidy retracts it (-1) once applied;
* ``(shard, txn id)`` with ``{"advance_to": upper}``: a committed transaction's
  *follow-up* (``Advance``): move that shard's upper to at least ``upper`` with an empty
  append (a collection's metadata shard, so its readers see the transaction's time
  whoever finishes it); done once the shard's upper is there, then tidied the same way.

A registration is retracted (-1) when its shard is deleted (``Txns.forget``).

The log's own times are log positions (one per commit or tidy), not data times. The
current log is its snapshot at ``upper - 1`` (``LogView``); a change is one
``compare_and_append`` at ``[upper, upper + 1)`` by this process's log writer, whose
registration in the log's state is what ``Txns.recover_orphans`` fences on.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, replace

import pyarrow as pa

from persist_lib.errors import InvalidUsage, PersistError
from persist_lib.frontier import Antichain
from persist_lib.handles.client import PersistClient
from persist_lib.handles.read import ReadHandle
from persist_lib.handles.write import WriteHandle
from persist_lib.ids import ShardId
from persist_lib.shard.batch_meta import HollowBatch

TXN_LOG_KEY = pa.schema(
    [pa.field("shard", pa.string(), nullable=False), pa.field("txn", pa.string(), nullable=False)]
)
TXN_LOG_VAL = pa.schema([pa.field("batch", pa.string(), nullable=False)])
_NAMESPACE = uuid.UUID("0b7c2a52-5f0e-4f61-9d0c-3b8f7a4e6c21")
REGISTERED = ""  # the txn column of a registration row
SINCE_STEP = 16

LogRow = tuple[tuple[tuple[str, str], tuple[str]], int, int]


def default_txn_log_shard() -> ShardId:
    """The well-known txn log of a location (the same for every controller)."""
    return ShardId("s" + str(uuid.uuid5(_NAMESPACE, "persist-txn-log")))


class TxnLogCorrupt(PersistError):
    """The txn log holds something no correct writer writes (a diff other than +1)."""


@dataclass(frozen=True)
class Pending:
    """A committed transaction's batch for one data shard, not tidied yet."""

    shard: str
    txn: str
    batch: HollowBatch

    @property
    def part_writer(self) -> str:
        return self.txn_part_writer(self.txn, self.shard)

    @staticmethod
    def txn_part_writer(txn: str, shard: str) -> str:
        """The part writer of ``txn`` on ``shard`` (derived, so an entry names it)."""
        return "w" + str(uuid.uuid5(uuid.UUID(txn), shard))

    @property
    def upper(self) -> Antichain:
        """The shard's upper once this entry is applied."""
        return self.batch.upper

    def row(self, diff: int) -> LogRow:
        return (((self.shard, self.txn), (json.dumps(self.batch.to_json()),)), 0, diff)


@dataclass(frozen=True)
class Advance:
    """A committed transaction's follow-up: ``shard``'s upper moves to at least ``upper``
    (an empty append; applied in any order, by anyone, any number of times)."""

    shard: str
    txn: str
    upper: Antichain

    def row(self, diff: int) -> LogRow:
        return (((self.shard, self.txn), (json.dumps({ADVANCE: self.upper.to_json()}),)), 0, diff)


ADVANCE = "advance_to"  # the key of a follow-up row's JSON value


@dataclass(frozen=True)
class LogView:
    """The log at ``upper - 1``: registrations and pending (untidied) entries."""

    upper: int
    seqno: int
    registered: frozenset[str]
    pending: tuple[Pending, ...]
    log_writers: frozenset[str]  # writers registered in the log's state at ``seqno``
    advances: tuple[Advance, ...] = ()  # committed follow-ups not tidied yet

    def advances_for(self, shard: str) -> list[Advance]:
        return [a for a in self.advances if a.shard == shard]

    def pending_for(self, shard: str) -> list[Pending]:
        """The shard's pending entries in apply order (their ``lower``s chain)."""
        return sorted(
            (p for p in self.pending if p.shard == shard), key=lambda p: p.batch.lower.time or 0
        )

    def pending_upper(self, shard: str) -> Antichain | None:
        """The upper of the shard's last pending entry (None: nothing pending)."""
        entries = self.pending_for(shard)
        return entries[-1].batch.upper if entries else None


class TxnLog:
    """Reads and appends to the txn log shard. Its handles are opened on first use and
    released by ``close()``."""

    def __init__(
        self, client: PersistClient, shard: ShardId | str | None = None, *, transient: bool = False
    ) -> None:
        self.client = client
        self.shard = str(ShardId.parse(shard)) if shard else str(default_txn_log_shard())
        self.transient = transient  # read-only: keep no registration, never create the log
        self._handles: tuple[WriteHandle, ReadHandle] | None = None
        self._last: LogView | None = None  # the view of the last state version read

    def _open(self) -> tuple[WriteHandle, ReadHandle]:
        if self.transient:
            raise InvalidUsage(f"txn log {self.shard}: opened read-only (by a read-only controller)")
        if self._handles is None:
            self._handles = self.client.open(self.shard, TXN_LOG_KEY, TXN_LOG_VAL, purpose="txn-log")
        return self._handles

    @property
    def writer_id(self) -> str:
        return self._open()[0].writer_id

    def read(self) -> LogView:
        """The current log (one consensus read, one snapshot of a small shard)."""
        state = self.client.machine(self.shard).fetch_latest()
        if self.transient and not state.exists:
            return LogView(0, state.seqno, frozenset(), (), frozenset())
        t = state.upper.time
        if t is None:
            raise InvalidUsage(f"txn log {self.shard} is closed (its upper is the empty frontier)")
        last = self._last
        if last is not None and last.seqno == state.seqno:
            return last  # the same state version: the same log
        writers = frozenset(state.writers)
        if t == 0:
            return LogView(0, state.seqno, frozenset(), (), writers)
        registered: set[str] = set()
        pending: list[Pending] = []
        advances: list[Advance] = []
        for row in self._snapshot(t - 1).to_pylist():
            if row["diff"] != 1:
                raise TxnLogCorrupt(
                    f"txn log {self.shard} at {t - 1}: ({row['shard']}, {row['txn']}) has diff "
                    f"{row['diff']} (every row must be +1 once or retracted)"
                )
            if row["txn"] == REGISTERED:
                registered.add(row["shard"])
            else:
                doc = json.loads(row["batch"])
                if ADVANCE in doc:
                    advances.append(Advance(row["shard"], row["txn"], Antichain.from_json(doc[ADVANCE])))
                    continue
                pending.append(Pending(row["shard"], row["txn"], HollowBatch.from_json(doc)))
        self._last = LogView(
            t, state.seqno, frozenset(registered), tuple(pending), writers, tuple(advances)
        )
        return self._last

    def _snapshot(self, as_of: int) -> pa.Table:
        if not self.transient:
            return self._open()[1].snapshot(as_of)
        r = self.client.open_leased_reader(self.shard, TXN_LOG_KEY, TXN_LOG_VAL, purpose="txn-log (read-only)")
        try:
            return r.snapshot(as_of)
        finally:
            r.expire()

    def append(self, rows: list[LogRow], at: int, *, then: LogView | None = None) -> None:
        """One CAS at ``[at, at + 1)`` (rows' times are set to ``at``). Raises
        ``UpperMismatch`` when the log moved: nothing was written. ``then``: the log these
        rows make (upper ``at + 1``), remembered so the next ``read`` needs no snapshot
        while the log's state still has that upper."""
        w, _ = self._open()
        w.compare_and_append([(kv, at, d) for kv, _t, d in rows], at, at + 1)
        if then is not None:
            state = self.client.machine(self.shard).cached()
            if state.upper.time == at + 1 and then.upper == at + 1:
                # Same upper, same contents (only appends change them): any seqno at this
                # upper is this log; ``read`` compares seqnos, so take the cached one.
                self._last = replace(then, seqno=state.seqno, log_writers=frozenset(state.writers))

    def allow_compaction(self, upto: int) -> None:
        """Lets compaction fold the log below ``upto`` (tidied entries then vanish); moves
        the since every ``SINCE_STEP`` positions, not on every tidy (each move is a CAS)."""
        _, r = self._open()
        if upto >= (r.since.time or 0) + SINCE_STEP:
            r.downgrade_since(upto)

    def close(self) -> None:
        handles, self._handles = self._handles, None
        for h in handles or ():
            try:
                h.expire()
            except PersistError:
                pass


def registration_row(shard: str, diff: int = 1) -> LogRow:
    """Registers ``shard`` (``diff`` -1: forgets it)."""
    return (((shard, REGISTERED), ("",)), 0, diff)
