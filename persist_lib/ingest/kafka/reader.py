"""Reading a topic: ``KafkaReader`` reads every partition from per-partition offsets with
one manually assigned consumer (no group rebalancing: every instance reads every
partition; partitions that appear while running are assigned at offset 0), fetching
ahead on a prefetch thread (``prefetch``) or in a reader process (``reader_process``),
and cuts what it fetched into ``KafkaChunk``s: at a binding's bounds when replaying,
by record count when minting. Consumers are read_committed: a binding ends at most at
a partition's last stable offset; offsets fetched again below a partition's position
are dropped (``messages._buffer``). Where a partition's offsets are no longer served,
a typed ``KafkaOffsetOutOfRange`` or ``KafkaTopicGone`` names it instead of skipping."""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

from persist_lib.ingest.addresses import Address, Frontier, Note
from persist_lib.ingest.errors import (
    IngestConfigError,
    KafkaOffsetOutOfRange,
    KafkaTopicGone,
    SourceTimeout,
    SourceUnavailable,
)
from persist_lib.ingest.kafka.messages import _Batch, _buffer, _Held
from persist_lib.ingest.kafka.prefetch import _consume, _Prefetcher
from persist_lib.ingest.kafka.reader_process import ReaderProcess
from persist_lib.ingest.kafka.split import convert_batch, decode_split, split_batch
from persist_lib.ingest.source import Chunk, Lag

if TYPE_CHECKING:  # pragma: no cover
    from persist_lib.ingest.decode import Decoded, DecodeSpec
    from persist_lib.ingest.kafka.topic import KafkaTopic

log = logging.getLogger(__name__)


class KafkaChunk(Chunk):
    """Messages of one Kafka partition with offsets in ``[start, end)``."""

    def __init__(self, src: KafkaTopic, partition: str, start: int, end: int, msgs: _Held) -> None:
        self.src = src
        self.partition = partition
        self.start = (start,)
        self.end = (end,)
        self.msgs = msgs
        self.num_records = len(msgs)
        self.nbytes = msgs.nbytes  # (values: what the bytes figures count)
        self.notes: tuple[Note, ...] = ()

    def split(self, at: Address) -> tuple[Chunk | None, Chunk | None]:
        a = int(at[0])
        s, e = int(self.start[0]), int(self.end[0])
        if a >= e:
            return self, None
        if a <= s:
            return None, self
        i = bisect.bisect_left(self.msgs.offs, a)
        p = self.partition
        return (
            KafkaChunk(self.src, p, s, a, self.msgs.slice(0, i)),
            KafkaChunk(self.src, p, a, e, self.msgs.slice(i, len(self.msgs))),
        )

    def take(self, n: int) -> tuple[Chunk, Chunk | None]:
        if n >= self.num_records:
            return self, None
        cut = self.msgs.offs[max(n, 1) - 1] + 1
        head, tail = self.split((cut,))
        assert head is not None
        return head, tail

    def decode(self, spec: DecodeSpec) -> Decoded:
        return self.msgs.decode(self.src, self.partition, spec)

    def __repr__(self) -> str:
        return f"KafkaChunk({self.src.topic!r}/{self.partition}, [{self.start[0]}, {self.end[0]}), {self.num_records} msgs)"


class KafkaReader:
    """Reads a topic from per-partition offsets with one manually assigned consumer."""

    def __init__(self, src: KafkaTopic, offsets: dict[int, int]) -> None:
        self.src = src
        self._pos: dict[int, int] = dict(offsets)  # next offset to return, per partition
        self._buf: dict[int, _Held] = {}
        self._assigned: set[int] = set()
        self._fetched: set[int] = set()  # partitions that answered (a message or EOF) since assignment
        # "end of partition" answers: partition -> (the log end it reported, when it was
        # consumed); it holds while no message at or past that offset was fetched (``_seen``)
        self._eof: dict[int, tuple[int, float]] = {}
        self._run_start: float | None = None  # begin_run: answers consumed since count
        # begin_run: each partition's end (last stable offset) asked from the broker at the
        # run's first read; an "end of partition" answer short of it is stale
        self._run_ends: dict[int, int] | None = None
        self._seen: dict[int, int] = {}  # partition -> 1 + the last offset fetched
        self._consumer = src.new_consumer()
        self._next_meta = 0.0
        self._prefetch: _Prefetcher | ReaderProcess | None = None
        prefetch = src.prefetch > 0 and type(self) is KafkaReader  # (a range reader fetches little)
        if prefetch and src.reader == "process":
            # (started first: the child imports while this process reads the metadata)
            self._prefetch = ReaderProcess(src, src.prefetch, src._where())
        try:
            self._refresh(force=True, count=src.checked_partitions())
        except BaseException:
            self.close()
            raise
        if prefetch and self._prefetch is None:
            self._prefetch = _Prefetcher(
                self._consumer, src.prefetch, src._where(),
                lambda msgs: split_batch(src, msgs), lambda sp: decode_split(src, sp),
            )

    @property
    def position(self) -> Frontier:
        return {str(p): (o,) for p, o in self._pos.items()}

    def _exclusive(self) -> AbstractContextManager[None]:
        """Around every consumer call but the prefetcher's own ``consume``."""
        return self._prefetch.exclusive() if self._prefetch is not None else nullcontext()

    def add_notes(self, notes: Iterable[Note]) -> None:
        return None

    def observe(self) -> list[Note]:
        return []

    def begin_run(self) -> None:
        """A run (``run_once``/``run``) begins: "end of partition" answers consumed before
        it are stale (messages may have been produced since), so the first read that finds
        nothing waits ``poll_s`` unless every partition reports its end anew. Answers
        consumed during the run stand until a message past them arrives, so the run's last
        reads don't wait ``poll_s`` each for answers an earlier read already took (the
        end-of-partition events usually come with the last messages). Without
        ``begin_run`` only answers consumed during the read itself count.

        The time an answer was consumed does not date the fetch it answers: a prefetching
        thread that lags (a loaded machine) hands over, after the run began, an "end of
        partition" that librdkafka queued before the messages the run is for were
        produced. So the run's first read also asks the broker where each partition ends
        now, and only an answer at or past that end counts."""
        self._eof.clear()
        self._run_start = time.monotonic()
        self._run_ends = None

    def _at_end(self, p: int, since: float) -> bool:
        """The last answer for ``p``, consumed at ``since`` or later, was its end, and
        nothing was fetched past it."""
        e = self._eof.get(p)
        ends = self._run_ends or {}
        return e is not None and e[1] >= since and e[0] >= max(self._seen.get(p, 0), ends.get(p, 0))

    # ----- partitions -----------------------------------------------------------------

    def _refresh(self, force: bool = False, count: int | None = None) -> None:
        """Re-reads the partition count (``count``: one just read): assigns new partitions
        (at offset 0, or where the frontier puts them), fails if the topic is gone or shrank
        below a known partition."""
        now = time.monotonic()
        if not force and now < self._next_meta:
            return
        self._next_meta = now + self.src.metadata_interval_s
        n = count
        if n is None:
            with self._exclusive():
                n = self.src.topic_partitions(self._consumer)
        known = set(self._pos) | self._assigned
        if n is None:
            raise KafkaTopicGone(
                f"{self.src._where()} no longer exists (deleted?) but the ingestion has read "
                f"partitions {sorted(known)} of it; messages not yet durable are lost and new ones "
                "would start again at offset 0: rebuild the collection in a new rendition (a new "
                "ingestion name) from the recreated topic",
                topic=self.src.topic, partition=None, offset=None,
            ) if known else IngestConfigError(
                f"{self.src._where()} does not exist: create it or fix the topic name"
            )
        gone = sorted(p for p in known if p >= n)
        if gone:
            p = gone[0]
            raise KafkaTopicGone(
                f"{self.src._where()} has {n} partitions now, but the ingestion has read partition(s) "
                f"{gone} (partition {p} up to offset {self._pos.get(p, 0)}): partitions were removed "
                "(the topic was recreated with fewer?); Kafka never reduces partitions in place: "
                "rebuild the collection in a new rendition from the topic as it is now",
                topic=self.src.topic, partition=p, offset=self._pos.get(p, 0),
            )
        new = [p for p in range(n) if p not in self._assigned]
        if new:
            self._assign(new)

    def _assign(self, parts: list[int]) -> None:
        from confluent_kafka import TopicPartition

        for p in parts:
            self._pos.setdefault(p, 0)
            self._check_range(p)
        if isinstance(self._prefetch, ReaderProcess):  # (its consumer fetches; ours only asks)
            self._prefetch.assign([(p, self._pos[p]) for p in parts])
        else:
            with self._exclusive():
                self._consumer.incremental_assign([TopicPartition(self.src.topic, p, self._pos[p]) for p in parts])
        self._assigned.update(parts)
        if self._assigned != set(parts):
            log.info("%s: partitions %s appeared; assigned at offsets %s", self.src._where(), parts, [self._pos[p] for p in parts])

    def _watermarks(self, p: int) -> tuple[int, int]:
        """(low watermark, end) of ``p``, asked from the broker. The consumer is
        read_committed (pinned, see ``KafkaTopic``), and librdkafka (since 1.8) asks
        ListOffsets with that isolation level, so the end is the *last stable offset*: the
        first offset of the oldest open transaction, the high watermark when none is open
        (Tansu: 0 while one is open, see docs/ingestion.md)."""
        from confluent_kafka import KafkaException, TopicPartition

        deadline = time.monotonic() + self.src.timeout_s
        delay = 0.1
        while True:
            try:
                with self._exclusive():
                    lo, hi = self._consumer.get_watermark_offsets(TopicPartition(self.src.topic, p), timeout=5.0, cached=False)
                return int(lo), int(hi)
            except KafkaException as e:
                if time.monotonic() >= deadline:
                    raise SourceTimeout(
                        f"{self.src._where()} partition {p}: no offsets from the broker within "
                        f"{self.src.timeout_s:g}s ({self.src._scrub(str(e))}); check the broker; retrying is safe"
                    ) from None
            time.sleep(delay)
            delay = min(delay * 2, 2.0)

    def _check_range(self, p: int) -> None:
        """The offset this reader starts at must still be served (see ``KafkaOffsetOutOfRange``)."""
        o = self._pos.get(p, 0)
        if o == 0:
            return  # (offset 0 below the low watermark: Kafka's fetch says OFFSET_OUT_OF_RANGE)
        lo, hi = self._watermarks(p)
        if o < lo:
            self._out_of_range(p, o, lo, hi, f"offsets below {lo} were deleted (retention or delete_records)")
        if o > hi and not self._last_exists(p, o - 1):
            # (checked by reading: some brokers under-report the high watermark)
            self._out_of_range(p, o, lo, hi, "the log ends before it (the topic was recreated or truncated)")

    def _last_exists(self, p: int, off: int) -> bool:
        """The log of ``p`` reaches offset ``off``: read, as the end offset the broker
        reports may be short of it (Tansu: its high watermark under-reports, and its last
        stable offset is 0 while a transaction is open)."""
        from confluent_kafka import Consumer, KafkaError, TopicPartition

        c = Consumer(self.src._consumer_conf(**{"group.id": f"{self.src.group_id}-probe"}))
        try:
            c.assign([TopicPartition(self.src.topic, p, off)])
            deadline = time.monotonic() + min(self.src.timeout_s, 5.0)
            while time.monotonic() < deadline:
                m = c.poll(0.2)
                if m is None:
                    continue
                # A message at or past the offset, or the end of the partition past it: the
                # log reaches it (the offset itself may hold no message -- a transaction's
                # commit marker, which a binding up to the last stable offset can end
                # right after). Any other error, or the end at or before it: it does not.
                err = m.error()
                if err is None:
                    return bool((m.offset() or 0) >= off)
                return bool(err.code() == KafkaError._PARTITION_EOF and (m.offset() or 0) > off)
            return False
        finally:
            c.close()

    def _out_of_range(self, p: int, o: int, lo: int | None, hi: int | None, why: str) -> None:
        raise KafkaOffsetOutOfRange(self.src.topic, p, o, lo, hi, why)

    # ----- fetching ---------------------------------------------------------------------

    def _poll(self, timeout: float, max_n: int) -> int:
        """Moves fetched messages into the per-partition buffers; returns how many."""
        from confluent_kafka import KafkaError

        if self._prefetch is not None:
            batches = self._prefetch.take(max_n, timeout)
        else:
            # consume() waits for the whole batch or the timeout: modest batches, so a
            # partial one (the prefetch queue ran dry) costs at most ``timeout``
            batches = [(_consume(self._consumer, max(1, min(max_n, 20_000)), timeout, self._convert)[1], time.monotonic())]
        for (events, _), at in batches:  # (every event first, as before)
            for m in events:
                self._on_error(m.error(), m, KafkaError, at)
        got = 0
        for (_, groups), _at in batches:
            for p, ms in groups:
                got += _buffer(self._buf, p, self._pos.get(p, 0), ms)
                self._fetched.add(p)
                if ms.offs:
                    self._seen[p] = max(self._seen.get(p, 0), ms.offs[-1] + 1)
        return got

    def _convert(self, msgs: list[Any]) -> _Batch:
        return convert_batch(self.src, msgs)

    def _on_error(self, err: Any, m: Any, KafkaError: Any, at: float) -> None:  # noqa: N803 - the class
        code = err.code()
        p = m.partition()
        if code == KafkaError._PARTITION_EOF:
            if p is not None:
                self._fetched.add(p)
                self._eof[p] = (int(m.offset() or 0), at)
            return
        if code in (KafkaError.OFFSET_OUT_OF_RANGE, KafkaError._AUTO_OFFSET_RESET):
            pp = p if p is not None and p >= 0 else -1
            self._out_of_range(pp, self._pos.get(pp, m.offset() or 0), None, None, f"the broker said: {err.str()}")
        if code in (KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC, KafkaError._UNKNOWN_PARTITION):
            self._refresh(force=True)  # raises KafkaTopicGone if it is gone
            return
        if err.fatal():
            raise SourceUnavailable(f"{self.src._where()}: fatal consumer error {self.src._scrub(err.str())}")
        log.debug("%s: %s", self.src._where(), err.str())

    def _buffered(self) -> int:
        return sum(len(b) for b in self._buf.values())

    def _cut(self, p: int, bound: int | None, max_n: int | None) -> KafkaChunk | None:
        """The buffered messages of ``p`` below ``bound`` (at most ``max_n``) as a chunk."""
        b = self._buf.get(p)
        start = self._pos.get(p, 0)
        if b is None or not b.offs:
            return None
        i = len(b.offs) if bound is None else bisect.bisect_left(b.offs, bound)
        if max_n is not None:
            i = min(i, max_n)
        if i == 0:
            if bound is not None and b.offs[0] >= bound and start < bound:
                self._pos[p] = bound  # an offset gap (transaction markers, compaction) up to the bound
            return None
        head = b.slice(0, i)
        rest = b.slice(i, len(b.offs))
        self._buf[p] = rest
        end = head.offs[-1] + 1
        if bound is not None and rest.offs and rest.offs[0] >= bound:
            end = bound
        self._pos[p] = end
        return KafkaChunk(self.src, str(p), start, end, head)

    def read(self, upto: Frontier | None, max_records: int) -> list[Chunk]:
        if upto is not None:
            return self._replay({int(p): int(a[0]) for p, a in upto.items()}, max_records)
        self._refresh()
        if self._run_start is not None and self._run_ends is None:
            self._run_ends = {p: self._watermarks(p)[1] for p in sorted(self._assigned)}
        deadline = time.monotonic() + self.src.timeout_s
        since = self._run_start if self._run_start is not None else time.monotonic()
        got = 1
        while self._buffered() < max_records:
            first = not self._assigned <= self._fetched
            # every partition is at its end: don't wait
            at_end = not first and all(self._at_end(p, since) for p in self._assigned)
            # while messages flow, short waits; after an empty poll, ``poll_s`` to call it idle
            wait = 0.0 if at_end else 0.5 if first else 0.02 if got else self.src.poll_s
            got = self._poll(wait, max_records - self._buffered())
            if got or wait < self.src.poll_s and not at_end:
                continue
            if not (self._assigned <= self._fetched):
                if time.monotonic() > deadline:
                    missing = sorted(self._assigned - self._fetched)
                    raise SourceTimeout(
                        f"{self.src._where()}: partitions {missing} gave no answer (no message, no end of "
                        f"partition) within {self.src.timeout_s:g}s; check that the broker is reachable; "
                        "retrying is safe (nothing was decided)"
                    )
                continue
            break
        out: list[Chunk] = []
        left = max_records
        for p in sorted(self._buf):
            if left <= 0:
                break
            c = self._cut(p, None, left)
            if c is not None:
                out.append(c)
                left -= c.num_records
        return out

    def _check_bound(self, bounds: dict[int, int]) -> None:
        """Every partition a binding names still exists (else ``KafkaTopicGone``)."""
        self._refresh()  # (rate-limited: also how an unreachable broker becomes SourceTimeout)
        for p in bounds:
            if p not in self._assigned:
                self._refresh(force=True)
                if p not in self._assigned:
                    raise KafkaTopicGone(
                        f"{self.src._where()}: partition {p} is bound in the remap shard but the topic "
                        "does not have it any more; rebuild in a new rendition",
                        topic=self.src.topic, partition=p, offset=self._pos.get(p, 0),
                    )

    def _replay(self, bounds: dict[int, int], max_records: int) -> list[Chunk]:
        self._check_bound(bounds)
        out: list[Chunk] = []
        for _ in range(2):
            for p, bound in sorted(bounds.items()):
                if self._pos.get(p, 0) >= bound:
                    continue
                c = self._cut(p, bound, max_records)
                if c is not None:
                    out.append(c)
            if out:
                return out
            if all(self._pos.get(p, 0) >= bound for p, bound in bounds.items()):
                return out
            self._poll(self.src.poll_s, max_records)
        return out

    def lag(self) -> Lag:
        from confluent_kafka import TopicPartition

        try:
            behind = 0
            if isinstance(self._prefetch, ReaderProcess):
                high = self._prefetch.high_watermarks()
                return Lag(records_behind=sum(max(0, high[p] - self._pos.get(p, 0)) for p in self._assigned if p in high))
            for p in sorted(self._assigned):
                # cached: the high watermark of the last fetch response (no broker round trip)
                with self._exclusive():
                    _, hi = self._consumer.get_watermark_offsets(TopicPartition(self.src.topic, p), cached=True)
                if hi is not None and hi >= 0:
                    behind += max(0, int(hi) - self._pos.get(p, 0))
            return Lag(records_behind=behind)
        except Exception:  # noqa: BLE001 - lag is informational
            return Lag()

    def close(self) -> None:
        if self._prefetch is not None:
            self._prefetch.close()  # (before the consumer goes: it may be in consume())
            self._prefetch = None
        try:
            self._consumer.close()
        except Exception:  # noqa: BLE001 - best effort
            pass
