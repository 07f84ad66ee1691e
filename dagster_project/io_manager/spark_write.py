"""Storing a PySpark DataFrame output through the Spark executors, not the driver.

The output never passes through the driver's memory (no ``toArrow``): its schema is
mapped to Arrow (as ``toArrow`` would type it) for the checks the other outputs get, and
every row-level step is a Spark job:

* a partitioned output is materialized once on the executors (``localCheckpoint``) and
  checked there to hold only its partitions' rows; otherwise the user's plan runs in the
  write's own jobs (once more after a lost race);
* ``append``: the rows (``diff`` +1, at the write's time) are written by the executors;
* ``overwrite`` / ``upsert``: the old contents at ``upper - 1`` come from the distributed
  read (``spark_read.snapshot_splits``: the partition filter pushed down, so an
  overwrite of a partition retracts exactly that partition's rows) and the difference
  is a Spark aggregation: old rows with ``-multiplicity``, new rows with ``+1``, grouped
  by every column, the diffs summed (materialized on the executors while the old
  parts are held; the counts for the metadata are one more aggregate of it), zeros
  dropped. ``upsert`` retracts the old rows
  whose key is in the output (a left-semi join: null keys match nothing, as in the Arrow
  path's join) and inserts the output's rows not flagged deleted — ``write_modes``'
  semantics, computed distributed;
* the data and the write's ledger entry (a one-row Arrow job) commit as ONE transaction
  (``persist_lib.spark.write_collections``, per-collection lowers), conditional on both
  uppers; a lost race recomputes against the new contents and tries again.

Caveat of the Spark aggregation (as for the Spark read): Spark's grouping treats
``-0.0`` as ``0.0`` and every NaN as one value, so an overwrite that only changes
``0.0`` to ``-0.0`` (or one NaN payload to another) writes nothing, and a ``-0.0``
grouped with other rows may be stored as ``0.0``; persist itself keeps them apart.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from typing import Any

import pyarrow as pa

from dagster_project.io_manager.atomic_commit import logical_upper
from dagster_project.io_manager.errors import IOManagerConfigError, PartitionMismatch
from dagster_project.io_manager.ledger import LandedWrite, WriteLedger, entry, now_ms
from dagster_project.io_manager.partitions import PartitionSelection
from dagster_project.io_manager.schema_follow import Conformed
from dagster_project.io_manager.settings import OutputSettings
from dagster_project.io_manager.spark_read import snapshot_splits
from persist_lib.errors import UpperMismatch
from persist_lib.frontier import Antichain
from persist_lib.shard.codec import DIFF
from persist_lib.spark import write_collections
from persist_lib.spark.types import spark_type
from persist_lib.storage import StorageController
from persist_lib.storage.reader import CollectionReader
from persist_lib.storage.schema_evolution import collection_schemas
from persist_lib.storage.writer import CollectionWriter

MAX_ATTEMPTS = 64


def is_spark_output(obj: Any) -> bool:
    """A PySpark DataFrame (classic or Spark Connect)."""
    mod = type(obj).__module__ or ""
    return mod.startswith("pyspark.sql") and type(obj).__name__ == "DataFrame"


def arrow_schema(df: Any) -> pa.Schema:
    """The Arrow schema ``df.toArrow()`` would give, without running anything."""
    from pyspark.sql.pandas.types import to_arrow_schema

    large = str(df.sparkSession.conf.get("spark.sql.execution.arrow.useLargeVarTypes", "false")).lower() == "true"
    return to_arrow_schema(df.schema, error_on_duplicated_field_names_in_struct=True, prefers_large_types=large)


def relax_nullability(ctl: StorageController, name: str, table: pa.Table) -> pa.Table:
    """``table`` (the output's empty Arrow stand-in) with a column Spark declares not null
    marked nullable where collection ``name`` holds it nullable: Spark infers nullability
    (``spark.range``'s ``id`` is not null, most expressions are nullable), and not-null
    values fit a nullable column, so that difference alone is no schema change."""
    cur = collection_schemas(ctl._spec(name))
    held = {f.name: f.nullable for f in [*cur.key, *cur.val]}
    fields = [f.with_nullable(True) if not f.nullable and held.get(f.name) else f for f in table.schema]
    return pa.schema(fields, table.schema.metadata).empty_table()


def check_owns(df: Any, sel: PartitionSelection, where: str) -> None:
    """``PartitionSelection.check_owns`` on the executors: each task counts its rows
    outside the partitions (and names its first); the driver gets one row per task."""

    def outside(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        bad, first = 0, None
        for b in batches:
            t = pa.Table.from_batches([b])
            inside = sel.mask(t, where).to_numpy(zero_copy_only=False)
            n = int((~inside).sum())
            if n and first is None:
                i = int((~inside).argmax())
                first = json.dumps({c: str(t.column(c)[i].as_py()) for c in sel.columns.values()})
            bad += n
        yield pa.RecordBatch.from_pydict({"bad": [bad], "first": [first]},
                                         schema=pa.schema([("bad", pa.int64()), ("first", pa.string())]))

    rows = df.mapInArrow(outside, "bad long, first string").collect()
    bad = sum(r["bad"] for r in rows)
    if bad:
        first = next(r["first"] for r in rows if r["first"] is not None)
        raise PartitionMismatch(
            f"{where}: {bad} output row(s) lie outside partition {sel.describe()} (first: {first}); "
            "an asset materializing a partition must return only that partition's rows"
        )


def conform(df: Any, conformed: Conformed) -> Any:
    """``df`` arranged like ``conformed.table`` (the schema-follow result computed on the
    output's empty Arrow schema): columns in the collection's order, the narrower ones
    cast up, the missing nullable ones as typed nulls — Spark columns, not Arrow work."""
    from pyspark.sql import functions as F

    cols = []
    for f in conformed.table.schema:
        if f.name in conformed.filled:
            cols.append(F.lit(None).cast(spark_type(f.type, f.name)).alias(f.name))
        elif f.name in conformed.cast_up:
            cols.append(F.col(f.name).cast(spark_type(f.type, f.name)).alias(f.name))
        else:
            cols.append(F.col(f.name))
    return df.select(*cols)


_N = "__persist_io_n"  # per distinct row: how many output rows it is
_BAD = "__persist_io_bad"  # per distinct row: old rows of negative multiplicity


def _signed(df: Any, names: list[str], diff: Any, n: int, bad: Any) -> Any:
    from pyspark.sql import functions as F

    return df.select(*names, diff.cast("long").alias(DIFF), F.lit(n).cast("long").alias(_N), bad.cast("long").alias(_BAD))


def _grouped(old: Any, live: Any, names: list[str]) -> Any:
    """Old rows (``diff`` = ``-multiplicity``) and ``live`` output rows (``+1``, counted
    in ``_N``) grouped by every column, the three columns summed. Materialized on the
    executors."""
    from pyspark.sql import functions as F

    both = _signed(live, names, F.lit(1), 1, F.lit(0))
    both = both.unionByName(_signed(old, names, -F.col(DIFF), 0, F.when(F.col(DIFF) < 0, 1).otherwise(0)))
    return both.groupBy(*names).agg(*(F.sum(c).alias(c) for c in (DIFF, _N, _BAD))).localCheckpoint(eager=True)


def updates(
    spark: Any, r: CollectionReader, w: CollectionWriter, new: Any, s: OutputSettings,
    sel: PartitionSelection | None, filt: Any, upper: int, where: str,
) -> tuple[Any, dict[str, int] | None]:
    """The updates (with ``diff``; without ``ts``) that turn the contents as of
    ``upper - 1`` into the output, and their counts: the output's rows as they are
    (lazy; counts from the write: None, or only ``rows``) for ``append`` and for a first
    write (nothing to retract; the part builders consolidate duplicates, as the Arrow
    path leaves them to), else the difference held by the executors."""
    from pyspark.sql import functions as F

    names = [*w.schemas.key_names, *w.schemas.val_names]
    if s.mode == "append":
        return new.select(*names), None
    rows = None
    live = new
    if s.mode == "upsert":
        most, rows = new.groupBy(*s.key).count().agg(F.max("count"), F.sum("count")).first()
        if most is not None and most > 1:
            raise IOManagerConfigError(
                f"upsert output holds a key of {s.key} more than once; each key may appear once per write"
            )
        if s.delete_column is not None:
            live = new.where(~F.coalesce(F.col(s.delete_column), F.lit(False)))
    if upper == 0:
        return live.select(*names), ({"rows": int(rows or 0)} if rows is not None else None)
    part = sel if s.mode == "overwrite" else None
    with snapshot_splits(
        spark, r, upper - 1, columns=None, filter=filt if part else None, sel=part, where=where,
    ) as old:
        if s.mode == "upsert":  # only the old rows whose key the output holds
            old = old.join(new.select(*s.key), on=s.key, how="left_semi")
        grouped = _grouped(old, live, names)  # run while the splits' parts are held
    n, pos, neg, bad = grouped.agg(
        F.sum(_N), F.sum(F.when(F.col(DIFF) > 0, F.col(DIFF)).otherwise(0)),
        F.sum(F.when(F.col(DIFF) < 0, -F.col(DIFF)).otherwise(0)), F.sum(_BAD),
    ).first()
    if bad:
        raise IOManagerConfigError(
            f"{where}: the snapshot holds rows with negative multiplicity; the collection was not "
            "written by this I/O manager alone"
        )
    counts = {"rows": int(rows if rows is not None else n or 0), "inserted": int(pos or 0), "retracted": int(neg or 0)}
    return grouped.where(F.col(DIFF) != 0).select(*names, DIFF), counts


def store(
    ctl: StorageController, ledger: WriteLedger, name: str, df: Any, s: OutputSettings,
    sel: PartitionSelection | None, where: str, write_id: str,
    check_schemas: Callable[[CollectionWriter], None], before_commit: Callable[[], None] | None,
) -> tuple[LandedWrite, dict[str, int], bool]:
    """``PersistIOManagerImpl.store`` for a conformed DataFrame (both collections
    transactional): its updates and ledger entry in one transaction, unless the ledger
    holds ``write_id`` already. Returns where it landed, its counts and whether it had
    landed before. ``df`` is the user's plan (or, for a partitioned output, its
    ``localCheckpoint``): it runs in the difference's or the write's Spark job."""
    spark = df.sparkSession
    new = df
    with ExitStack() as stack:
        w = stack.enter_context(ctl.open_writer(name))
        check_schemas(w)
        types = {f.name: f.type for f in [*w.schemas.key, *w.schemas.val]}
        filt = sel.pushdown(types, where) if sel is not None and s.mode == "overwrite" else None
        lw = stack.enter_context(ctl.open_writer(ledger.name))
        landed = ledger.lookup(name, write_id, writer=lw)
        if landed is not None:
            return landed, {"rows": new.count()}, True
        r = stack.enter_context(ctl.acquire_read_handle(name))
        upper: int = -1
        upd, counts = None, None
        for attempt in range(1, MAX_ATTEMPTS + 1):
            u = logical_upper(w)
            if u != upper or upd is None:  # the contents moved (or the first attempt): recompute
                upper = u
                upd, counts = updates(spark, r, w, new, s, sel, filt, upper, where)
            lu = logical_upper(lw)
            t = max(upper, now_ms(), lu)
            landed = LandedWrite(t, t + 1)
            if before_commit is not None:
                before_commit()
            try:
                res = write_collections(
                    [(upd, w), (entry(name, write_id, landed, t), lw)], upper, t + 1, lowers=[upper, lu], time=t,
                    skip_committed=False,
                )
            except UpperMismatch:
                continue  # the data or the ledger moved: nothing was written
            if counts is None or "inserted" not in counts:  # every row written is an insert
                counts = {"rows": (counts or {}).get("rows", res[0].rows_in), "inserted": res[0].rows_in, "retracted": 0}
            return landed, {**counts, "attempts": attempt}, False
        raise UpperMismatch(name, Antichain([upper]), Antichain([logical_upper(w)]))
