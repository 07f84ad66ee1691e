"""Loading an input as a PySpark DataFrame through ``persist_lib.spark``'s distributed read.

The driver plans snapshot splits on every shard of the rendition active at the input's
``as_of`` (``ReadHandle.snapshot_splits``, the partition filter pushed down: parts whose
statistics rule it out are in no split, and each split filters its rows) and Spark
executors fetch and decode the parts (``persist_lib.spark.splits_dataframe``, the
projection applied after the consolidation across splits). The result is materialized
on the executors (``localCheckpoint``) before the splits' holds are released, so
garbage collection can't delete a part the DataFrame still needs. Nothing of the input
passes through the driver's memory.

Rows come back as many times as their multiplicity (an append-mode collection may hold
a row more than once), like every other input type. Caveat of the Spark-side
consolidation (``persist_lib.spark.read``): Spark groups ``-0.0`` with ``0.0`` and every
NaN together, where persist keeps them apart.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import pyarrow as pa

from dagster_project.io_manager.errors import IOManagerConfigError
from dagster_project.io_manager.partitions import PartitionSelection
from persist_lib.handles.read import ReadHandle
from persist_lib.handles.splits import RangeSplit, SnapshotSplit
from persist_lib.shard.codec import DIFF, TS
from persist_lib.spark import default_parallelism, splits_dataframe
from persist_lib.storage.reader import CollectionReader

SPLITS_PER_SHARD_FACTOR = 2  # splits per shard: twice the session's default parallelism


def active_session() -> Any:
    """The active SparkSession (the one a ``dagster-pyspark`` resource or the asset built)."""
    from pyspark.sql import SparkSession

    return SparkSession.getActiveSession() or SparkSession.builder.getOrCreate()


def _exact_partitions(df: Any, sel: PartitionSelection, where: str) -> Any:
    """Cuts ``df`` to exactly ``sel``'s rows with the Arrow mask the other types use
    (for several partitions of several dimensions, the pushed filter is a superset)."""

    def keep(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for b in batches:
            t = pa.Table.from_batches([b])
            yield from t.filter(sel.mask(t, where)).to_batches()

    return df.mapInArrow(keep, df.schema)


def load_dataframe(
    spark: Any, reader: CollectionReader, as_of: int, *, columns: Sequence[str] | None,
    filter: Any, sel: PartitionSelection | None, keep: Sequence[str] | None, where: str,
) -> Any:
    """The collection at ``as_of`` as a Spark DataFrame of plain rows: ``columns`` (and
    ``filter``) pushed down, cut to ``sel``'s partitions, projected to ``keep``."""
    df = snapshot_dataframe(spark, reader, as_of, columns=columns, filter=filter, sel=sel, where=where)
    return _expand(df, keep, where)


def snapshot_dataframe(
    spark: Any, reader: CollectionReader, as_of: int, *, columns: Sequence[str] | None,
    filter: Any, sel: PartitionSelection | None, where: str,
) -> Any:
    """The consolidated snapshot at ``as_of`` (the rows with ``ts`` and ``diff``, each
    distinct row once), held by the executors: ``columns`` and ``filter`` pushed down,
    cut to ``sel``'s partitions."""
    with snapshot_splits(spark, reader, as_of, columns=columns, filter=filter, sel=sel, where=where) as df:
        return df.localCheckpoint(eager=True)  # executors hold the rows; the parts may go


@contextmanager
def snapshot_splits(
    spark: Any, reader: CollectionReader, as_of: int, *, columns: Sequence[str] | None,
    filter: Any, sel: PartitionSelection | None, where: str,
) -> Iterator[Any]:
    """The consolidated snapshot at ``as_of`` as a DataFrame that reads the parts when
    run: run (or materialize) whatever uses it inside the block, which holds the splits'
    parts against garbage collection until it ends."""
    rendition = reader.active_rendition(as_of)
    handles = reader.rendition_readers(rendition)  # applies committed transactions first
    n = max(1, default_parallelism(spark) * SPLITS_PER_SHARD_FACTOR // max(1, len(handles)))
    taken: list[ReadHandle] = []
    splits: list[SnapshotSplit | RangeSplit] = []
    try:
        for h in handles:
            splits.extend(h.snapshot_splits(as_of, n, filter=filter))
            taken.append(h)
        df = splits_dataframe(spark, splits, reader.schemas, columns=columns)
        if sel is not None and len(sel.columns) > 1 and len(sel.keys) > 1:
            df = _exact_partitions(df, sel, where)
        yield df
    finally:
        for h in taken:
            h.release_splits()


def _expand(df: Any, keep: Sequence[str] | None, where: str) -> Any:
    """Each row repeated ``diff`` times, without ``ts`` and ``diff``."""
    from pyspark.sql import functions as F

    lo, hi = df.agg(F.min(DIFF), F.max(DIFF)).first()
    if lo is not None and lo < 0:
        raise IOManagerConfigError(
            f"{where}: the snapshot holds rows with negative multiplicity; the collection was not "
            "written by this I/O manager alone"
        )
    names = [c for c in df.columns if c not in (TS, DIFF)] if keep is None else list(keep)
    if hi is not None and hi > 1:
        df = df.withColumn(DIFF, F.explode(F.sequence(F.lit(1), F.col(DIFF))))
    return df.select(*names)
