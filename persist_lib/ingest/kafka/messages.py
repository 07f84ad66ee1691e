"""Fetched Kafka messages of one partition, as a reader holds them: ``_Msgs`` (not
decoded yet: offsets and values, keys, timestamps and headers read off the messages
when asked) and ``_Decoded`` (decoded right after fetching: Arrow rows and error
records), both sliced by offset; the batch types the consumer, the prefetcher and the
reader process hand each other; and ``_buffer``, which adds fetched messages to a
partition's buffer without taking an offset twice."""

from __future__ import annotations

import bisect
from typing import Any, Protocol, cast

import pyarrow as pa

from persist_lib.ingest.decode import Decoded, DecodeSpec, ErrorRecord
from persist_lib.ingest.errors import IngestInvariantError


class MessageDecoder(Protocol):
    """What decodes the messages of a partition (``kafka.decoding.KafkaDecoding``, mixed
    into ``KafkaTopic``): the messages' side of the decoding, without importing it."""

    def decode_messages(self, partition: str, m: _Msgs, spec: DecodeSpec) -> Decoded: ...

    def _where(self) -> str: ...


class _Msgs:
    """Fetched messages of one partition (offsets ascending), not decoded yet: offsets
    and values as lists, and keys, timestamps and headers read off the confluent-kafka
    ``Message`` objects (``msgs``) only when decoding asks for them -- or given as lists
    (``materialize``, rebuilds).

    ``Message`` objects are GC-tracked, so the reader never keeps them past the batch
    they came in (see ``_Decoded`` and ``prefetch._gc_paused``): holding a binding's worth of
    them made every full garbage collection walk them all, about a second of CPU per
    million messages."""

    __slots__ = ("msgs", "offs", "vals", "_keys", "_ts", "_hdrs", "joined", "vlen")

    def __init__(
        self,
        msgs: list[Any] | None = None,
        offs: list[int] | None = None,
        vals: list[bytes | None] | None = None,
        *,
        keys: list[bytes | None] | None = None,
        ts: list[int | None] | None = None,
        hdrs: list[Any] | None = None,
        joined: bytes | None = None,
        vlen: list[int] | None = None,
    ) -> None:
        self.msgs = msgs
        # (from the native split: the values joined by b"\n" -- only when none is None or
        # holds a line break -- and their lengths; dropped by slicing and extending)
        self.joined = joined
        self.vlen = vlen
        self.offs: list[int] = offs if offs is not None else []
        self.vals: list[bytes | None] = vals if vals is not None else []
        self._keys, self._ts, self._hdrs = keys, ts, hdrs
        if msgs is None:  # (no Message objects to read them off: absent means none)
            n = len(self.offs)
            self._keys = keys if keys is not None else [None] * n
            self._ts = ts if ts is not None else [None] * n
            self._hdrs = hdrs if hdrs is not None else [None] * n

    def __len__(self) -> int:
        return len(self.offs)

    @property
    def keys(self) -> list[bytes | None]:
        if self._keys is None:
            from confluent_kafka import Message

            self._keys = list(map(Message.key, self.msgs or ()))
        return self._keys

    @property
    def ts(self) -> list[int | None]:
        """Timestamps in ms since the epoch (None: the producer set none)."""
        if self._ts is None:
            self._ts = [_ts_of(m) for m in self.msgs or ()]
        return self._ts

    @property
    def hdrs(self) -> list[Any]:
        if self._hdrs is None:
            from confluent_kafka import Message

            self._hdrs = list(map(Message.headers, self.msgs or ()))
        return self._hdrs

    def key_at(self, i: int) -> bytes | None:
        """The key of message ``i`` (without reading every key off the messages)."""
        return self._keys[i] if self._keys is not None or self.msgs is None else self.msgs[i].key()  # type: ignore[index]

    def ts_at(self, i: int) -> int | None:
        return self._ts[i] if self._ts is not None or self.msgs is None else _ts_of(self.msgs[i])  # type: ignore[index]

    def hdrs_at(self, i: int) -> Any:
        return self._hdrs[i] if self._hdrs is not None or self.msgs is None else self.msgs[i].headers()  # type: ignore[index]

    @property
    def nbytes(self) -> int:
        """Bytes of the values (what the ingestion's byte figures count)."""
        return sum(map(len, filter(None, self.vals)))

    def materialize(self) -> _Msgs:
        """Reads keys, timestamps and headers off the messages and lets go of them."""
        if self.msgs is not None:
            _ = (self.keys, self.ts, self.hdrs)  # (reads them)
            self.msgs = None
        return self

    def extend(self, o: _Msgs) -> int:
        """Appends the messages of ``o`` after the last offset held; returns how many."""
        self.materialize()
        o.materialize()
        self.joined = self.vlen = None
        if self.offs and o.offs and o.offs[0] <= self.offs[-1]:  # a re-fetch after a reconnect
            o = o.slice(bisect.bisect_right(o.offs, self.offs[-1]), len(o))
        self.offs.extend(o.offs)
        self.vals.extend(o.vals)
        self.keys.extend(o.keys)
        self.ts.extend(o.ts)
        self.hdrs.extend(o.hdrs)
        return len(o)

    def slice(self, i: int, j: int) -> _Msgs:
        def part(x: list[Any] | None) -> list[Any] | None:
            return None if x is None else x[i:j]

        return _Msgs(
            part(self.msgs), self.offs[i:j], self.vals[i:j],
            keys=part(self._keys), ts=part(self._ts), hdrs=part(self._hdrs), vlen=part(self.vlen),
        )

    def decode(self, src: MessageDecoder, partition: str, spec: DecodeSpec) -> Decoded:
        return src.decode_messages(partition, self, spec)


def _ts_of(m: Any) -> int | None:
    t = m.timestamp()
    return t[1] if t[0] else None  # (type 0: TIMESTAMP_NOT_AVAILABLE)


class _Decoded:
    """Messages of one partition (offsets ascending) decoded as soon as they were fetched
    (``KafkaReader._convert``, on the prefetch thread): decoding is row-wise, so the rows
    and errors of any offset range of them are exactly what decoding that range's
    messages gives. Holds nothing per message but Arrow rows, the error records of the
    bad ones and the value sizes; slices by offset (binding bounds) like the messages.

    Why: the messages' Python objects (and keys, timestamps, headers: read only for the
    bad messages and the columns the decoding needs) are gone right after their batch,
    and decoding overlaps the reader's appends."""

    __slots__ = ("offs", "rows", "errors", "eoffs", "raw", "vlen", "spec")

    def __init__(
        self, offs: list[int], rows: pa.Table, errors: list[ErrorRecord], raw: pa.Table | None,
        vlen: list[int], spec: DecodeSpec,
    ) -> None:
        self.offs = offs
        self.rows = rows  # the good messages' rows (spec.rows_schema()), in offset order
        self.errors = errors  # the bad messages' errors, in offset order
        self.eoffs = [int(e.address[0]) for e in errors]
        self.raw = raw  # keep_raw: one row per message
        self.vlen = vlen  # value bytes per message
        self.spec = spec

    @classmethod
    def of(cls, src: MessageDecoder, partition: str, m: _Msgs, spec: DecodeSpec) -> _Decoded:
        d = src.decode_messages(partition, m, spec)
        n = len(m)
        if d.rows.num_rows + len(d.errors) != n:
            raise IngestInvariantError(
                f"{src._where()} partition {partition}: {n} messages decoded to {d.rows.num_rows} rows "
                f"and {len(d.errors)} errors"
            )
        if m.vlen is not None:
            vlen = m.vlen
        else:
            try:
                vlen = list(map(len, cast(list[bytes], m.vals)))
            except TypeError:  # (null values: tombstones)
                vlen = [0 if v is None else len(v) for v in m.vals]
        return cls(m.offs, d.rows, d.errors, d.raw, vlen, spec)

    def __len__(self) -> int:
        return len(self.offs)

    @property
    def nbytes(self) -> int:
        return sum(self.vlen)

    def _errors_before(self, i: int) -> int:
        """How many of the messages before position ``i`` are bad."""
        return len(self.eoffs) if i >= len(self.offs) else bisect.bisect_left(self.eoffs, self.offs[i])

    def slice(self, i: int, j: int) -> _Decoded:
        n = len(self.offs)
        i, j = max(0, min(i, n)), max(0, min(j, n))
        j = max(i, j)
        e0, e1 = self._errors_before(i), self._errors_before(j)
        g0, g1 = i - e0, j - e1  # (good rows before i and before j)
        return _Decoded(
            self.offs[i:j], self.rows.slice(g0, g1 - g0), self.errors[e0:e1],
            None if self.raw is None else self.raw.slice(i, j - i), self.vlen[i:j], self.spec,
        )

    def extend(self, o: _Decoded) -> int:
        """Appends the messages of ``o`` after the last offset held; returns how many."""
        if self.offs and o.offs and o.offs[0] <= self.offs[-1]:  # a re-fetch after a reconnect
            o = o.slice(bisect.bisect_right(o.offs, self.offs[-1]), len(o))
        if not o.offs:
            return 0
        # (in place: a reader's buffer owns its lists; slices copy them)
        self.offs.extend(o.offs)
        self.rows = pa.concat_tables([self.rows, o.rows])
        self.errors.extend(o.errors)
        self.eoffs.extend(o.eoffs)
        if self.raw is not None and o.raw is not None:
            self.raw = pa.concat_tables([self.raw, o.raw])
        self.vlen.extend(o.vlen)
        return len(o.offs)

    def decode(self, src: MessageDecoder, partition: str, spec: DecodeSpec) -> Decoded:
        if spec is not self.spec and spec != self.spec:
            raise IngestInvariantError(
                f"{src._where()} partition {partition}: messages were decoded with another schema "
                "than the one asked for now; reopen the reader after changing the decoding"
            )
        return Decoded(self.rows, list(self.errors), self.raw)


_Held = _Msgs | _Decoded  # what a reader buffers per partition
_Batch = tuple[list[Any], list[tuple[int, _Held]]]  # (error/event messages, [(partition, messages)])
_Fetched = tuple[_Batch, float]  # a batch and when ``consume`` returned it (time.monotonic)


def _extend(b: _Held, ms: _Held) -> int:
    """``b.extend(ms)`` (a reader holds one kind per partition)."""
    if isinstance(b, _Decoded) and isinstance(ms, _Decoded):
        return b.extend(ms)
    if isinstance(b, _Msgs) and isinstance(ms, _Msgs):
        return b.extend(ms)
    raise IngestInvariantError(f"a partition buffer holds {type(b).__name__}, got {type(ms).__name__}")


def _buffer(buf: dict[int, _Held], p: int, pos: int, ms: _Held) -> int:
    """Adds messages of partition ``p`` just fetched (``ms``, offsets ascending) to its
    buffer ``buf[p]``; returns how many it added. Only offsets at or past ``pos`` (the
    partition's position: everything below it was cut into chunks already) and past the
    last one held: a re-fetch after a reconnect, a seek or an offset reset hands some
    over again, also when the buffer is empty (then nothing but ``pos`` tells what was
    taken already)."""
    if ms.offs and ms.offs[0] < pos:
        ms = ms.slice(bisect.bisect_left(ms.offs, pos), len(ms))
    b = buf.get(p)
    if b is None or not len(b):
        buf[p] = ms
        return len(ms)
    return _extend(b, ms)
