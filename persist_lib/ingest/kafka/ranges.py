"""Offset ranges for Spark: a ``KafkaRangeReader`` binds ranges of offsets up to each
partition's last stable offset without fetching them (``KafkaRangeChunk``), and whoever
decodes a range -- a Spark executor, or the driver in-process -- reads exactly its
messages with ``read_range``: a fresh, manually assigned consumer that never commits.
A range read is a pure function of the range, so a retried or speculative task reads
the same messages."""

from __future__ import annotations

import bisect
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from persist_lib.ingest.addresses import Address, Frontier, Note
from persist_lib.ingest.errors import (
    KafkaOffsetOutOfRange,
    KafkaTopicGone,
    SourceTimeout,
    SourceUnavailable,
)
from persist_lib.ingest.kafka.messages import _Msgs
from persist_lib.ingest.kafka.prefetch import _consume
from persist_lib.ingest.kafka.reader import KafkaReader
from persist_lib.ingest.kafka.split import _split_materialized
from persist_lib.ingest.source import Chunk, Lag

if TYPE_CHECKING:  # pragma: no cover
    from persist_lib.ingest.decode import Decoded, DecodeSpec
    from persist_lib.ingest.kafka.topic import KafkaTopic


class KafkaRangeChunk(Chunk):
    """Offsets ``[start, end)`` of one partition, bound without fetching the messages
    (``KafkaRangeReader``). ``num_records`` counts offsets until the range is read: offsets
    that hold no message (transaction markers, compacted away) make it an upper bound.
    ``decode`` reads the range (``read_range``) wherever it runs and then sets
    ``num_records`` and ``nbytes`` to what it found."""

    def __init__(self, src: KafkaTopic, partition: str, start: int, end: int) -> None:
        self.src = src
        self.partition = partition
        self.start = (start,)
        self.end = (end,)
        self.num_records = max(0, end - start)
        self.nbytes = 0
        self.notes: tuple[Note, ...] = ()

    def split(self, at: Address) -> tuple[Chunk | None, Chunk | None]:
        a = int(at[0])
        s, e = int(self.start[0]), int(self.end[0])
        if a >= e:
            return self, None
        if a <= s:
            return None, self
        return KafkaRangeChunk(self.src, self.partition, s, a), KafkaRangeChunk(self.src, self.partition, a, e)

    def take(self, n: int) -> tuple[Chunk, Chunk | None]:
        if n >= self.num_records:
            return self, None
        head, tail = self.split((int(self.start[0]) + max(n, 1),))
        assert head is not None
        return head, tail

    def fetch(self) -> _Msgs:
        msgs = read_range(self.src, int(self.partition), int(self.start[0]), int(self.end[0]))
        self.num_records = len(msgs)
        self.nbytes = msgs.nbytes
        return msgs

    def decode(self, spec: DecodeSpec) -> Decoded:
        return self.src.decode_messages(self.partition, self.fetch(), spec)

    def __repr__(self) -> str:
        return f"KafkaRangeChunk({self.src.topic!r}/{self.partition}, [{self.start[0]}, {self.end[0]}))"


def read_range(src: KafkaTopic, partition: int, start: int, end: int) -> _Msgs:
    """The messages of ``partition`` with offsets in ``[start, end)`` -- a bound range --
    read with a fresh, manually assigned consumer that never commits (a Spark executor
    decoding its task's range, or a range chunk decoded in-process).

    Offsets in the range without a message (transaction markers, compacted away) are just
    absent, so every reader gets the same messages. Raises ``KafkaOffsetOutOfRange`` when
    the broker no longer serves ``start`` or its log now ends before ``end`` (recreated or
    truncated; judged after ``timeout_s`` without progress, as an open transaction also
    holds a read_committed reader back), ``KafkaTopicGone``, or ``SourceTimeout`` when the
    broker gives no answer for ``timeout_s``.
    """
    from confluent_kafka import Consumer, KafkaError, TopicPartition

    out = _Msgs()
    if end <= start:
        return out
    topic = src.topic
    c = Consumer(src._consumer_conf(**{"group.id": f"{src.group_id or 'persist'}-range"}))
    try:
        c.assign([TopicPartition(topic, partition, start)])
        deadline = time.monotonic() + src.timeout_s
        eof_at: int | None = None
        passed = False  # a message at or past ``end`` was seen: the range is complete
        while True:
            nxt = out.offs[-1] + 1 if out.offs else start
            events, groups = _consume(c, max(1, min(end - nxt, 20_000)), 0.2, _split_materialized)[1]
            got = 0
            for _, ms in groups:  # (only ``partition`` is assigned; offsets ascend in a group)
                assert isinstance(ms, _Msgs)
                passed = passed or ms.offs[-1] >= end
                ms = ms.slice(bisect.bisect_left(ms.offs, nxt), bisect.bisect_left(ms.offs, end))
                got += out.extend(ms)
            for m in events:
                err = m.error()
                code = err.code()
                if code == KafkaError._PARTITION_EOF:
                    eof_at = int(m.offset() or 0)
                elif code in (KafkaError.OFFSET_OUT_OF_RANGE, KafkaError._AUTO_OFFSET_RESET):
                    raise KafkaOffsetOutOfRange(
                        topic, partition, nxt, None, None, f"the broker said: {err.str()} (reading bound offsets [{start}, {end}))"
                    )
                elif code in (KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC, KafkaError._UNKNOWN_PARTITION):
                    raise KafkaTopicGone(
                        f"{src._where()}: partition {partition} is gone, but offsets [{start}, {end}) of it "
                        "are bound in the remap shard; rebuild the collection in a new rendition",
                        topic=topic, partition=partition, offset=nxt,
                    )
                elif err.fatal():
                    raise SourceUnavailable(f"{src._where()}: fatal consumer error {src._scrub(err.str())}")
            if got:
                deadline = time.monotonic() + src.timeout_s
            if passed or (out.offs and out.offs[-1] >= end - 1) or (eof_at is not None and eof_at >= end):
                return out
            if time.monotonic() > deadline:
                if eof_at is None and not out.offs:
                    eof_at = _log_end(src, partition)  # (Tansu answers a fetch past the end with nothing)
                    if eof_at is not None and eof_at > nxt:
                        eof_at = None  # the log reaches the range: something else holds it up
                if eof_at is not None:
                    raise KafkaOffsetOutOfRange(
                        topic, partition, max(eof_at, nxt), None, eof_at,
                        f"the log ends at offset {eof_at}, but offsets up to {end} are bound (the topic was "
                        "recreated or truncated, or a transaction stayed open for longer than timeout_s)",
                    )
                raise SourceTimeout(
                    f"{src._where()} partition {partition}: no answer while reading bound offsets "
                    f"[{start}, {end}) (at {nxt}) within {src.timeout_s:g}s; check that the broker is "
                    "reachable from here; retrying is safe (nothing was decided)"
                )
    finally:
        c.close()


def _log_end(src: KafkaTopic, partition: int) -> int | None:
    """Where ``partition``'s log ends, read off the broker (None: no answer). Reads from
    just before the high watermark to the end-of-partition event, as some brokers (Tansu)
    under-report the watermark and answer a fetch past the end with nothing at all."""
    from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

    c = Consumer(src._consumer_conf(**{"group.id": f"{src.group_id or 'persist'}-range"}))
    try:
        lo, hi = c.get_watermark_offsets(TopicPartition(src.topic, partition), timeout=5.0, cached=False)
        c.assign([TopicPartition(src.topic, partition, max(int(lo), int(hi) - 1, 0))])
        deadline = time.monotonic() + min(src.timeout_s, 10.0)
        while time.monotonic() < deadline:
            for m in c.consume(1000, 0.2):
                err = m.error()
                if err is not None and err.code() == KafkaError._PARTITION_EOF:
                    return int(m.offset() or 0)
        return None
    except KafkaException:
        return None
    finally:
        c.close()


class KafkaRangeReader(KafkaReader):
    """A ``KafkaReader`` that binds offset ranges instead of messages (``ranges=True``).

    While a partition's last stable offset (``_watermarks``: never inside an open
    transaction) is ahead of the position, ``read`` returns a ``KafkaRangeChunk`` up to it
    and fetches nothing: the backlog is read where it is decoded (Spark executors), and
    the partition is not assigned to the consumer, so it doesn't prefetch it either. Only
    when every partition is at its watermark does the reader fetch, like ``KafkaReader``: messages past a watermark that under-reports
    (Tansu) or that just arrived. Replays of bound offsets are ranges as well, except for
    messages this reader has fetched already.
    """

    def __init__(self, src: KafkaTopic, offsets: dict[int, int]) -> None:
        self._live: set[int] = set()  # partitions assigned to the consumer (fetching)
        self._tailing = False
        self._high: dict[int, int] = {}
        super().__init__(src, offsets)

    def _assign(self, parts: list[int]) -> None:
        for p in parts:
            self._pos.setdefault(p, 0)
            self._check_range(p)
        self._assigned.update(parts)
        if self._tailing:
            self._go_live(parts)

    def _go_live(self, parts: Iterable[int]) -> None:
        from confluent_kafka import TopicPartition

        new = sorted(p for p in parts if p not in self._live)
        if not new:
            return
        for p in new:
            self._buf.pop(p, None)
            self._fetched.discard(p)
            self._eof.pop(p, None)
        self._consumer.incremental_assign([TopicPartition(self.src.topic, p, self._pos.get(p, 0)) for p in new])
        self._live.update(new)

    def _range(self, p: int, end: int) -> KafkaRangeChunk:
        """Offsets from the position to ``end`` as a range; stops fetching ``p``."""
        from confluent_kafka import TopicPartition

        if p in self._live:
            self._consumer.incremental_unassign([TopicPartition(self.src.topic, p)])
            self._live.discard(p)
        self._buf.pop(p, None)
        self._fetched.discard(p)
        self._eof.pop(p, None)
        start = self._pos.get(p, 0)
        self._pos[p] = end
        return KafkaRangeChunk(self.src, str(p), start, end)

    def read(self, upto: Frontier | None, max_records: int) -> list[Chunk]:
        if upto is not None:
            return self._replay({int(p): int(a[0]) for p, a in upto.items()}, max_records)
        self._refresh()
        out: list[Chunk] = []
        left = max_records
        for p in sorted(self._assigned):
            if left <= 0:
                break
            c = self._cut(p, None, left)  # messages an earlier read fetched come first
            if c is not None:
                out.append(c)
                left -= c.num_records
                if left <= 0:
                    break
            hi = self._watermarks(p)[1]  # (the last stable offset)
            self._high[p] = hi
            pos = self._pos.get(p, 0)
            if hi > pos:
                out.append(self._range(p, min(hi, pos + left)))
                left -= min(hi, pos + left) - pos
        if out:
            return out
        self._tailing = True
        try:
            self._go_live(self._assigned)
            return super().read(None, max_records)
        finally:
            self._tailing = False

    def _replay(self, bounds: dict[int, int], max_records: int) -> list[Chunk]:
        self._check_bound(bounds)
        out: list[Chunk] = []
        for p, bound in sorted(bounds.items()):
            if self._pos.get(p, 0) >= bound:
                continue
            b = self._buf.get(p)
            if b is not None and len(b):
                c = self._cut(p, bound, max_records)
                if c is not None:
                    out.append(c)
                    continue
                if self._pos.get(p, 0) >= bound:
                    continue
            out.append(self._range(p, bound))
        return out

    def lag(self) -> Lag:
        return Lag(records_behind=sum(max(0, hi - self._pos.get(p, 0)) for p, hi in self._high.items()))
