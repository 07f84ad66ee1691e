"""Retries of location operations with exponential backoff, jitter and a deadline.

Backends report *what may have happened* (``Determinate``: nothing; ``Indeterminate``:
maybe). Whether that is retryable depends on the operation, so the decision lives
here, in one place, instead of in every backend:

- every Blob operation is idempotent (keys are written once, ``delete`` is idempotent),
  so ``RetryingBlob`` retries both kinds;
- ``Consensus.head/scan/list_keys/truncate`` are idempotent too;
- ``Consensus.compare_and_set`` is *not*: after an ``Indeterminate`` CAS a blind retry
  could report a mismatch for a write that in fact committed. ``RetryingConsensus``
  retries only ``Determinate`` CAS failures and lets ``Indeterminate`` reach the caller,
  which resolves it by re-reading the head (docs/design.md section 5).

Time and randomness are injectable (``sleep``, ``clock``, ``rng``) so tests are fast
and deterministic.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from persist_lib.errors import Determinate, ExternalError, Indeterminate, InvalidUsage
from persist_lib.location.base import (
    Blob,
    BlobMetadata,
    CaSResult,
    Consensus,
    VersionedData,
)

__all__ = ["RetryPolicy", "RetryingBlob", "RetryingConsensus", "retry_external"]

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class RetryPolicy:
    """Exponential backoff with jitter, bounded by a total deadline.

    The n-th sleep is ``min(initial * multiplier**n, max)`` scaled by a random factor in
    ``[1 - jitter, 1]`` (``jitter=0``: no randomness; ``jitter=1``: "full jitter").
    Retrying stops once ``deadline_s`` has passed since the first attempt (a sleep never
    overshoots the deadline); the last error is then re-raised, naming the operation.
    """

    initial_backoff_s: float = 0.005
    max_backoff_s: float = 1.0
    multiplier: float = 2.0
    deadline_s: float = 60.0
    jitter: float = 0.5
    sleep: Callable[[float], None] = time.sleep
    clock: Callable[[], float] = time.monotonic
    rng: random.Random = field(default_factory=random.Random)

    def __post_init__(self) -> None:
        if self.initial_backoff_s < 0 or self.max_backoff_s < 0:
            raise InvalidUsage(
                f"retry backoffs must be >= 0, got initial={self.initial_backoff_s} "
                f"max={self.max_backoff_s}"
            )
        if self.multiplier < 1:
            raise InvalidUsage(f"retry multiplier must be >= 1, got {self.multiplier}")
        if self.deadline_s < 0:
            raise InvalidUsage(f"retry deadline must be >= 0, got {self.deadline_s}")
        if not 0 <= self.jitter <= 1:
            raise InvalidUsage(f"retry jitter must be in [0, 1], got {self.jitter}")

    def backoff(self, attempt: int) -> float:
        """The sleep after failed attempt number ``attempt`` (0-based), before jitter."""
        b = self.initial_backoff_s * (self.multiplier ** min(attempt, 64))
        return min(b, self.max_backoff_s)

    def jittered(self, attempt: int) -> float:
        b = self.backoff(attempt)
        return b * (1.0 - self.jitter * self.rng.random())


def retry_external(
    fn: Callable[[], T],
    what: str,
    policy: RetryPolicy | None = None,
    *,
    retry_indeterminate: bool,
) -> T:
    """Runs ``fn``, retrying ``Determinate`` (and, if allowed, ``Indeterminate``) errors.

    ``what`` describes the operation for log lines and the final error message
    (e.g. ``"consensus head of 's0123'"``). Usage errors and any other exception are
    never retried. When the deadline passes, the last error is re-raised as the same
    class with a message naming ``what`` and the number of attempts.
    """
    policy = policy or RetryPolicy()
    start = policy.clock()
    attempt = 0
    while True:
        try:
            return fn()
        except (Determinate, Indeterminate) as e:
            if isinstance(e, Indeterminate) and not retry_indeterminate:
                raise
            elapsed = policy.clock() - start
            remaining = policy.deadline_s - elapsed
            if remaining <= 0:
                raise _exhausted(e, what, attempt + 1, elapsed) from e
            delay = min(policy.jittered(attempt), remaining)
            log.debug(
                "%s failed (attempt %d, %s), retrying in %.3fs: %s",
                what,
                attempt + 1,
                type(e).__name__,
                delay,
                e,
            )
            attempt += 1
            policy.sleep(delay)


def _exhausted(e: ExternalError, what: str, attempts: int, elapsed: float) -> ExternalError:
    msg = f"{what}: still failing after {attempts} attempt(s) over {elapsed:.1f}s, giving up: {e}"
    try:
        return type(e)(msg)
    except TypeError:  # a subclass with another constructor: keep the kind
        return Indeterminate(msg) if isinstance(e, Indeterminate) else Determinate(msg)


class RetryingBlob(Blob):
    """A Blob whose operations are retried (both error kinds: blob ops are idempotent).

    With ``metrics`` (a ``persist_lib.shard.metrics.PersistMetrics``) every attempt is counted
    as a request of the shard its key starts with, and the bytes moved once it succeeded."""

    def __init__(self, inner: Blob, policy: RetryPolicy | None = None, metrics: Any = None) -> None:
        self.inner = inner
        self.policy = policy or RetryPolicy()
        self.metrics = metrics

    def _r(self, fn: Callable[[], T], what: str) -> T:
        return retry_external(fn, what, self.policy, retry_indeterminate=True)

    def get(self, key: str) -> bytes | None:
        m = self.metrics
        if m is None:
            return self._r(lambda: self.inner.get(key), f"blob get {key!r} from {self.describe()}")

        def attempt() -> bytes | None:
            m.on_get(key)
            return self.inner.get(key)

        data = self._r(attempt, f"blob get {key!r} from {self.describe()}")
        if data is not None:
            m.blob_read(key, len(data))
        return data

    def get_range(self, key: str, start: int, end: int) -> bytes | None:
        m = self.metrics
        what = f"blob get {key!r} bytes [{start}, {end}) from {self.describe()}"
        if m is None:
            return self._r(lambda: self.inner.get_range(key, start, end), what)

        def attempt() -> bytes | None:
            m.on_get(key)
            return self.inner.get_range(key, start, end)

        data = self._r(attempt, what)
        if data is not None:
            m.blob_read(key, len(data))
        return data

    def set(self, key: str, value: bytes) -> None:
        m = self.metrics
        if m is None:
            self._r(lambda: self.inner.set(key, value), f"blob set {key!r} in {self.describe()}")
            return

        def attempt() -> None:
            m.on_put(key, len(value))
            self.inner.set(key, value)

        self._r(attempt, f"blob set {key!r} in {self.describe()}")
        m.blob_written(key, len(value))

    def delete(self, key: str) -> int | None:
        m = self.metrics

        def attempt() -> int | None:
            if m is not None:
                m.on_delete(key)
            return self.inner.delete(key)

        return self._r(attempt, f"blob delete {key!r} from {self.describe()}")

    def list_keys_and_metadata(self, prefix: str) -> Iterator[BlobMetadata]:
        m = self.metrics

        def attempt() -> list[BlobMetadata]:
            got = list(self.inner.list_keys_and_metadata(prefix))
            if m is not None:
                m.on_list(prefix, len(got))
            return got

        # Materialized so a failure half-way is retried as a whole, not mid-iteration.
        items = self._r(attempt, f"blob list {prefix!r} in {self.describe()}")
        yield from items

    def close(self) -> None:
        self.inner.close()

    def describe(self) -> str:
        return self.inner.describe()

    def __repr__(self) -> str:
        return f"RetryingBlob({self.inner.describe()})"


class RetryingConsensus(Consensus):
    """A Consensus whose idempotent operations are retried; CAS only on ``Determinate``."""

    def __init__(self, inner: Consensus, policy: RetryPolicy | None = None) -> None:
        self.inner = inner
        self.policy = policy or RetryPolicy()

    def _r(self, fn: Callable[[], T], what: str) -> T:
        return retry_external(fn, what, self.policy, retry_indeterminate=True)

    def head(self, key: str) -> VersionedData | None:
        return self._r(lambda: self.inner.head(key), f"consensus head of {key!r}")

    def compare_and_set(self, key: str, expected: int | None, new: VersionedData) -> CaSResult:
        return retry_external(
            lambda: self.inner.compare_and_set(key, expected, new),
            f"consensus compare_and_set of {key!r} (expected {expected}, new {new.seqno})",
            self.policy,
            retry_indeterminate=False,
        )

    def scan(self, key: str, from_seqno: int, limit: int) -> list[VersionedData]:
        return self._r(
            lambda: self.inner.scan(key, from_seqno, limit),
            f"consensus scan of {key!r} from {from_seqno}",
        )

    def truncate(self, key: str, seqno: int) -> int:
        return self._r(
            lambda: self.inner.truncate(key, seqno), f"consensus truncate of {key!r} to {seqno}"
        )

    def list_keys(self) -> Iterator[str]:
        keys = self._r(lambda: list(self.inner.list_keys()), "consensus list_keys")
        yield from keys

    def wait_for_change(self, key: str, seqno: int | None, timeout_s: float) -> None:
        self.inner.wait_for_change(key, seqno, timeout_s)

    def close(self) -> None:
        self.inner.close()

    def describe(self) -> str:
        return self.inner.describe()

    def __repr__(self) -> str:
        return f"RetryingConsensus({self.inner.describe()})"
