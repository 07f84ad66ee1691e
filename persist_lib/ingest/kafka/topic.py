"""A configured Kafka topic: its settings (validated), its consumers' configuration, its
broker-side operations (partition metadata, the consumer group's committed offsets:
``release`` commits the durable frontier, never beyond it) and, mixed in, the decoding
of its messages (``decoding``).

Why apart from ``source.KafkaSource`` (which adds only ``open_reader``): the readers,
the range reads and the reader process all work on a ``KafkaTopic``, and the source
builds readers, so the readers import this module and the source imports them -- no
import circle."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from persist_lib.ingest.addresses import Frontier
from persist_lib.ingest.errors import IngestConfigError, SourceTimeout, SourceUnavailable
from persist_lib.ingest.ingest_config import require_valid_settings
from persist_lib.ingest.kafka.config import (
    FETCH_SETTINGS,
    FORMATS,
    KAFKA_RULES,
    READERS,
    _bootstrap_of,
    _parse_include,
)
from persist_lib.ingest.kafka.decoding import KafkaDecoding
from persist_lib.location.redaction import (
    SensitiveUrl,
    redacted_dataclass_repr,
    scrub,
    settings_secrets,
)

if TYPE_CHECKING:  # pragma: no cover
    from persist_lib.handles.client import PersistClient
    from persist_lib.ingest.decode import DecodeSpec

log = logging.getLogger(__name__)


@dataclass
class KafkaTopic(KafkaDecoding):
    """A Kafka topic and how to read and decode it (``KafkaSource`` is this plus readers).

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
    reader process (``reader_process``) that ships the decoded batches over a socket, so its
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
        if not isinstance(self.bootstrap_url, str) or not self.bootstrap_url:
            raise IngestConfigError(  # the value itself is not shown: it may hold a password
                f"KafkaSource bootstrap_url must be a non-empty string, not a {type(self.bootstrap_url).__name__}: "
                "use HOST:PORT[,HOST:PORT] or kafka://[USER:PASSWORD@]HOST:PORT[?...]"
            )
        require_valid_settings(self, KAFKA_RULES, "KafkaSource")
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
