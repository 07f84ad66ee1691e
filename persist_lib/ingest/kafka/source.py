"""The Kafka source: a ``KafkaTopic`` that opens readers (the ``Source`` protocol's
``open_reader``): a ``KafkaReader`` that fetches and binds messages, or with
``ranges=True`` a ``KafkaRangeReader`` that binds offset ranges for Spark executors to
read. The rest of the source (settings, metadata, group offsets, decoding) is the
topic's."""

from __future__ import annotations

from persist_lib.ingest.addresses import Frontier, Note
from persist_lib.ingest.kafka.ranges import KafkaRangeReader
from persist_lib.ingest.kafka.reader import KafkaReader
from persist_lib.ingest.kafka.topic import KafkaTopic


class KafkaSource(KafkaTopic):
    """A Kafka topic as an ingestion source (see ``KafkaTopic`` for the settings).

    (A plain subclass, not a dataclass of its own: it adds no field, and keeps the
    topic's redacting ``__repr__``.)"""

    def open_reader(self, frontier: Frontier, notes: list[Note]) -> KafkaReader:
        offsets = {int(p): int(a[0]) for p, a in frontier.items()}
        return KafkaRangeReader(self, offsets) if self.ranges else KafkaReader(self, offsets)
