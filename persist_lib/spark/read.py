"""Reading shards into Spark DataFrames: snapshots and time ranges, fetched on executors.

The driver plans *splits* (picklable lists of part metadata) from one state version
and holds that version (the reader's seqno hold) while executors fetch, verify and
decode the parts. Each split is consolidated on its executor; a ``groupBy`` over
``(key, value, ts)`` then consolidates across splits (the same ``(k, v, t)`` can sit
in parts of different splits), dropping zero diffs. A snapshot of key-disjoint parts is instead fetched in key-range
splits that share no record (``disjoint_splits``) and needs no grouping.

A DataFrame is lazy, but parts may be garbage collected once the hold is released, so
by default the DataFrame is made independent of the hold before it is released: on a
``file://`` blob ``read_snapshot`` pins the parts (``spark.pins``: hard links that
garbage collection does not delete) and returns the DataFrame lazily, reading the pinned
files; otherwise the result is materialized (``localCheckpoint``: executor-local, no
lineage back to the blob store). With ``read_snapshot(materialize=False)`` it stays lazy
and the reader keeps the hold until ``release_splits``. The caller's ``ReadHandle`` keeps
its since (and so the readable history) as usual.

Caveat of the Spark-side consolidation: Spark groups ``-0.0`` with ``0.0`` and every
NaN together, where persist keeps them apart. Only float key/value fields holding
those values are affected.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from persist_lib.errors import InvalidUsage
from persist_lib.frontier import check_time
from persist_lib.handles import split_overlap
from persist_lib.handles.pushdown import ReadPushdown
from persist_lib.handles.split_overlap import SplitOverlap
from persist_lib.handles.splits import RangeSplit, SnapshotSplit
from persist_lib.shard.codec import DIFF, Schemas
from persist_lib.spark._common import (
    blob_uri_of,
    check_session,
    default_parallelism,
    open_executor_blob,
    sql_functions,
    table_batches,
)
from persist_lib.spark.direct_read import local_root, try_direct
from persist_lib.spark.disjoint_splits import key_range_splits
from persist_lib.spark.pins import Pin, check_pin, pin_parts
from persist_lib.spark.types import spark_arrow_schema, spark_schema, to_spark_arrow

if TYPE_CHECKING:  # pragma: no cover
    from persist_lib.handles.read import ReadHandle
    from persist_lib.storage.reader import CollectionReader


Split = SnapshotSplit | RangeSplit


def _default_splits(spark: Any) -> int:
    return default_parallelism(spark) * 2


# Rows a key-range split fetches at most by default (each executor holds its split's
# decoded table, and a copy in Spark's layout, while it hands it over).
MAX_SPLIT_ROWS = 4_000_000


def _range_splits(spark: Any, splits: Sequence[SnapshotSplit]) -> int:
    """How many key-range splits by default: balanced by bytes, they need no spare
    tasks, so one per core, unless that makes a split hold more than ``MAX_SPLIT_ROWS``."""
    rows = sum(p.count for s in splits for p in s.parts)
    return max(default_parallelism(spark), -(-rows // MAX_SPLIT_ROWS))


def _fetcher(
    splits: list[Split], target: pa.Schema, overlaps: list[SplitOverlap] | None = None
) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """The executor function: fetches the splits whose indexes it is given. With
    ``overlaps`` (one per split), each row also gets ``OVERLAP``: whether another split
    may hold its record."""

    def run(ids: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        blobs: dict[str, Any] = {}
        for rb in ids:
            for i in rb.column(0).to_pylist():
                s = splits[i]
                check_pin(s.blob_uri, s.shard_id)
                blob = blobs.get(s.blob_uri)
                if blob is None:
                    blob = blobs[s.blob_uri] = open_executor_blob(s.blob_uri)
                table = s.fetch(blob)
                if table.num_rows:
                    out = to_spark_arrow(table, target)
                    if overlaps is not None:
                        out = out.append_column(OVERLAP, overlaps[i].mask(table))
                    yield from table_batches(out, FETCH_BATCH_ROWS)

    return run


# Rows per Arrow batch a fetching executor hands to the JVM: a split's table in a few
# large batches costs less per row than Spark's usual 10k-64k (issue 28, measured).
FETCH_BATCH_ROWS = 1 << 20

# The executors' mark on a row another split may also hold (``split_overlap``).
OVERLAP = "__persist_overlap"


def _fetched(spark: Any, splits: list[Split], schemas: Schemas) -> Any:
    """The splits' rows as fetched (each split consolidated on its own), one Spark
    partition per split, lazily."""
    check_session(spark, "splits_dataframe")
    from persist_lib.spark.executors import prepare_executors

    prepare_executors(spark, blob_uri=next((s.blob_uri for s in splits), None))
    sschema = spark_schema(schemas)
    ids = spark.range(0, len(splits), 1, max(1, len(splits)))
    return ids.mapInArrow(_fetcher(splits, spark_arrow_schema(sschema)), sschema)


def _projected(df: Any, schemas: Schemas, columns: Sequence[str] | None) -> Any:
    if columns is None:
        return df
    pd = ReadPushdown.plan(schemas, columns, None, shard="(splits)")
    return df.select(*(pd.columns or ()))


def splits_dataframe(
    spark: Any, splits: list[Split], schemas: Schemas, *, consolidate: bool = True,
    columns: Sequence[str] | None = None,
) -> Any:
    """A DataFrame of the updates in ``splits`` (one Spark partition per split), lazily.

    The caller must keep the splits' parts alive (a seqno hold) until it is computed;
    ``read_snapshot``/``read_updates`` do that and materialize the result.
    ``columns``: the key/value fields to keep (with ``ts`` and ``diff``), selected after
    the consolidation across splits (which needs every column).
    """
    df = _fetched(spark, splits, schemas)
    F = sql_functions(spark)
    sschema = spark_schema(schemas)
    if consolidate and len([s for s in splits if s.parts]) > 1:
        group = [c for c in sschema.fieldNames() if c != DIFF]
        df = (
            df.groupBy(*group)
            .agg(F.sum(DIFF).cast("long").alias(DIFF))
            .where(F.col(DIFF) != 0)
            .select(*sschema.fieldNames())
        )
    return _projected(df, schemas, columns)


def _materialize(df: Any) -> Any:
    return df.localCheckpoint(eager=True)


def _read(
    spark: Any, splits: list[Split], schemas: Schemas, *, consolidate: bool,
    columns: Sequence[str] | None,
) -> Any:
    """The splits' rows, consolidated across splits (with ``consolidate``), materialized.

    When the parts' statistics bound which rows more than one split may hold
    (``split_overlap``), the fetched rows are materialized once with that mark and only
    the marked rows are grouped (the rest are already consolidated by their split): a
    compacted shard's read needs no shuffle of its rows. The DataFrame returned reads
    the materialized rows only (nothing from the blob store)."""
    with_parts = [s for s in splits if s.parts]
    overlaps = split_overlap.plan([s.parts for s in splits], schemas) if consolidate else None
    if overlaps is None or len(with_parts) <= 1 or OVERLAP in (n.lower() for n in schemas.key.names + schemas.val.names):
        return _materialize(splits_dataframe(spark, splits, schemas, consolidate=consolidate, columns=columns))
    check_session(spark, "splits_dataframe")
    from persist_lib.spark.executors import prepare_executors

    prepare_executors(spark, blob_uri=with_parts[0].blob_uri)
    F = sql_functions(spark)
    sschema = spark_schema(schemas)
    from pyspark.sql import types as T

    marked_schema = T.StructType([*sschema.fields, T.StructField(OVERLAP, T.BooleanType(), False)])
    target = spark_arrow_schema(sschema)
    ids = spark.range(0, len(splits), 1, len(splits))
    rows = _materialize(ids.mapInArrow(_fetcher(splits, target, overlaps), marked_schema))
    names = sschema.fieldNames()
    group = [c for c in names if c != DIFF]
    alone = rows.where(~F.col(OVERLAP)).select(*names)
    shared = (
        rows.where(F.col(OVERLAP))
        .groupBy(*group)
        .agg(F.sum(DIFF).cast("long").alias(DIFF))
        .where(F.col(DIFF) != 0)
        .select(*names)
    )
    df = alone.unionByName(shared)
    return _projected(df, schemas, columns)


def read_snapshot(
    spark: Any,
    reader: ReadHandle,
    as_of: int,
    *,
    num_splits: int | None = None,
    consolidate: bool = True,
    timeout_s: float | None = None,
    columns: Sequence[str] | None = None,
    filter: Any = None,
    materialize: bool = True,
) -> Any:
    """The shard's contents at ``as_of`` as a DataFrame (key, value, ``ts``, ``diff``).

    ``columns`` and ``filter`` are pushed down as for ``ReadHandle.snapshot``: parts
    whose statistics rule the filter out are not fetched by any executor, each split
    filters its rows before consolidating, and only ``columns`` (plus ``ts`` and
    ``diff``) come back. (pyspark 4.0's Python data sources have no filter pushdown
    hook, so they are explicit arguments rather than taken from ``df.where``.)

    Every ``ts`` is ``as_of`` (times forwarded, as ``ReadHandle.snapshot``); with
    ``consolidate`` (default) each ``(key, value)`` appears once with its summed diff.
    Fetched on executors in ``num_splits`` splits (default: twice the default
    parallelism). The splits' hold is released before returning; the DataFrame does not
    need it: on a ``file://`` blob the direct and key-range paths below read pinned part
    files lazily (``spark.pins``: each action reads them again, exactly; an action after
    ``pins.release_pins()``, the process's exit or the pins' TTL fails with
    ``PinExpired`` or Spark's ``FileNotFoundException``), every other read is
    materialized (``localCheckpoint``) first.

    When the parts at ``as_of`` need no consolidation and the blob is a local
    directory (``spark.direct_read``: key-disjoint consolidated parts, every time at or
    before ``as_of``, no filter), the executors only verify each part's checksum and
    Spark's own Parquet reader reads the part files. Otherwise, when the parts' key
    ranges are disjoint (a compacted shard, history kept or not), they are fetched in
    key-range splits that share no record (``spark.disjoint_splits``): each split is
    consolidated on its executor and nothing is grouped across splits (no shuffle).

    With ``materialize=False`` the DataFrame stays lazy on every path (read when an
    action runs, once per action) and this reader keeps its hold on the parts until
    ``reader.release_splits()`` or ``expire()`` (call it once the DataFrame is no longer
    used; the next read through this reader releases it too).
    """
    as_of = check_time(as_of, "as_of")
    check_session(spark, f"read_snapshot of shard {reader.shard_id}")
    blob_uri = blob_uri_of(reader.client, f"shard {reader.shard_id}")
    spark_schema(reader.schemas)  # unsupported types fail before any hold is taken
    ReadPushdown.plan(reader.schemas, columns, filter, shard=reader.shard_id)  # bad names fail here
    n = num_splits or _default_splits(spark)
    planned = reader.snapshot_splits(as_of, n, timeout_s, filter=filter)
    splits: list[Split] = list(planned)
    keep_hold = False
    pin: Pin | None = None
    try:
        root = local_root(blob_uri) if materialize and consolidate else None
        pin = pin_parts(root, [p for s in planned for p in s.parts]) if root is not None else None
        if pin is not None:  # read through the pin: lazy, and the hold can go now
            planned = [dataclasses.replace(s, blob_uri=pin.uri) for s in planned]
        if consolidate:
            direct = try_direct(
                spark, pin.uri if pin else blob_uri, reader.shard_id, reader.schemas,
                [p for s in planned for p in s.parts], as_of, filter=filter, columns=columns,
                driver_blob=pin.blob() if pin else reader.client.blob,
            )
            if direct is not None:
                if pin is not None:
                    pin = None  # the DataFrame reads through it: kept
                    return direct
                if materialize:
                    return _materialize(direct)
                keep_hold = True
                return direct
        ranged = key_range_splits(planned, reader.schemas, num_splits or _range_splits(spark, planned)) if consolidate else None
        if ranged is not None:  # no record in two splits: nothing to group across them
            df = _projected(_fetched(spark, list(ranged), reader.schemas), reader.schemas, columns)
            if pin is not None:
                pin = None
                return df
        elif materialize:
            return _read(spark, splits, reader.schemas, consolidate=consolidate, columns=columns)
        else:
            df = splits_dataframe(spark, splits, reader.schemas, consolidate=consolidate, columns=columns)
        if materialize:
            return _materialize(df)
        keep_hold = True
        return df
    finally:
        if pin is not None:  # taken, but the read went another way (or failed)
            pin.release()
        if not keep_hold:
            reader.release_splits()


def range_splits(
    reader: ReadHandle, lower: int, upper: int, num_splits: int, timeout_s: float | None = None,
    *, filter: Any = None,
) -> list[RangeSplit]:
    """``reader.range_splits`` (kept for callers of the first Spark API)."""
    return reader.range_splits(lower, upper, num_splits, timeout_s, filter=filter)


def read_updates(
    spark: Any,
    reader: ReadHandle,
    from_as_of: int,
    to_as_of: int,
    *,
    num_splits: int | None = None,
    consolidate: bool = True,
    timeout_s: float | None = None,
    columns: Sequence[str] | None = None,
    filter: Any = None,
) -> Any:
    """Every update at times in ``(from_as_of, to_as_of]``, with its own ``ts``.
    ``columns`` and ``filter`` as for ``read_snapshot`` (a ``ts`` conjunct compares
    each update's own time).

    What a listener started at ``from_as_of`` emits up to ``to_as_of``: the snapshot at
    ``to_as_of`` equals the snapshot at ``from_as_of`` plus these updates. For
    incremental jobs that remember the last ``as_of`` they processed. Waits until the
    shard upper passes ``to_as_of``; ``from_as_of`` must be at or beyond the reader's
    since.
    """
    lo = check_time(from_as_of, "from_as_of") + 1
    hi = check_time(to_as_of, "to_as_of") + 1
    if hi < lo:
        raise InvalidUsage(
            f"shard {reader.shard_id}: range ({from_as_of}, {to_as_of}] is backwards"
        )
    check_session(spark, f"read_updates of shard {reader.shard_id}")
    blob_uri_of(reader.client, f"shard {reader.shard_id}")
    spark_schema(reader.schemas)
    ReadPushdown.plan(reader.schemas, columns, filter, shard=reader.shard_id)  # bad names fail here
    if hi == lo:
        return splits_dataframe(spark, [], reader.schemas, columns=columns)
    n = num_splits or _default_splits(spark)
    splits: list[Split] = list(range_splits(reader, lo, hi, n, timeout_s, filter=filter))
    try:
        return _read(spark, splits, reader.schemas, consolidate=consolidate, columns=columns)
    finally:
        reader.release_splits()


def read_collection_snapshot(
    spark: Any,
    reader: CollectionReader,
    as_of: int,
    *,
    splits_per_shard: int = 2,
    consolidate: bool = True,
    timeout_s: float | None = None,
) -> Any:
    """The collection at ``as_of``: the active rendition's shards, fetched on executors."""
    as_of = check_time(as_of, "as_of")
    check_session(spark, "read_collection_snapshot")
    spark_schema(reader.schemas)
    rendition = reader.active_rendition(as_of, timeout_s)
    handles = reader.rendition_readers(rendition)
    splits: list[Split] = []
    taken: list[ReadHandle] = []
    try:
        for h in handles:
            blob_uri_of(h.client, f"shard {h.shard_id}")
            splits.extend(h.snapshot_splits(as_of, splits_per_shard, timeout_s))
            taken.append(h)
        return _read(spark, splits, reader.schemas, consolidate=consolidate, columns=None)
    finally:
        for h in taken:
            h.release_splits()
