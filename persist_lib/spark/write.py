"""Writing a Spark DataFrame to persist as ONE batch, committed with ONE compare-and-set.

Executors do the heavy part: each Spark partition validates its rows against the
shard schemas once (``codec.normalize_checked``, the same rules as every other writer),
feeds the checked rows to its own ``BatchBuilder`` (bounded memory: parts are sorted,
consolidated, encoded and uploaded as they fill) and returns only part metadata
(``PartMeta.to_json()``). The driver assembles one ``HollowBatch`` from every
partition's parts and commits it with one ``compare_and_append_batch``.

So a Spark job that fails (an executor error, a killed worker, an invalid row)
commits nothing: its parts are referenced by no state. The driver deletes what it can
find under the job's own prefix ``{shard}/{job writer id}/`` (best effort; tasks still
running while the job is torn down may upload later), and the leaked-blob sweeper
(``client.unreferenced_blobs``) removes the rest after its grace period. A lost
compare-and-set (``UpperMismatch``) deletes the batch's parts, as every writer does.

Each job mints its own part-writer id (a fresh ``WriterId``) for the blob keys, so a
failed job's leftovers are one prefix, and registers it on every shard it writes
before any executor starts (``persist_lib.shard.part_writers``): the leaked-blob sweeper
never deletes the parts of a registered writer, however long the job runs, and the
commit links them only while the registration holds. The registration is released
when the job ends (lease expiry does it if the driver dies). The commit itself goes
through the caller's registered ``WriteHandle`` (its writer id, lease and idempotency
token); its parts are deleted only when the compare-and-set certainly did not apply.

``write_collection_shards`` does the same for a rendition of a non-transactional
STORAGE collection: rows are routed to shards by ``storage.routing.route`` on the
*normalized* key columns — the exact hash ``CollectionWriter`` uses — with one builder
per shard per partition; the driver then commits one batch per shard, shard by shard.
A transactional collection's job commits as one transaction (``write_txn.py``).
"""

from __future__ import annotations

import logging
import time as _time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from persist_lib.errors import InvalidUsage, UpperMismatch
from persist_lib.frontier import Antichain, FrontierLike, as_frontier
from persist_lib.ids import WriterId
from persist_lib.shard.batch_meta import HollowBatch, PartMeta
from persist_lib.shard.codec import DIFF, KEY_PREFIX, TS, Schemas
from persist_lib.shard.part_writers import PartWriter
from persist_lib.spark._common import (
    DEFAULT_CHUNK_BYTES,
    blob_uri_of,
    is_connect,
    open_executor_blob,
    rechunk,
    sql_functions,
    task_partition_id,
)
from persist_lib.spark.executors import prepare_executors
from persist_lib.spark.types import check_dataframe_schema, spark_schema

if TYPE_CHECKING:  # pragma: no cover
    from persist_lib.handles.write import WriteHandle
    from persist_lib.storage.writer import CollectionWriter

log = logging.getLogger(__name__)

# Test hook signature: (partition id, one HollowBatch per shard) -> None, run on the
# executor after the partition's parts are uploaded and before their metadata is
# returned. Raising there (or killing the process) behaves like a crash at that point.
AfterUpload = Callable[[int, list[HollowBatch]], None]

_RESULT_SCHEMA = "shard int, partition int, seq int, part string, rows long"


@dataclass(frozen=True)
class _WriteSpec:
    """What an executor needs to build its parts (picklable; no handles)."""

    blob_uri: str
    shard_ids: tuple[str, ...]
    schemas_json: dict[str, Any]
    part_writer: str
    lower: int
    upper: int | None  # None: the empty frontier
    target_part_bytes: int
    inline_threshold: int
    max_inflight_uploads: int
    chunk_bytes: int
    # One writer id per shard (a transaction's part writers), else ``part_writer`` for all.
    part_writers: tuple[str, ...] | None = None

    def writer_for(self, i: int) -> str:
        return self.part_writers[i] if self.part_writers is not None else self.part_writer

    def __repr__(self) -> str:  # the blob URI may carry an S3 secret key
        from persist_lib.location.redaction import redacted_dataclass_repr

        return redacted_dataclass_repr(self)


@dataclass
class SparkWriteResult:
    """What a Spark write committed (JSON-able through ``to_json``)."""

    shard_ids: list[str]
    lower: Antichain
    upper: Antichain
    part_writer: str
    rows_in: int  # rows the DataFrame had
    updates: int  # updates committed (after per-part consolidation)
    parts: int
    bytes: int
    batches: list[HollowBatch] = field(default_factory=list)  # one per shard written
    skipped_shards: list[str] = field(default_factory=list)  # already at the new upper
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "shards": self.shard_ids,
            "lower": self.lower.elements,
            "upper": self.upper.elements,
            "part_writer": self.part_writer,
            "rows_in": self.rows_in,
            "updates": self.updates,
            "parts": self.parts,
            "bytes": self.bytes,
            "skipped_shards": self.skipped_shards,
            "seconds": round(self.seconds, 3),
        }


# ----- executor side ----------------------------------------------------------------------


def _partition_writer(
    spec: _WriteSpec, after_upload: AfterUpload | None
) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from persist_lib.shard.batch_builder import BatchBuilder
        from persist_lib.shard.codec import normalize_checked
        from persist_lib.storage.routing import split_by_shard

        pid = task_partition_id()
        schemas = Schemas.from_json(spec.schemas_json)
        key_cols = [KEY_PREFIX + n for n in schemas.key_names]
        blob = open_executor_blob(spec.blob_uri)
        n = len(spec.shard_ids)
        builders: list[BatchBuilder | None] = [None] * n
        upper = Antichain.empty() if spec.upper is None else Antichain([spec.upper])
        rows = 0

        def builder(i: int) -> BatchBuilder:
            b = builders[i]
            if b is None:
                b = builders[i] = BatchBuilder(
                    blob,
                    schemas,
                    shard=spec.shard_ids[i],
                    writer=spec.writer_for(i),
                    lower=spec.lower,
                    target_part_bytes=spec.target_part_bytes,
                    max_inflight_uploads=spec.max_inflight_uploads,
                    inline_threshold=spec.inline_threshold,
                )
            return b

        done: list[HollowBatch] = []
        try:
            for chunk in rechunk(batches, spec.chunk_bytes):
                rows += chunk.num_rows
                # Checked once here; the builders take the pieces as they are.
                internal = normalize_checked(chunk, schemas, shard=spec.shard_ids[0])
                # Route on the normalized key columns: the types (and so the hashes) are
                # exactly those CollectionWriter routes on.
                pieces = [internal] if n == 1 else split_by_shard(internal, key_cols, n)
                for i, piece in enumerate(pieces):
                    if piece.num_rows:
                        builder(i).add(piece)
            for b in builders:
                done.append(
                    b.finish(upper)
                    if b is not None
                    else HollowBatch(Antichain([spec.lower]), upper, Antichain([spec.lower]))
                )
        except BaseException:
            for b in builders:
                if b is not None:
                    b.abort()
            raise
        if after_upload is not None:
            after_upload(pid, done)
        out: dict[str, list[Any]] = {k: [] for k in ("shard", "partition", "seq", "part", "rows")}
        for i, hb in enumerate(done):
            for seq, p in enumerate(hb.parts):
                _row(out, i, pid, seq, _part_json(p), 0)
        _row(out, -1, pid, -1, None, rows)  # the partition's input row count
        yield pa.RecordBatch.from_pydict(
            out,
            schema=pa.schema(
                [
                    ("shard", pa.int32()),
                    ("partition", pa.int32()),
                    ("seq", pa.int32()),
                    ("part", pa.string()),
                    ("rows", pa.int64()),
                ]
            ),
        )

    return run


def _row(out: dict[str, list[Any]], shard: int, pid: int, seq: int, part: str | None, rows: int) -> None:
    out["shard"].append(shard)
    out["partition"].append(pid)
    out["seq"].append(seq)
    out["part"].append(part)
    out["rows"].append(rows)


def _part_json(p: PartMeta) -> str:
    import json

    return json.dumps(p.to_json(), separators=(",", ":"))


# ----- driver side ------------------------------------------------------------------------


def _prepare_df(df: Any, schemas: Schemas, what: str, time: int | None) -> Any:
    """Adds ``ts``/``diff`` when absent (``time`` / +1), checks types, orders columns."""
    F = sql_functions(df)  # classic or Spark Connect columns, as ``df`` is
    spark_schema(schemas)  # unsupported Arrow types fail here, naming the field
    cols = set(df.columns)
    if TS not in cols:
        if time is None:
            raise InvalidUsage(
                f"{what}: the DataFrame has no {TS!r} column; add one or pass time=T to write "
                "every row at time T"
            )
        df = df.withColumn(TS, F.lit(int(time)).cast("long"))
    elif time is not None:
        raise InvalidUsage(f"{what}: pass time=... only for a DataFrame without a {TS!r} column")
    if DIFF not in cols:
        df = df.withColumn(DIFF, F.lit(1).cast("long"))
    names = check_dataframe_schema(df.schema, schemas, what)
    return df.select(*names)


def _check_frontiers(what: str, lower: Antichain, upper: Antichain) -> None:
    if lower.is_empty():
        raise InvalidUsage(f"{what}: can't write at the empty frontier (the shard is closed)")
    if upper < lower:
        raise InvalidUsage(f"{what}: new upper {upper} is before the expected upper {lower}")


def _run_job(
    df: Any,
    spec: _WriteSpec,
    after_upload: AfterUpload | None,
    cleanup_on_failure: bool,
) -> tuple[list[list[PartMeta]], int]:
    """Runs the executors' part writes; returns the parts per shard (in order) and the
    number of input rows. On failure, deletes the job's parts it can find."""
    import json

    group = f"persist-write-{uuid.uuid4()}"
    try:
        with _job_group(df, group):
            rows = df.mapInArrow(_partition_writer(spec, after_upload), _RESULT_SCHEMA).collect()
    except BaseException:
        if cleanup_on_failure:
            _wait_for_tasks(df, group)
            _delete_job_parts(spec)
        raise
    per_shard: list[list[tuple[int, int, PartMeta]]] = [[] for _ in spec.shard_ids]
    rows_in = 0
    for r in rows:
        if r["part"] is None:
            rows_in += int(r["rows"])
            continue
        per_shard[r["shard"]].append(
            (r["partition"], r["seq"], PartMeta.from_json(json.loads(r["part"])))
        )
    return [[p for _, _, p in sorted(ps, key=lambda x: (x[0], x[1]))] for ps in per_shard], rows_in


@contextmanager
def _job_group(df: Any, group: str) -> Iterator[None]:
    """Runs the job under its own Spark job group (classic sessions; Spark Connect has no
    SparkContext), restoring the thread's previous group after."""
    sc = None if is_connect(df) else df.sparkSession.sparkContext
    if sc is None:
        yield
        return
    props = ("spark.jobGroup.id", "spark.job.description", "spark.job.interruptOnCancel")
    prev = {k: sc.getLocalProperty(k) for k in props}
    sc.setJobGroup(group, "persist_lib.spark write", interruptOnCancel=True)
    try:
        yield
    finally:
        for k, v in prev.items():
            sc.setLocalProperty(k, v)


def _wait_for_tasks(df: Any, group: str, timeout_s: float = 30.0) -> None:
    """After a failed job: waits (at most ``timeout_s``) until no task of ``group`` is
    still running, so the cleanup's listing sees what the other tasks uploaded. A task
    Spark cancels when the job aborts may still be uploading (it is reported killed
    only when it stops); a cleanup listed before that missed its part (issue 28,
    session 17: a fresh-clone run of ``test_a_failed_job_leaves_nothing_visible``).
    What still lands later is the leaked-part sweeper's (the writer is released)."""
    if is_connect(df):
        return
    sc = df.sparkSession.sparkContext
    sc.cancelJobGroup(group)
    tracker = sc.statusTracker()
    deadline = _time.monotonic() + timeout_s
    while _time.monotonic() < deadline:
        stages = [
            s for j in tracker.getJobIdsForGroup(group) if (info := tracker.getJobInfo(j)) is not None
            for s in info.stageIds
        ]
        if all((st := tracker.getStageInfo(s)) is None or st.numActiveTasks == 0 for s in stages):
            return
        _time.sleep(0.02)  # polling Spark's status tracker: it has no wait call
    log.warning("spark write %s: tasks still running %.0f s after the failure; cleaning up anyway", group, timeout_s)


def _delete_job_parts(spec: _WriteSpec) -> int:
    """Best effort: deletes every blob under ``{shard}/{part_writer}/`` of a failed job."""
    blob = open_executor_blob(spec.blob_uri)
    n = 0
    for i, shard in enumerate(spec.shard_ids):
        try:
            for m in blob.list_keys_and_metadata(f"{shard}/{spec.writer_for(i)}/"):
                blob.delete(m.key)
                n += 1
        except Exception as e:  # the sweeper catches whatever is left
            log.warning("shard %s: cleaning up a failed Spark write: %s", shard, e)
    return n


def _delete_parts(client: Any, parts: list[PartMeta]) -> None:
    for p in parts:
        if p.key is not None:
            try:
                client.blob.delete(p.key)
            except Exception as e:
                log.warning("could not delete part %s of an uncommitted Spark write: %s", p.key, e)


def _spec(
    client: Any,
    shard_ids: list[str],
    schemas: Schemas,
    lower: Antichain,
    upper: Antichain,
    target_part_bytes: int | None,
    chunk_bytes: int,
    part_writers: tuple[str, ...] | None = None,
) -> _WriteSpec:
    cfg = client.config
    assert lower.time is not None
    return _WriteSpec(
        blob_uri=blob_uri_of(client, f"shard {shard_ids[0]}"),
        shard_ids=tuple(shard_ids),
        schemas_json=schemas.to_json(),
        part_writer=str(WriterId.new()),
        lower=lower.time,
        upper=upper.time,
        target_part_bytes=int(target_part_bytes or cfg.blob_target_size),
        # A transaction's batches travel through the txn log: no inline parts there.
        inline_threshold=cfg.inline_threshold if part_writers is None else 0,
        max_inflight_uploads=cfg.max_inflight_uploads,
        chunk_bytes=chunk_bytes,
        part_writers=part_writers,
    )


def write_batch(
    df: Any,
    writer: WriteHandle,
    expected_upper: FrontierLike,
    new_upper: FrontierLike,
    *,
    time: int | None = None,
    target_part_bytes: int | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    cleanup_on_failure: bool = True,
    after_upload: AfterUpload | None = None,
) -> SparkWriteResult:
    """Writes ``df`` to ``writer``'s shard as one batch ``[expected_upper, new_upper)``.

    ``df`` has the key and value columns of the shard (any order) and ``ts``/``diff``
    (int64); without ``ts`` pass ``time`` (every row at that time), without ``diff``
    every row counts +1. Raises ``UpperMismatch`` (nothing written) if the shard upper
    isn't ``expected_upper`` at commit time, ``InvalidUsage`` for rows that don't fit
    the schemas or lie outside the interval (the Spark job fails; nothing committed).
    ``target_part_bytes`` defaults to the client's ``blob_target_size``.
    ``after_upload`` is a test hook (see ``AfterUpload``).
    """
    t0 = _now()
    client = writer.client
    shard = writer.shard_id
    what = f"shard {shard}"
    lower = as_frontier(expected_upper, "expected_upper")
    upper = as_frontier(new_upper, "new_upper")
    _check_frontiers(what, lower, upper)
    df = _prepare_df(df, writer.schemas, what, time)
    spec = _spec(client, [shard], writer.schemas, lower, upper, target_part_bytes, chunk_bytes)
    prepare_executors(df.sparkSession, blob_uri=spec.blob_uri)  # before any state change
    cur = writer.fetch_recent_upper()
    if cur != lower:  # fail fast, before any executor works; the CAS re-checks
        raise UpperMismatch(shard, lower, cur)
    pws = _register_part_writers(client, [shard], spec.part_writer)
    try:
        per_shard, rows_in = _run_job(df, spec, after_upload, cleanup_on_failure)
        parts = per_shard[0]
        batch = HollowBatch(lower=lower, upper=upper, since=lower, parts=tuple(parts))
        # One CAS links the parts and releases the job's part writer (or, if it loses
        # for certain, the parts are deleted).
        writer.compare_and_append_batch(batch, lower, upper, release_part_writer=spec.part_writer)
    except Exception:
        _release(pws)
        raise
    _release(pws)  # a no-op unless the commit did not release it
    return SparkWriteResult(
        shard_ids=[shard], lower=lower, upper=upper, part_writer=spec.part_writer,
        rows_in=rows_in, updates=batch.len, parts=len(parts), bytes=batch.size,
        batches=[batch], seconds=_now() - t0,
    )


def write_collection_shards(
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
    """Writes ``df`` to a rendition of a collection: one batch per shard, routed by key hash.

    Before the job every shard's upper must be ``expected_upper`` or already at least
    ``new_upper`` (a retry of a write that committed on some shards: those are
    skipped, which is correct for a *definite* collection whose retry writes identical
    data); anything else is an ``UpperMismatch`` and nothing runs. The batches are
    then committed shard by shard, and the metadata shard's upper advances as
    ``CollectionWriter.append`` does. For a non-transactional collection only;
    ``spark.write_txn.write_collection`` picks this or one transaction.
    """
    t0 = _now()
    what = f"collection {writer.name}/{writer.rendition}"
    lower = as_frontier(expected_upper, "expected_upper")
    upper = as_frontier(new_upper, "new_upper")
    _check_frontiers(what, lower, upper)
    handles: list[WriteHandle] = list(writer.shard_writers)
    schemas = writer.schemas
    df = _prepare_df(df, schemas, what, time)
    uppers = [w.fetch_recent_upper() for w in handles]
    todo = [i for i, u in enumerate(uppers) if not (u >= upper)]
    bad = [u for i, u in enumerate(uppers) if i in todo and u != lower]
    if bad:
        raise UpperMismatch(what, lower, min(bad))
    shard_ids = [w.shard_id for w in handles]
    skipped = [shard_ids[i] for i in range(len(handles)) if i not in todo]
    client = handles[0].client
    spec = _spec(client, shard_ids, schemas, lower, upper, target_part_bytes, chunk_bytes)
    prepare_executors(df.sparkSession, blob_uri=spec.blob_uri)  # before any state change
    batches: list[HollowBatch] = []
    rows_in = 0
    if todo:
        pws = _register_part_writers(client, [shard_ids[i] for i in todo], spec.part_writer)
        try:
            rows_in = _write_and_commit(
                df, spec, after_upload, cleanup_on_failure, handles, todo, client, lower, upper,
                batches, skipped,
            )
        except Exception:
            _release(pws)
            raise
        _release(pws)  # no-ops where the commit released it
    writer.advance_metadata(upper)
    return SparkWriteResult(
        shard_ids=shard_ids, lower=lower, upper=upper, part_writer=spec.part_writer,
        rows_in=rows_in, updates=sum(b.len for b in batches),
        parts=sum(len(b.parts) for b in batches), bytes=sum(b.size for b in batches),
        batches=batches, skipped_shards=skipped, seconds=_now() - t0,
    )


def _register_part_writers(client: Any, shard_ids: list[str], writer_id: str) -> list[PartWriter]:
    """Registers the job's part writer on each shard before any executor uploads."""
    pws: list[PartWriter] = []
    try:
        for sid in shard_ids:
            pws.append(
                PartWriter.register(
                    client.machine(sid), purpose="spark-write", context=client, writer_id=writer_id
                )
            )
    except Exception:
        _release(pws)
        raise
    return pws


def _release(pws: list[PartWriter]) -> None:
    for pw in pws:
        pw.release()


def _write_and_commit(
    df: Any,
    spec: _WriteSpec,
    after_upload: AfterUpload | None,
    cleanup_on_failure: bool,
    handles: list[WriteHandle],
    todo: list[int],
    client: Any,
    lower: Antichain,
    upper: Antichain,
    batches: list[HollowBatch],
    skipped: list[str],
) -> int:
    """Runs the job and commits one batch per shard in ``todo``; returns the input rows."""
    per_shard, rows_in = _run_job(df, spec, after_upload, cleanup_on_failure)
    for i, w in enumerate(handles):
        parts = per_shard[i]
        if i not in todo:
            _delete_parts(client, parts)  # written by no registered writer: never linked
            continue
        batch = HollowBatch(lower=lower, upper=upper, since=lower, parts=tuple(parts))
        try:
            w.compare_and_append_batch(batch, lower, upper, release_part_writer=spec.part_writer)
        except UpperMismatch as e:
            if e.current is not None and e.current >= upper:
                skipped.append(w.shard_id)  # a concurrent identical writer got there first
                continue
            for rest in per_shard[i + 1 :]:
                _delete_parts(client, rest)
            raise
        batches.append(batch)
    return rows_in


def _now() -> float:
    return _time.monotonic()
