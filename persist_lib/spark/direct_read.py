"""Snapshots whose parts need no consolidation, read by the JVM's Parquet reader
(``spark.read.parquet``) after the executors verified every part (issue 28).

``read_snapshot``'s general path decodes and consolidates every part in Python on the
executors and hands the rows to the JVM through Arrow. When the parts at the as-of
already *are* the snapshot, that work can be skipped: Spark's vectorized reader reads
the part files themselves, the key and value fields are taken out of their ``k``/``v``
structs, ``ts`` is the as-of and ``diff`` is the part's ``d``. That holds when, decided
on the driver from state alone:

- the blob is a local directory (``file://``: executors see the same paths);
- no filter is pushed (it would have to be translated to Spark exactly);
- every part is a blob part (not inlined), sorted (so consolidated: no two rows share
  ``(k, v, t)``, no zero diff), with every time at or before the as-of (times are only
  forwarded, no row is cut);
- the parts are key-disjoint: their recorded ranges of an integer first key field
  (``shard.stats``) don't meet, so no record sits in two parts;
- every key and value field has a plain type (integers, floats, bool, strings,
  binary), which Parquet stores as the Spark type ``spark_schema`` gives it;
- the session reads missing or corrupt files as errors (``spark.sql.files.
  ignoreMissingFiles`` / ``ignoreCorruptFiles`` not set);

and then, checked in parallel (``verify_parts``: on the driver's threads for a read of
up to ``DRIVER_VERIFY_BYTES``, else a small distributed job over the part list, one
task per few parts): each part's bytes have the recorded size and SHA-256 (else
``CorruptionError``, nothing returned), its footer has the persist layout and the
reader's own schemas (a part written under an earlier schema version needs migration:
the general path then reads it), and, for a part holding several times, its first key
field strictly increases (no ``(key, value)`` at two times, which would need
consolidating). Anything else falls back to the general path.

**The verify-then-read window.** The checksums are verified when ``read_snapshot``
runs; the JVM reads the files when an action runs, later. Parts are immutable (a key
is written once, never rewritten), so the bytes read are the bytes verified unless the
file is changed behind persist's back in between; a file *deleted* in between (garbage
collection after the hold is released) fails the action (``FileNotFoundException``)
rather than losing rows, as long as ``ignoreMissingFiles`` stays off. By default
``read_snapshot`` verifies and reads the parts through a pin (``spark.pins``: hard links
taken while the hold is held, which garbage collection does not delete), so the bytes
verified are the bytes read later; ``materialize=False`` reads the parts' own names and
the reader keeps its hold.
Strings are not re-validated as UTF-8 on this path (parts written by this version were
validated when written; the general path also checks parts written before that).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from persist_lib.errors import CorruptionError
from persist_lib.handles.pushdown import ReadPushdown
from persist_lib.handles.split_overlap import disjoint_overlaps
from persist_lib.location.base import Blob
from persist_lib.shard.batch_meta import PartMeta
from persist_lib.shard.codec import DIFF, TS, Schemas
from persist_lib.shard.direct_parts import first_key_increases, plain_type
from persist_lib.shard.parts import FORMAT_VERSION, META_FORMAT, META_SCHEMAS, verify_part_bytes
from persist_lib.spark._common import (
    default_parallelism,
    open_executor_blob,
    sql_functions,
    task_frame,
    task_ids,
)
from persist_lib.spark.types import spark_schema

# What a part's verification says (``verify_parts``).
OK = "ok"
NEEDS_MERGE = "merge"  # several times of one key: the general path consolidates them
MIGRATE = "migrate"  # an earlier schema version: the general path migrates it
CORRUPT = "corrupt:"  # a prefix: the rest is the CorruptionError's message

# Parts of at most this many bytes in all are verified on the driver (``verify_parts``).
DRIVER_VERIFY_BYTES = 256 << 20


def local_root(blob_uri: str) -> str | None:
    """The directory of a ``file://`` blob, or None for any other blob."""
    if not blob_uri.startswith("file:"):
        return None
    from persist_lib.location.file_blob import FileBlob
    from persist_lib.location.uri import open_blob

    blob = open_blob(blob_uri)
    return blob.root if isinstance(blob, FileBlob) else None


def eligible_parts(
    spark: Any, blob_uri: str, schemas: Schemas, parts: Sequence[PartMeta], as_of: int, filter: Any
) -> list[PartMeta] | None:
    """The parts, when the driver-side conditions of the module docstring hold; else None."""
    if filter is not None or not parts or local_root(blob_uri) is None:
        return None
    if not all(plain_type(f.type) for f in [*schemas.key, *schemas.val]):
        return None
    for conf in ("spark.sql.files.ignoreMissingFiles", "spark.sql.files.ignoreCorruptFiles"):
        if str(spark.conf.get(conf, "false")).lower() == "true":
            return None
    if any(p.key is None or p.inline is not None or not p.sorted or p.tmax > as_of for p in parts):
        return None
    if len(parts) == 1:
        return list(parts)
    planned = disjoint_overlaps(parts, schemas)
    if planned is None or any(o.los for o in planned[1]):
        return None  # overlapping ranges, or a key value two parts share
    return planned[0]


def verify_one(blob: Blob, part: PartMeta, schemas: Schemas, shard: str) -> str:
    """One part's verdict (``OK``, ``NEEDS_MERGE``, ``MIGRATE`` or ``CORRUPT`` + why)."""
    assert part.key is not None
    data = blob.get(part.key)
    if data is None:
        return f"{CORRUPT} shard {shard}: part {part.key} is missing from the blob store"
    try:
        verify_part_bytes(data, expected_sha256=part.sha256, expected_size=part.size, shard=shard, key=part.key)
        pf = pq.ParquetFile(pa.BufferReader(data), pre_buffer=False)
        meta = pf.schema_arrow.metadata or {}
        names = pf.schema_arrow.names
    except CorruptionError as e:
        return f"{CORRUPT} {e}"
    except Exception as e:  # noqa: BLE001 - verified bytes that don't decode are corrupt
        return f"{CORRUPT} shard {shard}: part {part.key}: cannot read its Parquet footer ({type(e).__name__}: {e})"
    if meta.get(META_FORMAT) != FORMAT_VERSION.encode() or pf.metadata.num_rows != part.count:
        return f"{CORRUPT} shard {shard}: part {part.key}: unknown format or row count"
    if meta.get(META_SCHEMAS) != schemas.fingerprint().encode():
        return MIGRATE
    if names != (["k", "v", "t", "d"] if len(schemas.val) else ["k", "t", "d"]):
        return f"{CORRUPT} shard {shard}: part {part.key}: columns {names}"
    if part.tmin < part.tmax and not first_key_increases(pf):
        return NEEDS_MERGE
    return OK


def verify_parts(
    spark: Any, blob_uri: str, shard: str, schemas: Schemas, parts: Sequence[PartMeta],
    driver_blob: Blob | None = None,
) -> list[str]:
    """Every part's verdict (``verify_one``). Parts of at most ``DRIVER_VERIFY_BYTES``
    in all are verified on the driver (threads over ``driver_blob``: a Spark job's own
    overhead is ~0.5-1 s, hashing 100 MB ~0.1 s); larger reads on the executors: one
    task per few parts, each fetching and hashing its parts on its own."""
    if driver_blob is not None and sum(p.size for p in parts) <= DRIVER_VERIFY_BYTES:
        from concurrent.futures import ThreadPoolExecutor

        workers = max(1, min(8, os.cpu_count() or 1, len(parts)))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="persist-spark-verify") as pool:
            return list(pool.map(lambda p: verify_one(driver_blob, p, schemas, shard), parts))
    n_tasks = max(1, min(len(parts), default_parallelism(spark) * 2))
    groups: list[list[int]] = [list(range(t, len(parts), n_tasks)) for t in range(n_tasks)]
    sj = schemas.to_json()
    plist = list(parts)

    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        blob = open_executor_blob(blob_uri)
        sch = Schemas.from_json(sj)
        for t in task_ids(batches):
            idx = groups[t]
            verdicts = [verify_one(blob, plist[i], sch, shard) for i in idx]
            yield pa.record_batch({"i": pa.array(idx, pa.int64()), "verdict": pa.array(verdicts, pa.string())})

    rows = task_frame(spark, n_tasks).mapInArrow(run, "i long, verdict string").collect()
    out = [""] * len(parts)
    for r in rows:
        out[int(r["i"])] = str(r["verdict"])
    return out


def direct_dataframe(
    spark: Any, blob_uri: str, schemas: Schemas, parts: Sequence[PartMeta], as_of: int,
    columns: Sequence[str] | None,
) -> Any:
    """The parts' rows as the snapshot's DataFrame (lazy: Spark reads the files when an
    action runs), in ``spark_schema``'s layout (``columns``: those, ``ts``, ``diff``)."""
    from persist_lib.location.file_blob import validate_key

    root = local_root(blob_uri)
    assert root is not None
    F = sql_functions(spark)
    paths = ["file://" + os.path.join(root, *validate_key(str(p.key))) for p in parts]
    sschema = spark_schema(schemas)
    cols = [F.col("k").getField(f.name).alias(f.name) for f in schemas.key]
    cols += [F.col("v").getField(f.name).alias(f.name) for f in schemas.val]
    cols += [F.lit(as_of).cast("long").alias(TS), F.col("d").cast("long").alias(DIFF)]
    df = spark.read.parquet(*paths).select(*cols)
    for f, want in zip(df.schema.fields, sschema.fields, strict=True):
        if f.dataType != want.dataType:
            raise _TypeDrift(f"{f.name}: {f.dataType} != {want.dataType}")
    if columns is not None:  # as the general path: the shard's order, then ts and diff
        pd = ReadPushdown.plan(schemas, columns, None, shard="(direct read)")
        df = df.select(*[F.col("`" + c.replace("`", "``") + "`") for c in pd.columns or ()])
    return df


class _TypeDrift(Exception):
    """Parquet gave a column another Spark type than ``spark_schema``'s: not read directly."""


def try_direct(
    spark: Any, blob_uri: str, shard: str, schemas: Schemas, parts: Sequence[PartMeta], as_of: int,
    *, filter: Any, columns: Sequence[str] | None, driver_blob: Blob | None = None,
) -> Any | None:
    """The snapshot read directly from the part files (lazy), or None when it can't be
    (the caller then reads it the general way). ``CorruptionError`` when a part fails
    its verification."""
    chosen = eligible_parts(spark, blob_uri, schemas, parts, as_of, filter)
    if chosen is None:
        return None
    multi = [p for p in chosen if p.tmin < p.tmax]
    if multi and driver_blob is not None:
        # A shard with history has ties in (nearly) every part: one part's verdict
        # saves verifying all of them only to read them the general way.
        first = verify_one(driver_blob, multi[0], schemas, shard)
        if first.startswith(CORRUPT):
            raise CorruptionError(first[len(CORRUPT):].strip())
        if first != OK:
            return None
    verdicts = verify_parts(spark, blob_uri, shard, schemas, chosen, driver_blob)
    bad = next((v for v in verdicts if v.startswith(CORRUPT)), None)
    if bad is not None:
        raise CorruptionError(bad[len(CORRUPT):].strip())
    if any(v != OK for v in verdicts):
        return None
    try:
        return direct_dataframe(spark, blob_uri, schemas, chosen, as_of, columns)
    except _TypeDrift:
        return None
