"""Fault-injecting Blob and Consensus wrappers, driven by a seeded RNG.

A port of Materialize's ``unreliable.rs`` (research/reliability.md section 1). Each
call draws once from the handle's ``random.Random`` and then does one of:

- **determinate**: does not run the operation, raises ``Determinate``;
- **applied_then_timeout**: runs the operation, then raises ``Indeterminate`` (the
  nastiest case: the effect happened but the caller can't know it);
- **timeout_only**: does not run the operation, raises ``Indeterminate``;
- **stall**: sleeps ``stall_s`` and then runs the operation normally;
- otherwise passes through.

The default (``UnreliableHandle()``) is Materialize's 5% unreliability:
4.75% applied+timeout, 4.75% determinate, 0.25% timeout-only. Counters of every kind
of fault injected are kept for the reliability figures. One handle may be shared by a
blob and a consensus wrapper (as Maelstrom does) so outages can be scripted with
``totally_available()`` / ``partially_available(...)`` / ``totally_unavailable()``.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from persist_lib.errors import Determinate, Indeterminate, InvalidUsage
from persist_lib.location.base import (
    Blob,
    BlobMetadata,
    CaSResult,
    Consensus,
    VersionedData,
)

__all__ = ["FaultRates", "UnreliableBlob", "UnreliableConsensus", "UnreliableHandle"]

T = TypeVar("T")

FAULT_KINDS = ("determinate", "applied_then_timeout", "timeout_only", "stall")


@dataclass(frozen=True)
class FaultRates:
    """Per-call probabilities of each kind of fault (they must sum to at most 1)."""

    determinate: float = 0.0
    applied_then_timeout: float = 0.0
    timeout_only: float = 0.0
    stall: float = 0.0

    def __post_init__(self) -> None:
        for name in FAULT_KINDS:
            p = getattr(self, name)
            if not 0.0 <= p <= 1.0:
                raise InvalidUsage(f"fault probability {name}={p} must be in [0, 1]")
        if self.total() > 1.0 + 1e-9:
            raise InvalidUsage(f"fault probabilities sum to {self.total()} > 1: {self}")

    def total(self) -> float:
        return self.determinate + self.applied_then_timeout + self.timeout_only + self.stall

    @staticmethod
    def from_unreliability(u: float) -> FaultRates:
        """Materialize's split: should_happen = 1-u, should_timeout = u, independently."""
        if not 0.0 <= u <= 1.0:
            raise InvalidUsage(f"unreliability must be in [0, 1], got {u}")
        return FaultRates(
            determinate=u * (1 - u),  # neither happened nor timed out
            applied_then_timeout=(1 - u) * u,
            timeout_only=u * u,
        )


class UnreliableHandle:
    """Decides, per call, which fault (if any) to inject. Thread-safe; seeded."""

    def __init__(
        self,
        seed: int = 0,
        rates: FaultRates | None = None,
        *,
        stall_s: float = 0.01,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.seed = seed
        self._rng = random.Random(seed)
        self._rates = rates if rates is not None else FaultRates.from_unreliability(0.05)
        self.stall_s = stall_s
        self._sleep = sleep
        self._lock = threading.Lock()
        self.calls = 0
        self.counts: dict[str, int] = {k: 0 for k in FAULT_KINDS}

    @classmethod
    def from_unreliability(
        cls, u: float, seed: int = 0, *, stall_s: float = 0.01
    ) -> UnreliableHandle:
        """Materialize's two independent draws (happen: 1-u, timeout: u) as rates."""
        return cls(seed, FaultRates.from_unreliability(u), stall_s=stall_s)

    @property
    def rates(self) -> FaultRates:
        with self._lock:
            return self._rates

    def totally_available(self) -> None:
        """No more faults (until reconfigured)."""
        with self._lock:
            self._rates = FaultRates()

    def partially_available(
        self,
        determinate: float = 0.0475,
        applied_then_timeout: float = 0.0475,
        timeout_only: float = 0.0025,
        stall: float = 0.0,
    ) -> None:
        """Sets the fault probabilities (defaults: Materialize's 5%)."""
        rates = FaultRates(determinate, applied_then_timeout, timeout_only, stall)
        with self._lock:
            self._rates = rates

    def totally_unavailable(self, kind: str = "timeout_only") -> None:
        """Every call fails without effect: as a timeout (default, like Materialize) or
        with ``kind="determinate"`` as a determinate error."""
        if kind not in ("timeout_only", "determinate"):
            raise InvalidUsage(
                f"totally_unavailable kind must be 'timeout_only' or 'determinate', got {kind!r}"
            )
        with self._lock:
            self._rates = FaultRates(**{kind: 1.0})

    def snapshot_counts(self) -> dict[str, int]:
        """``{"calls": n, "determinate": ..., ...}`` (a copy)."""
        with self._lock:
            return {"calls": self.calls, **self.counts}

    def _decide(self) -> str | None:
        with self._lock:
            self.calls += 1
            r = self._rng.random()
            acc = 0.0
            for kind in FAULT_KINDS:
                acc += getattr(self._rates, kind)
                if r < acc:
                    self.counts[kind] += 1
                    return kind
            return None

    def run(self, what: str, op: Callable[[], T]) -> T:
        """Runs ``op`` subject to fault injection; ``what`` names it in error messages."""
        kind = self._decide()
        if kind is None:
            return op()
        if kind == "determinate":
            raise Determinate(f"unreliable: injected determinate failure of {what} (not run)")
        if kind == "timeout_only":
            raise Indeterminate(f"unreliable: injected timeout of {what} (not run)")
        if kind == "stall":
            self._sleep(self.stall_s)
            return op()
        op()  # applied_then_timeout
        raise Indeterminate(f"unreliable: injected timeout of {what} (it was applied)")

    def __repr__(self) -> str:
        return f"UnreliableHandle(seed={self.seed}, rates={self.rates})"


class UnreliableBlob(Blob):
    """A Blob that injects faults from ``handle`` into every call."""

    def __init__(self, blob: Blob, handle: UnreliableHandle) -> None:
        self.inner = blob
        self.handle = handle

    def get(self, key: str) -> bytes | None:
        return self.handle.run(f"blob get {key!r}", lambda: self.inner.get(key))

    def get_range(self, key: str, start: int, end: int) -> bytes | None:
        return self.handle.run(
            f"blob get {key!r} bytes [{start}, {end})", lambda: self.inner.get_range(key, start, end)
        )

    def set(self, key: str, value: bytes) -> None:
        self.handle.run(f"blob set {key!r}", lambda: self.inner.set(key, value))

    def delete(self, key: str) -> int | None:
        return self.handle.run(f"blob delete {key!r}", lambda: self.inner.delete(key))

    def list_keys_and_metadata(self, prefix: str) -> Iterator[BlobMetadata]:
        items = self.handle.run(
            f"blob list {prefix!r}", lambda: list(self.inner.list_keys_and_metadata(prefix))
        )
        yield from items

    def close(self) -> None:
        self.inner.close()

    def describe(self) -> str:
        return f"unreliable({self.inner.describe()})"

    def __repr__(self) -> str:
        return f"UnreliableBlob({self.inner.describe()}, seed={self.handle.seed})"


class UnreliableConsensus(Consensus):
    """A Consensus that injects faults from ``handle`` into every call."""

    def __init__(self, consensus: Consensus, handle: UnreliableHandle) -> None:
        self.inner = consensus
        self.handle = handle

    def head(self, key: str) -> VersionedData | None:
        return self.handle.run(f"consensus head {key!r}", lambda: self.inner.head(key))

    def compare_and_set(self, key: str, expected: int | None, new: VersionedData) -> CaSResult:
        return self.handle.run(
            f"consensus compare_and_set {key!r} (expected {expected}, new {new.seqno})",
            lambda: self.inner.compare_and_set(key, expected, new),
        )

    def scan(self, key: str, from_seqno: int, limit: int) -> list[VersionedData]:
        return self.handle.run(
            f"consensus scan {key!r}", lambda: self.inner.scan(key, from_seqno, limit)
        )

    def truncate(self, key: str, seqno: int) -> int:
        return self.handle.run(
            f"consensus truncate {key!r} to {seqno}", lambda: self.inner.truncate(key, seqno)
        )

    def list_keys(self) -> Iterator[str]:
        keys = self.handle.run("consensus list_keys", lambda: list(self.inner.list_keys()))
        yield from keys

    def wait_for_change(self, key: str, seqno: int | None, timeout_s: float) -> None:
        # A hint only (callers re-read the head), so no faults here.
        self.inner.wait_for_change(key, seqno, timeout_s)

    def close(self) -> None:
        self.inner.close()

    def describe(self) -> str:
        return f"unreliable({self.inner.describe()})"

    def __repr__(self) -> str:
        return f"UnreliableConsensus({self.inner.describe()}, seed={self.handle.seed})"
