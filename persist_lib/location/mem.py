"""In-process Blob and Consensus (``mem://NAME``), for tests and measuring overhead.

Instances with the same name share their data within a process (like a tiny server),
so two clients opened on ``mem://x`` see one another.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

from persist_lib.errors import InvalidUsage
from persist_lib.location.base import (
    Blob,
    BlobMetadata,
    CaSResult,
    Consensus,
    VersionedData,
    check_range,
)


class _MemBlobData:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.data: dict[str, tuple[bytes, int]] = {}


class _MemConsensusData:
    def __init__(self) -> None:
        self.lock = threading.Condition()
        self.data: dict[str, list[VersionedData]] = {}


_BLOBS: dict[str, _MemBlobData] = {}
_CONSENSUS: dict[str, _MemConsensusData] = {}
_REGISTRY_LOCK = threading.Lock()


class MemBlob(Blob):
    def __init__(self, name: str = "default") -> None:
        with _REGISTRY_LOCK:
            self._d = _BLOBS.setdefault(name, _MemBlobData())
        self.name = name

    def get(self, key: str) -> bytes | None:
        with self._d.lock:
            v = self._d.data.get(key)
        return None if v is None else v[0]

    def get_range(self, key: str, start: int, end: int) -> bytes | None:
        check_range(key, start, end)
        with self._d.lock:
            v = self._d.data.get(key)
        return None if v is None else v[0][start:end]

    def set(self, key: str, value: bytes) -> None:
        with self._d.lock:
            self._d.data[key] = (bytes(value), int(time.time() * 1000))

    def delete(self, key: str) -> int | None:
        with self._d.lock:
            v = self._d.data.pop(key, None)
        return None if v is None else len(v[0])

    def list_keys_and_metadata(self, prefix: str) -> Iterator[BlobMetadata]:
        with self._d.lock:
            items = [(k, v) for k, v in self._d.data.items() if k.startswith(prefix)]
        for k, (b, ts) in sorted(items):
            yield BlobMetadata(k, len(b), ts)

    def describe(self) -> str:
        return f"mem://{self.name}"


class MemConsensus(Consensus):
    def __init__(self, name: str = "default") -> None:
        with _REGISTRY_LOCK:
            self._d = _CONSENSUS.setdefault(name, _MemConsensusData())
        self.name = name

    def head(self, key: str) -> VersionedData | None:
        with self._d.lock:
            log = self._d.data.get(key)
            return log[-1] if log else None

    def compare_and_set(self, key: str, expected: int | None, new: VersionedData) -> CaSResult:
        _check_cas_args(key, expected, new)
        with self._d.lock:
            log = self._d.data.setdefault(key, [])
            head = log[-1].seqno if log else None
            if head != expected:
                return CaSResult.EXPECTATION_MISMATCH
            log.append(VersionedData(new.seqno, bytes(new.data)))
            self._d.lock.notify_all()
            return CaSResult.COMMITTED

    def scan(self, key: str, from_seqno: int, limit: int) -> list[VersionedData]:
        if limit <= 0:
            raise InvalidUsage(f"scan limit must be positive, got {limit}")
        with self._d.lock:
            log = self._d.data.get(key, [])
            return [e for e in log if e.seqno >= from_seqno][:limit]

    def truncate(self, key: str, seqno: int) -> int:
        with self._d.lock:
            log = self._d.data.get(key)
            if not log:
                raise InvalidUsage(f"consensus key {key!r}: cannot truncate an empty log")
            if seqno > log[-1].seqno:
                raise InvalidUsage(
                    f"consensus key {key!r}: cannot truncate to {seqno}, beyond the head "
                    f"{log[-1].seqno}"
                )
            keep = [e for e in log if e.seqno >= seqno]
            n = len(log) - len(keep)
            self._d.data[key] = keep
            return n

    def list_keys(self) -> Iterator[str]:
        with self._d.lock:
            keys = [k for k, v in self._d.data.items() if v]
        yield from sorted(keys)

    def wait_for_change(self, key: str, seqno: int | None, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with self._d.lock:
            while True:
                log = self._d.data.get(key)
                head = log[-1].seqno if log else None
                remaining = deadline - time.monotonic()
                if head != seqno or remaining <= 0:
                    return
                self._d.lock.wait(remaining)

    def describe(self) -> str:
        return f"mem://{self.name}"


def _check_cas_args(key: str, expected: int | None, new: VersionedData) -> None:
    """Shared argument validation of ``compare_and_set`` for every backend."""
    if expected is None:
        if new.seqno < 0:
            raise InvalidUsage(f"consensus key {key!r}: seqno must be >= 0, got {new.seqno}")
    elif new.seqno != expected + 1:
        raise InvalidUsage(
            f"consensus key {key!r}: new seqno {new.seqno} must be expected + 1 = {expected + 1}"
        )
