"""Source ingestion with reclocking (docs/design.md section 11).

Sources (a file landing zone, Postgres CDC, Kafka) are reclocked through a remap shard and
ingested by the recipe of seed 001 into definite outputs: the data collection, an
errors collection, optionally the raw collection, and the envelope's state.

Entry points: ``Ingestion(client, name, source, key_schema, val_schema, ...)`` with
``run_once()`` / ``run()``, or the ``run_once(...)`` function. See docs/ingestion.md.
"""

from persist_lib.ingest.decode import DecodeSpec
from persist_lib.ingest.driver import Ingestion, run_once
from persist_lib.ingest.errors import (
    IngestConfigError,
    IngestError,
    IngestInvariantError,
    InvalidIngestConfig,
    KafkaOffsetOutOfRange,
    KafkaTopicGone,
    NeedsNewRendition,
    ReplayUnverifiable,
    SourceDataGone,
    SourceTimeout,
    SourceUnavailable,
)
from persist_lib.ingest.ingest_config import IngestConfig
from persist_lib.ingest.kafka import KafkaSource
from persist_lib.ingest.landing_zone import LandingZoneSource
from persist_lib.ingest.outputs import ShardOutputs, StorageOutputs, shard_id_for
from persist_lib.ingest.pg_cdc import PgCdcSource
from persist_lib.ingest.pg_types import UnsupportedColumnType
from persist_lib.ingest.progress import IngestProgress, ProgressBar, ProgressCallback, ProgressLog

__all__ = [
    "DecodeSpec",
    "IngestConfig",
    "IngestConfigError",
    "IngestError",
    "IngestInvariantError",
    "IngestProgress",
    "Ingestion",
    "InvalidIngestConfig",
    "KafkaOffsetOutOfRange",
    "KafkaSource",
    "KafkaTopicGone",
    "LandingZoneSource",
    "NeedsNewRendition",
    "PgCdcSource",
    "ProgressBar",
    "ProgressCallback",
    "ProgressLog",
    "ReplayUnverifiable",
    "ShardOutputs",
    "SourceDataGone",
    "SourceTimeout",
    "SourceUnavailable",
    "StorageOutputs",
    "UnsupportedColumnType",
    "run_once",
    "shard_id_for",
]
