"""Helpers shared by the driver and the executor sides of ``persist_lib.spark``.

Executors never receive a client or a handle (they don't pickle, and they hold
consensus connections): they get plain, picklable specs — the blob URI, the shard id,
the schemas as JSON, frontiers as ints — and open the Blob themselves.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pyarrow as pa

from persist_lib.errors import InvalidUsage
from persist_lib.location.base import Blob
from persist_lib.location.redaction import SensitiveUrl

EXECUTOR_RETRY_DEADLINE_S = 60.0
# Arrow bytes an executor buffers from Spark before validating and adding them to a
# builder: Spark hands over batches of 10k rows, and per-call overheads add up.
DEFAULT_CHUNK_BYTES = 8 << 20


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
