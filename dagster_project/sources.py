"""The configured sources: what is ingested where, with which schema and envelope.

Each source becomes a static group of assets (``assets.build_source_assets``), an
ingestion job and an arrival sensor. Static assets per source (rather than one
dynamically partitioned "collection" asset) give a readable asset graph: landing zone ->
reclocking -> raw -> collection -> downstream, with the GE checks on the collection.

The default source, ``orders``, is a file landing zone (JSON lines) under
``PERSIST_LANDING_URI`` (else ``$PERSIST_HOME/landing``), sub-directory ``orders/``,
upserted by ``order_id`` into a 4-shard collection; the rendition backfill rebuilds it
with 8 shards unless told otherwise. It needs no setup.

``customers`` is a Postgres CDC source (logical replication, ``pgoutput``) of table
``public.customers``; it is configured only when ``PERSIST_CDC_DSN`` is set (a
``postgresql://`` URL of a REPLICATION role on a server with ``wal_level=logical``).

``events`` is a Kafka source (topic ``events``, JSON key = ``id``, JSON values, upsert:
a null value deletes); it is configured only when ``PERSIST_KAFKA_BOOTSTRAP`` is set
(``HOST:PORT`` or ``kafka://USER:PASSWORD@HOST:PORT?...``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field, fields

import pyarrow as pa

from dagster_project.checks import CollectionRules
from dagster_project.source_rules import SOURCE_RULES, check_source_spec
from persist_lib.config_rules import field_default


@dataclass(frozen=True)
class SourceSpec:
    """One ingested source and the collection it feeds.

    ``name`` is the collection name (also the asset name, the ingestion name and the
    landing sub-directory);
    STORAGE keeps the raw records in ``<name>.raw``, decode errors in ``<name>.errors`` and
    the reclocking bindings in the remap shard.
    """

    name: str
    key_schema: pa.Schema
    val_schema: pa.Schema
    envelope: str = "upsert"  # "upsert" or "append_only"
    kind: str = "landing_zone"  # or "postgres_cdc", "kafka"
    format: str = "auto"  # landing zone: jsonl, csv, parquet or auto (by extension)
    table: str = ""  # postgres_cdc: TABLE or SCHEMA.TABLE
    dsn_env: str = "PERSIST_CDC_DSN"  # postgres_cdc: the variable holding the source DSN
    topic: str = ""  # kafka: the topic
    bootstrap_env: str = "PERSIST_KAFKA_BOOTSTRAP"  # kafka: the variable holding the bootstrap URL
    key_format: str = "json"  # kafka: json, text, bytes or none
    num_shards: int = 4
    #: Shards of a rendition rebuilt by the rendition backfill when its run config does
    #: not say (0 = ``num_shards``): what materializing ``<name>_rendition`` builds.
    rendition_shards: int = 0
    delete_field: str | None = None
    rules: CollectionRules = field(default_factory=lambda: CollectionRules(()))
    description: str = ""
    #: A row-wise fix-up of decoded rows (same schema). Changing it changes what the
    #: pipeline writes: build a new rendition (the rendition backfill) and hand over.
    transform: Callable[[pa.Table], pa.Table] | None = None
    #: When the schemas above change in code: ``"evolve"`` (the next ingestion evolves
    #: the collections in place when persist can, else stops and asks for a rendition
    #: backfill) or ``"fail"`` (any change stops ingestion). ``schema_changes.py``.
    on_schema_change: str = "evolve"

    def __post_init__(self) -> None:  # every setting checked where the source is declared
        check_source_spec({f: getattr(self, f) for f in SOURCE_RULES}, _SPEC_DEFAULTS)

    @property
    def default_rendition_shards(self) -> int:
        return self.rendition_shards or self.num_shards

    @property
    def key_columns(self) -> tuple[str, ...]:
        return tuple(self.key_schema.names)

    def dsn(self) -> str:
        """The CDC source's DSN, read from the environment when used (never stored)."""
        return os.environ.get(self.dsn_env, "")

    def bootstrap(self) -> str:
        """The Kafka bootstrap URL, read from the environment when used (never stored)."""
        return os.environ.get(self.bootstrap_env, "")


_SPEC_DEFAULTS = {f.name: field_default(f) for f in fields(SourceSpec)}

ORDERS = SourceSpec(
    name="orders",
    key_schema=pa.schema([pa.field("order_id", pa.int64(), nullable=False)]),
    val_schema=pa.schema(
        [
            ("customer", pa.string()),
            ("amount", pa.float64()),
            ("status", pa.string()),
        ]
    ),
    envelope="upsert",
    num_shards=4,
    rendition_shards=8,
    rules=CollectionRules(
        key_columns=("order_id",),
        not_null=("customer", "status"),
        ranges={"amount": (0.0, 1_000_000.0)},
        unique_key=True,
    ),
    description="Orders landing as JSON-lines files; latest state per order_id (upsert).",
)

CUSTOMERS = SourceSpec(
    name="customers",
    kind="postgres_cdc",
    table="public.customers",
    key_schema=pa.schema([pa.field("id", pa.int64(), nullable=False)]),
    val_schema=pa.schema(
        [("name", pa.string()), ("email", pa.string()), ("balance", pa.float64())]
    ),
    envelope="upsert",
    num_shards=2,
    rules=CollectionRules(
        key_columns=("id",),
        not_null=("name",),
        ranges={"balance": (-1_000_000.0, 1_000_000_000.0)},
        unique_key=True,
    ),
    description="Table public.customers via Postgres CDC (pgoutput); latest row per id.",
)


EVENTS = SourceSpec(
    name="events",
    kind="kafka",
    topic="events",
    key_schema=pa.schema([pa.field("id", pa.int64(), nullable=False)]),
    val_schema=pa.schema([("kind", pa.string()), ("amount", pa.float64())]),
    envelope="upsert",
    num_shards=2,
    rules=CollectionRules(
        key_columns=("id",),
        not_null=("kind",),
        ranges={"amount": (-1_000_000.0, 1_000_000_000.0)},
        unique_key=True,
    ),
    description="Kafka topic events (JSON key id, JSON values); latest value per id, tombstones delete.",
)


def configured_sources() -> tuple[SourceSpec, ...]:
    """``orders`` always; ``customers`` when ``PERSIST_CDC_DSN`` is set; ``events`` when
    ``PERSIST_KAFKA_BOOTSTRAP`` is set."""
    out = [ORDERS]
    if CUSTOMERS.dsn():
        out.append(CUSTOMERS)
    if EVENTS.bootstrap():
        out.append(EVENTS)
    return tuple(out)


SOURCES: tuple[SourceSpec, ...] = configured_sources()


def source(name: str) -> SourceSpec:
    for s in SOURCES:
        if s.name == name:
            return s
    raise KeyError(f"unknown source {name!r}; configured: {[s.name for s in SOURCES]}")
