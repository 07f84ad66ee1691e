"""Dynamic partitions: one per persist shard, one per rendition of a collection.

Partition keys are shard ids (``s<uuid>``) and rendition names (STORAGE validates them:
letters, digits, ``_-.``), so they never hold commas or JSON, which the Dagster UI
mishandles (dagster#15105) and backfills of dynamic partitions choke on.
"""

from __future__ import annotations

import dagster as dg

#: Every shard of the location (collections' rendition and metadata shards, the catalog).
shard_partitions = dg.DynamicPartitionsDefinition(name="persist_shards")


def rendition_partitions(collection_asset: str) -> dg.DynamicPartitionsDefinition:
    """The renditions of one collection (partition key = rendition name)."""
    return dg.DynamicPartitionsDefinition(name=f"{collection_asset}_renditions")
