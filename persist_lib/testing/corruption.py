"""Corruption at rest: flip bits in (or truncate) parts, rollups and consensus entries,
then read: persist must raise ``CorruptionError`` and never return data.

``CorruptionFixture`` builds a small shard once (several batches with parts in blob,
some inline in state, a rollup, diffs after it). A *target* is something a cold read
(``clear_state_cache`` + a new client + ``snapshot`` at ``upper - 1``) is certain to
consume: every part of the trace, the latest rollup (opening a shard loads it), and
every consensus entry from the rollup's seqno + 1 to the head. ``read_corrupted``
serves one target's bytes altered (through wrappers over the stored bytes, so the
fixture is reused across thousands of examples) and classifies what the read did.
``corrupt_file`` does the same to the real bytes on disk for the file/SQLite backends.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from persist_lib.config import PersistConfig
from persist_lib.errors import CorruptionError
from persist_lib.handles.client import PersistClient
from persist_lib.ids import ShardId
from persist_lib.location.base import Blob, BlobMetadata, CaSResult, Consensus, VersionedData
from persist_lib.location.mem import MemBlob, MemConsensus
from persist_lib.shard.machine import clear_state_cache

KEY = pa.schema([("k", pa.string())])
VAL = pa.schema([("v", pa.int64())])

Mutation = Callable[[bytes], bytes]


def flip_bit(pos: int) -> Mutation:
    """Flips bit ``pos % (8 * len)``."""

    def f(b: bytes) -> bytes:
        i = pos % (8 * len(b))
        out = bytearray(b)
        out[i // 8] ^= 1 << (i % 8)
        return bytes(out)

    return f


def truncate_to(frac: float) -> Mutation:
    """Keeps the first ``floor(frac * len)`` bytes (``frac`` in [0, 1))."""
    return lambda b: b[: int(frac * len(b))]


class CorruptingBlob(Blob):
    """Serves ``key``'s bytes through ``mutate``; everything else passes through."""

    def __init__(self, inner: Blob, key: str | None, mutate: Mutation) -> None:
        self.inner, self.key, self.mutate = inner, key, mutate
        self.served = 0

    def get(self, key: str) -> bytes | None:
        b = self.inner.get(key)
        if b is not None and key == self.key:
            self.served += 1
            return self.mutate(b)
        return b

    def set(self, key: str, value: bytes) -> None:
        self.inner.set(key, value)

    def delete(self, key: str) -> int | None:
        return self.inner.delete(key)

    def list_keys_and_metadata(self, prefix: str) -> Iterator[BlobMetadata]:
        return self.inner.list_keys_and_metadata(prefix)


class CorruptingConsensus(Consensus):
    """Serves the entry at ``seqno`` through ``mutate`` (in ``head`` and ``scan``)."""

    def __init__(self, inner: Consensus, seqno: int | None, mutate: Mutation) -> None:
        self.inner, self.seqno, self.mutate = inner, seqno, mutate
        self.served = 0

    def _m(self, e: VersionedData) -> VersionedData:
        if e.seqno == self.seqno:
            self.served += 1
            return VersionedData(e.seqno, self.mutate(e.data))
        return e

    def head(self, key: str) -> VersionedData | None:
        h = self.inner.head(key)
        return None if h is None else self._m(h)

    def compare_and_set(self, key: str, expected: int | None, new: VersionedData) -> CaSResult:
        return self.inner.compare_and_set(key, expected, new)

    def scan(self, key: str, from_seqno: int, limit: int) -> list[VersionedData]:
        return [self._m(e) for e in self.inner.scan(key, from_seqno, limit)]

    def truncate(self, key: str, seqno: int) -> int:
        return self.inner.truncate(key, seqno)

    def list_keys(self) -> Iterator[str]:
        return self.inner.list_keys()


@dataclass(frozen=True)
class Target:
    kind: str  # "part" | "inline_part" | "rollup" | "consensus"
    key: str | None = None
    seqno: int | None = None

    def __str__(self) -> str:
        return f"{self.kind}:{self.key or self.seqno}"


def _config(**kw: Any) -> PersistConfig:
    return PersistConfig.for_tests(rollup_interval=5, retry_deadline_s=0.5, snapshot_timeout_s=1.0, **kw)


class CorruptionFixture:
    """A small shard on ``mem://`` with parts in blob and inline, a rollup and diffs."""

    def __init__(self, batches: int = 8) -> None:
        self.name = uuid.uuid4().hex
        self.shard = str(ShardId.new())
        blob, cons = MemBlob(self.name), MemConsensus(self.name)
        c = PersistClient(blob, cons, _config(inline_threshold=0))
        w, r = c.open(self.shard, KEY, VAL)
        for t in range(batches):
            rows = [((f"k{t}-{i}",), (t * 10 + i,)) for i in range(3)]
            w.compare_and_append([(kv, t, 1) for kv in rows], t, t + 1)
        # Tiny parts inline in state (so they live in consensus entries and rollups too).
        c.config.inline_threshold = 4096
        for t in range(batches, batches + 2):
            w.compare_and_append([(((f"inline{t}",), (t,)), t, 1)], t, t + 1)
        self.as_of = batches + 1
        self.expected = sorted((d["k"], d["v"], d["ts"], d["diff"]) for d in r.snapshot(self.as_of).to_pylist())
        s = c.machine(self.shard).fetch_latest()
        latest = s.latest_rollup()
        assert latest is not None, "the fixture needs a rollup"
        self.targets: list[Target] = []
        for _, b in s.trace_batches():
            for p in b.parts:
                if p.key is not None:
                    self.targets.append(Target("part", key=p.key))
        self.targets.append(Target("rollup", key=latest[1].key))
        for seqno in range(latest[0] + 1, s.seqno + 1):
            self.targets.append(Target("consensus", seqno=seqno))
        self.n_inline = sum(1 for _, b in s.trace_batches() for p in b.parts if p.inline is not None)
        c.close()
        clear_state_cache()
        # Reads register a reader (and may write a rollup): restore the stores after each.
        self._blob_saved = dict(blob._d.data)
        self._cons_saved = list(cons._d.data[self.shard])

    def _restore(self) -> None:
        blob, cons = MemBlob(self.name), MemConsensus(self.name)
        with blob._d.lock:
            blob._d.data.clear()
            blob._d.data.update(self._blob_saved)
        with cons._d.lock:
            cons._d.data[self.shard] = list(self._cons_saved)

    def read_corrupted(self, target: Target, mutate: Mutation) -> str:
        """A cold read with ``target`` altered by ``mutate``; returns what happened:
        ``detected`` (CorruptionError), ``unchanged`` (the mutation changed nothing),
        ``returned`` (data came back: the bug), or ``error:<Type>`` (another error)."""
        clear_state_cache()
        blob: Blob = MemBlob(self.name)
        cons: Consensus = MemConsensus(self.name)
        original = (blob.get(target.key) if target.key else None) if target.kind != "consensus" else None
        if target.kind == "consensus":
            entries = {e.seqno: e.data for e in cons.scan(self.shard, 0, 10_000)}
            original = entries.get(target.seqno)  # type: ignore[arg-type]
            cons = CorruptingConsensus(cons, target.seqno, mutate)
        else:
            blob = CorruptingBlob(blob, target.key, mutate)
        if original is not None and mutate(original) == original:
            return "unchanged"
        c = PersistClient(blob, cons, _config())
        try:
            r = c.open_leased_reader(self.shard, KEY, VAL)
            got = r.snapshot(self.as_of)
            rows = sorted((d["k"], d["v"], d["ts"], d["diff"]) for d in got.to_pylist())
            return "returned" if rows != self.expected else "returned_same"
        except CorruptionError:
            return "detected"
        except Exception as e:  # noqa: BLE001 - classified for the property
            return f"error:{type(e).__name__}:{e}"
        finally:
            c.close()
            clear_state_cache()
            self._restore()
