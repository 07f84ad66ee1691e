"""Kafka source: one source partition per Kafka partition, address = ``(offset,)``.

Why it is definite: a Kafka partition is an ordered, replayable log, so the messages in
``[F(b-1), F(b))`` of every partition are the same for every instance that replays a
binding (as long as the broker still serves them; if not, a typed
``KafkaOffsetOutOfRange`` names topic, partition and offset instead of skipping).
Partitions that appear while running are assigned at offset 0 and bound like the rest.
Consumers are read_committed (pinned): a binding ends at most at a partition's last
stable offset, so it never holds an aborted transaction's messages or part of an open
one; offsets fetched again below a partition's position are dropped
(``messages._buffer``).

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

The package, bottom to top (each module imports only the ones above it):

- ``config``: the bootstrap URL, ``include``, formats, the consumers' fetch settings;
- ``messages``: fetched messages of a partition, raw (``_Msgs``) or decoded (``_Decoded``);
- ``split``: a consumed batch split by partition (the C extension ``_split``, built from
  ``_split.c`` by setup.py, or its Python fallback) and converted;
- ``prefetch``: consuming on a thread ahead of the reader, decoding on two more;
- ``wire``, ``reader_process``: the reader process (consuming and decoding in a child
  process) -- what crosses its socket, and the ingestion's side of it;
- ``decoding``, ``topic``: the decoding of messages, and the configured topic
  (``KafkaTopic``: settings, metadata, group offsets);
- ``reader``: ``KafkaReader`` and its ``KafkaChunk``s;
- ``ranges``: offset ranges for Spark (``KafkaRangeReader``, ``read_range``);
- ``source``: ``KafkaSource``, the topic as an ingestion source (opens the readers);
- ``reader_child``: the reader process's own side; ``raw``: raw records decoded again
  (rebuilds).
"""

from persist_lib.ingest.kafka.source import KafkaSource

__all__ = ["KafkaSource"]
