"""``evolve_schema_job``: changes a collection's schemas in place from the launchpad.

The same change as ``persist schema evolve NAME --add COL:TYPE --widen COL:TYPE --drop
COL`` (``persist_lib.storage.schema_spec``), run by ``StorageController.evolve_schema``:
crash-safe, all or nothing; a change persist can't make in place fails the run with
``IncompatibleSchemaChange`` and changes nothing (build a new rendition instead). A
source's collections follow the schemas declared in code by themselves
(``dagster_project/schema_changes.py``); this job is for evolving on purpose, e.g. a
collection written by the I/O manager, or ahead of a source deployment.
"""


import dagster as dg

from dagster_project.resources import PersistResource
from dagster_project.schema_changes import current_schemas
from persist_lib.shard.codec import Schemas
from persist_lib.shard.schema_compat import check_evolution
from persist_lib.storage.schema_spec import TYPES_HELP, evolved_val


class EvolveSchemaConfig(dg.Config):
    """Which collection and what to change (``COL:TYPE`` with an Arrow type name)."""

    collection: str
    add: list[str] = []
    widen: list[str] = []
    drop: list[str] = []
    dry_run: bool = False


@dg.op(description="Evolve a collection's schemas in place (add / widen / drop value columns). " + TYPES_HELP)
def evolve_schema_op(
    context: dg.OpExecutionContext, config: EvolveSchemaConfig, persist: PersistResource
) -> dict:
    if not (config.add or config.widen or config.drop):
        raise dg.Failure("evolve_schema_job: give at least one of add, widen or drop in the op config")
    ctl = persist.controller()
    cur = current_schemas(ctl, config.collection)
    val = evolved_val(cur.val, add=config.add, widen=config.widen, drop=config.drop)
    if config.dry_run:
        new = Schemas.create(cur.key, val)
        changes = check_evolution(cur, new, shard=f"collection {config.collection!r}")
        out = {
            "name": config.collection, "dry_run": True, "outcome": "dry run",
            "version": cur.version + (1 if changes else 0), "changes": [c.describe() for c in changes],
        }
    else:
        out = ctl.evolve_schema(config.collection, cur.key, val)
    schemas = Schemas.create(cur.key, val).describe() if config.dry_run else ctl.schema(config.collection)["schemas"]
    context.add_output_metadata(
        {
            "collection": config.collection,
            "outcome": out["outcome"],
            "version": out["version"],
            "changes": dg.MetadataValue.json(out.get("changes", [])),
            "schemas": schemas,
        }
    )
    context.log.info(
        "%s: %s, schema version %s (%s)", config.collection, out["outcome"], out["version"],
        "; ".join(out.get("changes") or []) or "no change",
    )
    return out


@dg.job(description="Evolve a collection's schemas in place.", executor_def=dg.in_process_executor)
def evolve_schema_job() -> None:
    evolve_schema_op()
