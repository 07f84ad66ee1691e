"""A decoder for Postgres's built-in ``pgoutput`` logical replication protocol (v1).

The messages are what ``pg_logical_slot_peek_binary_changes(..., 'proto_version',
'1', 'publication_names', ...)`` returns in its ``data`` column (the same bytes the
streaming replication protocol carries in XLogData). Only the server's built-in plugin
is needed: no extension. Reference: "Logical Replication Message Formats" in the
Postgres manual.

``TxnAssembler`` turns a message sequence into whole transactions (Begin ... Commit):
the unit the CDC source applies atomically at its commit LSN.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from persist_lib.ingest.errors import IngestError


class PgOutputError(IngestError):
    """A pgoutput message could not be decoded (protocol mismatch or corruption)."""


class _Unchanged:
    """Marker: an unchanged TOASTed value (the update did not send it)."""

    _inst: _Unchanged | None = None

    def __new__(cls) -> _Unchanged:
        if cls._inst is None:
            cls._inst = super().__new__(cls)
        return cls._inst

    def __repr__(self) -> str:
        return "UNCHANGED"


UNCHANGED = _Unchanged()
TupleValue = str | None | _Unchanged


def lsn_to_int(s: str) -> int:
    hi, lo = s.split("/")
    return (int(hi, 16) << 32) | int(lo, 16)


def int_to_lsn(v: int) -> str:
    return f"{v >> 32:X}/{v & 0xFFFFFFFF:X}"


@dataclass(frozen=True)
class Column:
    name: str
    type_oid: int
    type_mod: int
    is_key: bool


@dataclass(frozen=True)
class Relation:
    relid: int
    namespace: str
    name: str
    replica_identity: str  # 'd' default, 'n' nothing, 'f' full, 'i' index
    columns: tuple[Column, ...]

    @property
    def qualified(self) -> str:
        return f"{self.namespace}.{self.name}"


@dataclass
class Begin:
    final_lsn: int
    commit_ts: int
    xid: int


@dataclass
class Commit:
    flags: int
    commit_lsn: int
    end_lsn: int
    commit_ts: int


@dataclass
class Change:
    """One row change: ``op`` is 'I' (insert), 'U' (update), 'D' (delete) or 'T' (truncate).

    ``old`` is the old key ('K') or full old row ('O') when sent; ``new`` the new row.
    Values are the text form, ``None`` for NULL, ``UNCHANGED`` for an unsent TOAST value.
    """

    op: str
    relid: int
    old: tuple[TupleValue, ...] | None = None
    old_kind: str | None = None  # 'K' or 'O'
    new: tuple[TupleValue, ...] | None = None
    truncate_relids: tuple[int, ...] = ()
    relation: Relation | None = None  # the relation as described when the change was sent
    truncate_relations: tuple[Relation | None, ...] = ()


@dataclass
class Txn:
    xid: int
    commit_lsn: int
    end_lsn: int
    commit_ts: int
    changes: list[Change] = field(default_factory=list)


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.b = data
        self.i = 0

    def byte(self) -> str:
        c = self.b[self.i : self.i + 1]
        if not c:
            raise PgOutputError("truncated pgoutput message")
        self.i += 1
        return c.decode("ascii")

    def int8(self) -> int:
        v = self.b[self.i]
        self.i += 1
        return int(v)

    def int16(self) -> int:
        (v,) = struct.unpack_from(">h", self.b, self.i)
        self.i += 2
        return int(v)

    def int32(self) -> int:
        (v,) = struct.unpack_from(">i", self.b, self.i)
        self.i += 4
        return int(v)

    def uint32(self) -> int:
        (v,) = struct.unpack_from(">I", self.b, self.i)
        self.i += 4
        return int(v)

    def int64(self) -> int:
        (v,) = struct.unpack_from(">q", self.b, self.i)
        self.i += 8
        return int(v)

    def uint64(self) -> int:
        (v,) = struct.unpack_from(">Q", self.b, self.i)
        self.i += 8
        return int(v)

    def string(self) -> str:
        j = self.b.index(b"\x00", self.i)
        s = self.b[self.i : j].decode("utf-8")
        self.i = j + 1
        return s

    def bytes_(self, n: int) -> bytes:
        v = self.b[self.i : self.i + n]
        if len(v) != n:
            raise PgOutputError("truncated pgoutput tuple value")
        self.i += n
        return v

    def tuple_(self) -> tuple[TupleValue, ...]:
        n = self.int16()
        out: list[TupleValue] = []
        for _ in range(n):
            kind = self.byte()
            if kind == "n":
                out.append(None)
            elif kind == "u":
                out.append(UNCHANGED)
            elif kind == "t":
                ln = self.int32()
                out.append(self.bytes_(ln).decode("utf-8"))
            elif kind == "b":
                ln = self.int32()
                raise PgOutputError("binary tuple values are not supported (use the text format: no 'binary' option)")
            else:
                raise PgOutputError(f"unknown tuple value kind {kind!r}")
        return tuple(out)


def decode_message(data: bytes) -> Any:
    """One pgoutput message -> Begin / Commit / Relation / Change / None (ignored kinds)."""
    r = _Reader(bytes(data))
    kind = r.byte()
    if kind == "B":
        return Begin(r.uint64(), r.int64(), r.uint32())
    if kind == "C":
        return Commit(r.int8(), r.uint64(), r.uint64(), r.int64())
    if kind == "R":
        relid = r.uint32()
        ns = r.string()
        name = r.string()
        ident = chr(r.int8())
        ncols = r.int16()
        cols = []
        for _ in range(ncols):
            flags = r.int8()
            cname = r.string()
            oid = r.uint32()
            mod = r.int32()
            cols.append(Column(cname, oid, mod, bool(flags & 1)))
        return Relation(relid, ns or "pg_catalog", name, ident, tuple(cols))
    if kind == "I":
        relid = r.uint32()
        if r.byte() != "N":
            raise PgOutputError("insert message without a new tuple")
        return Change("I", relid, new=r.tuple_())
    if kind == "U":
        relid = r.uint32()
        k = r.byte()
        old = None
        old_kind = None
        if k in ("K", "O"):
            old_kind = k
            old = r.tuple_()
            k = r.byte()
        if k != "N":
            raise PgOutputError(f"update message: expected the new tuple, got {k!r}")
        return Change("U", relid, old=old, old_kind=old_kind, new=r.tuple_())
    if kind == "D":
        relid = r.uint32()
        k = r.byte()
        if k not in ("K", "O"):
            raise PgOutputError(f"delete message: expected an old key/tuple, got {k!r}")
        return Change("D", relid, old=r.tuple_(), old_kind=k)
    if kind == "T":
        n = r.uint32()
        r.int8()  # options: cascade / restart identity
        relids = tuple(r.uint32() for _ in range(n))
        return Change("T", 0, truncate_relids=relids)
    if kind in ("Y", "O", "M"):
        return None  # type, origin and logical messages carry nothing we apply
    raise PgOutputError(f"unknown pgoutput message kind {kind!r} (is proto_version 1 in use?)")


class TxnAssembler:
    """Feeds messages in order; yields complete transactions. Keeps the relation cache."""

    def __init__(self) -> None:
        self.relations: dict[int, Relation] = {}
        self._cur: Txn | None = None

    def feed(self, messages: Iterable[bytes]) -> list[Txn]:
        out: list[Txn] = []
        for data in messages:
            m = decode_message(data)
            if isinstance(m, Begin):
                self._cur = Txn(m.xid, m.final_lsn, 0, m.commit_ts)
            elif isinstance(m, Commit):
                if self._cur is None:
                    raise PgOutputError("commit without begin")
                self._cur.commit_lsn = m.commit_lsn
                self._cur.end_lsn = m.end_lsn
                out.append(self._cur)
                self._cur = None
            elif isinstance(m, Relation):
                self.relations[m.relid] = m
            elif isinstance(m, Change):
                if self._cur is None:
                    raise PgOutputError("row change outside a transaction")
                m.relation = self.relations.get(m.relid)
                m.truncate_relations = tuple(self.relations.get(r) for r in m.truncate_relids)
                self._cur.changes.append(m)
        return out

    @property
    def in_transaction(self) -> bool:
        return self._cur is not None

    def reset_partial(self) -> None:
        """Drops a transaction cut off by the end of a batch (it comes again whole)."""
        self._cur = None
