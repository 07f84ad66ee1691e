"""Shard state: the small metadata that consensus versions (docs/design.md section 5).

``ShardState`` is an immutable value. Transitions (``persist_lib.shard.transitions``) build
a new value from an old one; the ``Machine`` commits the *field-level diff* between
the two at ``seqno + 1``. Two encodings exist, both JSON with an explicit format
version:

* a **diff** (one consensus entry): the changed scalar fields and, per map field, the
  entries set and the keys deleted, plus a pointer to the latest rollup;
* a **rollup** (a blob): the whole state at one seqno, written every ~128 seqnos so that
  opening a shard costs one rollup fetch plus a bounded number of diffs.

Map entries are immutable objects; the diff compares them by identity first, so the
cost of diffing is proportional to the number of entries, and of encoding to the
size of what changed.

**Versions.** The format is ``[major, minor]``. A newer *major* is refused with a clear
error (``StateFormatTooNew``). A newer *minor* may only add fields that older code can
safely ignore (anything that changes what may be deleted or read needs a major bump):
older code reads such a state, keeps the unknown fields it does not understand
verbatim in ``ShardState.unknown`` (so its own rollups and diffs carry them forward
unchanged) and otherwise ignores them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from persist_lib.errors import CorruptionError, StateFormatTooNew
from persist_lib.frontier import Antichain
from persist_lib.shard.batch_meta import HollowBatch
from persist_lib.shard.inline_format import is_ipc_part

# 1.1: quarantined_merges. 2.0: parts may be unsorted (``PartMeta.sorted``): code that
# assumes every part sorted must not read such a state, hence a major version.
# 2.1: parts may carry ``decoded`` (their Arrow size as written); 2.0 code ignores it.
# 3.0: the schemas evolved (``schemas`` carries earlier ``versions``): parts may be of an
# earlier version, which 2.x code would take for corrupt. Only such a state is written
# as 3.0; a shard whose schemas never changed keeps writing 2.1, byte for byte as before.
# 4.0: inline parts may be Arrow IPC streams (``inline_format``), which 3.x code would
# take for corrupt Parquet. Written only while the state holds such a part.
FORMAT_MAJOR = 4
FORMAT_MINOR = 0
FORMAT_EVOLVED = (3, 0)
FORMAT_UNEVOLVED = (2, 1)


def state_format(state: ShardState) -> list[int]:
    """The format a state is encoded in: 4.0 while it holds an inline IPC part, else
    3.0 once its schemas evolved, else 2.1 (each the oldest code that can read it)."""
    if state.has_ipc_inline:
        return [FORMAT_MAJOR, FORMAT_MINOR]
    sch = state.schemas
    if sch is not None and sch.get("versions"):
        return list(FORMAT_EVOLVED)
    return list(FORMAT_UNEVOLVED)
CODE_VERSION = "0.1.0"


@dataclass(frozen=True)
class LeasedReaderState:
    """A leased reader: holds back ``since`` (compaction) and ``seqno`` (GC)."""

    since: Antichain
    seqno: int  # the oldest state version this reader may still read from
    last_heartbeat_ms: int
    lease_duration_ms: int
    purpose: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "since": self.since.to_json(),
            "seqno": self.seqno,
            "hb": self.last_heartbeat_ms,
            "lease": self.lease_duration_ms,
            "purpose": self.purpose,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> LeasedReaderState:
        return cls(Antichain.from_json(d["since"]), d["seqno"], d["hb"], d["lease"], d["purpose"])


@dataclass(frozen=True)
class CriticalReaderState:
    """A critical reader: holds back ``since`` forever, fenced by an opaque token."""

    since: Antichain
    opaque: str
    purpose: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"since": self.since.to_json(), "opaque": self.opaque, "purpose": self.purpose}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> CriticalReaderState:
        return cls(Antichain.from_json(d["since"]), d["opaque"], d["purpose"])


@dataclass(frozen=True)
class WriterState:
    """A writer: its lease and the idempotency token of its most recent write."""

    last_heartbeat_ms: int
    lease_duration_ms: int
    most_recent_write_token: str | None = None
    most_recent_write_upper: Antichain = field(default_factory=Antichain.minimum)
    purpose: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "hb": self.last_heartbeat_ms,
            "lease": self.lease_duration_ms,
            "token": self.most_recent_write_token,
            "upper": self.most_recent_write_upper.to_json(),
            "purpose": self.purpose,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> WriterState:
        return cls(d["hb"], d["lease"], d["token"], Antichain.from_json(d["upper"]), d["purpose"])


@dataclass(frozen=True)
class GarbageEntry:
    """A blob that became unreachable at ``seqno`` (epoch-based reclamation)."""

    seqno: int
    size: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"seqno": self.seqno, "size": self.size}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> GarbageEntry:
        return cls(d["seqno"], d.get("size", 0))


@dataclass(frozen=True)
class RollupRef:
    """A full-state rollup of this shard at ``seqno``, stored in blob at ``key``."""

    key: str
    size: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "size": self.size}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RollupRef:
        return cls(d["key"], d.get("size", 0))


@dataclass(frozen=True)
class QuarantineEntry:
    """A merge that failed deterministically (a corrupt or missing input part, a bug)
    and is no longer retried automatically until an operator asks (``persist compact
    --retry-quarantined``) or its batches leave the trace."""

    batch_ids: tuple[int, ...]
    error: str
    failures: int
    first_failure_ms: int
    last_failure_ms: int

    def to_json(self) -> dict[str, Any]:
        return {
            "batch_ids": list(self.batch_ids),
            "error": self.error,
            "failures": self.failures,
            "first_ms": self.first_failure_ms,
            "last_ms": self.last_failure_ms,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> QuarantineEntry:
        return cls(
            tuple(int(x) for x in d["batch_ids"]), str(d["error"]), int(d["failures"]),
            int(d["first_ms"]), int(d["last_ms"]),
        )


def quarantine_key(batch_ids: tuple[int, ...]) -> str:
    return "-".join(str(b) for b in batch_ids)


# Map fields of the state: name -> (value decoder, key decoder).
_MAP_CODECS: dict[str, tuple[Callable[[Any], Any], Callable[[str], Any]]] = {
    "leased_readers": (LeasedReaderState.from_json, str),
    "critical_readers": (CriticalReaderState.from_json, str),
    "writers": (WriterState.from_json, str),
    "batches": (HollowBatch.from_json, int),
    "rollups": (RollupRef.from_json, int),
    "garbage": (GarbageEntry.from_json, str),
    "quarantined_merges": (QuarantineEntry.from_json, str),
}

# Scalar fields that are frontiers (encoded as int | None).
_FRONTIER_SCALARS = {"since", "upper"}
# Fields that are not part of the encoded state.
_NOT_ENCODED = {"unknown"}

@dataclass(frozen=True)
class ShardState:
    """Everything persist knows about one shard at one seqno.

    ``batches`` is the trace: batch id -> batch, contiguous in time when ordered by
    ``lower`` (see ``trace_batches``). ``since`` is the shard since (the meet of every
    reader's since); ``upper`` the shard upper (the trace upper).
    """

    shard_id: str
    seqno: int = 0  # 0: the shard doesn't exist yet (no consensus entry)
    walltime_ms: int = 0
    code_version: str = CODE_VERSION
    schemas: dict[str, Any] | None = None  # codec.Schemas.to_json()
    since: Antichain = field(default_factory=Antichain.minimum)
    upper: Antichain = field(default_factory=Antichain.minimum)
    next_id: int = 1
    tombstone: bool = False
    last_gc_seqno: int = 0
    leased_readers: Mapping[str, LeasedReaderState] = field(default_factory=dict)
    critical_readers: Mapping[str, CriticalReaderState] = field(default_factory=dict)
    writers: Mapping[str, WriterState] = field(default_factory=dict)
    batches: Mapping[int, HollowBatch] = field(default_factory=dict)
    rollups: Mapping[int, RollupRef] = field(default_factory=dict)
    garbage: Mapping[str, GarbageEntry] = field(default_factory=dict)
    quarantined_merges: Mapping[str, QuarantineEntry] = field(default_factory=dict)
    # Fields written by a newer minor format that this code doesn't know, kept verbatim:
    # {"scalars": {name: json}, "maps": {name: {key: json}}}.
    unknown: Mapping[str, Any] = field(default_factory=dict, compare=False)

    # ----- derived views -------------------------------------------------------------

    @property
    def exists(self) -> bool:
        return self.seqno > 0

    def trace_batches(self) -> list[tuple[int, HollowBatch]]:
        """The trace in time order (batches are contiguous: each upper is the next lower).

        Sorted once per state value (a state is immutable; several transitions and the
        compaction planner ask for it on every commit); each call returns a new list.
        """
        order: tuple[tuple[int, HollowBatch], ...] | None = self.__dict__.get("_trace")
        if order is None:
            order = tuple(sorted(self.batches.items(), key=lambda kv: (kv[1].lower.time or 0, kv[0])))
            self.__dict__["_trace"] = order
        return list(order)

    @property
    def inline_bytes(self) -> int:
        """Encoded bytes of the parts inlined in this state (bounded per shard by
        ``PersistConfig.inline_max_total``); computed once per state value."""
        n: int | None = self.__dict__.get("_inline_bytes")
        if n is None:
            n = sum(p.size for b in self.batches.values() for p in b.parts if p.inline is not None)
            self.__dict__["_inline_bytes"] = n
        return n

    @property
    def has_ipc_inline(self) -> bool:
        """Whether an inline part of this state is an Arrow IPC stream (format 4.0:
        ``state_format``); computed once per state value."""
        found: bool | None = self.__dict__.get("_ipc_inline")
        if found is None:
            found = any(
                p.inline is not None and is_ipc_part(p.inline) for b in self.batches.values() for p in b.parts
            )
            self.__dict__["_ipc_inline"] = found
        return found

    def seqno_since(self) -> int:
        """The oldest seqno some leased reader may still read: GC must not pass it."""
        holds = [r.seqno for r in self.leased_readers.values()]
        return min([self.seqno, *holds])

    def latest_rollup(self) -> tuple[int, RollupRef] | None:
        if not self.rollups:
            return None
        s = max(self.rollups)
        return s, self.rollups[s]

    def blob_keys(self) -> set[str]:
        """Every blob key this state version references (parts, rollups, garbage)."""
        keys: set[str] = set()
        for b in self.batches.values():
            keys.update(b.blob_keys())
        keys.update(r.key for r in self.rollups.values())
        keys.update(self.garbage)
        return keys

    def evolve(self, **changes: Any) -> ShardState:
        """``dataclasses.replace`` without the generic machinery (~10x cheaper: every
        transition and every replayed diff makes one or two); memoized views that
        depend on the batches are dropped when they change."""
        unknown = changes.keys() - _FIELD_NAMES
        if unknown:
            raise TypeError(f"ShardState has no field(s) {sorted(unknown)}")
        out = object.__new__(ShardState)
        d = out.__dict__
        d.update(self.__dict__)
        if "batches" in changes:
            for k in _BATCH_MEMOS:
                d.pop(k, None)
        d.update(changes)
        return out

    # ----- encoding ---------------------------------------------------------------------

    def _scalars_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in fields(self):
            if f.name in _MAP_CODECS or f.name in _NOT_ENCODED:
                continue
            v = getattr(self, f.name)
            out[f.name] = v.to_json() if isinstance(v, Antichain) else v
        out.update(self.unknown.get("scalars", {}))
        return out

    def to_rollup_json(self) -> dict[str, Any]:
        return {
            "format": state_format(self),
            "kind": "rollup",
            "scalars": self._scalars_json(),
            "maps": {
                **{
                    name: {str(k): v.to_json() for k, v in getattr(self, name).items()}
                    for name in _MAP_CODECS
                },
                **self.unknown.get("maps", {}),
            },
        }

    def encode_rollup(self) -> bytes:
        return json.dumps(self.to_rollup_json(), separators=(",", ":")).encode()

    @classmethod
    def decode_rollup(cls, data: bytes, *, shard: str, key: str) -> ShardState:
        d = _loads(data, shard=shard, what=f"rollup {key}")
        _check_format(d, shard=shard, what=f"rollup {key}")
        if d.get("kind") != "rollup":
            raise CorruptionError(f"shard {shard}: blob {key} is not a state rollup")
        return _from_parts(d["scalars"], d["maps"])


_SCALAR_FIELDS = frozenset(
    f.name for f in fields(ShardState) if f.name not in _MAP_CODECS and f.name not in _NOT_ENCODED
)
# The same, in declaration order (the order diffs list changed scalars in).
_SCALAR_ORDER = tuple(
    f.name for f in fields(ShardState) if f.name not in _MAP_CODECS and f.name not in _NOT_ENCODED
)
_FIELD_NAMES = frozenset(f.name for f in fields(ShardState))
# Memoized views kept in a state's ``__dict__`` that depend on its batches.
_BATCH_MEMOS = ("_trace", "_inline_bytes", "_ipc_inline")


def _from_parts(scalars: dict[str, Any], maps: dict[str, dict[str, Any]]) -> ShardState:
    kw: dict[str, Any] = {}
    unknown_scalars: dict[str, Any] = {}
    unknown_maps: dict[str, Any] = {}
    for name, v in scalars.items():
        if name not in _SCALAR_FIELDS:
            unknown_scalars[name] = v  # a newer minor format's field: carried, not used
            continue
        kw[name] = Antichain.from_json(v) if name in _FRONTIER_SCALARS else v
    for name, (dec, kdec) in _MAP_CODECS.items():
        kw[name] = {kdec(k): dec(v) for k, v in maps.get(name, {}).items()}
    for name, m in maps.items():
        if name not in _MAP_CODECS:
            unknown_maps[name] = dict(m)
    if unknown_scalars or unknown_maps:
        kw["unknown"] = {"scalars": unknown_scalars, "maps": unknown_maps}
    return ShardState(**kw)


def _loads(data: bytes, *, shard: str, what: str) -> dict[str, Any]:
    try:
        d = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise CorruptionError(f"shard {shard}: {what} is not valid state encoding: {e}") from None
    if not isinstance(d, dict):
        raise CorruptionError(f"shard {shard}: {what} is not valid state encoding")
    return d


def _check_format(d: dict[str, Any], *, shard: str, what: str) -> None:
    fmt = d.get("format")
    if (
        not isinstance(fmt, list)
        or len(fmt) != 2
        or not all(isinstance(x, int) and not isinstance(x, bool) for x in fmt)
    ):
        raise CorruptionError(f"shard {shard}: {what} has no valid format version (got {fmt!r})")
    if fmt[0] > FORMAT_MAJOR:
        raise StateFormatTooNew(
            f"shard {shard}: {what} was written in state format {fmt[0]}.{fmt[1]} by a newer "
            f"persist_lib; this code understands format {FORMAT_MAJOR}.x (up to "
            f"{FORMAT_MAJOR}.{FORMAT_MINOR}) and does not read or write it: upgrade persist_lib"
        )
    for k in ("scalars", "maps"):
        if k in d and not isinstance(d[k], dict):
            raise CorruptionError(f"shard {shard}: {what}: field {k!r} is not an object")


def encode_diff(old: ShardState, new: ShardState) -> bytes:
    """The field-level diff from ``old`` (at seqno N) to ``new`` (at seqno N+1).

    Scalars are compared as values (equal values have equal JSON forms), so only the
    changed ones are encoded."""
    scalars: dict[str, Any] = {}
    od, nd = old.__dict__, new.__dict__
    for k in _SCALAR_ORDER:
        nv = nd[k]
        ov = od[k]
        if ov is nv or ov == nv:
            continue
        scalars[k] = nv.to_json() if isinstance(nv, Antichain) else nv
    new_unknown = new.unknown.get("scalars", {})
    if new_unknown:
        old_unknown = old.unknown.get("scalars", {})
        for k, v in new_unknown.items():
            if old_unknown.get(k, _MISSING) != v:
                scalars[k] = v
    maps: dict[str, Any] = {}
    for name in _MAP_CODECS:
        a: Mapping[Any, Any] = getattr(old, name)
        b: Mapping[Any, Any] = getattr(new, name)
        if a is b:
            continue
        set_: dict[str, Any] = {}
        for k, v in b.items():
            ov = a.get(k, _MISSING)
            if ov is v or ov == v:
                continue
            set_[str(k)] = v.to_json()
        dels = [str(k) for k in a if k not in b]
        if set_ or dels:
            maps[name] = {"set": set_, "del": dels}
    lr = new.latest_rollup()
    doc = {
        "format": state_format(new),
        "kind": "diff",
        "prev": old.seqno,
        "rollup": [lr[0], lr[1].key] if lr else None,
        "scalars": scalars,
        "maps": maps,
    }
    return json.dumps(doc, separators=(",", ":")).encode()


_MISSING = object()


def diff_rollup_pointer(data: bytes, *, shard: str) -> tuple[int, str] | None:
    """The latest rollup a consensus entry points to (read from the head to open a shard)."""
    d = _loads(data, shard=shard, what="consensus entry")
    _check_format(d, shard=shard, what="consensus entry")
    r = d.get("rollup")
    return (int(r[0]), str(r[1])) if r else None


def apply_diff(old: ShardState, data: bytes, seqno: int) -> ShardState:
    """Applies the consensus entry at ``seqno`` (which must be ``old.seqno + 1``)."""
    return apply_diffs(old, [(seqno, data)])


_DELETED = object()


def apply_diffs(old: ShardState, entries: list[tuple[int, bytes]]) -> ShardState:
    """Applies consecutive consensus entries ``(seqno, payload)``, the first at
    ``old.seqno + 1``: the state ``apply_diff`` one by one would give.

    Opening a shard replays up to a rollup interval of diffs, and most map entries
    they set are replaced by a later one (an append's batch, merged away a few diffs
    on). So the entries are folded first — per map key the last ``set`` or ``del``
    wins, per scalar the last value — and only what survives is decoded (batches,
    their frontiers and inline parts), once. Every entry is still checked: its
    format, that it follows the previous one, and the seqno it carries.
    """
    shard = old.shard_id
    prev = old.seqno
    scalars: dict[str, Any] = {}
    maps: dict[str, dict[str, Any]] = {}
    for seqno, data in entries:
        d = _loads(data, shard=shard, what=f"consensus entry {seqno}")
        _check_format(d, shard=shard, what=f"consensus entry {seqno}")
        if d.get("kind") != "diff" or d.get("prev") != prev or seqno != prev + 1:
            raise CorruptionError(
                f"shard {shard}: consensus entry {seqno} does not follow state {prev} "
                f"(it says prev={d.get('prev')})"
            )
        sc = d["scalars"]
        if sc.get("seqno") != seqno:
            raise CorruptionError(
                f"shard {shard}: consensus entry {seqno} carries seqno {sc.get('seqno', prev)}"
            )
        scalars.update(sc)
        for name, m in d["maps"].items():
            folded = maps.get(name)
            if folded is None:
                folded = maps[name] = {}
            for k in m.get("del", ()):
                folded[k] = _DELETED
            folded.update(m.get("set", ()))
        prev = seqno
    if not entries:
        return old
    changes: dict[str, Any] = {}
    old_unknown = old.unknown
    unknown_scalars = dict(old_unknown.get("scalars", {})) if old_unknown else {}
    unknown_maps = {k: dict(v) for k, v in old_unknown.get("maps", {}).items()} if old_unknown else {}
    touched_unknown = False
    for name, v in scalars.items():
        if name not in _SCALAR_FIELDS:
            unknown_scalars[name] = v  # a newer minor format's field: carried, not used
            touched_unknown = True
            continue
        changes[name] = Antichain.from_json(v) if name in _FRONTIER_SCALARS else v
    for name, folded in maps.items():
        codec = _MAP_CODECS.get(name)
        if codec is None:
            um = unknown_maps.setdefault(name, {})
            for k, v in folded.items():
                if v is _DELETED:
                    um.pop(k, None)
                else:
                    um[k] = v
            touched_unknown = True
            continue
        dec, kdec = codec
        cur = dict(getattr(old, name))
        for k, v in folded.items():
            if v is _DELETED:
                cur.pop(kdec(k), None)
            else:
                cur[kdec(k)] = dec(v)
        changes[name] = cur
    if touched_unknown:
        changes["unknown"] = {"scalars": unknown_scalars, "maps": unknown_maps}
    return old.evolve(**changes)
