"""``insert_job``: rows into transactional collections as ONE transaction, from Dagster.

The Dagster form of ``ctl.insert`` / ``ctl.transaction()`` (the seed's table-like write
path, issue 27): the run config names, per collection, the rows to insert (JSON objects
with the collection's key and value fields, an optional ``diff``); every row of every
collection becomes visible at one time the controller picks, all or nothing. Refusals
(an unknown or non-transactional collection, a row that does not fit the schema) fail
the run with the typed error and write nothing.
"""

from typing import Any

import dagster as dg
import pyarrow as pa

from dagster_project.resources import PersistResource
from persist_lib.errors import InvalidUsage


class InsertConfig(dg.Config):
    """``rows``: collection name -> list of row objects."""

    rows: dict[str, list[dict[str, Any]]]


@dg.op(description="Insert rows into transactional collections as one transaction.")
def insert_rows_op(context: dg.OpExecutionContext, config: InsertConfig, persist: PersistResource) -> dict:
    if not config.rows or not any(config.rows.values()):
        raise InvalidUsage("insert_job: the run config holds no rows; nothing was written")
    ctl = persist.controller()
    with ctl.transaction() as tx:
        for name, rows in sorted(config.rows.items()):
            try:
                table = pa.Table.from_pylist(rows)
            except (pa.ArrowException, TypeError, ValueError) as e:
                raise InvalidUsage(f"insert_job: the rows of {name!r} don't form one table: {e}") from e
            tx.insert(name, table)
    out = {"time": tx.committed_at, "rows": {n: len(r) for n, r in config.rows.items()}}
    context.add_output_metadata({"time": tx.committed_at, "rows": dg.MetadataValue.json(out["rows"])})
    return out


@dg.job(description="Insert rows into transactional collections (one transaction).",
        executor_def=dg.in_process_executor)
def insert_job() -> None:
    insert_rows_op()
