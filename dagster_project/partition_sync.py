"""What each shard is, and the dynamic partitions that keep the UI truthful.

``persist_shard`` partitions are shard ids and ``<src>_rendition`` partitions are
rendition names; on their own they say nothing. This module:

* maps every shard to what it is (``ShardRole``): the shard ``3 of 8`` of rendition
  ``r1`` of collection ``orders``, a collection's metadata shard, the STORAGE catalog, a
  source's reclocking (remap) shard. The mapping is recorded as the metadata of the
  shard's partition when it is registered (a materialization: a shard that exists is
  not "Missing") and of every ``persist_shard`` materialization;
* plans partition changes (``PartitionSync``): live shards and ready renditions become
  partitions (a rendition nobody materialized through the asset, e.g. the first one made
  by ingestion, gets a materialization saying so); **finalized shards and retired or
  dropped renditions are removed** (they neither show as "Missing" nor as a green,
  usable rendition; their history stays in the asset's event log). This follows
  Dagster's data-retention guidance for dynamic partitions whose data is gone.

Plans are applied in a run (``apply_in_run``) or returned by a sensor
(``sensor_requests`` + ``events`` as ``SensorResult.asset_events``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import dagster as dg

from dagster_project.metadata import collection_metadata
from dagster_project.partitions import shard_partitions
from persist_lib.ingest.outputs import collection_name, shard_id_for
from persist_lib.storage.catalog import default_catalog_shard
from persist_lib.storage.metadata import active_rendition
from persist_lib.storage.status import LIVE_STATUSES, rendition_status

PERSIST_SHARD_KEY = dg.AssetKey("persist_shard")
#: Deterministic shards of an ingestion ``<source>``, by role (``persist_lib.ingest``).
SOURCE_SHARD_ROLES = ("remap", "cdc-snapshot", "data", "errors", "raw", "state")


@dataclass(frozen=True)
class ShardRole:
    """What a shard is for."""

    shard: str
    kind: str  # "rendition", "metadata", "catalog", "remap", "cdc-snapshot", ..., "unknown"
    collection: str | None = None
    rendition: str | None = None
    index: int | None = None
    num_shards: int | None = None
    status: str = "live"  # a rendition shard: its rendition's status (persist_lib.storage.status)

    @property
    def label(self) -> str:
        if self.kind == "rendition":
            return (
                f"{self.collection} / {self.rendition} / shard {self.index} of {self.num_shards}"
            )
        if self.kind == "metadata":
            return f"{self.collection} / rendition metadata shard"
        if self.kind == "catalog":
            return "STORAGE catalog"
        if self.kind == "unknown":
            return "not part of a collection or a configured source"
        return f"{self.collection} / ingestion {self.kind} shard"

    def metadata(self) -> dict[str, dg.MetadataValue]:
        out: dict[str, dg.MetadataValue] = {
            "shard": dg.MetadataValue.text(self.shard),
            "shard_of": dg.MetadataValue.text(self.label),
            "shard_kind": dg.MetadataValue.text(self.kind),
            "collection": dg.MetadataValue.text(self.collection or "-"),
        }
        if self.kind == "rendition":
            out["rendition"] = dg.MetadataValue.text(self.rendition or "-")
            out["shard_index"] = dg.MetadataValue.int(int(self.index or 0))
            out["rendition_shards"] = dg.MetadataValue.int(int(self.num_shards or 0))
            out["rendition_status"] = dg.MetadataValue.text(self.status)
        return out


def shard_directory(
    descs: Iterable[Mapping[str, Any]], sources: Iterable[str] = ()
) -> dict[str, ShardRole]:
    """Every shard of the described collections (``StorageController.describe``), the
    catalog, and the ingestion shards of ``sources``, by shard id."""
    out: dict[str, ShardRole] = {}
    cat = str(default_catalog_shard())
    out[cat] = ShardRole(cat, "catalog")
    for src in sources:
        for role in SOURCE_SHARD_ROLES:
            sid = str(shard_id_for(src, role))
            out[sid] = ShardRole(sid, role, collection=src)
    for d in descs:
        name = d["name"]
        out[d["metadata_shard"]] = ShardRole(d["metadata_shard"], "metadata", collection=name)
        for r, info in d["renditions"].items():
            for i, sid in enumerate(info["shards"]):
                out[sid] = ShardRole(
                    sid, "rendition", name, r, i, len(info["shards"]), status=info["status"]
                )
    return out


def catalog_directory(ctl: Any, sources: Iterable[str] = ()) -> dict[str, ShardRole]:
    """``shard_directory`` of every collection, from one read of the STORAGE catalog and
    of each collection's metadata shard (which rendition is active); no data shard's
    state is fetched: cheap enough for every materialization and sensor tick."""
    cat, _ = ctl.catalog.load()
    descs = []
    for name, spec in sorted(cat.items()):
        rs = {}
        active = active_rendition(ctl.client, spec["metadata_shard"])
        for r, info in spec["renditions"].items():
            rs[r] = {"shards": info["shards"], "status": rendition_status(info, active=r == active)}
        descs.append({"name": name, "metadata_shard": spec["metadata_shard"], "renditions": rs})
    return shard_directory(descs, sources)


def role_of(directory: Mapping[str, ShardRole], shard: str) -> ShardRole:
    return directory.get(shard) or ShardRole(shard, "unknown")


def source_collections(source: str, roles: Iterable[str] = ("data", "raw", "errors", "state")) -> list[str]:
    return [collection_name(source, r) for r in roles]


@dataclass
class PartitionSync:
    """Dynamic partitions to add and delete, and the materializations that go with them."""

    add: dict[str, list[str]] = field(default_factory=dict)
    delete: dict[str, list[str]] = field(default_factory=dict)
    events: list[dg.AssetMaterialization] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.add or self.delete or self.events)

    def apply_in_run(
        self, instance: dg.DagsterInstance, log_event: Callable[[Any], None] | None = None
    ) -> None:
        """Applies the plan to ``instance``; events go through ``log_event`` (a run's
        ``context.log_event``) or are reported runless."""
        for name, keys in self.add.items():
            if keys:
                instance.add_dynamic_partitions(name, keys)
        for name, keys in self.delete.items():
            for k in keys:
                instance.delete_dynamic_partition(name, k)
        for ev in self.events:
            if log_event is not None:
                log_event(ev)
            else:
                instance.report_runless_asset_event(ev)

    def sensor_requests(self) -> list[Any]:
        """The plan as ``SensorResult.dynamic_partitions_requests`` (events go to
        ``SensorResult.asset_events``)."""
        out: list[Any] = []
        for name, keys in self.add.items():
            if keys:
                out.append(dg.DynamicPartitionsDefinition(name=name).build_add_request(keys))
        for name, keys in self.delete.items():
            if keys:
                out.append(dg.DynamicPartitionsDefinition(name=name).build_delete_request(keys))
        return out


def plan_shard_partitions(
    plan: PartitionSync,
    known: Iterable[str],
    directory: Mapping[str, ShardRole],
    live: Iterable[str],
    finalized: Iterable[str],
    recorded: Mapping[str, str] | None = None,
) -> PartitionSync:
    """Live shards that are not partitions yet become partitions, each with a
    materialization naming what it is; finalized shards stop being partitions.
    ``recorded``: the ``rendition_status`` each shard partition's latest materialization
    shows; a partition whose rendition's status changed since (a handover made it
    ``active`` or ``retired``) gets a materialization with the new status."""
    known_set = set(known)
    name = shard_partitions.name or "persist_shards"
    new = sorted(set(live) - known_set)
    gone = sorted(set(finalized) & known_set)
    if new:
        plan.add.setdefault(name, []).extend(new)
    if gone:
        plan.delete.setdefault(name, []).extend(gone)
    events = [(s, "registered", f"shard registered: {role_of(directory, s).label}") for s in new]
    for s, was in sorted((recorded or {}).items()):
        role = role_of(directory, s)
        if s in known_set and s not in gone and role.kind == "rendition" and role.status != was:
            what = f"{role.label}: rendition {role.rendition} is now {role.status} (was {was})"
            events.append((s, "status changed", what))
    for s, event, description in events:
        meta = {**role_of(directory, s).metadata(), "event": dg.MetadataValue.text(event)}
        plan.events.append(
            dg.AssetMaterialization(
                asset_key=PERSIST_SHARD_KEY, partition=s, description=description, metadata=meta
            )
        )
    return plan


def collection_shards(desc: Mapping[str, Any]) -> tuple[set[str], set[str]]:
    """(live shards, finalized shards) of a described collection: shards of dropped
    renditions are finalized; the metadata shard and every other rendition's are live."""
    live = {desc["metadata_shard"]}
    finalized: set[str] = set()
    for info in desc["renditions"].values():
        if info["status"] == "dropped":
            finalized.update(info["shards"])
        elif info["status"] in LIVE_STATUSES:
            live.update(info["shards"])
    return live, finalized


def plan_rendition_partitions(
    plan: PartitionSync,
    instance: dg.DagsterInstance,
    partitions_def: dg.DynamicPartitionsDefinition,
    asset_key: dg.AssetKey,
    desc: Mapping[str, Any],
    *,
    materializing: str | None = None,
    rendition_metadata: Callable[[str], Mapping[str, Any]] | None = None,
) -> PartitionSync:
    """Ready renditions of the collection ``desc`` become partitions of
    ``partitions_def``; retired and dropped ones stop being partitions. A ready
    rendition that was never materialized (the first rendition, made by ingestion) gets
    a materialization, except ``materializing`` (the current run materializes it)."""
    name = partitions_def.name or ""
    known = set(instance.get_dynamic_partitions(name))
    ready = [r for r, i in sorted(desc["renditions"].items()) if i["status"] in ("ready", "active")]
    gone = [r for r, i in sorted(desc["renditions"].items()) if i["status"] in ("retired", "dropped")]
    new = [r for r in ready if r not in known]
    if new:
        plan.add.setdefault(name, []).extend(new)
    drop = [r for r in gone if r in known and r != materializing]
    if drop:
        plan.delete.setdefault(name, []).extend(drop)
    done = instance.get_materialized_partitions(asset_key)
    for r in ready:
        if r in done or r == materializing:
            continue
        info = desc["renditions"][r]
        meta: dict[str, Any] = {
            "collection": dg.MetadataValue.text(desc["name"]),
            "rendition": dg.MetadataValue.text(r),
            "status": dg.MetadataValue.text(info["status"]),
            "num_shards": dg.MetadataValue.int(int(info["num_shards"])),
        }
        if rendition_metadata is not None:
            meta = {**rendition_metadata(r), **meta}
        plan.events.append(
            dg.AssetMaterialization(
                asset_key=asset_key,
                partition=r,
                description=(
                    f"rendition {r} of {desc['name']} exists ({info['num_shards']} shards): "
                    "made outside a rendition backfill (e.g. the first rendition, created by "
                    "ingestion)"
                ),
                metadata=meta,
            )
        )
    return plan


def sync_source_partitions(
    context: Any,
    client: Any,
    ctl: Any,
    name: str,
    renditions_def: dg.DynamicPartitionsDefinition,
    *,
    materializing: str | None = None,
) -> PartitionSync:
    """Brings the partitions of collection ``name``'s renditions and shards up to date in
    a run (``context``: an asset or op execution context): live ones added with what they
    are, retired/dropped renditions and finalized shards removed."""
    instance = context.instance
    desc = ctl.describe(name)
    plan = plan_rendition_partitions(
        PartitionSync(),
        instance,
        renditions_def,
        dg.AssetKey(f"{name}_rendition"),
        desc,
        materializing=materializing,
        rendition_metadata=lambda r: collection_metadata(client, desc, rendition=r),
    )
    live, finalized = collection_shards(desc)
    known = instance.get_dynamic_partitions(shard_partitions.name or "")
    plan_shard_partitions(
        plan,
        known,
        shard_directory([desc]),
        live,
        finalized,
        recorded_rendition_status(instance, set(known) & live),
    )
    plan.apply_in_run(instance, context.log_event)
    return plan


def recorded_rendition_status(instance: dg.DagsterInstance, shards: Iterable[str]) -> dict[str, str]:
    """The ``rendition_status`` the latest materialization of each ``persist_shard``
    partition in ``shards`` records (shards without one are left out)."""
    out: dict[str, str] = {}
    for s in sorted(shards):
        recs = instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=PERSIST_SHARD_KEY, asset_partitions=[s]),
            limit=1,
            ascending=False,
        ).records
        mat = recs[0].asset_materialization if recs else None
        value = mat.metadata.get("rendition_status") if mat is not None else None
        if value is not None:
            out[s] = str(value.value)
    return out
