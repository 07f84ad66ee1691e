"""The two location contracts persist is built on (docs/design.md section 4).

``Blob``: a durable ``key -> bytes`` store whose keys are written once. ``set`` is
atomic (a reader sees the old value or the new one, never a part), ``delete`` is
idempotent and ``list_keys_and_metadata`` lists a prefix.

``Consensus``: a durable, per-key linearizable log of ``(seqno, bytes)``.
``compare_and_set(key, expected, new)`` appends ``new`` at ``new.seqno`` iff the
current head is ``expected`` (``None``: the key has no entries yet) and
``new.seqno == expected + 1`` (seqnos are contiguous; that is what makes the SQL
implementations safe under READ COMMITTED). ``truncate`` removes entries below a
seqno but never the head.

Every backend raises ``Determinate`` when an operation definitely did not happen and
``Indeterminate`` when it may have. Contract: ``tests/test_location_contract.py``.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum

from persist_lib.errors import InvalidUsage


@dataclass(frozen=True)
class BlobMetadata:
    """A listed blob: its key, size in bytes and last-modified time (ms since epoch)."""

    key: str
    size_in_bytes: int
    last_modified_ms: int


@dataclass(frozen=True)
class VersionedData:
    """One consensus log entry."""

    seqno: int
    data: bytes


class CaSResult(Enum):
    COMMITTED = "committed"
    EXPECTATION_MISMATCH = "expectation_mismatch"


class Blob(abc.ABC):
    """A durable key-value store of write-once blobs."""

    @abc.abstractmethod
    def get(self, key: str) -> bytes | None:
        """The value of ``key``, or ``None`` if it doesn't exist."""

    def get_range(self, key: str, start: int, end: int) -> bytes | None:
        """Bytes ``[start, end)`` of ``key``'s value (fewer when the value is shorter),
        or ``None`` if it doesn't exist.

        Backends that can read a byte range (file, S3 ``Range``, memory) override this;
        the default fetches the whole value and slices it (correct, not cheaper)."""
        check_range(key, start, end)
        data = self.get(key)
        return None if data is None else bytes(data[start:end])

    @abc.abstractmethod
    def set(self, key: str, value: bytes) -> None:
        """Atomically writes ``value`` at ``key`` (readers see old or new, never part)."""

    @abc.abstractmethod
    def delete(self, key: str) -> int | None:
        """Deletes ``key`` if present (idempotent); returns the size deleted, if known."""

    @abc.abstractmethod
    def list_keys_and_metadata(self, prefix: str) -> Iterator[BlobMetadata]:
        """Every blob whose key starts with ``prefix``."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Releases connections/threads held by the backend."""

    def describe(self) -> str:
        """A redacted, human-readable description (for logs and errors)."""
        return type(self).__name__


def check_range(key: str, start: int, end: int) -> None:
    """Raises ``InvalidUsage`` unless ``0 <= start <= end`` (integers)."""
    if (
        isinstance(start, bool)
        or isinstance(end, bool)
        or not isinstance(start, int)
        or not isinstance(end, int)
        or not 0 <= start <= end
    ):
        raise InvalidUsage(
            f"blob get_range of {key!r}: the range must be integers 0 <= start <= end, got "
            f"[{start!r}, {end!r})"
        )


class Consensus(abc.ABC):
    """A durable, linearizable log of ``(seqno, data)`` per key."""

    @abc.abstractmethod
    def head(self, key: str) -> VersionedData | None:
        """The latest entry of ``key``, or ``None`` if it has none."""

    @abc.abstractmethod
    def compare_and_set(
        self, key: str, expected: int | None, new: VersionedData
    ) -> CaSResult:
        """Appends ``new`` iff the head seqno equals ``expected`` (``None``: no entries).

        ``new.seqno`` must be ``expected + 1`` (any seqno >= 0 when ``expected`` is
        ``None``); anything else is an ``InvalidUsage``.
        """

    @abc.abstractmethod
    def scan(self, key: str, from_seqno: int, limit: int) -> list[VersionedData]:
        """Up to ``limit`` entries with ``seqno >= from_seqno``, in ascending order."""

    @abc.abstractmethod
    def truncate(self, key: str, seqno: int) -> int:
        """Deletes entries with ``seqno < seqno``; never the head.

        Raises ``InvalidUsage`` if ``seqno`` is beyond the head (or the key is empty).
        Returns the number of entries deleted (0 if already truncated: idempotent).
        """

    @abc.abstractmethod
    def list_keys(self) -> Iterator[str]:
        """Every key with at least one entry."""

    def wait_for_change(self, key: str, seqno: int | None, timeout_s: float) -> None:
        """Blocks until ``key``'s head may be beyond ``seqno`` or ``timeout_s`` passes.

        A hint only: callers re-read the head afterwards. The default implementation
        polls; backends with a push channel (Postgres LISTEN/NOTIFY) do better.
        """
        deadline = time.monotonic() + timeout_s
        sleep = 0.005
        while True:
            h = self.head(key)
            if (h.seqno if h else None) != seqno:
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            time.sleep(min(sleep, remaining))
            sleep = min(sleep * 2, 0.25)

    def close(self) -> None:  # noqa: B027 - optional hook
        """Releases connections/threads held by the backend."""

    def describe(self) -> str:
        """A redacted, human-readable description (for logs and errors)."""
        return type(self).__name__
