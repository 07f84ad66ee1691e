"""The remap (reclocking) shard of a source (docs/design.md section 11; Materialize's remap shard).

Updates are ``((partition, address), t, ±1)`` with a unit value: at every time ``t``
the shard accumulates to the source frontier bound at ``t`` (per partition, the first
address not yet covered), so the messages with addresses in ``[F(t-1), F(t))`` are
*bound* to time ``t``. A partition without an entry is at the source's initial
frontier.

The shard also carries *notes* under the partition ``@note``: non-deterministic
observations made while minting (a file was unreadable, a late file appeared, a file
was completed with N rows and S bytes). They are inserted with the binding that needs
them and never retracted, so every instance decides the same way.

Bindings are minted with ``compare_and_append`` (expected upper = the remap upper):
of two racing instances exactly one wins and the other adopts its binding. An
instance always uses the bindings it reads back from the shard (``sync``), never the
one it proposed.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from persist_lib.errors import UpperMismatch
from persist_lib.ingest.addresses import (
    Frontier,
    Note,
    decode_address,
    encode_address,
    encode_note,
    frontier_text,
)
from persist_lib.ingest.errors import IngestInvariantError

if TYPE_CHECKING:  # pragma: no cover
    from persist_lib.handles.client import PersistClient
    from persist_lib.handles.listen import Listen
    from persist_lib.ids import ShardId

REMAP_KEY = pa.schema([("partition", pa.string()), ("address", pa.string())])
REMAP_VAL = pa.schema([])
NOTE_PARTITION = "@note"


@dataclass(frozen=True)
class Binding:
    """At ``time`` the source frontier became ``frontier``; ``notes`` were added then."""

    time: int
    frontier: Frontier
    notes: tuple[Note, ...] = ()


class RemapShard:
    """Reads and mints the bindings of one source."""

    def __init__(
        self, client: PersistClient, shard: ShardId | str, initial: Frontier, *, label: str
    ) -> None:
        self.shard_id = str(shard)
        self.label = label
        self.initial = {p: tuple(a) for p, a in initial.items()}
        self._w, self._r = client.open(shard, REMAP_KEY, REMAP_VAL, purpose=f"ingest:{label}")
        self.upper = 0
        self._base = -1  # the time the history starts after (-1: the beginning)
        self._base_frontier: Frontier = dict(self.initial)
        self._base_notes: list[Note] = []
        self._history: dict[int, Binding] = {}
        self._times: list[int] = []
        self._current: Frontier = dict(self.initial)
        self._listen: Listen | None = None
        self._entries: Counter[tuple[str, str]] = Counter()

    # ----- reading ----------------------------------------------------------------------

    def load(self, as_of: int | None) -> None:
        """Reads the bindings accumulated as of ``as_of`` (None: 0), then syncs past it."""
        a = 0 if as_of is None else max(as_of, 0)
        up = self._w.fetch_recent_upper().time or 0
        self._history.clear()
        self._times.clear()
        self._entries = Counter()
        if up > a:
            self._apply_rows(self._r.snapshot(a).to_pylist())
        self._base = a
        self._base_frontier, self._base_notes = self._accumulated()
        self._current = dict(self._base_frontier)
        self._listen = self._r.listen(a)
        self.upper = up
        self.sync()

    def _apply_rows(self, rows: Iterable[dict[str, Any]]) -> None:
        for r in rows:
            self._entries[(r["partition"], r["address"])] += int(r["diff"])
        for k in [k for k, v in self._entries.items() if v == 0]:
            del self._entries[k]

    def _accumulated(self) -> tuple[Frontier, list[Note]]:
        frontier: Frontier = dict(self.initial)
        seen: set[str] = set()
        notes: list[Note] = []
        for (p, a), d in sorted(self._entries.items()):
            if p == NOTE_PARTITION:
                if d != 1:
                    self._bad(f"note {a} has multiplicity {d}")
                notes.append(json.loads(a))
                continue
            if d != 1 or p in seen:
                self._bad(f"partition {p!r} has entries {[(k, v) for k, v in self._entries.items() if k[0] == p]}")
            seen.add(p)
            frontier[p] = decode_address(a)
        return frontier, notes

    def _bad(self, what: str) -> None:
        raise IngestInvariantError(
            f"remap shard {self.shard_id} ({self.label}) does not accumulate to a frontier: {what}; "
            "it was written by something other than the ingestion driver"
        )

    def sync(self, timeout_s: float = 0.0) -> list[Binding]:
        """Reads bindings committed since the last sync (waiting up to ``timeout_s`` for one)."""
        from persist_lib.handles.listen import ListenProgress, ListenUpdates

        if self._listen is None:
            raise IngestInvariantError(f"remap {self.label}: sync before load")
        new: list[Binding] = []
        wait = timeout_s
        while True:
            events = self._listen.next(wait)
            wait = 0.0
            if not events:
                break
            for e in events:
                if isinstance(e, ListenUpdates):
                    by_t: dict[int, list[dict[str, Any]]] = {}
                    for r in e.table.to_pylist():
                        by_t.setdefault(int(r["ts"]), []).append(r)
                    for t in sorted(by_t):
                        new.append(self._apply_time(t, by_t[t]))
                elif isinstance(e, ListenProgress):
                    if e.upper.time is None:
                        self._bad("its upper is the empty frontier (closed)")
                    self.upper = max(self.upper, e.upper.time or 0)
        return new

    def _apply_time(self, t: int, rows: list[dict[str, Any]]) -> Binding:
        before = set(self._entries)
        self._apply_rows(rows)
        frontier, _ = self._accumulated()
        added = [k for k in self._entries if k not in before and k[0] == NOTE_PARTITION]
        notes = tuple(json.loads(a) for _, a in sorted(added))
        b = Binding(t, frontier, notes)
        self._history[t] = b
        self._times.append(t)
        self._current = frontier
        return b

    # ----- queries ------------------------------------------------------------------------

    @property
    def frontier(self) -> Frontier:
        """The frontier bound at ``upper - 1`` (everything the remap covers so far)."""
        return dict(self._current)

    def frontier_at(self, t: int) -> Frontier:
        """The frontier accumulated at time ``t`` (``t`` >= the loaded base)."""
        if t < self._base:
            raise IngestInvariantError(
                f"remap {self.label}: frontier at {t} requested but only times >= {self._base} are loaded"
            )
        best = dict(self._base_frontier)
        for bt in self._times:
            if bt > t:
                break
            best = self._history[bt].frontier
        return dict(best)

    def bindings_between(self, lo: int, hi: int) -> list[Binding]:
        return [self._history[t] for t in self._times if lo <= t < hi]

    def all_notes(self) -> list[Note]:
        out = list(self._base_notes)
        for t in self._times:
            out.extend(self._history[t].notes)
        return out

    def notes_upto(self, t: int) -> list[Note]:
        out = list(self._base_notes)
        for bt in self._times:
            if bt > t:
                break
            out.extend(self._history[bt].notes)
        return out

    def forget_before(self, t: int) -> None:
        """Drops history before ``t`` (the driver is past it) to bound memory."""
        keep = [x for x in self._times if x >= t]
        drop = [x for x in self._times if x < t]
        if not drop:
            return
        last = self._history[drop[-1]]
        self._base_frontier = dict(last.frontier)
        for x in drop:
            self._base_notes.extend(self._history[x].notes)
            del self._history[x]
        self._base = drop[-1]
        self._times = keep

    # ----- minting ------------------------------------------------------------------------

    def mint(self, t: int, new: Frontier, notes: list[Note]) -> bool:
        """Proposes frontier ``new`` (and ``notes``) at ``t`` >= upper; False if another won.

        The binding is relative to the current frontier (the one at ``upper - 1``).
        Either way, call ``sync`` to learn what was committed.
        """
        if t < self.upper:
            raise IngestInvariantError(f"remap {self.label}: mint at {t} below the upper {self.upper}")
        rows: list[tuple[tuple[tuple[str, str], tuple[()]], int, int]] = []
        for p, a in sorted(new.items()):
            prev = self._current.get(p)
            if prev is not None and tuple(prev) == tuple(a):
                continue
            if prev is not None and tuple(a) < tuple(prev):
                raise IngestInvariantError(
                    f"remap {self.label}: the frontier of partition {p!r} would go back from "
                    f"{encode_address(prev)} to {encode_address(a)}"
                )
            if prev is not None and (p, encode_address(prev)) in self._entries:
                rows.append((((p, encode_address(prev)), ()), t, -1))
            rows.append((((p, encode_address(a)), ()), t, 1))
        for n in notes:
            rows.append((((NOTE_PARTITION, encode_note(n)), ()), t, 1))
        try:
            self._w.compare_and_append(rows, self.upper, t + 1)
            return True
        except UpperMismatch:
            return False

    def advance_to(self, upper: int) -> bool:
        """Moves the upper forward with no new binding (time passes, nothing new)."""
        if upper <= self.upper:
            return True
        try:
            self._w.compare_and_append([], self.upper, upper)
            return True
        except UpperMismatch:
            return False

    def downgrade_since(self, since: int) -> None:
        from persist_lib.frontier import Antichain

        if self._r.since < Antichain([since]):
            self._r.downgrade_since(since)

    def heartbeat(self) -> None:
        self._r.heartbeat()
        self._w.heartbeat()

    def describe(self) -> dict[str, Any]:
        return {
            "shard": self.shard_id,
            "upper": self.upper,
            "frontier": {p: list(a) for p, a in self._current.items()},
            "frontier_text": frontier_text(self._current),
        }

    def close(self) -> None:
        for h in (self._w, self._r):
            try:
                h.expire()
            except Exception:  # noqa: BLE001 - best effort; leases lapse anyway
                pass
