"""The location contract: one suite that every Blob and Consensus backend must pass.

A port of Materialize's ``blob_impl_test`` / ``consensus_impl_test``
(research/reliability.md section 1), run against every backend through the
``blob_uri`` / ``consensus_uri`` fixtures (mem, file, s3 via moto; mem, sqlite, postgres
via a throwaway server), plus the wrappers (retry, unreliable) and the error semantics
each backend promises (what is ``Determinate`` and what is ``Indeterminate``).
"""

from __future__ import annotations

import errno
import logging
import multiprocessing
import os
import random
import socket
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from persist_lib.errors import Determinate, Indeterminate, InvalidBlobKey, InvalidUsage
from persist_lib.location import (
    Blob,
    CaSResult,
    Consensus,
    FaultRates,
    FileBlob,
    MemBlob,
    MemConsensus,
    RetryingBlob,
    RetryingConsensus,
    RetryPolicy,
    SqliteConsensus,
    UnreliableBlob,
    UnreliableConsensus,
    UnreliableHandle,
    VersionedData,
    open_blob,
    open_consensus,
    retry_external,
)
from tests.support.threads import run_threads

COMMITTED = CaSResult.COMMITTED
MISMATCH = CaSResult.EXPECTATION_MISMATCH


@pytest.fixture
def blob(blob_uri: str) -> Iterator[Blob]:
    b = open_blob(blob_uri)
    yield b
    b.close()


@pytest.fixture
def consensus(consensus_uri: str) -> Iterator[Consensus]:
    c = open_consensus(consensus_uri)
    yield c
    c.close()


# -- Blob contract --------------------------------------------------------------------


def test_blob_get_set_overwrite_delete(blob: Blob) -> None:
    assert blob.get("k0") is None
    assert list(blob.list_keys_and_metadata("")) == []
    blob.set("k0", b"v0")
    assert blob.get("k0") == b"v0"
    blob.set("k0", b"v1-longer")  # overwrite
    assert blob.get("k0") == b"v1-longer"
    deleted = blob.delete("k0")
    assert deleted in (len(b"v1-longer"), None)  # the size, if the backend knows it
    assert deleted == len(b"v1-longer")  # every backend here does
    assert blob.get("k0") is None
    assert blob.delete("k0") is None  # idempotent
    assert blob.delete("never-existed") is None
    blob.set("empty", b"")
    assert blob.get("empty") == b""
    assert blob.delete("empty") == 0


def test_blob_get_range(blob: Blob) -> None:
    """Ranged reads (issue 28): bytes [start, end) of a value, fewer past its end, None
    for a missing key, a usage error for a malformed range."""
    data = bytes(range(256)) * 40  # 10 KiB
    assert blob.get_range("r0", 0, 10) is None
    blob.set("r0", data)
    for a, b in [(0, 1), (0, len(data)), (100, 5000), (len(data) - 3, len(data)), (7, 7)]:
        assert blob.get_range("r0", a, b) == data[a:b], (a, b)
    assert blob.get_range("r0", len(data) - 4, len(data) + 100) == data[-4:]
    assert blob.get_range("r0", len(data) + 10, len(data) + 20) == b""
    for a, b in [(-1, 3), (5, 4), (0.5, 3)]:
        with pytest.raises(InvalidUsage, match="0 <= start <= end"):
            blob.get_range("r0", a, b)  # type: ignore[arg-type]
    blob.delete("r0")
    assert blob.get_range("r0", 0, 10) is None


def test_blob_reopen_sees_same_data(blob_uri: str) -> None:
    a = open_blob(blob_uri)
    a.set("shard-1/part-1", b"durable")
    a.close()
    b = open_blob(blob_uri)
    assert b.get("shard-1/part-1") == b"durable"
    assert [m.key for m in b.list_keys_and_metadata("")] == ["shard-1/part-1"]
    b.close()


def test_blob_list_keys_and_prefixes(blob: Blob) -> None:
    values = {
        "s1/batch/p1": b"a" * 3,
        "s1/batch/p2": b"b" * 5,
        "s1/rollup/r1": b"c",
        "s2/batch/p1": b"dd",
        "s10/x": b"e",
    }
    for k, v in values.items():
        blob.set(k, v)
    listed = {m.key: m for m in blob.list_keys_and_metadata("")}
    assert set(listed) == set(values)
    assert all(listed[k].size_in_bytes == len(v) for k, v in values.items())
    now_ms = time.time() * 1000
    assert all(abs(m.last_modified_ms - now_ms) < 3_600_000 for m in listed.values())
    assert sorted(m.key for m in blob.list_keys_and_metadata("s1/")) == [
        "s1/batch/p1",
        "s1/batch/p2",
        "s1/rollup/r1",
    ]
    # a prefix is a string prefix, not a directory: "s1" also matches "s10/..."
    assert sorted(m.key for m in blob.list_keys_and_metadata("s1")) == sorted(
        ["s1/batch/p1", "s1/batch/p2", "s1/rollup/r1", "s10/x"]
    )
    assert [m.key for m in blob.list_keys_and_metadata("s1/batch/p")] == [
        "s1/batch/p1",
        "s1/batch/p2",
    ]
    assert list(blob.list_keys_and_metadata("nope/")) == []
    blob.delete("s1/batch/p1")
    assert [m.key for m in blob.list_keys_and_metadata("s1/batch/")] == ["s1/batch/p2"]


def test_blob_values_10kib_and_20mib(blob: Blob) -> None:
    rng = random.Random(7)
    small = rng.randbytes(10 * 1024)
    big = rng.randbytes(20 * 1024 * 1024 + 123)  # > 8 MiB: the multipart path on S3
    blob.set("small", small)
    blob.set("big", big)
    assert blob.get("small") == small
    got = blob.get("big")
    assert got is not None and len(got) == len(big) and got == big
    sizes = {m.key: m.size_in_bytes for m in blob.list_keys_and_metadata("")}
    assert sizes == {"small": len(small), "big": len(big)}
    assert blob.delete("big") == len(big)


def test_blob_concurrent_sets_never_torn(blob: Blob) -> None:
    """A reader racing overwrites sees the old value or the new one, never a mix. The
    reader's failures fail the test (``run_threads``); the writer overwrites 40 times
    and, every other write, waits for the reader to have read again, so reads and writes
    interleave on every backend (on the in-memory one too, where no I/O lets go of the GIL)."""
    a, b = b"A" * 200_000, b"B" * 300_000
    done = threading.Event()
    progress = threading.Condition()
    reads = [0]

    def reader() -> None:
        while not done.is_set():
            v = blob.get("k")
            assert v is None or v == a or v == b, (
                f"torn read: {len(v)} bytes, {v.count(b'A')} A and {v.count(b'B')} B"
            )
            with progress:
                reads[0] += 1
                progress.notify_all()

    def writer() -> None:
        try:
            for i in range(40):
                blob.set("k", a if i % 2 else b)
                if i % 2:
                    with progress:
                        seen = reads[0]
                        assert progress.wait_for(lambda seen=seen: reads[0] > seen, timeout=30), "reader stalled"
        finally:
            done.set()

    run_threads([reader, writer])
    assert reads[0] >= 20
    assert blob.get("k") == a


# -- Consensus contract ---------------------------------------------------------------


def _v(seqno: int, data: bytes | None = None) -> VersionedData:
    return VersionedData(seqno, data if data is not None else f"v{seqno}".encode())


def test_consensus_empty_key(consensus: Consensus) -> None:
    assert consensus.head("k") is None
    assert consensus.scan("k", 0, 10) == []
    assert list(consensus.list_keys()) == []
    with pytest.raises(InvalidUsage, match="empty"):
        consensus.truncate("k", 0)
    # expected Some on an empty key: mismatch
    assert consensus.compare_and_set("k", 0, _v(1)) == MISMATCH
    assert consensus.compare_and_set("k", 5, _v(6)) == MISMATCH
    assert consensus.head("k") is None


def test_consensus_cas_sequence(consensus: Consensus) -> None:
    key = "shard-a"
    assert consensus.compare_and_set(key, None, _v(0)) == COMMITTED
    assert consensus.head(key) == _v(0)
    # a second first write loses
    assert consensus.compare_and_set(key, None, _v(0, b"other")) == MISMATCH
    assert consensus.compare_and_set(key, None, _v(7)) == MISMATCH
    assert consensus.head(key) == _v(0)
    assert consensus.compare_and_set(key, 0, _v(1)) == COMMITTED
    # wrong expectations, higher and lower, leave the log alone
    assert consensus.compare_and_set(key, 2, _v(3)) == MISMATCH
    assert consensus.compare_and_set(key, 0, _v(1, b"late")) == MISMATCH
    assert consensus.compare_and_set(key, -1, _v(0)) == MISMATCH
    assert consensus.head(key) == _v(1)
    # new must be expected + 1
    for bad in (_v(1), _v(3), _v(0)):
        with pytest.raises(InvalidUsage, match=r"expected \+ 1"):
            consensus.compare_and_set(key, 1, bad)
    with pytest.raises(InvalidUsage):
        consensus.compare_and_set(key, None, _v(-1))
    assert consensus.compare_and_set(key, 1, _v(2)) == COMMITTED
    assert consensus.head(key) == _v(2)


def test_consensus_first_write_at_any_seqno(consensus: Consensus) -> None:
    assert consensus.compare_and_set("k", None, _v(41)) == COMMITTED
    assert consensus.head("k") == _v(41)
    assert consensus.compare_and_set("k", 40, _v(41)) == MISMATCH
    assert consensus.compare_and_set("k", 41, _v(42)) == COMMITTED
    assert consensus.scan("k", 0, 10) == [_v(41), _v(42)]


def test_consensus_scan_bounds_and_limits(consensus: Consensus) -> None:
    key = "k"
    consensus.compare_and_set(key, None, _v(0))
    for s in range(1, 6):
        assert consensus.compare_and_set(key, s - 1, _v(s)) == COMMITTED
    assert consensus.scan(key, 0, 100) == [_v(s) for s in range(6)]
    assert consensus.scan(key, 0, 1) == [_v(0)]
    assert consensus.scan(key, 2, 2) == [_v(2), _v(3)]
    assert consensus.scan(key, 5, 10) == [_v(5)]
    assert consensus.scan(key, 6, 10) == []
    assert consensus.scan(key, -3, 2) == [_v(0), _v(1)]
    with pytest.raises(InvalidUsage):
        consensus.scan(key, 0, 0)


def test_consensus_truncate(consensus: Consensus) -> None:
    key = "k"
    consensus.compare_and_set(key, None, _v(0))
    for s in range(1, 5):
        consensus.compare_and_set(key, s - 1, _v(s))
    assert consensus.truncate(key, 2) == 2
    assert consensus.scan(key, 0, 10) == [_v(2), _v(3), _v(4)]
    assert consensus.truncate(key, 2) == 0  # idempotent
    assert consensus.truncate(key, 1) == 0  # below what is left: nothing to do
    with pytest.raises(InvalidUsage, match="beyond the head"):
        consensus.truncate(key, 5)
    assert consensus.scan(key, 0, 10) == [_v(2), _v(3), _v(4)]
    assert consensus.truncate(key, 4) == 2  # up to the head, never the head itself
    assert consensus.head(key) == _v(4)
    assert consensus.scan(key, 0, 10) == [_v(4)]
    # a stale CAS whose expected row was truncated away still loses
    assert consensus.compare_and_set(key, 2, _v(3)) == MISMATCH
    assert consensus.compare_and_set(key, None, _v(0)) == MISMATCH
    assert consensus.compare_and_set(key, 4, _v(5)) == COMMITTED
    assert consensus.scan(key, 0, 10) == [_v(4), _v(5)]


def test_consensus_keys_are_isolated_and_listed(consensus: Consensus) -> None:
    assert consensus.compare_and_set("a", None, _v(0, b"a0")) == COMMITTED
    assert consensus.compare_and_set("b", None, _v(0, b"b0")) == COMMITTED
    assert consensus.compare_and_set("a", 0, _v(1, b"a1")) == COMMITTED
    assert consensus.head("a") == _v(1, b"a1")
    assert consensus.head("b") == _v(0, b"b0")
    assert consensus.truncate("a", 1) == 1
    assert consensus.scan("b", 0, 10) == [_v(0, b"b0")]
    assert sorted(consensus.list_keys()) == ["a", "b"]
    unicode_key = "shard-\u00e9-\U0001f600"
    assert consensus.compare_and_set(unicode_key, None, _v(0)) == COMMITTED
    assert consensus.head(unicode_key) == _v(0)
    assert sorted(consensus.list_keys()) == sorted(["a", "b", unicode_key])


def test_consensus_large_and_binary_values(consensus: Consensus) -> None:
    rng = random.Random(3)
    v10k = rng.randbytes(10 * 1024)
    v1m = rng.randbytes(1024 * 1024)
    assert consensus.compare_and_set("k", None, VersionedData(0, v10k)) == COMMITTED
    assert consensus.compare_and_set("k", 0, VersionedData(1, v1m)) == COMMITTED
    assert consensus.compare_and_set("k", 1, VersionedData(2, b"")) == COMMITTED
    assert consensus.compare_and_set("k", 2, VersionedData(3, b"\x00\xff" * 7)) == COMMITTED
    assert [e.data for e in consensus.scan("k", 0, 10)] == [v10k, v1m, b"", b"\x00\xff" * 7]


def test_consensus_reopen_and_second_instance(consensus_uri: str) -> None:
    a = open_consensus(consensus_uri)
    b = open_consensus(consensus_uri)
    try:
        assert a.compare_and_set("k", None, _v(0)) == COMMITTED
        assert b.head("k") == _v(0)
        assert b.compare_and_set("k", None, _v(0)) == MISMATCH
        assert b.compare_and_set("k", 0, _v(1)) == COMMITTED
        assert a.head("k") == _v(1)
        assert a.compare_and_set("k", 0, _v(1)) == MISMATCH
    finally:
        a.close()
        b.close()
    c = open_consensus(consensus_uri)
    assert c.scan("k", 0, 10) == [_v(0), _v(1)]
    c.close()


def test_consensus_wait_for_change(consensus_uri: str) -> None:
    waiter = open_consensus(consensus_uri)
    writer = open_consensus(consensus_uri)
    try:
        assert waiter.compare_and_set("k", None, _v(0)) == COMMITTED
        t0 = time.monotonic()
        waiter.wait_for_change("k", None, timeout_s=30)  # head is already beyond None
        waiter.wait_for_change("k", 5, timeout_s=30)  # ... and not at 5
        assert time.monotonic() - t0 < 10
        t0 = time.monotonic()
        waiter.wait_for_change("k", 0, timeout_s=0.05)  # times out: no change
        assert time.monotonic() - t0 >= 0.04

        def cas_later() -> None:
            time.sleep(0.2)
            writer.compare_and_set("k", 0, _v(1))

        t = threading.Thread(target=cas_later)
        t0 = time.monotonic()
        t.start()
        waiter.wait_for_change("k", 0, timeout_s=30)
        elapsed = time.monotonic() - t0
        t.join()
        assert waiter.head("k") == _v(1)
        assert elapsed < 10, f"wait_for_change took {elapsed:.2f}s after a CAS"
    finally:
        waiter.close()
        writer.close()


def test_consensus_concurrent_threads_single_winner(consensus_uri: str) -> None:
    """Four racers, 15 attempts each: every seqno has exactly one winner, the stored data
    is the winner's, and a racer that raises fails the test (``run_threads``)."""
    c = open_consensus(consensus_uri)
    c.compare_and_set("k", None, _v(0))
    wins: list[tuple[int, int]] = []
    lock = threading.Lock()

    def worker(wid: int) -> int:
        attempts = 0
        for _ in range(15):
            h = c.head("k")
            assert h is not None
            attempts += 1
            if c.compare_and_set("k", h.seqno, _v(h.seqno + 1, f"w{wid}".encode())) == COMMITTED:
                with lock:
                    wins.append((h.seqno + 1, wid))
        return attempts

    assert run_threads([lambda i=i: worker(i) for i in range(4)]) == [15, 15, 15, 15]
    head = c.head("k")
    assert head is not None
    seqnos = sorted(s for s, _ in wins)
    assert seqnos == list(range(1, head.seqno + 1))  # gapless, one winner per seqno
    assert 15 <= len(wins) <= 60
    stored = {e.seqno: e.data for e in c.scan("k", 1, 1000)}
    assert {s: stored[s] for s, _ in wins} == {s: f"w{w}".encode() for s, w in wins}
    c.close()


# -- wrappers -------------------------------------------------------------------------


def test_wrappers_pass_the_contract_when_available(tmp_path: Path) -> None:
    handle = UnreliableHandle(seed=1)
    handle.totally_available()
    c = RetryingConsensus(UnreliableConsensus(MemConsensus(f"w-{tmp_path.name}"), handle))
    b = RetryingBlob(UnreliableBlob(FileBlob(tmp_path / "b"), handle))
    test_consensus_cas_sequence(c)
    test_consensus_truncate(MemConsensus(f"w2-{tmp_path.name}"))
    test_blob_get_set_overwrite_delete(b)
    test_blob_get_range(b)
    assert handle.snapshot_counts()["calls"] > 20
    assert sum(v for k, v in handle.snapshot_counts().items() if k != "calls") == 0


def test_unreliable_default_split_matches_materialize() -> None:
    rates = UnreliableHandle().rates
    assert rates.applied_then_timeout == pytest.approx(0.0475)
    assert rates.determinate == pytest.approx(0.0475)
    assert rates.timeout_only == pytest.approx(0.0025)
    assert rates.total() == pytest.approx(0.0975)
    handle = UnreliableHandle(seed=42)
    blob = UnreliableBlob(MemBlob("unreliable-split"), handle)
    outcomes = {"ok": 0, "Determinate": 0, "Indeterminate": 0}
    for i in range(4000):
        try:
            blob.set(f"k{i}", b"x")
            outcomes["ok"] += 1
        except (Determinate, Indeterminate) as e:
            outcomes[type(e).__name__] += 1
    counts = handle.snapshot_counts()
    assert counts["calls"] == 4000
    assert 100 < counts["determinate"] < 300  # ~190
    assert 100 < counts["applied_then_timeout"] < 300
    assert counts["timeout_only"] < 40
    assert outcomes["Determinate"] == counts["determinate"]
    # applied-then-timeout really applied the write
    stored = len(list(MemBlob("unreliable-split").list_keys_and_metadata("k")))
    assert stored == outcomes["ok"] + counts["applied_then_timeout"]
    # same seed, same faults
    h2 = UnreliableHandle(seed=42)
    b2 = UnreliableBlob(MemBlob("unreliable-split-2"), h2)
    for i in range(4000):
        try:
            b2.set(f"k{i}", b"x")
        except (Determinate, Indeterminate):
            pass
    assert h2.snapshot_counts() == counts


def test_unreliable_outage_scripting() -> None:
    handle = UnreliableHandle(seed=0)
    c = UnreliableConsensus(MemConsensus("outage"), handle)
    handle.totally_unavailable()
    with pytest.raises(Indeterminate, match="not run"):
        c.compare_and_set("k", None, _v(0))
    assert MemConsensus("outage").head("k") is None
    handle.totally_unavailable(kind="determinate")
    with pytest.raises(Determinate):
        c.head("k")
    handle.partially_available(determinate=0, applied_then_timeout=1.0, timeout_only=0)
    with pytest.raises(Indeterminate, match="was applied"):
        c.compare_and_set("k", None, _v(0))
    assert MemConsensus("outage").head("k") == _v(0)
    slept: list[float] = []
    h3 = UnreliableHandle(0, FaultRates(stall=1.0), stall_s=0.5, sleep=slept.append)
    assert UnreliableConsensus(MemConsensus("outage"), h3).head("k") == _v(0)
    assert slept == [0.5]
    handle.totally_available()
    assert c.compare_and_set("k", 0, _v(1)) == COMMITTED
    with pytest.raises(InvalidUsage):
        FaultRates(determinate=0.7, timeout_only=0.7)


def test_retry_policy_backoff_deadline_and_kinds() -> None:
    now = [0.0]
    slept: list[float] = []

    def sleep(s: float) -> None:
        slept.append(s)
        now[0] += s

    policy = RetryPolicy(
        initial_backoff_s=0.01,
        max_backoff_s=0.08,
        deadline_s=1.0,
        jitter=0.0,
        sleep=sleep,
        clock=lambda: now[0],
    )
    calls = [0]

    def flaky() -> str:
        calls[0] += 1
        if calls[0] < 5:
            raise Determinate("boom")
        return "ok"

    assert retry_external(flaky, "flaky op", policy, retry_indeterminate=False) == "ok"
    assert slept == pytest.approx([0.01, 0.02, 0.04, 0.08])

    def always() -> None:
        raise Determinate("still down")

    slept.clear()
    now[0] = 0.0
    with pytest.raises(Determinate, match="consensus head of 'k'.*giving up.*still down"):
        retry_external(always, "consensus head of 'k'", policy, retry_indeterminate=True)
    assert sum(slept) == pytest.approx(1.0)  # never sleeps past the deadline

    def indeterminate() -> None:
        raise Indeterminate("maybe")

    with pytest.raises(Indeterminate, match="^maybe$"):  # not retried: propagates as is
        retry_external(indeterminate, "cas", policy, retry_indeterminate=False)
    usage = [0]

    def bad_usage() -> None:
        usage[0] += 1
        raise InvalidUsage("nope")

    with pytest.raises(InvalidUsage):
        retry_external(bad_usage, "x", policy, retry_indeterminate=True)
    assert usage[0] == 1
    jittered = RetryPolicy(initial_backoff_s=1.0, jitter=0.5, rng=random.Random(1))
    assert all(0.5 <= jittered.jittered(0) <= 1.0 for _ in range(50))


def test_retrying_consensus_cas_resolves_only_determinate() -> None:
    no_sleep = RetryPolicy(deadline_s=5, sleep=lambda s: None)
    h = UnreliableHandle(0, FaultRates(determinate=0.5), sleep=lambda s: None)
    c = RetryingConsensus(UnreliableConsensus(MemConsensus("retry-cas"), h), no_sleep)
    for s in range(20):  # determinate failures are retried away
        assert c.compare_and_set("k", s - 1 if s else None, _v(s)) == COMMITTED
    assert h.snapshot_counts()["determinate"] > 5
    h.partially_available(determinate=0, applied_then_timeout=1.0, timeout_only=0)
    with pytest.raises(Indeterminate):  # never blindly retried: the caller resolves it
        c.compare_and_set("k", 19, _v(20))
    assert MemConsensus("retry-cas").head("k") == _v(20)
    # idempotent ops retry indeterminate failures too
    h.partially_available(determinate=0, applied_then_timeout=0.5, timeout_only=0.2)
    assert c.head("k") == _v(20)
    b = RetryingBlob(UnreliableBlob(MemBlob("retry-blob"), h), no_sleep)
    for i in range(20):
        b.set(f"k{i}", b"v")
    assert len(list(b.list_keys_and_metadata(""))) == 20


# -- backend-specific error semantics -------------------------------------------------


def test_file_blob_oserror_is_determinate_and_cleans_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blob = FileBlob(tmp_path / "root")
    real_write = os.write

    def full(fd: int, data: bytes) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    with pytest.raises(Determinate, match=r"'a/b'.*ENOSPC.*free disk space") as ei:
        blob.set("a/b", b"x")
    assert str(tmp_path / "root") in str(ei.value)
    monkeypatch.setattr(os, "write", real_write)
    assert os.listdir(tmp_path / "root" / "a") == []  # no temp file left behind
    blob.set("a/b", b"x")
    assert blob.get("a/b") == b"x"


def test_file_blob_key_prefix_conflict_is_usage_error(tmp_path: Path) -> None:
    blob = FileBlob(tmp_path)
    blob.set("a", b"1")
    with pytest.raises(InvalidBlobKey, match="conflicts"):
        blob.set("a/b", b"2")
    assert blob.get("a/b") is None
    blob.set("c/d", b"3")
    with pytest.raises(InvalidBlobKey, match="conflicts"):
        blob.set("c", b"4")
    assert blob.get("c") is None
    assert blob.delete("c") is None


def test_sqlite_locked_is_determinate(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "dir" / "c.db"  # parents are created
    c = SqliteConsensus(path, busy_timeout_ms=50)
    assert c.compare_and_set("k", None, _v(0)) == COMMITTED
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # hold the write lock
    try:
        with pytest.raises(Determinate, match="locked"):
            c.compare_and_set("k", 0, _v(1))
        assert c.head("k") == _v(0)  # WAL: reads don't wait for the writer
    finally:
        other.execute("ROLLBACK")
        other.close()
    assert c.compare_and_set("k", 0, _v(1)) == COMMITTED
    c.close()
    with pytest.raises(InvalidUsage, match="closed"):
        c.head("k")


class _Proxy:
    """A TCP proxy we can cut, to lose a connection while a statement is in flight."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            self.conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass

    def cut(self) -> None:
        for s in self.conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
                s.close()
            except OSError:
                pass

    def close(self) -> None:
        self.sock.close()
        self.cut()


@pytest.mark.postgres
def test_postgres_error_kinds(pg_consensus_url: str) -> None:
    from persist_lib.location.postgres_consensus import PostgresConsensus

    # connection refused before anything was sent: determinate
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]
    refused = PostgresConsensus(
        f"postgresql://persist:pw@127.0.0.1:{closed_port}/db", connect_timeout_s=2
    )
    with pytest.raises(Determinate, match="cannot connect"):
        refused.compare_and_set("k", None, _v(0))

    # connection lost while the CAS is in flight: indeterminate (and it may commit!)
    c = PostgresConsensus(pg_consensus_url)
    assert c.compare_and_set("k", None, _v(0)) == COMMITTED
    info = psycopg.conninfo.conninfo_to_dict(pg_consensus_url)
    proxy = _Proxy((str(info["host"]), int(info["port"])))
    proxied = PostgresConsensus(
        pg_consensus_url.replace(f":{info['port']}/", f":{proxy.port}/"), notify=False
    )
    assert proxied.head("k") == _v(0)
    locker = psycopg.connect(pg_consensus_url)
    locker.execute("LOCK TABLE consensus IN ACCESS EXCLUSIVE MODE")  # blocks the CAS
    result: list[BaseException | CaSResult] = []

    def cas() -> None:
        try:
            result.append(proxied.compare_and_set("k", 0, _v(1)))
        except BaseException as e:  # noqa: BLE001
            result.append(e)

    t = threading.Thread(target=cas)
    t.start()
    deadline = time.monotonic() + 10
    with psycopg.connect(pg_consensus_url, autocommit=True) as watcher:
        while time.monotonic() < deadline:  # wait until the CAS is blocked on the lock
            waiting = watcher.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
            ).fetchone()
            if waiting and waiting[0] >= 1:
                break
            time.sleep(0.02)
        else:
            pytest.fail("the proxied CAS never blocked on the table lock")
    proxy.cut()
    t.join(timeout=10)
    locker.rollback()  # release the lock: the orphaned CAS may now commit
    locker.close()
    assert len(result) == 1 and isinstance(result[0], Indeterminate), result
    assert "may or may not" in str(result[0])
    # resolving the indeterminate outcome: re-read the head
    # (the server only notices the lost client when it answers, so the orphaned CAS
    # runs to completion once the lock is released: the write happened after all)
    deadline = time.monotonic() + 10
    while c.head("k") == _v(0) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert c.head("k") == _v(1)
    proxy.close()

    # a server-reported error (here: the table is gone) is determinate
    with psycopg.connect(pg_consensus_url, autocommit=True) as admin:
        admin.execute("ALTER TABLE consensus RENAME TO consensus_away")
    with pytest.raises(Determinate, match="SQLSTATE 42P01"):
        c.head("k")
    c.close()
    proxied.close()
    refused.close()


@pytest.mark.postgres
def test_postgres_contract_under_serializable(pg_consensus_url: str) -> None:
    """The same CAS is correct under SERIALIZABLE; its 40001s are Determinate (retried)."""
    url = pg_consensus_url + "?options=-c%20default_transaction_isolation%3Dserializable"
    raw = open_consensus(url)
    level = psycopg.connect(url).execute("SHOW transaction_isolation").fetchone()
    assert level == ("serializable",)
    test_consensus_cas_sequence(raw)
    test_consensus_truncate(raw)
    c = RetryingConsensus(raw, RetryPolicy(deadline_s=30))
    assert c.compare_and_set("race", None, _v(0)) == COMMITTED
    wins: list[int] = []
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            for _ in range(15):
                h = c.head("race")
                assert h is not None
                if c.compare_and_set("race", h.seqno, _v(h.seqno + 1)) == COMMITTED:
                    wins.append(h.seqno + 1)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    head = c.head("race")
    assert head is not None and sorted(wins) == list(range(1, head.seqno + 1))
    c.close()


@pytest.mark.postgres
def test_postgres_error_classification(pg_consensus_url: str) -> None:
    """How psycopg errors map to Determinate/Indeterminate (the rules in the docstring)."""
    from persist_lib.location.postgres_consensus import PostgresConsensus

    c = PostgresConsensus(pg_consensus_url)
    with psycopg.connect(pg_consensus_url) as conn:
        cases = [
            (psycopg.errors.SerializationFailure("could not serialize"), True, Determinate),
            (psycopg.errors.DeadlockDetected("deadlock detected"), True, Determinate),
            (psycopg.errors.QueryCanceled("statement timeout"), True, Determinate),
            (psycopg.errors.AdminShutdown("terminating connection"), True, Determinate),
            (
                psycopg.OperationalError("server closed the connection unexpectedly"),
                True,
                Indeterminate,
            ),
            (
                psycopg.OperationalError("server closed the connection unexpectedly"),
                False,
                Determinate,
            ),
        ]
        for err, write, kind in cases:
            got = c._translate("compare_and_set", "k", write, conn, err)
            assert type(got) is kind, (err, write, got)
            assert "'k'" in str(got)
    c.close()


# -- Postgres: notifications after the commit, best effort ------------------------------


def _role_url(url: str, role: str, password: str) -> str:
    return psycopg.conninfo.make_conninfo(url, user=role, password=password)


@pytest.mark.postgres
def test_postgres_cas_commits_even_when_its_notification_fails(
    pg_consensus_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """``pg_notify`` used to run inside the CAS transaction, so a failing notification
    failed the CAS (in production: a notification queue filled by a listener that never
    consumes). Here it fails for real: the writer's role may not execute ``pg_notify``.
    The CAS must commit and say so; a waiter must still see the change (it re-checks)."""
    from psycopg import sql

    from persist_lib.location.postgres_consensus import PostgresConsensus

    caplog.set_level(logging.DEBUG, logger="persist_lib.location.postgres_consensus")
    role, password = f"no_notify_{uuid.uuid4().hex[:8]}", "no-notify-S3cr3t"
    owner = PostgresConsensus(pg_consensus_url)
    assert owner.head("k") is None  # creates the table (as its owner)
    with psycopg.connect(pg_consensus_url, autocommit=True) as admin:
        admin.execute(
            sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(
                sql.Identifier(role), sql.Literal(password)
            )
        )
        admin.execute(sql.SQL("GRANT USAGE, CREATE ON SCHEMA public TO {}").format(sql.Identifier(role)))
        admin.execute(
            sql.SQL("GRANT ALL ON consensus TO {}").format(sql.Identifier(role))
        )
        # Only in this test's database: pg_proc is per database.
        admin.execute("REVOKE EXECUTE ON FUNCTION pg_notify(text, text) FROM PUBLIC")
    url = _role_url(pg_consensus_url, role, password)
    writer = PostgresConsensus(url)
    waiter = PostgresConsensus(pg_consensus_url)
    try:
        with psycopg.connect(url, autocommit=True) as probe:  # the failure is real
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                probe.execute("SELECT pg_notify('persist_consensus', 'k')")

        assert writer.compare_and_set("k", None, _v(0)) == COMMITTED
        assert writer.notify_failures == 1
        assert owner.head("k") == _v(0)
        assert writer.compare_and_set("k", None, _v(0)) == MISMATCH
        assert writer.notify_failures == 1  # nothing is sent for a CAS that did not commit
        assert writer.compare_and_set("k", 0, _v(1)) == COMMITTED
        assert writer.notify_failures == 2
        assert writer.scan("k", 0, 10) == [_v(0), _v(1)]

        # A waiter misses the wake-up but still notices the commit (its re-check).
        done = threading.Event()

        def wait() -> None:
            waiter.wait_for_change("k", 1, timeout_s=600)
            done.set()

        t = threading.Thread(target=wait, daemon=True)
        t.start()
        assert writer.compare_and_set("k", 1, _v(2)) == COMMITTED
        t.join(timeout=300)
        assert done.is_set() and waiter.head("k") == _v(2)

        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "committed but its notification failed" in warnings[0].getMessage()
        assert password not in caplog.text
    finally:
        for c in (writer, waiter, owner):
            c.close()
        with psycopg.connect(pg_consensus_url, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
            admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


@pytest.mark.postgres
def test_postgres_notifies_listeners_after_each_commit(pg_consensus_url: str) -> None:
    """Listeners still wake on commits: one notification per committed CAS, after the
    commit (the new head is visible when it arrives), none for a mismatch."""
    from persist_lib.location.postgres_consensus import NOTIFY_CHANNEL, PostgresConsensus

    c = PostgresConsensus(pg_consensus_url)
    waiter = PostgresConsensus(pg_consensus_url)
    try:
        assert c.head("a") is None
        with psycopg.connect(pg_consensus_url, autocommit=True) as lc:
            lc.execute(f"LISTEN {NOTIFY_CHANNEL}")
            assert c.compare_and_set("a", None, _v(0)) == COMMITTED
            got = list(lc.notifies(timeout=60, stop_after=1))
            assert [(n.channel, n.payload) for n in got] == [(NOTIFY_CHANNEL, "a")]
            assert waiter.head("a") == _v(0)
            assert c.compare_and_set("a", None, _v(0)) == MISMATCH
            assert c.compare_and_set("a", 5, _v(6)) == MISMATCH
            assert c.compare_and_set("b", None, _v(3)) == COMMITTED
            got = list(lc.notifies(timeout=60, stop_after=1))
            assert [n.payload for n in got] == ["b"]  # the mismatches sent nothing
            long_key = "x" * 8000  # too long for a payload: an empty one wakes everybody
            assert c.compare_and_set(long_key, None, _v(0)) == COMMITTED
            got = list(lc.notifies(timeout=60, stop_after=1))
            assert [n.payload for n in got] == [""]

        # ... and through the instance's own listener, a waiter wakes up.
        done = threading.Event()

        def wait() -> None:
            waiter.wait_for_change("a", 0, timeout_s=600)
            done.set()

        t = threading.Thread(target=wait, daemon=True)
        t.start()
        assert c.compare_and_set("a", 0, _v(1)) == COMMITTED
        t.join(timeout=300)
        assert done.is_set() and waiter.head("a") == _v(1)
        assert c.notify_failures == 0
    finally:
        c.close()
        waiter.close()


# -- describe(): identifies the log (the process-wide state cache is keyed by it) ------


def test_consensus_describe_identifies_the_log(tmp_path: Path) -> None:
    from persist_lib.location.postgres_consensus import PostgresConsensus

    url = "postgresql://persist:pw-S3cr3t@127.0.0.1:5432/db"
    pgs = [
        PostgresConsensus(url),
        PostgresConsensus(url, table="other"),
        PostgresConsensus(url, schema="s"),
        PostgresConsensus(url, schema="s", table="other"),
        PostgresConsensus(url, table="s.consensus"),  # not schema "s", table "consensus"
        PostgresConsensus(url, table='a"."b'),
        PostgresConsensus(url, schema="a", table="b"),
        # A later '@' makes redaction hide the host and database: still told apart.
        PostgresConsensus("postgresql://u:pw-S3cr3t@h1/db1?application_name=x@y"),
        PostgresConsensus("postgresql://u:pw-S3cr3t@h2/db2?application_name=x@y"),
        PostgresConsensus("host=h1 dbname=db1 user=u password=pw-S3cr3t"),
        PostgresConsensus("host=h1 dbname=db2 user=u password=pw-S3cr3t"),
    ]
    descs = [c.describe() for c in pgs]
    assert len(set(descs)) == len(descs), descs
    assert all("pw-S3cr3t" not in d for d in descs), descs
    assert descs[0] == 'postgresql://persist:****@127.0.0.1:5432/db (table "consensus")'
    assert descs[3].endswith('(table "s"."other")')
    # Same log, same description (the password is not part of the identity).
    assert PostgresConsensus(url.replace("pw-S3cr3t", "other-pw")).describe() == descs[0]

    a = SqliteConsensus(tmp_path / "a.db")
    b = SqliteConsensus(tmp_path / "b.db")
    m1, m2 = MemConsensus(f"d-{uuid.uuid4().hex}"), MemConsensus(f"d-{uuid.uuid4().hex}")
    others = [a, b, m1, m2]
    assert len({c.describe() for c in others}) == 4
    for inner in (*others, pgs[1]):
        assert RetryingConsensus(inner).describe() == inner.describe()  # same log
        wrapped = UnreliableConsensus(inner, UnreliableHandle(0, FaultRates()))
        assert inner.describe() in wrapped.describe()
    for c in (*pgs, *others):
        c.close()


@pytest.mark.postgres
@pytest.mark.timeout(120)  # it used to spin forever: its cache was ahead of its log
def test_postgres_clients_on_other_tables_do_not_share_cached_state(
    pg_consensus_url: str,
) -> None:
    """Two clients on one Postgres URL with different tables (two separate logs) write
    the same shard id: each reads back only its own data. (They shared the process's
    cached state when ``describe()`` ignored the table, and computed diffs against the
    other log's state.)"""
    import pyarrow as pa

    from persist_lib import Antichain, PersistClient, PersistConfig, ShardId
    from persist_lib.location.postgres_consensus import PostgresConsensus
    from persist_lib.shard.machine import clear_state_cache

    key_schema = pa.schema([("k", pa.string())])
    val_schema = pa.schema([("v", pa.int64())])

    def rows(t: pa.Table) -> list[tuple[object, ...]]:
        return sorted((r["k"], r["v"], r["ts"], r["diff"]) for r in t.to_pylist())

    shard = ShardId.new()
    cfg = PersistConfig.for_tests(inline_threshold=0)
    tag = uuid.uuid4().hex
    ca = PersistClient(MemBlob(f"a-{tag}"), PostgresConsensus(pg_consensus_url, table="log_a"), cfg)
    cb = PersistClient(MemBlob(f"b-{tag}"), PostgresConsensus(pg_consensus_url, table="log_b"), cfg)
    try:
        wa, ra = ca.open(shard, key_schema, val_schema)
        wa.compare_and_append([((("a0",), (1,)), 0, 1)], 0, 1)
        wa.compare_and_append([((("a1",), (2,)), 1, 1)], 1, 2)
        wb, rb = cb.open(shard, key_schema, val_schema)
        wb.compare_and_append([((("b0",), (10,)), 0, 1)], 0, 1)
        wa.compare_and_append([((("a2",), (3,)), 2, 1)], 2, 3)
        assert rows(ra.snapshot(2)) == [("a0", 1, 2, 1), ("a1", 2, 2, 1), ("a2", 3, 2, 1)]
        assert rows(rb.snapshot(0)) == [("b0", 10, 0, 1)]
        # ... and so does a process that starts cold.
        clear_state_cache()
        assert ca.machine(shard).fetch_latest().upper == Antichain([3])
        assert cb.machine(shard).fetch_latest().upper == Antichain([1])
        ra2 = ca.open_leased_reader(shard, key_schema, val_schema)
        rb2 = cb.open_leased_reader(shard, key_schema, val_schema)
        assert rows(ra2.snapshot(2)) == [("a0", 1, 2, 1), ("a1", 2, 2, 1), ("a2", 3, 2, 1)]
        assert rows(rb2.snapshot(0)) == [("b0", 10, 0, 1)]
    finally:
        ca.close()
        cb.close()


# -- SQLite: concurrent first opens of a fresh file -------------------------------------


def _hold_write_lock(path: Path) -> sqlite3.Connection:
    """A rival that holds the write lock of a fresh (still rollback-journal) file, as a
    rival opener does while it switches the file to WAL."""
    rival = sqlite3.connect(path, isolation_level=None)
    rival.execute("BEGIN IMMEDIATE")
    return rival


def test_sqlite_first_open_waits_for_a_rival_holding_the_write_lock(tmp_path: Path) -> None:
    """``PRAGMA journal_mode=WAL`` on a fresh file answers SQLITE_BUSY at once (no busy
    handler) while a rival holds the write lock: the open used to fail within ~1 ms."""
    path = tmp_path / "fresh.db"
    rival = _hold_write_lock(path)
    result: list[BaseException | SqliteConsensus] = []

    def open_it() -> None:
        try:
            result.append(SqliteConsensus(path, busy_timeout_ms=120_000))
        except BaseException as e:  # noqa: BLE001
            result.append(e)

    t = threading.Thread(target=open_it, daemon=True)
    t.start()
    t.join(timeout=1.0)  # the opener meets the held lock (a failing one is done by now)
    rival.execute("COMMIT")
    rival.close()
    t.join(timeout=120)
    assert len(result) == 1 and isinstance(result[0], SqliteConsensus), result
    c = result[0]
    assert c.compare_and_set("k", None, _v(0)) == COMMITTED
    assert c.head("k") == _v(0)
    c.close()


def test_sqlite_first_open_gives_up_after_the_busy_timeout_and_says_so(tmp_path: Path) -> None:
    path = tmp_path / "fresh.db"
    rival = _hold_write_lock(path)
    try:
        with pytest.raises(Determinate) as ei:
            SqliteConsensus(path, busy_timeout_ms=300)
    finally:
        rival.execute("ROLLBACK")
        rival.close()
    msg = str(ei.value)
    assert "locked" in msg and "busy timeout 300 ms" in msg and "attempt(s) over" in msg, msg
    assert "after the 300 ms busy timeout" not in msg  # the old, untrue claim
    assert SqliteConsensus(path).head("k") is None  # usable once the rival is gone


FIRST_OPEN_THREADS = 100
FIRST_OPEN_PROCESSES = 20


def _fresh_location(tmp_path: Path) -> tuple[str, str]:
    d = tmp_path / f"loc-{uuid.uuid4().hex[:8]}"
    return "file://" + str(d / "blob"), "sqlite:///" + str(d / "consensus.db")


def _open_and_cas(blob_uri: str, consensus_uri: str, i: int) -> None:
    from persist_lib import PersistClient, PersistConfig

    client = PersistClient.open(blob_uri, consensus_uri, PersistConfig.for_tests())
    try:
        # the raw backend: no retries may hide a failure
        assert client.raw_consensus.compare_and_set(f"k{i}", None, _v(i)) == COMMITTED
    finally:
        client.close()


def _check_all_written(consensus_uri: str, n: int) -> None:
    c = open_consensus(consensus_uri)
    assert sorted(c.list_keys()) == sorted(f"k{i}" for i in range(n))
    assert all(c.head(f"k{i}") == _v(i) for i in range(n))
    c.close()


def test_sqlite_many_threads_open_a_fresh_location_at_once(tmp_path: Path) -> None:
    import persist_lib.handles.client  # noqa: F401 - slow imports before the start, not after

    blob_uri, consensus_uri = _fresh_location(tmp_path)
    start = threading.Barrier(FIRST_OPEN_THREADS)
    errors: list[str] = []

    def worker(i: int) -> None:
        try:
            start.wait(timeout=60)
            _open_and_cas(blob_uri, consensus_uri, i)
        except BaseException as e:  # noqa: BLE001
            errors.append(f"thread {i}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(FIRST_OPEN_THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert errors == [], f"{len(errors)} of {FIRST_OPEN_THREADS} failed: {errors[:3]}"
    _check_all_written(consensus_uri, FIRST_OPEN_THREADS)


def first_open_worker(blob_uri: str, consensus_uri: str, i: int, start: Any, out: Any) -> None:
    """Module level: spawned children import this module."""
    try:
        import persist_lib.handles.client  # noqa: F401 - slow imports before the start, not after

        start.wait(timeout=120)
        _open_and_cas(blob_uri, consensus_uri, i)
        out.put((i, None))
    except BaseException as e:  # noqa: BLE001
        out.put((i, f"{type(e).__name__}: {e}"))


# 6 processes in the default suite (each spawn imports pyarrow: ~1 s of CPU), 20 in the slow tier.
@pytest.mark.parametrize("n", [6, pytest.param(FIRST_OPEN_PROCESSES, marks=pytest.mark.slow)])
def test_sqlite_many_processes_open_a_fresh_location_at_once(tmp_path: Path, n: int) -> None:
    blob_uri, consensus_uri = _fresh_location(tmp_path)
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Barrier(n)
    out = ctx.Queue()
    procs = [
        ctx.Process(
            target=first_open_worker, args=(blob_uri, consensus_uri, i, start, out), daemon=True
        )
        for i in range(n)
    ]
    for p in procs:
        p.start()
    results: dict[int, str | None] = {}
    try:
        for _ in procs:
            i, err = out.get(timeout=300)
            results[i] = err
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.terminate()
    errors = {i: e for i, e in results.items() if e is not None}
    assert len(results) == n and not errors, (
        f"{len(errors)} of {n} failed: {list(errors.values())[:3]}"
    )
    _check_all_written(consensus_uri, n)
