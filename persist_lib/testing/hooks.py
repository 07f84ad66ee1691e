"""Fault hooks beyond location errors: interrupts, clock skew, failing heartbeats.

The location wrappers (``location.unreliable``) make Blob and Consensus calls fail; the
faults here hit the *client* instead, where the review found data-loss paths that no
location error produces:

* ``Interrupt`` / ``Cancelled``: BaseException subclasses shaped like KeyboardInterrupt
  and Dagster's run cancellation (``dagster.DagsterExecutionInterruptedError`` derives
  from BaseException). ``InterruptingConsensus`` / ``InterruptingBlob`` raise them at a
  seeded random point of a call: *before* it runs, or *after* it has taken effect (a
  CAS that landed, a blob that was written), which is the case that matters.
* ``clock_skew``: shifts a ``PersistConfig``'s clock, so an actor (a writer, or the
  sweeper, GC and lease expiry) runs ahead of or behind the others and the store.

Test-only: no library code imports this module.
"""

from __future__ import annotations

import contextlib
import random
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from persist_lib.config import PersistConfig
from persist_lib.location.base import Blob, BlobMetadata, CaSResult, Consensus, VersionedData

T = TypeVar("T")


class Interrupt(BaseException):  # noqa: N818 - named like KeyboardInterrupt
    """A KeyboardInterrupt-like interrupt raised inside a client call."""


class Cancelled(BaseException):  # noqa: N818 - named like a run cancellation
    """A run-cancellation-like BaseException (Dagster's derives from BaseException)."""


INTERRUPTS: tuple[type[BaseException], ...] = (Interrupt, Cancelled)


@contextlib.contextmanager
def clock_skew(config: PersistConfig, skew_ms: int) -> Iterator[None]:
    """Runs the block with ``config``'s clock shifted by ``skew_ms`` (may be negative)."""
    orig = config.now_ms
    config.now_ms = lambda: orig() + skew_ms
    try:
        yield
    finally:
        config.now_ms = orig


def skewed_clock(base: Callable[[], int], skew_ms: int) -> Callable[[], int]:
    """A clock ``skew_ms`` ahead of (or behind) ``base``."""
    return lambda: base() + skew_ms


class InterruptPlan:
    """Decides, from a seeded RNG, whether and where the next call is interrupted."""

    def __init__(
        self,
        seed: int,
        rate: float,
        kinds: tuple[type[BaseException], ...] = INTERRUPTS,
        *,
        main_thread_only: bool = False,
        limit: int | None = None,
    ) -> None:
        self.rng = random.Random(seed)
        self.limit = limit  # interrupts to raise at most (None: no limit)
        self.rate = rate
        self.kinds = kinds
        # Interrupts reach a program's main thread (KeyboardInterrupt, a cancellation);
        # background threads (uploads, heartbeats, compaction) are not interrupted.
        self.main_thread_only = main_thread_only
        self.enabled = True
        self.lock = threading.Lock()
        self.counts: dict[str, int] = {"before": 0, "after": 0}

    def draw(self) -> tuple[str, type[BaseException]] | None:
        """``None``, or (``"before"``/``"after"``, the exception type to raise)."""
        if self.main_thread_only and threading.current_thread() is not threading.main_thread():
            return None
        with self.lock:
            if not self.enabled or self.rng.random() >= self.rate:
                return None
            if self.limit is not None and sum(self.counts.values()) >= self.limit:
                return None
            where = "after" if self.rng.random() < 0.5 else "before"
            self.counts[where] += 1
            return where, self.kinds[self.rng.randrange(len(self.kinds))]

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        with self.lock:
            prev, self.enabled = self.enabled, False
        try:
            yield
        finally:
            with self.lock:
                self.enabled = prev


def _interrupting(plan: InterruptPlan, what: str, fn: Callable[[], T]) -> T:
    d = plan.draw()
    if d is None:
        return fn()
    where, kind = d
    if where == "before":
        raise kind(f"interrupted before {what}")
    fn()
    raise kind(f"interrupted after {what} took effect")


class InterruptingConsensus(Consensus):
    """Raises an interrupt before or after (the CAS having landed) a mutating call."""

    def __init__(self, inner: Consensus, plan: InterruptPlan) -> None:
        self.inner = inner
        self.plan = plan

    def describe(self) -> str:
        return self.inner.describe()

    def head(self, key: str) -> VersionedData | None:
        return self.inner.head(key)

    def compare_and_set(self, key: str, expected: int | None, new: VersionedData) -> CaSResult:
        return _interrupting(
            self.plan, f"compare_and_set({key}, {expected})",
            lambda: self.inner.compare_and_set(key, expected, new),
        )

    def scan(self, key: str, from_seqno: int, limit: int) -> list[VersionedData]:
        return self.inner.scan(key, from_seqno, limit)

    def truncate(self, key: str, seqno: int) -> int:
        return _interrupting(
            self.plan, f"truncate({key}, {seqno})", lambda: self.inner.truncate(key, seqno)
        )

    def list_keys(self) -> Iterator[str]:
        return self.inner.list_keys()

    def wait_for_change(self, key: str, seqno: int | None, timeout_s: float) -> None:
        self.inner.wait_for_change(key, seqno, timeout_s)

    def close(self) -> None:
        self.inner.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class InterruptingBlob(Blob):
    """Raises an interrupt before or after (the blob written) a ``set``."""

    def __init__(self, inner: Blob, plan: InterruptPlan) -> None:
        self.inner = inner
        self.plan = plan

    def describe(self) -> str:
        return self.inner.describe()

    def get(self, key: str) -> bytes | None:
        return self.inner.get(key)

    def set(self, key: str, value: bytes) -> None:
        _interrupting(self.plan, f"blob set {key}", lambda: self.inner.set(key, value))

    def delete(self, key: str) -> int | None:
        return self.inner.delete(key)

    def list_keys_and_metadata(self, prefix: str) -> Iterator[BlobMetadata]:
        return self.inner.list_keys_and_metadata(prefix)

    def close(self) -> None:
        self.inner.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
