"""Typed errors of source ingestion.

Configuration mistakes are ``IngestConfigError`` (an ``InvalidUsage``: the call can
never succeed as made); every message names what was wrong and how to fix it. Runtime
conditions that a retry may clear are ``SourceUnavailable``. Two conditions mean the
ingestion can't continue *definitely* and need a human: ``NeedsNewRendition`` (an
instance computed different updates than the ones already committed, so the pipeline
changed or is not deterministic) and ``SourceDataGone`` (the source no longer serves
addresses the output still depends on).
"""

from __future__ import annotations

from persist_lib.errors import InvalidUsage, PersistError, Timeout


class IngestError(PersistError):
    """Base class of ingestion errors."""


class IngestConfigError(InvalidUsage, IngestError):
    """The ingestion is misconfigured (bad URI, missing directory, unknown format, ...)."""


class SourceUnavailable(IngestError):
    """The source could not be read right now (network, permissions, server down).

    Nothing definite was decided from the failed read: retrying is safe.
    """


class SourceDataGone(IngestError):
    """The source can no longer serve addresses that a binding still needs.

    The remap shard bound data that has since disappeared from the source (a file was
    deleted, a replication slot was advanced or dropped) before the outputs were
    durable. The outputs can't be completed definitely: rebuild a new rendition (from
    the raw collection if one is kept) or restore the data.
    """


class NeedsNewRendition(IngestError):
    """An instance computed updates that differ from the ones already committed.

    Two instances (or a restarted one) of a deterministic pipeline write identical
    updates; a difference means the pipeline's logic or configuration changed, or is
    not deterministic. The committed data is kept as is; build a new rendition with the
    new logic and hand over to it.
    """

    def __init__(self, output: str, lower: int, upper: int, detail: str) -> None:
        self.output = output
        self.lower = lower
        self.upper = upper
        self.detail = detail
        super().__init__(
            f"ingestion output {output}: the updates this instance computed for times "
            f"[{lower}, {upper}) differ from the ones already committed ({detail}); the "
            "pipeline is not the one that wrote them (changed decoding/envelope/config, or a "
            "non-deterministic step): the committed data was left untouched; create a new "
            "rendition with the new logic and hand over to it"
        )


class IngestInvariantError(IngestError):
    """Persist state contradicts the ingestion recipe (e.g. an output ahead of the remap)."""


class KafkaDataGone(SourceDataGone):
    """A Kafka topic/partition/offset the ingestion still needs is no longer served."""

    def __init__(self, message: str, *, topic: str, partition: int | None, offset: int | None) -> None:
        self.topic = topic
        self.partition = partition
        self.offset = offset
        super().__init__(message)


class KafkaOffsetOutOfRange(KafkaDataGone):
    """The broker no longer serves an offset the ingestion needs (deleted by retention or
    ``delete_records``, or the log was truncated/recreated below it)."""

    def __init__(self, topic: str, partition: int, offset: int, low: int | None, high: int | None, why: str) -> None:
        self.low = low
        self.high = high
        rng = f"[{low}, {high})" if low is not None and high is not None else "unknown"
        super().__init__(
            f"kafka topic {topic!r} partition {partition}: offset {offset} is out of range (the broker "
            f"serves offsets {rng}): {why}. The messages from offset {offset} on are bound in the remap "
            "shard (or follow the ingested frontier) and can't be read again, so the collection can't "
            "be completed definitely: raise the topic's retention (retention.ms/retention.bytes) so "
            "it outlives ingestion lag, then rebuild the collection in a new rendition (a new "
            "ingestion name, or from the raw collection if one is kept)",
            topic=topic, partition=partition, offset=offset,
        )


class KafkaTopicGone(KafkaDataGone):
    """The topic was deleted, or has fewer partitions than the ingestion already read."""


class SourceTimeout(Timeout, IngestError):
    """The source did not answer within the configured time (after retries with backoff).

    Nothing was decided from the failed attempts: retrying later is safe.
    """
