"""Fault injection the histories need on top of ``persist_lib.location.unreliable``.

``PartitioningHandle`` is an ``UnreliableHandle`` (same seeded per-call faults, same
counters) that can also be **totally unavailable for a while** (an outage), and that
starts such an outage, with probability ``partition_after_timeout``, right after it
injected a timeout: a timeout is often the first sign of a partition that persists.
That correlation is what exercises the hardest path of the state machine: a
compare-and-set applied then timed out, followed by re-reads that fail until the
retry deadline passes (the operation's outcome must then be reported as unknown).
Outages end by time, checked on every call (no timer threads).
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

from persist_lib.errors import Determinate, Indeterminate
from persist_lib.location.base import CaSResult, Consensus, VersionedData
from persist_lib.location.unreliable import FaultRates, UnreliableHandle

T = TypeVar("T")


class PartitioningHandle(UnreliableHandle):
    """Per-call faults plus timed total outages (scripted or following a timeout)."""

    def __init__(
        self,
        seed: int = 0,
        rates: FaultRates | None = None,
        *,
        stall_s: float = 0.01,
        partition_after_timeout: float = 0.0,
        partition_s: tuple[float, float] = (0.3, 1.5),
    ) -> None:
        super().__init__(seed, rates, stall_s=stall_s)
        self.partition_after_timeout = partition_after_timeout
        self.partition_s = partition_s
        self._normal = self._rates
        self._until = 0.0
        self._olock = threading.Lock()
        self._orng = random.Random(seed ^ 0x0DA7A)
        self.outages: list[tuple[str, float]] = []  # (kind, duration) of every outage begun
        self.enabled = True
        self.on_outage: Callable[[str, float], None] | None = None

    def in_outage(self) -> bool:
        with self._olock:
            return self._until > time.monotonic()

    def outage(self, kind: str, duration_s: float) -> bool:
        """Makes every call fail (``kind``: timeout_only | determinate) for ``duration_s``."""
        with self._olock:
            if not self.enabled or self._until > time.monotonic():
                return False
            self._until = time.monotonic() + duration_s
            self.outages.append((kind, duration_s))
        self.totally_unavailable(kind)
        if self.on_outage is not None:
            self.on_outage(kind, duration_s)
        return True

    def disable(self) -> None:
        """No more faults of any kind (for a clean shutdown)."""
        with self._olock:
            self.enabled = False
            self._until = 0.0
        self.totally_available()

    def _maybe_end_outage(self) -> None:
        with self._olock:
            if self._until and time.monotonic() >= self._until:
                self._until = 0.0
                restore = self.enabled
            else:
                return
        if restore:
            with self._lock:
                self._rates = self._normal

    def run(self, what: str, op: Callable[[], T]) -> T:
        self._maybe_end_outage()
        try:
            return super().run(what, op)
        except Indeterminate:
            if self.partition_after_timeout and self._orng.random() < self.partition_after_timeout:
                kind = self._orng.choice(["timeout_only", "determinate"])
                self.outage(kind, self._orng.uniform(*self.partition_s))
            raise


class ScriptedConsensus(Consensus):
    """A consensus whose next calls can be scripted to fail (the stateful test's faults).

    ``arm(kind)`` makes the next ``compare_and_set`` fail once: ``applied_then_timeout``
    (runs it, then raises ``Indeterminate``), ``timeout_only`` (doesn't run it, raises
    ``Indeterminate``) or ``determinate`` (doesn't run it, raises ``Determinate``).
    """

    KINDS = ("applied_then_timeout", "timeout_only", "determinate")
    # Interrupts (BaseException, like KeyboardInterrupt or a run cancellation): armed
    # only around one call by the caller, which must handle them.
    INTERRUPTS = ("applied_then_interrupt", "interrupt_before")

    def __init__(self, inner: Consensus) -> None:
        self.inner = inner
        self.armed: str | None = None
        self.fired: dict[str, int] = {k: 0 for k in (*self.KINDS, *self.INTERRUPTS)}

    def arm(self, kind: str) -> None:
        if kind not in self.KINDS and kind not in self.INTERRUPTS:
            raise ValueError(f"unknown fault {kind!r}; one of {self.KINDS + self.INTERRUPTS}")
        self.armed = kind

    def head(self, key: str) -> VersionedData | None:
        return self.inner.head(key)

    def compare_and_set(self, key: str, expected: int | None, new: VersionedData) -> CaSResult:
        kind, self.armed = self.armed, None
        if kind is None:
            return self.inner.compare_and_set(key, expected, new)
        if kind == "applied_then_interrupt":
            from persist_lib.testing.hooks import Interrupt

            res = self.inner.compare_and_set(key, expected, new)
            if res is not CaSResult.COMMITTED:
                self.armed = kind  # fire on a compare-and-set that lands
                return res
            self.fired[kind] += 1
            raise Interrupt("scripted: interrupted after the compare_and_set was applied")
        if kind == "interrupt_before":
            from persist_lib.testing.hooks import Interrupt

            self.fired[kind] += 1
            raise Interrupt("scripted: interrupted before the compare_and_set was run")
        self.fired[kind] += 1
        if kind == "applied_then_timeout":
            self.inner.compare_and_set(key, expected, new)
            raise Indeterminate("scripted: timeout after the compare_and_set was applied")
        if kind == "timeout_only":
            raise Indeterminate("scripted: timeout (the compare_and_set was not run)")
        raise Determinate("scripted: determinate failure (the compare_and_set was not run)")

    def scan(self, key: str, from_seqno: int, limit: int) -> list[VersionedData]:
        return self.inner.scan(key, from_seqno, limit)

    def truncate(self, key: str, seqno: int) -> int:
        return self.inner.truncate(key, seqno)

    def list_keys(self) -> Iterator[str]:
        return self.inner.list_keys()

    def wait_for_change(self, key: str, seqno: int | None, timeout_s: float) -> None:
        self.inner.wait_for_change(key, seqno, timeout_s)

    def close(self) -> None:
        self.inner.close()

    def describe(self) -> str:
        return self.inner.describe()
