"""Spark at scale: distributed writes, reads, compaction and ingestion (docs/design.md section 12).

Executors build and fetch parts themselves through persist_lib's Blob client, opened
from the client's blob URI; the driver alone talks to Consensus, so every state
change is still one transition of the shard's state machine:

- ``write_batch`` / ``write_collection``: a DataFrame becomes one batch per shard,
  committed with one compare-and-set (``write.py``).
- ``read_snapshot`` / ``read_updates`` / ``read_collection_snapshot``: snapshot splits
  (or time-range splits) fetched on executors, consolidated across splits
  (``read.py``); on a ``file://`` blob the default snapshot read pins the part files it
  reads and stays lazy (``pins.py``: ``release_pins``, ``PinExpired``).
- ``compact_shard`` / ``spark_merge``: merges above a size threshold as a Spark job,
  applied with ``apply_merge_res`` like the in-process compactor (``compact.py``).
- ``ingest_landing_zone`` / ``ingest_kafka``: a file landing zone, or a Kafka topic's
  bound offset ranges, decoded on executors (``ingest.py``).
- ``spark_schema`` (``types.py``): the Arrow <-> Spark type mapping, checked up front.
- ``local_session`` (``session.py``): a small local session for tests and benchmarks.
- ``SparkConnectServer`` (``connect_server.py``): a local Spark Connect server from
  pyspark's own jars, for tests and benchmarks through ``sc://``.

Every function takes a classic session or a Spark Connect session alike: the jobs use
the DataFrame API only (``mapInArrow``), never the RDD API or the ``SparkContext``.
Importing this package does not import pyspark; the functions do, when called.
"""

from persist_lib.spark._common import UnsupportedSparkSession, default_parallelism
from persist_lib.spark.compact import apply_merge, compact_shard, spark_merge
from persist_lib.spark.connect_server import SparkConnectServer, SparkConnectServerError
from persist_lib.spark.ingest import SparkIngestion, ingest_kafka, ingest_landing_zone
from persist_lib.spark.pins import PinExpired, release_pins
from persist_lib.spark.read import (
    RangeSplit,
    read_collection_snapshot,
    read_snapshot,
    read_updates,
    splits_dataframe,
)
from persist_lib.spark.session import local_session
from persist_lib.spark.types import UnsupportedSparkType, spark_schema
from persist_lib.spark.write import SparkWriteResult, write_batch
from persist_lib.spark.write_txn import write_collection, write_collections

__all__ = [
    "PinExpired",
    "RangeSplit",
    "SparkConnectServer",
    "SparkConnectServerError",
    "SparkIngestion",
    "SparkWriteResult",
    "apply_merge",
    "compact_shard",
    "ingest_kafka",
    "ingest_landing_zone",
    "read_collection_snapshot",
    "read_snapshot",
    "read_updates",
    "release_pins",
    "spark_merge",
    "splits_dataframe",
    "UnsupportedSparkSession",
    "UnsupportedSparkType",
    "default_parallelism",
    "local_session",
    "spark_schema",
    "write_batch",
    "write_collection",
    "write_collections",
]
