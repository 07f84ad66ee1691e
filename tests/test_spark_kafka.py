"""A Kafka backlog ingested on Spark executors (``SparkIngestion`` with a ``KafkaSource``),
against the real Kafka-protocol broker (Tansu) and ``local[2]``.

The driver binds offset ranges without fetching them (``KafkaRangeReader``); each task
reads its ``(partition, [start, end))`` piece with its own consumer and decodes it. The
checks are the in-process ones (tests/test_ingest_kafka.py): at every bound time the
collection equals the produced ground truth below the bound offsets, and the consumer
group's offsets are the durable frontier. The cluster variant, with a Python worker
killed mid-task, is in tests/test_spark_cluster.py.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from persist_lib.ingest import IngestConfig, Ingestion
from persist_lib.ingest.errors import KafkaOffsetOutOfRange
from persist_lib.ingest.kafka import KafkaSource
from persist_lib.ingest.kafka.ranges import KafkaRangeChunk, read_range
from persist_lib.ingest.outputs import shard_id_for
from persist_lib.spark.ingest import SparkIngestion
from tests.support.kafka_server import KafkaBroker
from tests.test_ingest_kafka import (
    AKEY,
    AVAL,
    UKEY,
    UVAL,
    _append_batch,
    _check_exactly_once,
    _client,
    _source,
    _topic,
    _upsert_batch,
)

pytest_plugins = ["tests.spark_fixtures"]
pytestmark = [pytest.mark.kafka, pytest.mark.spark]


def _spark_ingestion(spark: Any, client: Any, name: str, src: KafkaSource, envelope: str, n: int, **kw: Any) -> SparkIngestion:
    k, v = (UKEY, UVAL) if envelope == "upsert" else (AKEY, AVAL)
    return SparkIngestion(
        spark, client, name, src, k, v, envelope=envelope,
        config=IngestConfig(max_records_per_binding=n), min_piece_records=50, **kw,
    )


@pytest.mark.parametrize("envelope", ["append_only", "upsert"])
def test_a_backlog_is_decoded_on_executors_exactly_once(spark: Any, kafka_broker: KafkaBroker, envelope: str) -> None:
    """Two rounds of produce + ``run_once``: the backlog's offset ranges are decoded by
    Spark tasks, several per partition; then the outputs equal the ground truth at every
    bound time, bad messages are in the errors collection, and the group offsets are the
    frontier. Upsert carries tombstones."""
    rng = random.Random(5 if envelope == "upsert" else 6)
    topic = _topic(kafka_broker, 3)
    client = _client()
    name = f"sk{envelope[0]}"
    src = _source(kafka_broker, topic, envelope)
    ing = _spark_ingestion(spark, client, name, src, envelope, 300)
    try:
        total = 0
        for rnd in range(2):
            batch = _upsert_batch(rng, 3, 900, keys=60) if envelope == "upsert" else _append_batch(rng, 3, 900, rnd * 10_000)
            # (two flushes: Tansu's high watermark stops at the last batch's first message,
            # and what lies past it is fetched by the driver; a small last batch keeps that small)
            kafka_broker.produce(topic, batch[:-30])
            kafka_broker.produce(topic, batch[-30:])
            total += len(batch)
            s = ing.run_once()
            assert s["records"] == len(batch), s
            sp = s["spark"]
            assert sp["records_on_executors"] >= len(batch) - 30 and sp["tasks"] >= 4, sp
        assert not src.ranges  # (the caller's source is left as it was; the ingestion reads a copy)
        truth = kafka_broker.consume_all(topic, 3)
        assert sum(len(v) for v in truth.values()) == total
        assert s["frontier"] == {str(p): [len(v)] for p, v in truth.items() if v}
        assert _check_exactly_once(client, name, truth, envelope) >= 6
        assert kafka_broker.group_offsets(f"persist_{name}", topic, 3) == {p: len(v) for p, v in truth.items() if v}
        assert ing.run_once()["records"] == 0
    finally:
        ing.close()
        client.close()


def test_spark_and_in_process_instances_adopt_each_others_bindings(spark: Any, kafka_broker: KafkaBroker) -> None:
    """An in-process instance and a Spark instance take turns on one ingestion: each
    replays the bindings the other minted (message bindings as ranges and the other way
    round), and the result is exactly once."""
    rng = random.Random(9)
    topic = _topic(kafka_broker, 2)
    client = _client()
    name = "mixed"
    local = Ingestion(
        client, name, _source(kafka_broker, topic, "append_only"), AKEY, AVAL,
        config=IngestConfig(max_records_per_binding=70),
    )
    remote = _spark_ingestion(spark, client, name, _source(kafka_broker, topic, "append_only"), "append_only", 170)
    try:
        for rnd in range(3):
            kafka_broker.produce(topic, _append_batch(rng, 2, 400, rnd * 10_000))
            local.run_once(max_records=150)
            s = remote.run_once()
        truth = kafka_broker.consume_all(topic, 2)
        assert sum(len(v) for v in truth.values()) == 1200
        assert s["frontier"] == {str(p): [len(v)] for p, v in truth.items()}
        assert _check_exactly_once(client, name, truth, "append_only") >= 9
    finally:
        local.close()
        remote.close()
        client.close()


def test_read_range_reads_exactly_the_bound_offsets(kafka_broker: KafkaBroker) -> None:
    """``read_range`` returns the messages of ``[start, end)`` -- also when the range ends
    past Tansu's under-reported high watermark -- and a range chunk splits by offset."""
    topic = _topic(kafka_broker, 1)
    kafka_broker.produce(topic, [(0, None, b'{"id": %d}' % i) for i in range(40)])
    kafka_broker.produce(topic, [(0, None, b'{"id": %d}' % i) for i in range(40, 55)])
    src = KafkaSource(kafka_broker.bootstrap, topic, timeout_s=5)
    src.attach(_client(), "rr")
    assert read_range(src, 0, 7, 49).offs == list(range(7, 49))
    assert read_range(src, 0, 50, 55).offs == list(range(50, 55))
    assert read_range(src, 0, 3, 3).offs == []
    c = KafkaRangeChunk(src, "0", 10, 30)
    head, tail = c.take(5)
    assert (head.start, head.end, tail.start if tail else None) == ((10,), (15,), (15,))


def test_a_range_the_broker_no_longer_has_fails_typed_from_the_executor(spark: Any, kafka_broker: KafkaBroker) -> None:
    """Offsets bound in the remap shard but gone from the broker (the topic was recreated
    with fewer messages; Tansu enforces no retention) make the Spark task fail; the caller
    gets ``KafkaOffsetOutOfRange`` naming topic and partition, and nothing is written."""
    topic = _topic(kafka_broker, 1)
    client = _client()
    name = "gone"
    kafka_broker.produce(topic, [(0, None, b'{"id": %d, "name": "x", "qty": 1}' % i) for i in range(300)])
    # mint a binding over the 300 messages without applying it (an instance that died)
    minter = Ingestion(client, name, _source(kafka_broker, topic, "append_only"), AKEY, AVAL,
                       config=IngestConfig(max_records_per_binding=1000))
    try:
        minter._open()
        assert minter._mint(advance_time=False) == "data"
    finally:
        minter.close()
    kafka_broker.delete_topic(topic)
    kafka_broker.create_topic(topic, 1)
    kafka_broker.produce(topic, [(0, None, b'{"id": 1}') for _ in range(100)])
    # (records_per_job: the bound range is decoded before the driver reads on; its own
    # read past the shorter log would time out on Tansu, which answers a fetch past the end
    # with nothing instead of OFFSET_OUT_OF_RANGE -- see docs/ingestion.md)
    ing = _spark_ingestion(spark, client, name, _source(kafka_broker, topic, "append_only", timeout_s=3), "append_only",
                           1000, records_per_job=100)
    try:
        with pytest.raises(KafkaOffsetOutOfRange) as ei:
            ing.run_once()
        e = ei.value
        assert (e.topic, e.partition) == (topic, 0)
        assert "offset" in str(e) and "rendition" in str(e)
        assert ing.spark_stats["records_on_executors"] == 0
    finally:
        ing.close()
    try:  # nothing was written: the outputs are still empty
        for role in ("data", "errors"):
            assert (client.machine(shard_id_for(name, role)).fetch_latest().upper.time or 0) == 0
    finally:
        client.close()
