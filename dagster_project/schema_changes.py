"""Schema changes from the Dagster side (issue 27, docs/dagster.md "Schema changes").

A source's schemas are declared in code (``SourceSpec.key_schema``/``val_schema`` in
``sources.py``). When a deployment changes them, the next ingestion run follows:

- ``on_schema_change="evolve"`` (the default): a change persist can make in place (add a
  nullable value column, widen a type, drop a value column) is applied to the source's
  collections (data and state) before anything is ingested: one crash-safe evolution
  (``StorageController.evolve_schema``), old rows read null in new columns. A change that
  can't be made in place stops the run with ``SourceSchemaNeedsRendition`` (nothing
  changed): materialize ``<name>_rendition`` (the rendition backfill), which rebuilds
  the collections under the new schemas from the raw records and hands over.
- ``on_schema_change="fail"``: any difference stops the run with
  ``SourceSchemaChanged``; evolve on purpose with ``evolve_schema_job`` (or
  ``persist schema evolve``) and then deploy the new declaration.

``evolve_schema_job`` evolves any collection (a source's or one the I/O manager stores)
from run config, the same ``COL:TYPE`` arguments as ``persist schema evolve``.
"""

from __future__ import annotations

from typing import Any

from persist_lib.errors import IncompatibleSchemaChange, InvalidUsage
from persist_lib.ingest.schema_follow import check_not_evolved, evolve_ingestion
from persist_lib.shard.codec import Schemas
from persist_lib.storage import StorageController
from persist_lib.storage.schema_evolution import collection_schemas

ON_SCHEMA_CHANGE = ("evolve", "fail")


class SourceSchemaChanged(InvalidUsage):
    """A source declared with ``on_schema_change="fail"`` has schemas in code that differ
    from its collection's."""


class SourceSchemaNeedsRendition(IncompatibleSchemaChange):
    """A source's declared schemas can't be reached in place: rebuild a rendition."""


def current_schemas(ctl: StorageController, name: str) -> Schemas:
    """The collection's schemas now (its latest version)."""
    return collection_schemas(ctl._spec(name))


def follow_declared_schema(spec: Any, ctl: StorageController) -> dict[str, Any] | None:
    """Brings the collections of source ``spec`` to its declared schemas when they
    changed (module docstring); None when there was nothing to do (no collection yet,
    or the same schemas)."""
    name = spec.name
    if name not in ctl.list_collections():
        return None  # the first ingestion creates it with the declared schemas
    want = Schemas.create(spec.key_schema, spec.val_schema)
    cur = current_schemas(ctl, name)
    if cur == want:
        return None
    # An earlier version of the collection's: someone evolved it ahead of the code.
    check_not_evolved(ctl, name, want)
    mode = getattr(spec, "on_schema_change", "evolve")
    if mode == "fail":
        raise SourceSchemaChanged(
            f"source {name!r}: its schemas in code ({want.describe()}) differ from collection "
            f"{name!r}'s version {cur.version} ({cur.describe()}) and on_schema_change='fail'; "
            f"evolve the collection on purpose (evolve_schema_job, or `persist schema evolve "
            f"{name} ...`) or set on_schema_change='evolve'"
        )
    try:
        return evolve_ingestion(ctl, name, spec.key_schema, spec.val_schema)
    except IncompatibleSchemaChange as e:
        raise SourceSchemaNeedsRendition(
            f"source {name!r}: its schemas in code can't be reached in place ({e}); nothing "
            f"was changed. Materialize {name}_rendition with a new rendition name (the "
            "rendition backfill rebuilds the collections under the new schemas from the raw "
            "records and hands over), then ingest again"
        ) from e
