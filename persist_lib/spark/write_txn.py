"""A Spark job writing a transactional collection commits as ONE transaction.

``write_collection`` is the entry point for any collection: a non-transactional one is
written shard by shard (``write.write_collection_shards``); a transactional one (every
multi-shard collection by default) like this:

1. the driver checks every shard's *logical* upper (committed transactions count, applied
   or not): all at ``new_upper`` or beyond is a retry of a job that committed, a no-op;
   all at ``expected_upper`` goes on; anything else is ``UpperMismatch`` and nothing runs;
2. ``Txns.prepare`` registers the transaction's part writer on every shard (ten-year
   leases, named after the transaction and its committer's log writer, as for any
   transaction), before any executor uploads;
3. executors route, check and build their parts under those writer ids, exactly as for a
   non-transactional write, and return part metadata only;
4. the driver assembles one batch per shard and commits them with ``Txns.commit_batches``:
   one compare-and-set on the txn log makes every shard's batch visible, or none.

A failed job (an executor error, an invalid row, a killed worker) commits nothing: the
driver deletes the parts it can find under the job's writer prefixes and releases the
part writers; a driver that dies leaves them to ``Txns.recover_orphans`` and the
leaked-blob sweeper, as any transaction that died before its commit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from persist_lib.errors import UpperMismatch
from persist_lib.frontier import Antichain, FrontierLike, as_frontier
from persist_lib.shard.batch_meta import HollowBatch
from persist_lib.spark._common import DEFAULT_CHUNK_BYTES
from persist_lib.spark.executors import prepare_executors
from persist_lib.spark.write import (
    AfterUpload,
    SparkWriteResult,
    _check_frontiers,
    _now,
    _prepare_df,
    _run_job,
    _spec,
    write_collection_shards,
)

if TYPE_CHECKING:  # pragma: no cover
    from persist_lib.storage.writer import CollectionWriter


def write_collection(
    df: Any,
    writer: CollectionWriter,
    expected_upper: FrontierLike,
    new_upper: FrontierLike,
    *,
    time: int | None = None,
    target_part_bytes: int | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    cleanup_on_failure: bool = True,
    after_upload: AfterUpload | None = None,
) -> SparkWriteResult:
    """Writes ``df`` to a rendition of a collection, one batch per shard routed by key
    hash: as ONE transaction for a transactional collection (module docstring), shard
    by shard otherwise (``write.write_collection_shards``). ``df`` is as for
    ``write_batch``; ``after_upload`` is a test hook (``write.AfterUpload``)."""
    kw: dict[str, Any] = dict(
        time=time, target_part_bytes=target_part_bytes, chunk_bytes=chunk_bytes,
        cleanup_on_failure=cleanup_on_failure, after_upload=after_upload,
    )
    if not writer.transactional:
        return write_collection_shards(df, writer, expected_upper, new_upper, **kw)
    return _write_txn(df, writer, as_frontier(expected_upper, "expected_upper"),
                      as_frontier(new_upper, "new_upper"), **kw)


def _write_txn(
    df: Any,
    writer: CollectionWriter,
    lower: Antichain,
    upper: Antichain,
    *,
    time: int | None,
    target_part_bytes: int | None,
    chunk_bytes: int,
    cleanup_on_failure: bool,
    after_upload: AfterUpload | None,
) -> SparkWriteResult:
    t0 = _now()
    what = f"collection {writer.name}/{writer.rendition}"
    _check_frontiers(what, lower, upper)
    txns = writer.txns
    client = txns.client
    shard_ids = writer.shard_ids
    schemas = writer.schemas
    df = _prepare_df(df, schemas, what, time)
    view = txns.log.read()
    uppers = [txns.logical_upper(s, view) for s in shard_ids]
    if all(u >= upper for u in uppers):  # a retry of a job that committed: nothing to do
        writer.advance_metadata(upper)
        return SparkWriteResult(
            shard_ids=shard_ids, lower=lower, upper=upper, part_writer="", rows_in=0,
            updates=0, parts=0, bytes=0, skipped_shards=list(shard_ids), seconds=_now() - t0,
        )
    bad = [u for u in uppers if u != lower]
    if bad:
        raise UpperMismatch(what, lower, min(bad))
    probe = _spec(client, shard_ids, schemas, lower, upper, target_part_bytes, chunk_bytes)
    prepare_executors(df.sparkSession, blob_uri=probe.blob_uri)  # before any state change
    prepared = txns.prepare(shard_ids)
    spec = _spec(
        client, shard_ids, schemas, lower, upper, target_part_bytes, chunk_bytes,
        part_writers=tuple(prepared.part_writer(s) for s in shard_ids),
    )
    try:
        per_shard, rows_in = _run_job(df, spec, after_upload, cleanup_on_failure)
    except BaseException:
        txns.abandon(prepared)
        raise
    batches = [
        HollowBatch(lower=lower, upper=upper, since=lower, parts=tuple(parts)) for parts in per_shard
    ]
    try:
        committed = txns.commit_batches(prepared, batches)
    except UpperMismatch as e:  # nothing committed; the parts are deleted
        raise UpperMismatch(what, lower, e.current) from e
    writer.advance_metadata(upper)
    return SparkWriteResult(
        shard_ids=shard_ids, lower=lower, upper=upper, part_writer=committed.txn,
        rows_in=rows_in, updates=sum(b.len for b in batches),
        parts=sum(len(b.parts) for b in batches), bytes=sum(b.size for b in batches),
        batches=batches, seconds=_now() - t0,
    )
