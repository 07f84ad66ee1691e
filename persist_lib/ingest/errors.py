"""Typed errors of source ingestion.

Configuration mistakes are ``IngestConfigError`` (an ``InvalidUsage``: the call can
never succeed as made); every message names what was wrong and how to fix it. Runtime
conditions that a retry may clear are ``SourceUnavailable``. Two conditions mean the
ingestion can't continue *definitely* and need a human: ``NeedsNewRendition`` (an
instance computed different updates than the ones already committed, so the pipeline
changed or is not deterministic) and ``SourceDataGone`` (the source no longer serves
addresses the output still depends on). ``ReplayUnverifiable``: an instance replays
committed times that compaction has folded into the since, where no check is possible.
"""

from __future__ import annotations

from collections.abc import Sequence

from persist_lib.errors import ConfigProblem, InvalidConfig, InvalidUsage, PersistError, Timeout


class IngestError(PersistError):
    """Base class of ingestion errors."""


class IngestConfigError(InvalidUsage, IngestError):
    """The ingestion is misconfigured (bad URI, missing directory, unknown format, ...)."""


class InvalidIngestConfig(InvalidConfig, IngestConfigError):
    """An ingestion's or a source's settings (``IngestConfig``, ``KafkaSource``,
    ``LandingZoneSource``, ``PgCdcSource``) broke their rules: ``problems`` names every
    bad setting at once (the field, the value, what is allowed, how to fix it); nothing
    was built with them."""

    def __init__(self, problems: Sequence[ConfigProblem], *, what: str = "IngestConfig") -> None:
        super().__init__(problems, what=what)


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


class ReplayUnverifiable(IngestError):
    """An instance replays times another writer committed, but can't check them.

    A verified append compares what it would write with what is committed. Below the
    output's since, compaction has folded the committed updates into the since together
    with older ones; the comparison is then only possible on the contents at the since
    when the replay starts at time 0. Otherwise nothing can tell whether the committed
    updates are the ones this instance computes, and accepting them unchecked is what a
    verified append must never do: the ingestion stops, nothing is written.
    """

    def __init__(self, output: str, lower: int, upper: int, since: int | None, why: str) -> None:
        self.output = output
        self.lower = lower
        self.upper = upper
        self.since = since
        super().__init__(
            f"ingestion output {output}: this instance replays times [{lower}, {upper}) that "
            f"another writer committed, but its since is {since if since is not None else 'empty'} "
            f"({why}), so they can't be checked against what it computes; nothing was written. "
            "This happens when an output lags the others by more than since_window_ms (e.g. "
            "keep_raw turned on again after a while without it). Ingest into a new rendition (or "
            "under a new name) from the source, or keep every output of an ingestion together"
        )


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
