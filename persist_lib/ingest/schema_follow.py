"""Ingestion after a schema evolution: the outputs follow the collection's schemas.

An ingestion decodes records against the schemas it is configured with
(``DecodeSpec``): a JSON, CSV or Kafka record's field lands in the column of that name,
and fields the schemas don't name are ignored. So after a collection's schemas
evolved (``StorageController.evolve_schema``), the ingestion is run with the evolved
schemas and new fields land in the new columns from then on; rows ingested before keep
reading null there (they are migrated on read). ``evolve_ingestion`` evolves every
collection of an ingestion whose schemas are the data's (``name`` and, for the
upsert envelope, ``name.state``) in one call; an ingestion still configured with an
earlier version is refused (``IngestSchemaStale``) instead of writing under it.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from persist_lib.ingest.errors import IngestConfigError
from persist_lib.shard.codec import Schemas


class IngestSchemaStale(IngestConfigError):
    """The ingestion's schemas are an earlier version of its collection's: the
    collection evolved since. Run the ingestion with the collection's current schemas."""


def check_not_evolved(ctl: Any, name: str, want: Schemas) -> None:
    """``IngestSchemaStale`` when ``want`` is an earlier version of collection ``name``'s
    schemas (nothing else: other mismatches are the caller's to report)."""
    info = ctl.schema(name)
    cur = Schemas.from_json(ctl._spec(name)["schemas"])
    if any(h == want for h in cur.history):
        raise IngestSchemaStale(
            f"collection {name!r} evolved to schema version {info['version']} ({cur.describe()}); "
            f"this ingestion is configured with an earlier version ({want.describe()}). Run it "
            "with the collection's current schemas (`persist schema show "
            f"{name}`): new record fields then land in the new columns"
        )


def evolve_ingestion(ctl: Any, name: str, key_schema: pa.Schema, val_schema: pa.Schema) -> dict[str, Any]:
    """Evolves the data collection ``name`` and its ``name.state`` (if the ingestion
    keeps one) to ``(key_schema, val_schema)``; returns each collection's result."""
    out: dict[str, Any] = {}
    existing = set(ctl.list_collections())
    for cname in (name, f"{name}.state"):  # outputs.collection_name of the DATA_ROLES
        if cname in existing:
            out[cname] = ctl.evolve_schema(cname, key_schema, val_schema)
    if not out:
        raise IngestConfigError(f"ingestion {name!r} has no collection {name!r} to evolve")
    return out
