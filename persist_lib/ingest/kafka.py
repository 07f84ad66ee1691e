"""Kafka source: one source partition per Kafka partition, address = ``(offset,)``.

Why it is definite: a Kafka partition is an ordered, replayable log, so the messages in
``[F(b-1), F(b))`` of every partition are the same for every instance that replays a
binding (as long as the broker still serves them; if not, a typed
``KafkaOffsetOutOfRange`` names topic, partition and offset instead of skipping).
Partitions that appear while running are assigned at offset 0 and bound like the rest.
Consumers are read_committed (pinned): a binding ends at most at a partition's last
stable offset, so it never holds an aborted transaction's messages or part of an open
one; offsets fetched again below a partition's position are dropped (``_buffer``).

The consumer uses manual assignment (no group rebalancing: every instance reads every
partition) and never commits on its own. ``release`` -- called by the driver only
after every output is durable up to a binding -- commits exactly that binding's
frontier as the consumer group's offsets, so the group offsets (what monitoring and
retention tooling look at) never run ahead of what is durable.

Decoding (row-wise, so any chunking decodes identically): key and value are ``json``
(an object's fields; a scalar JSON key fills a single key field), ``text`` (UTF-8) or
``bytes`` into one field; ``include`` adds message metadata (partition, offset,
timestamp, headers, topic) as columns. With the upsert envelope a null value (a
tombstone) deletes its key.
"""

from __future__ import annotations

import base64
import bisect
import dataclasses
import json
import logging
import operator
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from itertools import compress, repeat
from typing import TYPE_CHECKING, Any, cast
from urllib.parse import parse_qsl, unquote, urlsplit

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from persist_lib.ingest.decode import (
    Decoded,
    DecodeSpec,
    ErrorRecord,
    cast_rowwise,
    decode_json_lines,
    merge_good_and_bad,
    raw_table,
)
from persist_lib.ingest.errors import (
    IngestConfigError,
    IngestInvariantError,
    KafkaOffsetOutOfRange,
    KafkaTopicGone,
    SourceTimeout,
    SourceUnavailable,
)
from persist_lib.ingest.kafka_prefetch import _consume, _Prefetcher
from persist_lib.ingest.kafka_proc import ReaderProcess
from persist_lib.ingest.source import Address, Chunk, Frontier, Lag, Note
from persist_lib.location.redaction import (
    SensitiveUrl,
    redacted_dataclass_repr,
    scrub,
    settings_secrets,
)

if TYPE_CHECKING:  # pragma: no cover
    from persist_lib.handles.client import PersistClient

log = logging.getLogger(__name__)

FORMATS = ("json", "text", "bytes", "none")
READERS = ("thread", "process")  # where a reader prefetches and decodes (KafkaSource.reader)
METADATA = ("partition", "offset", "timestamp", "headers", "topic")
_TOMBSTONE = "__kafka_tombstone"

# How the reader's consumer fetches (bench/kafka_ingest.py gives its raw-consume anchor the
# same settings). ``fetch.queue.backoff.ms``: librdkafka's default (1000 ms) stops fetching
# a partition for a second whenever its local queue reached ``queued.min.messages``; a
# reader that drains the queue faster than that then waits for the broker with nothing
# to do -- measured: a raw consume of 1M messages took 1.5-4 s instead of 0.65-1.3 s, and
# ``run_once`` took such a pause for the end of the topic (poll_s) and returned early.
# ``reconnect.backoff.ms`` (librdkafka: 100): a fresh consumer suppresses "connect to
# any broker" for half of it after its first connection attempt, so its first metadata
# request or fetch often waited ~50 ms for nothing (a topic check's ``list_topics``
# against Tansu took 1 or 53 ms, about half the time each); 10 ms (still doubling up to
# ``reconnect.backoff.max.ms`` while a broker stays down) takes that to a few ms.
FETCH_SETTINGS: dict[str, Any] = {
    "fetch.wait.max.ms": 100,
    "queued.min.messages": 200_000,
    "fetch.queue.backoff.ms": 50,
    "reconnect.backoff.ms": 10,
}


def _parse_include(include: Mapping[str, str] | Sequence[str] | str | None) -> dict[str, str]:
    """``include`` -> {column name: metadata kind}."""
    if include is None:
        return {}
    if isinstance(include, str):
        items: list[tuple[str, str]] = []
        for part in [p.strip() for p in include.split(",") if p.strip()]:
            kind, _, col = part.partition("=")
            items.append((kind.strip(), col.strip() or f"kafka_{kind.strip()}"))
    elif isinstance(include, Mapping):
        items = [(str(k), str(v)) for k, v in include.items()]
    else:
        items = [(str(k), f"kafka_{k}") for k in include]
    out: dict[str, str] = {}
    for kind, col in items:
        if kind not in METADATA:
            raise IngestConfigError(
                f"unknown Kafka metadata {kind!r} in include: use any of {', '.join(METADATA)} "
                "(optionally KIND=COLUMN, e.g. 'timestamp=ts')"
            )
        out[col] = kind
    return out


def _bootstrap_of(url: str) -> tuple[str, dict[str, str]]:
    """``kafka://[USER:PASSWORD@]HOST:PORT[,HOST:PORT]?security_protocol=...`` or a
    plain ``HOST:PORT,...`` list -> (bootstrap.servers, extra librdkafka settings)."""
    if "://" not in url:
        return url, {}
    parts = urlsplit(url)
    if parts.scheme != "kafka":
        raise IngestConfigError(
            f"Kafka bootstrap URL {SensitiveUrl(url)}: use kafka://[USER:PASSWORD@]HOST:PORT[,HOST:PORT]"
            "[?security_protocol=SASL_SSL&sasl_mechanism=PLAIN] or a plain HOST:PORT list"
        )
    netloc = parts.netloc
    conf: dict[str, str] = {}
    if "@" in netloc:
        userinfo, _, netloc = netloc.rpartition("@")
        user, _, pw = userinfo.partition(":")
        conf["sasl.username"] = unquote(user)
        conf["sasl.password"] = unquote(pw)
        conf.setdefault("security.protocol", "SASL_SSL")
        conf.setdefault("sasl.mechanism", "PLAIN")
    for k, v in parse_qsl(parts.query, keep_blank_values=True):
        conf[k.replace("_", ".")] = v
    if not netloc:
        raise IngestConfigError(f"Kafka bootstrap URL {SensitiveUrl(url)} names no HOST:PORT")
    return netloc, conf


class _Msgs:
    """Fetched messages of one partition (offsets ascending), not decoded yet: offsets
    and values as lists, and keys, timestamps and headers read off the confluent-kafka
    ``Message`` objects (``msgs``) only when decoding asks for them -- or given as lists
    (``materialize``, rebuilds).

    ``Message`` objects are GC-tracked, so the reader never keeps them past the batch
    they came in (see ``_Decoded`` and ``kafka_prefetch._gc_paused``): holding a binding's worth of
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

    def decode(self, src: KafkaSource, partition: str, spec: DecodeSpec) -> Decoded:
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
    def of(cls, src: KafkaSource, partition: str, m: _Msgs, spec: DecodeSpec) -> _Decoded:
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

    def decode(self, src: KafkaSource, partition: str, spec: DecodeSpec) -> Decoded:
        if spec is not self.spec and spec != self.spec:
            raise IngestInvariantError(
                f"{src._where()} partition {partition}: messages were decoded with another schema "
                "than the one asked for now; reopen the reader after changing the decoding"
            )
        return Decoded(self.rows, list(self.errors), self.raw)


_Held = _Msgs | _Decoded  # what a reader buffers per partition
_Batch = tuple[list[Any], list[tuple[int, _Held]]]  # (error/event messages, [(partition, messages)])
_Fetched = tuple[_Batch, float]  # a batch and when ``consume`` returned it (time.monotonic)


def _split(msgs: list[Any]) -> tuple[list[Any], list[tuple[int, _Msgs]]]:
    """One ``consume()`` batch -> (its error/event messages in order, [(partition, its
    messages)] for each run of one partition with ascending offsets, in the order
    consumed). One ``map`` over the batch per field (C calls, no Python frame per
    message); keys, timestamps and headers are left on the messages (``_Msgs``)."""
    if not msgs:
        return [], []
    from confluent_kafka import Message

    runs = _native_split(msgs)
    if runs is not None:
        return [], [
            (p, _Msgs(msgs[i:j], offs, vals, joined=joined, vlen=np.frombuffer(lens, dtype=np.int64).tolist()))
            for p, i, j, offs, vals, joined, lens in runs
        ]
    errs = list(map(Message.error, msgs))
    events: list[Any] = []
    if any(errs):  # (a KafkaError is truthy; its __eq__ rejects None, so no errs.count(None))
        events = list(compress(msgs, errs))
        msgs = list(compress(msgs, map(operator.is_, errs, repeat(None))))
        if not msgs:
            return events, []
    parts: list[int] = list(map(Message.partition, msgs))  # type: ignore[arg-type]
    offs: list[int] = list(map(Message.offset, msgs))  # type: ignore[arg-type]
    vals: list[bytes | None] = list(map(Message.value, msgs))
    n = len(parts)
    p = np.array(parts, dtype=np.int64)
    o = np.array(offs, dtype=np.int64)
    # runs of one partition, cut where the offsets don't ascend (a re-fetch after a reconnect)
    cuts = (np.flatnonzero((p[1:] != p[:-1]) | (o[1:] <= o[:-1])) + 1).tolist()
    if not cuts:
        return events, [(parts[0], _Msgs(msgs, offs, vals))]
    return events, [
        (parts[i], _Msgs(msgs[i:j], offs[i:j], vals[i:j]))
        for i, j in zip([0, *cuts], [*cuts, n], strict=True)
    ]


_native: Any = None  # persist_lib.ingest._kafka_split once bound; False: not available


def _native_split(msgs: list[Any]) -> list[tuple[int, int, int, list[int], list[bytes | None], bytes | None, bytes]] | None:
    """``_split``'s work (and decoding's join of the values) in one C pass when the
    optional extension ``_kafka_split`` is built (see its source): None when it is not,
    or when the batch holds an event (then the Python path). ``PERSIST_KAFKA_NATIVE=0``
    turns it off."""
    global _native
    if _native is None:
        _native = False
        if os.environ.get("PERSIST_KAFKA_NATIVE", "1") != "0":
            try:
                from confluent_kafka import Message

                from persist_lib.ingest import _kafka_split  # type: ignore[attr-defined]

                if _kafka_split.bind(Message):
                    _native = _kafka_split
            except ImportError:
                log.info("persist_lib.ingest._kafka_split is not built: Kafka batches are split in Python")
    if _native is False:
        return None
    return cast(Any, _native).split(msgs)


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


def _split_materialized(msgs: list[Any]) -> _Batch:
    """``_split`` with keys, timestamps and headers read off (the messages let go)."""
    events, groups = _split(msgs)
    return events, [(p, m.materialize()) for p, m in groups]


_Split = tuple[list[Any], list[tuple[int, _Held]], DecodeSpec | None]  # a batch split, not decoded yet


def split_batch(src: KafkaSource, msgs: list[Any]) -> _Split:
    """The first stage of ``convert_batch``: the batch split by partition (``_split``),
    with the schema to decode it with (None: no ingestion attached one -- the messages
    are pulled into lists, nothing is left to decode)."""
    events, groups = _split(msgs)
    spec = src._spec
    if spec is None:
        return events, [(p, m.materialize()) for p, m in groups], None
    return events, list(groups), spec


def decode_split(src: KafkaSource, sp: _Split) -> _Batch:
    """The second stage of ``convert_batch``: each partition's messages decoded
    (``_Decoded``); their ``Message`` objects are let go."""
    events, groups, spec = sp
    if spec is None:
        return events, groups
    return events, [(p, _Decoded.of(src, str(p), cast(_Msgs, m), spec)) for p, m in groups]


def convert_batch(src: KafkaSource, msgs: list[Any]) -> _Batch:
    """A consumed batch, each partition's messages decoded right away (``_Decoded``),
    or -- when no ingestion attached its schema -- held as lists for later. What a
    reader's reader process (``kafka_proc``) and a reader without prefetching run; the
    prefetcher runs its two stages on two threads."""
    return decode_split(src, split_batch(src, msgs))


class KafkaChunk(Chunk):
    """Messages of one Kafka partition with offsets in ``[start, end)``."""

    def __init__(self, src: KafkaSource, partition: str, start: int, end: int, msgs: _Held) -> None:
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


@dataclass
class KafkaSource:
    """A Kafka topic (see the module docstring).

    ``bootstrap_url``: ``HOST:PORT[,HOST:PORT]`` or ``kafka://USER:PASSWORD@HOST:PORT?...``
    (SASL; query parameters are librdkafka settings with ``_`` for ``.``, e.g.
    ``security_protocol=SASL_SSL&sasl_mechanism=SCRAM-SHA-512``; never shown in reprs,
    logs or errors). ``key_format``/``value_format``: ``json``, ``text``, ``bytes`` or
    ``none`` (key only). ``key_field``/``value_field``: the field a text/bytes key or
    value goes to (default: the only candidate). ``include``: metadata columns, e.g.
    ``"partition,offset,timestamp=ts,headers"`` (default column ``kafka_KIND``).
    ``group_id`` (default ``persist_NAME``): the consumer group whose offsets are
    committed at the durable frontier. ``timeout_s``: how long an unreachable broker is
    retried (with backoff) before ``SourceTimeout``. ``ranges``: the reader binds offset
    ranges up to each partition's last stable offset without fetching them (``KafkaRangeReader``;
    Spark ingestion decodes them on executors). ``prefetch``: messages the reader may
    consume and decode ahead of the ingestion (so fetching overlaps decoding and
    appending; 0: fetch only when asked, on the ingestion's thread). ``reader``: where
    that runs -- ``"thread"``, a thread of this process, or ``"process"``, a spawned
    reader process (``kafka_proc``) that ships the decoded batches over a socket, so its
    GIL-bound work runs on another core than the ingestion's.
    """

    bootstrap_url: str
    topic: str
    key_format: str = "none"
    value_format: str = "json"
    key_field: str | None = None
    value_field: str | None = None
    include: Mapping[str, str] | Sequence[str] | str | None = None
    group_id: str | None = None
    commit_offsets: bool = True
    timeout_s: float = 30.0
    poll_s: float = 0.2
    metadata_interval_s: float = 5.0
    prefetch: int = 200_000
    reader: str = "thread"
    config: Mapping[str, str] | None = field(default=None, repr=False)  # extra librdkafka settings
    ranges: bool = False
    kind: str = "kafka"
    _servers: str = field(default="", init=False, repr=False)
    _conf: dict[str, str] = field(default_factory=dict, init=False, repr=False)
    _meta: dict[str, str] = field(default_factory=dict, init=False, repr=False)
    _spec: DecodeSpec | None = field(default=None, init=False, repr=False)
    _envelope: str = field(default="append_only", init=False, repr=False)
    _committer: Any = field(default=None, init=False, repr=False)
    _checked: tuple[int, float] | None = field(default=None, init=False, repr=False)  # check(): (partitions, when)
    _committed: dict[int, int] = field(default_factory=dict, init=False, repr=False)
    _name: str = field(default="", init=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.topic, str) or not self.topic:
            raise IngestConfigError("KafkaSource needs a topic name")
        for what, v in (("key_format", self.key_format), ("value_format", self.value_format)):
            if v not in FORMATS or (what == "value_format" and v == "none"):
                allowed = FORMATS if what == "key_format" else FORMATS[:3]
                raise IngestConfigError(f"Kafka {what} {v!r} is not supported: use one of {', '.join(allowed)}")
        url = SensitiveUrl(self.bootstrap_url)
        if "://" in self.bootstrap_url and url.problem:
            raise IngestConfigError(f"the Kafka bootstrap URL {url} is ambiguous: {url.problem}")
        if self.reader not in READERS:
            raise IngestConfigError(f"Kafka reader {self.reader!r} is not supported: use one of {', '.join(READERS)}")
        self._servers, self._conf = _bootstrap_of(self.bootstrap_url)
        self._meta = _parse_include(self.include)
        iso = {**self._conf, **dict(self.config or {})}.get("isolation.level", "read_committed")
        if str(iso).lower() != "read_committed":
            raise IngestConfigError(
                f"Kafka topic {self.topic!r}: isolation.level={iso!r} is not supported: an ingestion "
                "reads committed messages only (read_committed), so a binding never holds messages of "
                "an open or aborted transaction and binds at most up to the last stable offset; drop "
                "the setting"
            )

    def __repr__(self) -> str:  # the bootstrap URL may hold a SASL password
        return redacted_dataclass_repr(self)

    # ----- identity and configuration -----------------------------------------------

    def attach(self, client: PersistClient, name: str, spec: DecodeSpec | None = None) -> None:
        self._name = name
        self._spec = spec
        if self.group_id is None:
            self.group_id = f"persist_{name}"

    def bind_envelope(self, kind: str) -> None:
        self._envelope = kind
        if kind == "upsert" and self.key_format == "none":
            raise IngestConfigError(
                f"Kafka topic {self.topic!r}: the upsert envelope needs the message key "
                "(a tombstone carries only the key): pass key_format='json', 'text' or 'bytes'"
            )

    def describe(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "bootstrap": SensitiveUrl(self.bootstrap_url).redacted if "://" in self.bootstrap_url else self.bootstrap_url,
            "topic": self.topic,
            "key_format": self.key_format,
            "value_format": self.value_format,
            "include": dict(self._meta),
            "group_id": self.group_id,
        }

    def _where(self) -> str:
        return f"Kafka topic {self.topic!r} at {self.describe()['bootstrap']}"

    def partitions(self) -> tuple[str, ...]:
        return tuple(str(p) for p in range(self.partition_count()))

    def initial_frontier(self) -> Frontier:
        return {}  # every partition starts at offset 0, including ones added later

    def _consumer_conf(self, **extra: Any) -> dict[str, Any]:
        conf: dict[str, Any] = {
            "bootstrap.servers": self._servers,
            "group.id": self.group_id or "persist",
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "auto.offset.reset": "error",
            "enable.partition.eof": True,
            "isolation.level": "read_committed",
            **FETCH_SETTINGS,
            "socket.connection.setup.timeout.ms": max(1000, int(self.timeout_s * 1000)),
            "reconnect.backoff.max.ms": 2000,
            "logger": log,
        }
        conf.update(self._conf)
        conf.update(dict(self.config or {}))
        conf.update(extra)
        return conf

    def new_consumer(self) -> Any:
        from confluent_kafka import Consumer

        try:
            return Consumer(self._consumer_conf())
        except Exception as e:  # noqa: BLE001 - librdkafka's configuration errors
            raise IngestConfigError(
                f"{self._where()}: invalid consumer configuration: {self._scrub(str(e))}; fix the "
                "bootstrap URL parameters or config"
            ) from None

    def _scrub(self, text: str) -> str:
        """``text`` without the settings' values that are not known to be harmless
        (``redaction.HARMLESS_SETTINGS``: a private key, an OAuth config, a password
        under any name) nor the bootstrap URL's secrets."""
        text = scrub(text, settings_secrets({**self._conf, **dict(self.config or {})}))
        return SensitiveUrl(self.bootstrap_url).scrub(text) if "://" in self.bootstrap_url else text

    def topic_partitions(self, consumer: Any) -> int | None:
        """The topic's partition count (None: the topic does not exist), retrying an
        unreachable broker with backoff for ``timeout_s`` before ``SourceTimeout``."""
        from confluent_kafka import KafkaError, KafkaException

        deadline = time.monotonic() + self.timeout_s
        delay = 0.1
        last = ""
        while True:
            try:
                md = consumer.list_topics(self.topic, timeout=max(0.5, min(5.0, deadline - time.monotonic())))
                t = md.topics.get(self.topic)
                if t is None:
                    return None
                if t.error is not None:
                    if t.error.code() in (KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC):
                        return None
                    if not t.error.retriable():
                        raise SourceUnavailable(f"{self._where()}: metadata error {t.error.str()}")
                    last = t.error.str()
                else:
                    return len(t.partitions)
            except KafkaException as e:
                last = self._scrub(str(e.args[0].str() if e.args else e))
            if time.monotonic() >= deadline:
                raise SourceTimeout(
                    f"{self._where()}: no answer from the broker(s) within {self.timeout_s:g}s "
                    f"(retried with backoff; last error: {last}); check that the broker is up and the "
                    "bootstrap address/port and security settings are right; retrying later is safe "
                    "(nothing was decided)"
                )
            time.sleep(delay)
            delay = min(delay * 2, 2.0)

    def partition_count(self) -> int:
        c = self.new_consumer()
        try:
            n = self.topic_partitions(c)
        finally:
            c.close()
        if n is None:
            raise IngestConfigError(
                f"{self._where()} does not exist: create it (e.g. kafka-topics.sh --create --topic "
                f"{self.topic}) or fix the topic name"
            )
        return n

    def check(self) -> None:
        """The schema fits the formats, and the broker answers (``SourceTimeout`` if not).
        A missing topic is judged by the reader: a configuration error for a new
        ingestion, ``KafkaTopicGone`` for one that already read from it."""
        if self._spec is not None:
            self._plan(self._spec)
        # (the committer asks: it is connected by the time the first binding commits)
        c = self._committer if self._committer is not None else self.new_consumer()
        try:
            n = self.topic_partitions(c)
        except BaseException:
            if c is not self._committer:
                c.close()
            raise
        if not self.commit_offsets:
            c.close()
        else:
            self._committer = c
        self._checked = None if n is None else (n, time.monotonic())

    def checked_partitions(self, max_age_s: float = 1.0) -> int | None:
        """The partition count ``check`` read, if it did so less than ``max_age_s`` ago
        (then forgotten): the reader the driver opens right after uses it instead of
        asking the broker again (a fresh consumer's metadata request delays its first
        fetch by up to ~50 ms against Tansu)."""
        got, self._checked = self._checked, None
        if got is None or time.monotonic() - got[1] > max_age_s:
            return None
        return got[0]

    def prepare(self) -> None:
        return None

    # ----- reading --------------------------------------------------------------------

    def open_reader(self, frontier: Frontier, notes: list[Note]) -> KafkaReader:
        offsets = {int(p): int(a[0]) for p, a in frontier.items()}
        return KafkaRangeReader(self, offsets) if self.ranges else KafkaReader(self, offsets)

    def settings(self) -> dict[str, Any]:
        """The constructor arguments (to build the same source elsewhere, e.g. on a Spark
        executor: ``KafkaSource(**settings)``); the executor copy never commits offsets."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init and f.name != "kind"}
        out.update(commit_offsets=False, ranges=False, config=dict(self.config or {}))
        return out

    def release(self, frontier: Frontier) -> None:
        """Commits the durable frontier as the consumer group's offsets (never beyond it)."""
        if not self.commit_offsets:
            return
        from confluent_kafka import KafkaException, TopicPartition

        want = {int(p): int(a[0]) for p, a in frontier.items()}
        todo = [TopicPartition(self.topic, p, o) for p, o in sorted(want.items()) if self._committed.get(p) != o]
        if not todo:
            return
        try:
            if self._committer is None:
                self._committer = self.new_consumer()
            self._committer.commit(offsets=todo, asynchronous=False)
        except KafkaException as e:
            raise SourceUnavailable(f"{self._where()}: committing group offsets failed: {self._scrub(str(e))}") from None
        for tp in todo:
            self._committed[tp.partition] = tp.offset

    def committed(self) -> dict[int, int]:
        """The consumer group's committed offsets (for tests and status)."""
        from confluent_kafka import TopicPartition

        c = self.new_consumer()
        try:
            n = self.topic_partitions(c) or 0
            got = c.committed([TopicPartition(self.topic, p) for p in range(n)], timeout=self.timeout_s)
            return {tp.partition: tp.offset for tp in got if tp.offset >= 0}
        finally:
            c.close()

    def group_lag(self) -> dict[int, tuple[int, int]]:
        """``{partition: (committed offset, high watermark)}`` of the consumer group: the
        committed offsets are the durable frontier, so ``high - committed`` is what is
        not ingested yet (for lag sensors and status; Tansu under-reports the high
        watermark, see docs/ingestion.md)."""
        from confluent_kafka import KafkaException, TopicPartition

        c = self.new_consumer()
        try:
            n = self.topic_partitions(c)
            if n is None:
                raise IngestConfigError(f"{self._where()} does not exist: create it or fix the topic name")
            tps = [TopicPartition(self.topic, p) for p in range(n)]
            out: dict[int, tuple[int, int]] = {}
            for tp in c.committed(tps, timeout=self.timeout_s):
                _, hi = c.get_watermark_offsets(TopicPartition(self.topic, tp.partition), timeout=5.0, cached=False)
                out[tp.partition] = (max(int(tp.offset), 0), int(hi))
            return out
        except KafkaException as e:
            raise SourceUnavailable(f"{self._where()}: reading group offsets failed: {self._scrub(str(e))}") from None
        finally:
            c.close()

    def close(self) -> None:
        if self._committer is not None:
            try:
                self._committer.close()
            except Exception:  # noqa: BLE001 - best effort
                pass
            self._committer = None

    # ----- decoding -------------------------------------------------------------------

    def _plan(self, spec: DecodeSpec) -> tuple[list[pa.Field], list[pa.Field], str | None, str | None]:
        """(fields from a JSON key, fields from a JSON value, text/bytes key field, value field)."""
        names = set(spec.key_names) | set(spec.val_names)
        for col in self._meta:
            if col not in names:
                raise IngestConfigError(
                    f"{self._where()}: include names column {col!r} ({self._meta[col]}) but the schema has "
                    f"no such field; add it (e.g. --value {col}:int64) or drop it from include"
                )
        key_fields = [pa.field(f.name, f.type, True) for f in spec.key_schema if f.name not in self._meta]
        val_fields = [pa.field(f.name, f.type, True) for f in spec.val_schema if f.name not in self._meta]
        kfield: str | None = None
        vfield: str | None = None
        from_key: list[pa.Field] = []
        if self.key_format == "json":
            from_key = key_fields
        elif self.key_format in ("text", "bytes"):
            kfield = self.key_field or (key_fields[0].name if len(key_fields) == 1 else None)
            if kfield is None or kfield not in names:
                raise IngestConfigError(
                    f"{self._where()}: key_format={self.key_format!r} needs key_field naming the field the "
                    f"key goes to (key fields: {[f.name for f in key_fields]})"
                )
            from_key = []
        if self.key_format in ("json", "text", "bytes"):
            from_val = val_fields if self.key_format == "json" else [f for f in key_fields + val_fields if f.name != kfield]
        else:
            from_val = key_fields + val_fields
        if self.value_format in ("text", "bytes"):
            cands = [f.name for f in from_val]
            vfield = self.value_field or (cands[0] if len(cands) == 1 else None)
            if vfield is None or vfield not in names:
                raise IngestConfigError(
                    f"{self._where()}: value_format={self.value_format!r} fills one field: pass value_field "
                    f"(candidates: {cands})"
                )
            missing = [n for n in cands if n != vfield]
            if missing:
                raise IngestConfigError(
                    f"{self._where()}: with value_format={self.value_format!r} fields {missing} get no data; "
                    "drop them, include them as metadata, or use value_format='json'"
                )
            from_val = []
        return from_key, from_val, kfield, vfield

    def decode_messages(self, partition: str, m: _Msgs, spec: DecodeSpec) -> Decoded:
        n = len(m)
        inp = spec.input_schema()
        from_key, from_val, kfield, vfield = self._plan(spec)
        bad: dict[int, tuple[str, str]] = {}
        cols: dict[str, pa.Array] = {}
        vals_all = m.vals
        tomb = (
            np.fromiter((v is None for v in vals_all), dtype=bool, count=n)
            if None in vals_all  # (a C-level scan: most chunks hold no tombstone)
            else np.zeros(n, dtype=bool)
        )
        upsert = self._envelope == "upsert"
        if from_val or vfield is not None:
            idx = np.flatnonzero(~tomb)
            # (in idx order; with no tombstone the values are all bytes)
            vals = [v for v in vals_all if v is not None] if len(idx) < n else cast(list[bytes], vals_all)
            self._fill(spec, "value", self.value_format, vals, idx, n, from_val, vfield, cols, bad, m.joined)
        if self.key_format != "none":
            keys_all = m.keys
            if None in keys_all:
                kidx = np.array([i for i, k in enumerate(keys_all) if k is not None], dtype=np.int64)
                keys = [k for k in keys_all if k is not None]
            else:
                kidx, keys = np.arange(n, dtype=np.int64), cast(list[bytes], keys_all)
            self._fill(spec, "key", self.key_format, keys, kidx, n, from_key, kfield, cols, bad)
        for col, kind in self._meta.items():
            cols[col] = self._metadata(kind, partition, m, inp.field(col).type)
        arrays = [cols.get(f.name, pa.nulls(n, f.type)) for f in inp]
        table = pa.Table.from_arrays(arrays, schema=inp)
        dspec = spec
        if upsert:
            table = table.append_column(_TOMBSTONE, pa.array(tomb, pa.bool_()))
            dspec = dataclasses.replace(spec, delete_field=_TOMBSTONE)
        badl = [(i, k, r) for i, (k, r) in sorted(bad.items())]
        if badl:
            mask = np.ones(n, dtype=bool)
            mask[[i for i, _, _ in badl]] = False
            table = table.filter(pa.array(mask))
        rows, allbad = merge_good_and_bad(dspec, n, table, badl)
        offs = m.offs
        errors = [ErrorRecord(partition, (offs[i],), kind, reason, self._raw(m, i)) for i, kind, reason in allbad]
        raw = None
        if spec.keep_raw:
            raw = raw_table(partition, [(o,) for o in offs], "kafka", [self._raw(m, i) for i in range(n)])
        return Decoded(rows, errors, raw)

    def _fill(
        self, spec: DecodeSpec, what: str, fmt: str, data: list[bytes], idx: Any, n: int,
        fields: list[pa.Field], single: str | None, cols: dict[str, pa.Array], bad: dict[int, tuple[str, str]],
        clean_joined: bytes | None = None,
    ) -> None:
        """Decodes keys or values (present at positions ``idx`` of ``n``) into ``cols``.
        ``clean_joined``: ``b"\n".join(data)``, known to hold no line break inside a
        value (the native split checked)."""
        pos = np.full(n, -1, dtype=np.int64)  # position -> row of the decoded table (-1: null)
        if fmt == "json":
            if not fields:
                return
            lines: list[bytes] = data
            pre_bad: dict[int, tuple[str, str]] = {}
            scalar_key = what == "key" and len(fields) == 1
            clean = clean_joined is not None and not scalar_key
            joined: bytes | None = clean_joined if clean else b"\n".join(data)
            assert joined is not None
            if not clean and (scalar_key or b"\r" in joined or joined.count(b"\n") != len(data) - 1):
                joined = None
                lines = []  # the slow path: a record spans lines, or scalar keys to wrap
                for j, b in enumerate(data):
                    if scalar_key and not b.lstrip().startswith(b"{"):
                        b = b'{"' + fields[0].name.encode() + b'":' + b + b"}"  # a scalar JSON key
                    if b"\n" in b or b"\r" in b:
                        try:
                            b = json.dumps(json.loads(b), separators=(",", ":")).encode()
                        except UnicodeDecodeError as e:
                            pre_bad[j] = ("invalid_utf8", f"the message {what} is not valid UTF-8: {e}")
                            b = b"\x00"
                        except ValueError as e:
                            pre_bad[j] = ("invalid_json", f"the message {what} is not valid JSON: {e}")
                            b = b"\x00"
                        except RecursionError:
                            pre_bad[j] = ("invalid_json", f"the message {what} is not valid JSON: nested too deeply")
                            b = b"\x00"
                    lines.append(b)
            table, jbad = decode_json_lines(spec, lines, schema=pa.schema(fields), joined=joined)
            badj = {i: (k, r) for i, k, r in jbad}
            badj.update(pre_bad)
            if not badj and len(lines) == n:  # (every message has one, and every one decoded)
                for f in fields:
                    cols[f.name] = table.column(f.name).combine_chunks() if n else pa.nulls(0, f.type)
                return
            good = [j for j in range(len(lines)) if j not in badj]
            for j, (k, r) in badj.items():
                bad.setdefault(int(idx[j]), (k, f"message {what}: {r}"))
            pos[np.asarray(idx, dtype=np.int64)[good]] = np.arange(len(good))
            sel = pa.array(pos, pa.int64(), mask=pos < 0)
            for f in fields:
                cols[f.name] = table.column(f.name).combine_chunks().take(sel) if table.num_rows else pa.nulls(n, f.type)
            return
        assert single is not None
        target = spec.input_schema().field(single).type
        arr = pa.array(data, pa.binary())
        if fmt == "text":
            arr, errs = cast_rowwise(arr, pa.string())
            for j, msg in errs.items():
                bad.setdefault(int(idx[j]), ("invalid_utf8", f"message {what} is not valid UTF-8 text: {msg}"))
        if not arr.type.equals(target):
            arr, errs = cast_rowwise(arr, target)
            for j, msg in errs.items():
                bad.setdefault(int(idx[j]), ("type_mismatch", f"message {what}: field {single!r}: cannot convert to {target}: {msg}"))
        pos[np.asarray(idx, dtype=np.int64)] = np.arange(len(data))
        cols[single] = arr.take(pa.array(pos, pa.int64(), mask=pos < 0)) if len(data) else pa.nulls(n, target)

    def _metadata(self, kind: str, partition: str, m: _Msgs, t: pa.DataType) -> pa.Array:
        n = len(m)
        if kind == "partition":
            arr: pa.Array = pa.array(np.full(n, int(partition), dtype=np.int64))
        elif kind == "offset":
            arr = pa.array(m.offs, pa.int64())
        elif kind == "topic":
            arr = pa.array([self.topic] * n, pa.string())
        elif kind == "timestamp":
            arr = pa.array(m.ts, pa.int64())
            if pa.types.is_timestamp(t):
                arr = arr.cast(pa.timestamp("ms", tz="UTC")).cast(t)
        else:  # headers: JSON [[key, value], ...] with UTF-8 text values (else base64: "b64:...")
            arr = pa.array([_headers_json(h) for h in m.hdrs], pa.string())
        return arr if arr.type.equals(t) else pc.cast(arr, t)

    def decoding(self) -> dict[str, Any]:
        """How messages are decoded (kept with each raw record, for rebuilds)."""
        return {
            "topic": self.topic, "key_format": self.key_format, "value_format": self.value_format,
            "key_field": self.key_field, "value_field": self.value_field, "include": dict(self._meta),
        }

    def _raw(self, m: _Msgs, i: int) -> bytes:
        """The message as the raw collection keeps it: key, value and header values in
        base64, the timestamp, and the decoding settings (``decode_kafka_raw``)."""
        k, v, h = m.key_at(i), m.vals[i], m.hdrs_at(i)
        return json.dumps(
            {
                "key": None if k is None else base64.b64encode(k).decode(),
                "value": None if v is None else base64.b64encode(v).decode(),
                "timestamp": m.ts_at(i),
                "headers": None if h is None else [[hk, None if hv is None else base64.b64encode(hv).decode()] for hk, hv in h],
                "decoding": self.decoding(),
            },
            separators=(",", ":"),
        ).encode()


def _headers_json(h: Any) -> str | None:
    if not h:
        return None if h is None else "[]"
    out = []
    for k, v in h:
        if v is None:
            out.append([k, None])
            continue
        try:
            out.append([k, v.decode("utf-8")])
        except UnicodeDecodeError:
            out.append([k, "b64:" + base64.b64encode(v).decode()])
    return json.dumps(out, separators=(",", ":"), ensure_ascii=False)


class KafkaReader:
    """Reads a topic from per-partition offsets with one manually assigned consumer."""

    def __init__(self, src: KafkaSource, offsets: dict[int, int]) -> None:
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
        read_committed (pinned, see ``KafkaSource``), and librdkafka (since 1.8) asks
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


class KafkaRangeChunk(Chunk):
    """Offsets ``[start, end)`` of one partition, bound without fetching the messages
    (``KafkaRangeReader``). ``num_records`` counts offsets until the range is read: offsets
    that hold no message (transaction markers, compacted away) make it an upper bound.
    ``decode`` reads the range (``read_range``) wherever it runs and then sets
    ``num_records`` and ``nbytes`` to what it found."""

    def __init__(self, src: KafkaSource, partition: str, start: int, end: int) -> None:
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


def read_range(src: KafkaSource, partition: int, start: int, end: int) -> _Msgs:
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


def _log_end(src: KafkaSource, partition: int) -> int | None:
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

    def __init__(self, src: KafkaSource, offsets: dict[int, int]) -> None:
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


def decode_kafka_raw(
    spec: DecodeSpec, envelope: str, partitions: Sequence[str], offsets: Sequence[int], raws: Sequence[bytes]
) -> tuple[pa.Table, list[tuple[int, str, str]]]:
    """Decodes raw ``kafka`` records (in partition, offset order) as the source did:
    rows, and ``(index, kind, reason)`` of the bad ones (``rebuild.decode_raw``)."""
    docs = [json.loads(r) for r in raws]
    out: list[pa.Table] = []
    bad: list[tuple[int, str, str]] = []
    i = 0
    while i < len(docs):
        j = i
        while j < len(docs) and partitions[j] == partitions[i] and docs[j]["decoding"] == docs[i]["decoding"]:
            j += 1
        d = docs[i]["decoding"]
        src = KafkaSource(
            "rebuild:0", d["topic"], key_format=d["key_format"], value_format=d["value_format"],
            key_field=d["key_field"], value_field=d["value_field"], include=d["include"],
        )
        src.bind_envelope(envelope)

        def b64(x: str | None) -> bytes | None:
            return None if x is None else base64.b64decode(x)

        m = _Msgs(
            None,
            list(offsets[i:j]),
            [b64(x["value"]) for x in docs[i:j]],
            keys=[b64(x["key"]) for x in docs[i:j]],
            ts=[x["timestamp"] for x in docs[i:j]],
            hdrs=[None if x["headers"] is None else [(k, b64(v)) for k, v in x["headers"]] for x in docs[i:j]],
        )
        dec = src.decode_messages(partitions[i], m, spec)
        out.append(dec.rows)
        where = {(e.partition, e.address[0]): e for e in dec.errors}
        for k in range(i, j):
            e = where.get((partitions[k], offsets[k]))
            if e is not None:
                bad.append((k, e.kind, e.reason))
        i = j
    rows = pa.concat_tables(out) if out else spec.rows_schema().empty_table()
    return rows, bad
