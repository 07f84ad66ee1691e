"""Location wrappers that make a history checkable after the fact.

``AuditConsensus`` archives every consensus entry before a ``truncate`` can remove it,
so the checker can replay the *whole* state history from seqno 1 even though GC
truncates the log. Entries are immutable once committed, so archiving whatever is
present is always correct, and an archived entry that later reads differently is
itself a violation (history was rewritten, e.g. a truncate that deleted the head).

``AuditBlob`` logs every delete with the key, the time and the consensus head seqno
read just *before* the delete (the delete audit), and keeps a copy of the deleted
bytes in a separate "graveyard" blob, so the checker can still decode a part that
compaction and GC legitimately removed. The graveyard is invisible to the system.

Both sit *below* the fault-injecting wrappers (closest to the real backend), so they
see what really happened, including operations applied-then-timed-out.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import threading
import time
from collections.abc import Iterator

from persist_lib.errors import Determinate
from persist_lib.location.base import Blob, BlobMetadata, CaSResult, Consensus, VersionedData
from persist_lib.testing.history import EventLog

ARCHIVE_PAGE = 1024


class AuditConsensus(Consensus):
    """Passes everything through; archives the log before each truncate."""

    def __init__(self, inner: Consensus, archive_path: str, log: EventLog | None = None) -> None:
        self.inner = inner
        self.archive_path = archive_path
        self.log = log
        self._archived: dict[str, set[int]] = {}
        self._lock = threading.Lock()
        self.truncations = 0
        self.head_regressions = 0

    def archive(self, key: str) -> int:
        """Appends every entry of ``key`` not yet archived by this process; returns how many."""
        lines: list[bytes] = []
        seen = self._archived.setdefault(key, set())
        frm = 0
        while True:
            page = self.inner.scan(key, frm, ARCHIVE_PAGE)
            for e in page:
                if e.seqno in seen:
                    continue
                seen.add(e.seqno)
                rec = {
                    "key": key,
                    "seqno": e.seqno,
                    "sha": hashlib.sha256(e.data).hexdigest(),
                    "data": base64.b64encode(e.data).decode("ascii"),
                    "mono": time.monotonic(),
                }
                lines.append((json.dumps(rec, separators=(",", ":")) + "\n").encode())
            if len(page) < ARCHIVE_PAGE:
                break
            frm = page[-1].seqno + 1
        if lines:
            fd = os.open(self.archive_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                for line in lines:
                    os.write(fd, line)
            finally:
                os.close(fd)
        return len(lines)

    def head(self, key: str) -> VersionedData | None:
        return self.inner.head(key)

    def compare_and_set(self, key: str, expected: int | None, new: VersionedData) -> CaSResult:
        res = self.inner.compare_and_set(key, expected, new)
        if res is CaSResult.EXPECTATION_MISMATCH and expected is not None:
            # A mismatch means the head moved past ``expected``. A head *below* it means the
            # log lost its head (it can't happen with a correct backend): record it, and
            # fail the call rather than let the caller re-read and retry forever.
            h = self.inner.head(key)
            if h is None or h.seqno < expected:
                self.head_regressions += 1
                if self.log is not None:
                    self.log.note(
                        "consensus_head_regressed",
                        key=key,
                        expected=expected,
                        head=h.seqno if h is not None else None,
                    )
                raise Determinate(
                    f"audit: consensus head of {key!r} is {h.seqno if h else None}, below the "
                    f"expected {expected}: the log lost entries"
                )
        return res

    def scan(self, key: str, from_seqno: int, limit: int) -> list[VersionedData]:
        return self.inner.scan(key, from_seqno, limit)

    def truncate(self, key: str, seqno: int) -> int:
        with self._lock:
            self.archive(key)
            self.truncations += 1
        return self.inner.truncate(key, seqno)

    def list_keys(self) -> Iterator[str]:
        return self.inner.list_keys()

    def wait_for_change(self, key: str, seqno: int | None, timeout_s: float) -> None:
        self.inner.wait_for_change(key, seqno, timeout_s)

    def close(self) -> None:
        self.inner.close()

    def describe(self) -> str:
        return self.inner.describe()


class AuditBlob(Blob):
    """Passes everything through; logs each delete and keeps the deleted bytes."""

    def __init__(
        self, inner: Blob, graveyard: Blob, consensus: Consensus, log: EventLog | None
    ) -> None:
        self.inner = inner
        self.graveyard = graveyard
        self.consensus = consensus  # fault-free: reads the head for the delete audit
        self.log = log
        self.deletes = 0

    def get(self, key: str) -> bytes | None:
        return self.inner.get(key)

    def set(self, key: str, value: bytes) -> None:
        self.inner.set(key, value)

    def delete(self, key: str) -> int | None:
        data = self.inner.get(key)
        if data is not None and self.graveyard.get(key) is None:
            self.graveyard.set(key, data)
        shard = key.split("/", 1)[0]
        head = self.consensus.head(shard)
        if self.log is not None:
            self.log.note(
                "blob_delete",
                key=key,
                head_before=head.seqno if head is not None else None,
                existed=data is not None,
            )
        self.deletes += 1
        return self.inner.delete(key)

    def list_keys_and_metadata(self, prefix: str) -> Iterator[BlobMetadata]:
        return self.inner.list_keys_and_metadata(prefix)

    def close(self) -> None:
        self.inner.close()
        self.graveyard.close()

    def describe(self) -> str:
        return self.inner.describe()
