"""A pure in-memory model of one shard: what persist *should* do, in a few lines.

The stateful test drives the real shard and this model side by side; the history
checker uses the same update algebra (``consolidate``, ``snapshot``, ``advance``) to
compare reads against the committed batches. Updates are ``(key, value, time, diff)``
tuples with ``str`` keys and ``int`` values, matching the harness's schemas.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

Row = tuple[str, int, int, int]  # key, value, time, diff


def consolidate(rows: Iterable[Row]) -> Counter[tuple[str, int, int]]:
    """Sums diffs of equal ``(k, v, t)``; drops zeros."""
    c: Counter[tuple[str, int, int]] = Counter()
    for k, v, t, d in rows:
        c[(k, v, t)] += d
    return Counter({x: d for x, d in c.items() if d != 0})


def snapshot(rows: Iterable[Row], as_of: int) -> Counter[tuple[str, int, int]]:
    """The collection at ``as_of``: updates at ``t <= as_of``, times forwarded to ``as_of``."""
    return consolidate((k, v, as_of, d) for k, v, t, d in rows if t <= as_of)


def advance(rows: Iterable[Row], since: int | None) -> Counter[tuple[str, int, int]]:
    """Times below ``since`` forwarded to ``since`` (what compaction may do), consolidated."""
    if since is None:
        return consolidate(rows)
    return consolidate((k, v, max(t, since), d) for k, v, t, d in rows)


def time_slice(rows: Iterable[Row], lo: int, hi: int | None) -> Counter[tuple[str, int, int]]:
    """Updates with ``lo <= t < hi`` (``hi`` None: unbounded), consolidated."""
    return consolidate(r for r in rows if r[2] >= lo and (hi is None or r[2] < hi))


def counter_diff(got: Counter[tuple[str, int, int]], want: Counter[tuple[str, int, int]], limit: int = 5) -> str:
    """A short description of how two consolidated collections differ."""
    keys = set(got) | set(want)
    bad = sorted((k for k in keys if got.get(k, 0) != want.get(k, 0)), key=repr)
    parts = [f"{k}: got {got.get(k, 0)} want {want.get(k, 0)}" for k in bad[:limit]]
    more = f" (+{len(bad) - limit} more)" if len(bad) > limit else ""
    return "; ".join(parts) + more


@dataclass
class HandleModel:
    """A registered reader or writer: its lease and (for readers) its since."""

    last_heartbeat_ms: int
    lease_ms: int
    since: int = 0
    expired: bool = False


@dataclass
class ShardModel:
    """The expected state of one shard (single-process, no faults visible to the user)."""

    rows: list[Row] = field(default_factory=list)
    upper: int = 0
    since: int = 0
    readers: dict[str, HandleModel] = field(default_factory=dict)
    writers: dict[str, HandleModel] = field(default_factory=dict)

    # ----- writes ----------------------------------------------------------------------

    def compare_and_append(self, rows: list[Row], expected: int, new: int) -> bool:
        """True if it applies; False means ``UpperMismatch`` (nothing changes)."""
        if expected != self.upper:
            return False
        assert all(expected <= r[2] < new for r in rows)
        self.rows.extend(rows)
        self.upper = new
        return True

    def append(self, rows: list[Row], lower: int, upper: int) -> bool:
        """Definite append; False means ``UpperMismatch`` (a gap)."""
        if self.upper >= upper:
            return True
        if self.upper < lower:
            return False
        self.rows.extend(r for r in rows if r[2] >= self.upper)
        self.upper = upper
        return True

    # ----- reads -----------------------------------------------------------------------

    def snapshot(self, as_of: int) -> Counter[tuple[str, int, int]]:
        assert self.since <= as_of < self.upper
        return snapshot(self.rows, as_of)

    def listen_slice(self, lo_exclusive: int, hi: int) -> Counter[tuple[str, int, int]]:
        return time_slice(self.rows, lo_exclusive + 1, hi)

    # ----- since and leases ---------------------------------------------------------------

    def recompute_since(self) -> None:
        live = [r.since for r in self.readers.values() if not r.expired]
        if live:
            self.since = max(self.since, min(live))

    def downgrade_since(self, reader: str, new: int, now_ms: int) -> bool:
        """False means ``InvalidUsage`` (backwards)."""
        r = self.readers[reader]
        if new < r.since:
            return False
        r.since = new
        r.last_heartbeat_ms = max(r.last_heartbeat_ms, now_ms)
        self.recompute_since()
        return True

    def expire_leases(self, now_ms: int) -> tuple[list[str], list[str]]:
        dead_r = [
            rid for rid, r in self.readers.items()
            if not r.expired and r.last_heartbeat_ms + r.lease_ms < now_ms
        ]
        dead_w = [
            wid for wid, w in self.writers.items()
            if not w.expired and w.last_heartbeat_ms + w.lease_ms < now_ms
        ]
        for rid in dead_r:
            self.readers[rid].expired = True
        for wid in dead_w:
            self.writers[wid].expired = True
        self.recompute_since()
        return dead_r, dead_w


@dataclass
class CollectionsModel:
    """Transactional collections: each one's committed updates and upper. A transaction
    is a set of rows per collection committed at times of its choosing, all or nothing."""

    uppers: dict[str, int]
    rows: dict[str, list[Row]] = field(default_factory=dict)

    def commit(self, writes: dict[str, list[Row]], uppers: dict[str, int]) -> None:
        for coll, rows in writes.items():
            self.rows.setdefault(coll, []).extend(rows)
            self.uppers[coll] = uppers[coll]

    def snapshot(self, coll: str, as_of: int) -> Counter[tuple[str, int, int]]:
        return snapshot(self.rows.get(coll, []), as_of)

    def listen_slice(self, coll: str, lo_exclusive: int, hi: int) -> Counter[tuple[str, int, int]]:
        return time_slice(self.rows.get(coll, []), lo_exclusive + 1, hi)
