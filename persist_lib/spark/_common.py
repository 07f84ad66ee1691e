"""Helpers shared by the driver and the executor sides of ``persist_lib.spark``.

Executors never receive a client or a handle (they don't pickle, and they hold
consensus connections): they get plain, picklable specs — the blob URI, the shard id,
the schemas as JSON, frontiers as ints — and open the Blob themselves.

Every job is written against the DataFrame API only (``spark.range``, ``mapInArrow``,
``repartition``), never the RDD API or the ``SparkContext``, so the same code runs on
a classic session and on a Spark Connect session (``sc://``), which has neither. The
helpers here hide the few places where the two kinds of session differ.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pyarrow as pa

from persist_lib.errors import InvalidUsage
from persist_lib.location.base import Blob
from persist_lib.location.redaction import SensitiveUrl

EXECUTOR_RETRY_DEADLINE_S = 60.0
# Arrow bytes an executor buffers from Spark before validating and adding them to a
# builder: Spark hands over batches of 10k rows, and per-call overheads add up.
DEFAULT_CHUNK_BYTES = 8 << 20
# The default parallelism of a Spark Connect session whose server sets neither
# ``spark.default.parallelism`` nor a ``local[N]`` master (the client can't ask the
# server's SparkContext). Every API that uses it takes an explicit override.
DEFAULT_CONNECT_PARALLELISM = 2


class UnsupportedSparkSession(InvalidUsage):
    """The ``spark`` argument is not a SparkSession persist_lib.spark can drive."""


def is_connect(obj: Any) -> bool:
    """Whether ``obj`` (a session, DataFrame or Column) belongs to Spark Connect.

    Decided by the object's class, not by ``pyspark.sql.utils.is_remote()``: that is a
    process-wide switch (an environment variable) and a classic and a Connect session
    can live in one process.
    """
    return type(obj).__module__.startswith("pyspark.sql.connect.")


def check_session(spark: Any, what: str) -> None:
    """Raises ``UnsupportedSparkSession`` unless ``spark`` is a classic or Connect session.

    (A ``SparkContext`` or ``None`` would otherwise fail deep inside a job with an
    ``AttributeError``.)
    """
    from pyspark.sql import SparkSession

    if isinstance(spark, SparkSession):
        return
    if is_connect(spark) and type(spark).__name__ == "SparkSession":
        return
    raise UnsupportedSparkSession(
        f"{what}: expected a pyspark SparkSession (classic, or Spark Connect from "
        f"SparkSession.builder.remote('sc://...')), got {type(spark).__module__}.{type(spark).__qualname__}"
    )


def sql_functions(obj: Any) -> ModuleType:
    """``pyspark.sql.functions`` for ``obj``'s kind of session (a session or DataFrame).

    ``pyspark.sql.functions`` picks classic or Connect columns by the process-wide
    ``is_remote()`` switch; a Connect session made with the Connect builder directly
    (so that it can live next to a classic one) doesn't set it, so its columns must
    come from ``pyspark.sql.connect.functions``.
    """
    if is_connect(obj):
        from pyspark.sql.connect import functions as connect_functions

        return connect_functions
    from pyspark.sql import functions

    return functions


_LOCAL_MASTER = re.compile(r"local(?:\[(\d+)(?:,\s*\d+)?\])?$")


def default_parallelism(spark: Any, override: int | None = None) -> int:
    """How many tasks a job should spread over: ``override`` if given, else the session's.

    Classic: ``sparkContext.defaultParallelism``. Spark Connect has no SparkContext:
    the server's ``spark.default.parallelism`` if set, else the N of a ``local[N]``
    master, else ``DEFAULT_CONNECT_PARALLELISM``.
    """
    if override is not None:
        if int(override) < 1:
            raise InvalidUsage(f"parallelism must be >= 1, got {override}")
        return int(override)
    if not is_connect(spark):
        return max(1, int(spark.sparkContext.defaultParallelism))
    value = spark.conf.get("spark.default.parallelism", None)
    if value:
        return max(1, int(value))
    m = _LOCAL_MASTER.match(str(spark.conf.get("spark.master", None) or ""))
    if m is not None:
        return max(1, int(m.group(1) or 1))
    return DEFAULT_CONNECT_PARALLELISM


def task_frame(spark: Any, n: int) -> Any:
    """A DataFrame of the ints ``0 .. n-1``, exactly one per partition (no shuffle).

    The driver keeps a list of ``n`` task inputs (in the executor function's closure)
    and ``mapInArrow`` task ``i`` works on input ``i``: the RDD ``parallelize`` idiom,
    in DataFrame terms.
    """
    n = max(1, int(n))
    return spark.range(0, n, 1, n)


def task_ids(batches: Iterator[pa.RecordBatch]) -> Iterator[int]:
    """The ints of a ``task_frame`` partition, as ``mapInArrow`` hands them over."""
    for rb in batches:
        yield from rb.column(0).to_pylist()


def binary_rows(data: bytes, max_bytes: int) -> list[bytes]:
    """``data`` cut into pieces of at most ``max_bytes`` (at least one piece).

    Results travel to the driver in rows; through Spark Connect one row must fit one
    gRPC message (128 MiB by default), so large results are sent in pieces.
    """
    if not data:
        return [b""]
    return [data[i : i + max_bytes] for i in range(0, len(data), max_bytes)]


def blob_uri_of(client: Any, what: str) -> str:
    """The client's blob URI, checked to be reachable from other processes."""
    uri = getattr(client, "blob_uri", "") or ""
    if not uri:
        raise InvalidUsage(
            f"{what}: the PersistClient was built without a blob URI (construct it with "
            "PersistClient.open(blob_uri, consensus_uri)); Spark executors open the blob from it"
        )
    if uri.startswith("mem://") or uri.startswith("unreliable+mem://"):
        raise InvalidUsage(
            f"{what}: blob {SensitiveUrl(uri).redacted!r} is in-process memory, which Spark executors (other processes) "
            "can't see; use a file:// or s3:// blob"
        )
    return str(uri)


def open_executor_blob(uri: str) -> Blob:
    """The blob as an executor uses it: opened from its URI, with retries and backoff."""
    from persist_lib.location.retry import RetryingBlob, RetryPolicy
    from persist_lib.location.uri import open_blob

    return RetryingBlob(open_blob(uri), RetryPolicy(deadline_s=EXECUTOR_RETRY_DEADLINE_S))


def rechunk(batches: Iterator[pa.RecordBatch], chunk_bytes: int) -> Iterator[pa.Table]:
    """Groups Spark's small Arrow batches into tables of about ``chunk_bytes``."""
    buf: list[pa.RecordBatch] = []
    size = 0
    for rb in batches:
        if rb.num_rows == 0:
            continue
        buf.append(rb)
        size += rb.nbytes
        if size >= chunk_bytes:
            yield pa.Table.from_batches(buf)
            buf, size = [], 0
    if buf:
        yield pa.Table.from_batches(buf)


def table_batches(table: pa.Table, max_rows: int = 65536) -> Iterator[pa.RecordBatch]:
    """``table`` as record batches of at most ``max_rows`` rows (what Spark ingests)."""
    yield from table.combine_chunks().to_batches(max_chunksize=max_rows)


def task_partition_id() -> int:
    """The Spark partition this task computes (0 outside Spark)."""
    from pyspark import TaskContext

    ctx = TaskContext.get()
    return int(ctx.partitionId()) if ctx is not None else 0
