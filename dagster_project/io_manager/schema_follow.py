"""An output whose columns changed since its collection was created (issue 27 item 3).

Data frames change shape as assets evolve; the collection follows when persist can
make the change in place (docs/architecture.md, "Schema evolution"):

- a **new value column** is added to the collection (nullable; rows written before read
  null there), a **wider type** (int32 -> int64, float32 -> float64, decimal precision up,
  string -> large_string) widens the collection's column: one crash-safe
  ``StorageController.evolve_schema`` before the write, with ``persist/schema_change:
  evolve`` (the default); with ``fail`` the write is refused instead;
- a **narrower type** than the collection's is cast up (every value fits);
- a **missing nullable value column** is written as nulls (Delta's rule for a write
  with fewer columns); dropping a column is done on purpose only (``evolve_schema_job``
  or ``persist schema evolve --drop``), never by forgetting to return it;
- value columns are matched by name: the output's column order does not matter (new
  ones go last);
- anything else (a key column changed, a missing not-null column, a change of kind such
  as double -> string) raises ``OutputSchemaMismatch`` and nothing is written.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pyarrow as pa

from dagster_project.io_manager.errors import OutputSchemaMismatch
from persist_lib.errors import IncompatibleSchemaChange
from persist_lib.shard.codec import Schemas
from persist_lib.shard.schema_compat import is_widening
from persist_lib.storage import StorageController
from persist_lib.storage.schema_evolution import collection_schemas


@dataclass
class Conformed:
    """The output arranged as the collection's schemas (after any evolution)."""

    table: pa.Table
    evolved: dict | None = None  # evolve_schema's result when this write evolved it
    filled: list[str] = field(default_factory=list)  # nullable columns written as nulls
    cast_up: list[str] = field(default_factory=list)  # columns cast to the wider type


def conform_output(
    ctl: StorageController, name: str, out: pa.Table, key: list[str], delete_column: str | None,
    policy: str, where: str,
) -> Conformed:
    """``out`` (key columns, value columns, then ``delete_column``) arranged to collection
    ``name``'s schemas, evolving them first when the output needs it (module docstring)."""
    cur = collection_schemas(ctl._spec(name))
    ks = pa.schema([out.schema.field(c) for c in key])
    vs = pa.schema([f for f in out.schema if f.name not in key and f.name != delete_column])
    if Schemas.create(ks, vs) == cur:
        return Conformed(out)
    if not ks.equals(cur.key):
        raise OutputSchemaMismatch(
            f"{where}: output key columns {_fields(ks)} differ from collection {name!r}'s {_fields(cur.key)}; "
            "key columns can't change: materialize into a new asset key"
        )
    res = Conformed(out)
    target: list[pa.Field] = []
    columns: dict[str, pa.ChunkedArray] = {}
    for f in cur.val:
        if f.name not in vs.names:
            if not f.nullable:
                raise OutputSchemaMismatch(
                    f"{where}: the output has no column {f.name!r}, which collection {name!r} holds not null; "
                    "return it (dropping a column is done on purpose: evolve_schema_job with drop)"
                )
            res.filled.append(f.name)
            target.append(f)
            columns[f.name] = pa.chunked_array([pa.nulls(out.num_rows, f.type)])
            continue
        g = vs.field(f.name)
        col = out.column(f.name)
        if g.type.equals(f.type):
            target.append(f)
        elif is_widening(g.type, f.type):  # narrower than stored: every value fits
            res.cast_up.append(f.name)
            target.append(f)
            col = col.cast(f.type)
        elif is_widening(f.type, g.type):  # wider than stored: widen the collection
            target.append(pa.field(f.name, g.type, f.nullable, f.metadata))
        else:
            raise OutputSchemaMismatch(
                f"{where}: output schemas {Schemas.create(ks, vs).describe()} differ from collection {name!r}'s "
                f"{cur.describe()}: column {f.name!r} is {g.type} in the output, {f.type} in the collection; only "
                "widening is made in place: return the recorded type, or materialize into a new asset key"
            )
        columns[f.name] = col
    for g in vs:
        if g.name not in cur.val.names:
            target.append(pa.field(g.name, g.type, True, g.metadata))
            columns[g.name] = out.column(g.name)
    val = pa.schema(target)
    if not val.equals(cur.val):
        new = Schemas.create(cur.key, val)
        if policy == "fail":
            raise OutputSchemaMismatch(
                f"{where}: output schemas {new.describe()} differ from collection {name!r}'s "
                f"{cur.describe()} and persist/schema_change is 'fail'; return the recorded columns, "
                "or set persist/schema_change: evolve"
            )
        try:
            res.evolved = ctl.evolve_schema(name, cur.key, val)
        except IncompatibleSchemaChange as e:
            raise OutputSchemaMismatch(f"{where}: {e}") from e
    arrays = [out.column(c) for c in key] + [columns[f.name] for f in val]
    fields = list(cur.key) + list(val)
    if delete_column is not None:
        arrays.append(out.column(delete_column))
        fields.append(out.schema.field(delete_column))
    res.table = pa.Table.from_arrays(arrays, schema=pa.schema(fields))
    return res


def _fields(s: pa.Schema) -> str:
    return "(" + ", ".join(f"{f.name}: {f.type}" for f in s) + ")"
