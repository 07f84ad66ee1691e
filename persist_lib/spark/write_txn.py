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

``write_collections`` commits several collections' jobs as one transaction; a job may
also be a small Arrow table (built on the driver under the transaction's part writers,
``Txns.build_batches``: e.g. a ledger row that must land with the data), and each job may
expect its own lower (``lowers``), all moving to one new upper.

A failed job (an executor error, an invalid row, a killed worker) commits nothing: the
driver deletes the parts it can find under the job's writer prefixes and releases the
part writers; a driver that dies leaves them to ``Txns.recover_orphans`` and the
leaked-blob sweeper, as any transaction that died before its commit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from persist_lib.errors import InvalidUsage, UpperMismatch
from persist_lib.frontier import Antichain, FrontierLike, as_frontier
from persist_lib.shard.batch_meta import HollowBatch
from persist_lib.shard.codec import DIFF, KEY_PREFIX, TS, normalize_checked
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
from persist_lib.storage.routing import split_by_shard
from persist_lib.txn.txns import ShardWrite

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
    return write_collections([(df, writer)], expected_upper, new_upper, **kw)[0]


def write_collections(
    jobs: Sequence[tuple[Any, CollectionWriter]],
    expected_upper: FrontierLike,
    new_upper: FrontierLike,
    *,
    lowers: Sequence[FrontierLike] | None = None,
    skip_committed: bool = True,
    time: int | None = None,
    target_part_bytes: int | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    cleanup_on_failure: bool = True,
    after_upload: AfterUpload | None = None,
) -> list[SparkWriteResult]:
    """Several ``(data, writer)`` jobs, each writing a transactional collection (of one
    controller) from ``expected_upper`` to ``new_upper``, committed as ONE transaction
    over every shard of every writer: e.g. a rendition's data, errors and state built
    together, so no reader sees one without the others. One Spark job per DataFrame,
    then one commit; all jobs a no-op when every shard is at ``new_upper`` already.

    ``data`` is a Spark DataFrame (written by the executors) or a small ``pyarrow.Table``
    in the user layout (built on the driver under the same transaction's part writers:
    e.g. a bookkeeping row that must land with the data, or not at all). ``lowers``: each
    job's own expected upper (default ``expected_upper`` for all), for collections whose
    uppers differ but must all move to ``new_upper`` in the one commit.
    ``skip_committed=False``: shards at ``new_upper`` or beyond are an ``UpperMismatch``
    like any other upper, not a committed retry (for writers that recognize their
    retries otherwise, e.g. by a ledger row, and whose ``new_upper`` another writer may
    well have passed)."""
    for _, w in jobs:
        if not w.transactional:
            raise InvalidUsage(f"collection {w.name}: write_collections needs transactional collections")
    lows = [as_frontier(expected_upper, "expected_upper")] * len(jobs)
    if lowers is not None:
        if len(lowers) != len(jobs):
            raise InvalidUsage(f"write_collections: {len(lowers)} lowers for {len(jobs)} jobs")
        lows = [as_frontier(lo, "lowers[]") for lo in lowers]
    return _write_jobs_txn(
        list(jobs), lows, as_frontier(new_upper, "new_upper"), skip_committed=skip_committed,
        time=time, target_part_bytes=target_part_bytes, chunk_bytes=chunk_bytes,
        cleanup_on_failure=cleanup_on_failure, after_upload=after_upload,
    )


def _prepare_table(table: pa.Table, w: CollectionWriter, what: str, time: int | None) -> pa.Table:
    """An Arrow job's rows with ``ts`` (``time``) and ``diff`` (+1) when absent."""
    if TS not in table.column_names:
        if time is None:
            raise InvalidUsage(f"{what}: the table has no {TS!r} column; add one or pass time=T")
        table = table.append_column(TS, pa.array(np.full(table.num_rows, time, dtype=np.int64)))
    if DIFF not in table.column_names:
        table = table.append_column(DIFF, pa.array(np.ones(table.num_rows, dtype=np.int64)))
    return table


def _table_writes(table: pa.Table, w: CollectionWriter, lower: Antichain, upper: Antichain) -> list[ShardWrite]:
    """An Arrow job as one write per shard of ``w`` (an empty one where no row routes)."""
    checked = normalize_checked(table, w.schemas, shard=f"{w.name}/{w.rendition}")
    pieces = split_by_shard(checked, [KEY_PREFIX + n for n in w.schemas.key_names], w.num_shards)
    return [ShardWrite(s, w.schemas, p, lower, upper) for s, p in zip(w.shard_ids, pieces, strict=True)]


def _write_jobs_txn(
    jobs: list[tuple[Any, CollectionWriter]],
    lows: list[Antichain],
    upper: Antichain,
    *,
    skip_committed: bool = True,
    time: int | None,
    target_part_bytes: int | None,
    chunk_bytes: int,
    cleanup_on_failure: bool,
    after_upload: AfterUpload | None,
) -> list[SparkWriteResult]:
    t0 = _now()
    writers = [w for _, w in jobs]
    what = ", ".join(f"collection {w.name}/{w.rendition}" for w in writers)
    for lower in lows:
        _check_frontiers(what, lower, upper)
    txns = writers[0].txns
    client = txns.client
    data = [
        _prepare_table(d, w, f"collection {w.name}/{w.rendition}", time) if isinstance(d, pa.Table)
        else _prepare_df(d, w.schemas, f"collection {w.name}/{w.rendition}", time)
        for d, w in jobs
    ]
    view = txns.log.read()
    uppers = [txns.logical_uppers(w.shard_ids, view) for w in writers]
    if skip_committed and all(u >= upper for us in uppers for u in us):  # a retry of a job that committed: nothing to do
        out = []
        for w, lower in zip(writers, lows, strict=True):
            w.advance_metadata(upper)
            out.append(SparkWriteResult(
                shard_ids=w.shard_ids, lower=lower, upper=upper, part_writer="", rows_in=0,
                updates=0, parts=0, bytes=0, skipped_shards=list(w.shard_ids), seconds=_now() - t0,
            ))
        return out
    bad = [(lower, u) for us, lower in zip(uppers, lows, strict=True) for u in us if u != lower]
    if bad:
        raise UpperMismatch(what, bad[0][0], min(u for _, u in bad))
    frames = [(d, w) for d, w in zip(data, writers, strict=True) if not isinstance(d, pa.Table)]
    if frames:
        probe = _spec(client, frames[0][1].shard_ids, frames[0][1].schemas, lows[0], upper, target_part_bytes, chunk_bytes)
        prepare_executors(frames[0][0].sparkSession, blob_uri=probe.blob_uri)  # before any state change
    prepared = txns.prepare([s for w in writers for s in w.shard_ids])
    per_job: list[tuple[list[HollowBatch], int]] = []
    try:
        for d, w, lower in zip(data, writers, lows, strict=True):
            if isinstance(d, pa.Table):
                per_job.append((txns.build_batches(prepared, _table_writes(d, w, lower, upper)), d.num_rows))
                continue
            spec = _spec(
                client, w.shard_ids, w.schemas, lower, upper, target_part_bytes, chunk_bytes,
                part_writers=tuple(prepared.part_writer(s) for s in w.shard_ids),
            )
            per_shard, rows_in = _run_job(d, spec, after_upload, cleanup_on_failure)
            per_job.append((
                [HollowBatch(lower=lower, upper=upper, since=lower, parts=tuple(p)) for p in per_shard],
                rows_in,
            ))
    except BaseException:
        txns.abandon(prepared, [b for bs, _ in per_job for b in bs])
        raise
    batches = [b for bs, _ in per_job for b in bs]
    advances = [a for w in writers for a in w.metadata_advances(upper)]
    try:
        committed = txns.commit_batches(prepared, batches, advances=advances)
    except UpperMismatch as e:  # nothing committed; the parts are deleted
        raise UpperMismatch(what, e.expected, e.current) from e
    out = []
    for w, lower, (bs, rows_in) in zip(writers, lows, per_job, strict=True):
        w.advance_metadata_after_commit(upper)
        out.append(SparkWriteResult(
            shard_ids=w.shard_ids, lower=lower, upper=upper, part_writer=committed.txn,
            rows_in=rows_in, updates=sum(b.len for b in bs),
            parts=sum(len(b.parts) for b in bs), bytes=sum(b.size for b in bs),
            batches=bs, seconds=_now() - t0,
        ))
    return out
