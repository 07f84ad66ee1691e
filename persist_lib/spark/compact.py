"""Distributed compaction: merges too large for one process, run as a Spark job.

The output of a merge is one sorted run: every ``(k, v, t)`` of the inputs, times
below the since forwarded (``compactor.forward_time``), consolidated. The Spark job
produces exactly that by *range partitioning* in persist's own row order
(``ranks.row_keys``, the order the in-process compactor merges by):

1. **Sample.** Tasks fetch (and verify) the input parts and return evenly spaced rows
   of each (a part is sorted, so these are its quantiles) and its decoded size.
2. **Splitters.** The driver ranks the samples and picks ``B - 1`` splitter rows for
   ``B`` buckets of about ``bucket_bytes`` each.
3. **Shuffle.** Tasks fetch the parts again, forward their times, and cut each part
   into the bucket ranges by ranking its rows together with the splitters (rows equal
   to a splitter all go right, so equal rows always meet). Slices travel as Arrow IPC
   bytes in a binary column — any Arrow type, no Spark type conversion — through a
   ``repartition(B, pkey)``, where ``pkey`` is an int whose Spark hash partition is the
   bucket (``partition_keys``), so each bucket gets a merge task of its own.
4. **Merge.** Bucket ``b``'s task consolidates its rows (sorting them) and writes them
   through a ``BatchBuilder`` under one compactor writer id (``cmp-...``). (Should two
   buckets ever share a task, it merges them one after the other.)

Every stage is a DataFrame job (``spark.range`` task inputs, ``mapInArrow``,
``repartition``), never the RDD API, so the same code runs on a classic session and
through Spark Connect.

The buckets are ordered ranges, so the parts in bucket order form one sorted run: the
output equals the in-process ``compactor.merge_batches`` output row for row, and
later merges treat it as one run like any compactor output. The driver applies it
with ``maintenance_transitions.apply_merge_res`` — the in-process compactor's
transition — which replaces exactly the inputs or, if they changed meanwhile, does
nothing (and the output is deleted). The job's writer id is registered on the shard
before any task writes (``persist_lib.shard.part_writers``), so the leaked-blob sweeper
never deletes output that may still be linked; the transition releases it. A failed
job leaves only blobs under its ``{shard}/cmp-.../`` prefix, which the driver deletes
(best effort) and the leaked-blob sweeper otherwise collects once the registration is
released or has lapsed.
"""

from __future__ import annotations

import io
import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from persist_lib.errors import InvalidUsage
from persist_lib.shard import maintenance_transitions as mt
from persist_lib.shard.batch_meta import HollowBatch, PartMeta
from persist_lib.shard.codec import D_COL, Schemas, internal_schema
from persist_lib.shard.compactor import forward_time
from persist_lib.shard.part_writers import PartWriter
from persist_lib.shard.runs import new_compactor_writer_id
from persist_lib.shard.spine import CompactionRequest, compaction_requests
from persist_lib.spark._common import (
    blob_uri_of,
    check_session,
    default_parallelism,
    open_executor_blob,
    task_frame,
    task_ids,
    task_partition_id,
)

if TYPE_CHECKING:  # pragma: no cover
    from persist_lib.handles.client import PersistClient
    from persist_lib.shard.machine import Machine

log = logging.getLogger(__name__)

MiB = 1 << 20
DEFAULT_BUCKET_BYTES = 64 * MiB  # decoded Arrow bytes one merge task holds (~3x at peak)
DEFAULT_MIN_BYTES = 256 * MiB  # compact_shard: smaller merges run in-process
SAMPLES_PER_BUCKET = 64
# A slice (one part's rows in one bucket) travels in rows of at most this much IPC.
MAX_SLICE_BYTES = 16 * MiB
# Spark hands a merge task its rows as Arrow batches whose binary column holds at most
# 2 GiB: a bucket must stay well below that (buckets are ~``bucket_bytes`` of decoded
# Arrow, and the IPC slices are about as large).
MAX_BUCKET_BYTES = 1 << 30

_SAMPLE_SCHEMA = "sample binary, rows long, nbytes long"
_SAMPLE_ARROW = pa.schema([("sample", pa.binary()), ("rows", pa.int64()), ("nbytes", pa.int64())])
_SLICE_SCHEMA = "bucket int, pkey int, data binary"
_SLICE_ARROW = pa.schema([("bucket", pa.int32()), ("pkey", pa.int32()), ("data", pa.binary())])
_MERGED_SCHEMA = "bucket int, seq int, part string, rows long, task int"
_MERGED_ARROW = pa.schema(
    [("bucket", pa.int32()), ("seq", pa.int32()), ("part", pa.string()), ("rows", pa.int64()), ("task", pa.int32())]
)

ArrowFn = Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]
# A test hook: called on the executor with (bucket, parts written) once a merge task has
# uploaded a bucket's parts and before it returns their metadata. Raising there (or
# killing the process) behaves like a crash at that point.
AfterMergeUpload = Callable[[int, int], None]


@dataclass(frozen=True)
class _MergeSpec:
    """What executors need (picklable)."""

    blob_uri: str
    shard_id: str
    schemas_json: dict[str, Any]
    since_t: int | None
    writer: str
    lower: int
    upper: int | None
    since: int | None
    target_part_bytes: int
    inline_threshold: int

    def __repr__(self) -> str:  # the blob URI may carry an S3 secret key
        from persist_lib.location.redaction import redacted_dataclass_repr

        return redacted_dataclass_repr(self)


@dataclass
class SparkMergeStats:
    parts_in: int = 0
    bytes_in: int = 0
    rows_in: int = 0
    decoded_bytes_in: int = 0
    buckets: int = 0
    rows_out: int = 0
    parts_out: int = 0
    bytes_out: int = 0
    max_bucket_rows: int = 0
    # Merge tasks that got more than one bucket (0 unless Spark's hash partitioning
    # stops matching ``partition_keys``; the output is the same, a task's memory grows).
    shared_merge_tasks: int = 0
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class SparkMergeOutput:
    batch: HollowBatch
    stats: SparkMergeStats
    writer: str
    # The job's part-writer registration (released when the merge is applied or not).
    registration: PartWriter | None = None


@dataclass
class SparkCompactionResult:
    request: CompactionRequest
    outcome: mt.MergeOutcome
    output: HollowBatch | None
    stats: SparkMergeStats = field(default_factory=SparkMergeStats)
    deleted_output: bool = False

    @property
    def applied(self) -> bool:
        return self.outcome in (mt.MergeOutcome.APPLIED, mt.MergeOutcome.ALREADY_APPLIED)

    def to_json(self) -> dict[str, Any]:
        return {
            "request": self.request.describe(),
            "outcome": self.outcome.value,
            "where": "spark",
            "stats": self.stats.to_json(),
        }


# ----- executor side ----------------------------------------------------------------------


def _ipc(table: pa.Table) -> bytes:
    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    return sink.getvalue()


def _from_ipc(data: bytes | pa.Buffer) -> pa.Table:
    return pa.ipc.open_stream(data if isinstance(data, pa.Buffer) else pa.py_buffer(data)).read_all()


def _murmur3_int(value: int, seed: int = 42) -> int:
    """Spark's ``Murmur3Hash`` of an ``int`` column value (``hash(CAST(x AS INT))``)."""
    m = 0xFFFFFFFF
    k1 = ((value & m) * 0xCC9E2D51) & m
    k1 = ((k1 << 15) | (k1 >> 17)) & m
    k1 = (k1 * 0x1B873593) & m
    h1 = seed ^ k1
    h1 = ((h1 << 13) | (h1 >> 19)) & m
    h1 = (h1 * 5 + 0xE6546B64) & m
    h1 ^= 4  # the length in bytes
    h1 ^= h1 >> 16
    h1 = (h1 * 0x85EBCA6B) & m
    h1 ^= h1 >> 13
    h1 = (h1 * 0xC2B2AE35) & m
    h1 ^= h1 >> 16
    return h1 - (1 << 32) if h1 >= 1 << 31 else h1


def partition_keys(n: int) -> list[int]:
    """``keys[b]``: the smallest int ``x >= 0`` that ``repartition(n, col)`` sends to
    partition ``b`` (``pmod(murmur3(x), n) == b``), one distinct key per partition.

    ``repartition(n, "bucket")`` alone would hash bucket ids onto partitions, so two
    buckets could share a merge task (twice the memory) while another task idles.
    """
    keys = [-1] * n
    found, x = 0, 0
    while found < n:
        p = _murmur3_int(x) % n  # Python's % of a positive n is Spark's pmod
        if keys[p] < 0:
            keys[p] = x
            found += 1
        x += 1
    return keys


def _key_cols(schemas: Schemas) -> list[str]:
    return [n for n in internal_schema(schemas).names if n != D_COL]


def _read_part(spec: _MergeSpec, blob: Any, schemas: Schemas, pj: dict[str, Any]) -> pa.Table:
    """Fetches, verifies and decodes one part and forwards its times (still sorted)."""
    from persist_lib.shard.parts import fetch_part
    from persist_lib.shard.time_filters import advance_to_since

    t = fetch_part(blob, PartMeta.from_json(pj), schemas, spec.shard_id)
    return advance_to_since(t, spec.since_t) if spec.since_t is not None else t


def _sample_task(spec: _MergeSpec, items: Iterable[tuple[dict[str, Any], int]]) -> Iterator[tuple[bytes, int, int]]:
    """(part json, samples wanted) -> (sample rows as IPC, rows, decoded bytes) per part."""
    schemas = Schemas.from_json(spec.schemas_json)
    blob = open_executor_blob(spec.blob_uri)
    cols = _key_cols(schemas)
    for pj, q in items:
        t = _read_part(spec, blob, schemas, pj)
        n = t.num_rows
        if n == 0:
            continue
        idx = np.unique(np.linspace(0, n - 1, num=max(1, min(q, n))).astype(np.int64))
        yield _ipc(t.select(cols).take(pa.array(idx))), n, int(t.nbytes)


def _bucket_of(table: pa.Table, splitters: pa.Table | None, cols: list[str]) -> np.ndarray:
    """The bucket of every row: the number of splitters ``<=`` it (persist row order)."""
    from persist_lib.shard.ranks import row_keys

    n = table.num_rows
    if splitters is None or splitters.num_rows == 0:
        return np.zeros(n, dtype=np.int64)
    both = pa.concat_tables([table.select(cols), splitters])
    keys = row_keys([both.column(c) for c in cols], both.num_rows)
    return np.searchsorted(keys[n:], keys[:n], side="right").astype(np.int64)


def _shuffle_task(
    spec: _MergeSpec, splitters_ipc: bytes | None, parts: Iterable[dict[str, Any]]
) -> Iterator[tuple[int, bytes]]:
    """Part json -> (bucket, IPC slice of the part's forwarded rows in that bucket)."""
    schemas = Schemas.from_json(spec.schemas_json)
    blob = open_executor_blob(spec.blob_uri)
    cols = _key_cols(schemas)
    splitters = _from_ipc(splitters_ipc) if splitters_ipc is not None else None
    for pj in parts:
        t = _read_part(spec, blob, schemas, pj)
        if t.num_rows == 0:
            continue
        b = _bucket_of(t, splitters, cols)
        # A sorted part and a monotone bucket function: buckets are contiguous runs. A part
        # a bulk write stored unsorted is grouped by bucket first (a stable sort of small
        # integers), else every change of bucket between rows would be its own slice.
        if pj.get("unsorted", False) and len(b) > 1 and bool((b[1:] < b[:-1]).any()):
            order = np.argsort(b, kind="stable")
            t, b = t.take(pa.array(order)), b[order]
        edges = np.flatnonzero(np.diff(b)) + 1
        starts = np.concatenate(([0], edges))
        ends = np.concatenate((edges, [t.num_rows]))
        step = max(1, MAX_SLICE_BYTES // max(1, t.nbytes // t.num_rows))  # rows per piece
        for s, e in zip(starts, ends, strict=True):
            for s2 in range(int(s), int(e), step):
                yield int(b[s]), _ipc(t.slice(s2, min(step, int(e) - s2)))


def _sampler(spec: _MergeSpec, items: list[list[tuple[dict[str, Any], int]]]) -> ArrowFn:
    """The sampling stage's ``mapInArrow`` function: task ``i`` samples ``items[i]``."""

    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for i in task_ids(batches):
            for sample, n, nbytes in _sample_task(spec, items[i]):
                yield pa.RecordBatch.from_pydict(
                    {"sample": [sample], "rows": [n], "nbytes": [nbytes]}, schema=_SAMPLE_ARROW
                )

    return run


def _shuffler(spec: _MergeSpec, splitters_ipc: bytes | None, groups: list[list[dict[str, Any]]], nb: int) -> ArrowFn:
    """The shuffle stage's map side: task ``i`` cuts ``groups[i]`` into bucket slices,
    each row tagged with its bucket's partition key."""
    pkeys = partition_keys(nb)

    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for i in task_ids(batches):
            buf: dict[str, list[Any]] = {"bucket": [], "pkey": [], "data": []}
            size = 0
            for b, data in _shuffle_task(spec, splitters_ipc, groups[i]):
                buf["bucket"].append(b)
                buf["pkey"].append(pkeys[b])
                buf["data"].append(data)
                size += len(data)
                if size >= MAX_SLICE_BYTES:
                    yield pa.RecordBatch.from_pydict(buf, schema=_SLICE_ARROW)
                    buf, size = {"bucket": [], "pkey": [], "data": []}, 0
            if buf["data"]:
                yield pa.RecordBatch.from_pydict(buf, schema=_SLICE_ARROW)

    return run


def _merger(spec: _MergeSpec, after_upload: AfterMergeUpload | None = None) -> ArrowFn:
    """The shuffle's reduce side: merges and writes each bucket of the partition."""

    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        task = task_partition_id()
        by_bucket: dict[int, list[pa.Table]] = {}
        for rb in batches:
            data = rb.column(2)
            for j, b in enumerate(rb.column(0).to_pylist()):
                by_bucket.setdefault(int(b), []).append(_from_ipc(data[j].as_buffer()))
        for b in sorted(by_bucket):
            out: dict[str, list[Any]] = {"bucket": [], "seq": [], "part": [], "rows": [], "task": []}
            for bucket, seq, pj, rows in _merge_task(spec, b, by_bucket.pop(b)):
                for k, v in zip(out, (bucket, seq, pj, rows, task), strict=True):
                    out[k].append(v)
            if after_upload is not None:
                after_upload(b, len(out["bucket"]))
            if out["bucket"]:
                yield pa.RecordBatch.from_pydict(out, schema=_MERGED_ARROW)

    return run


def _merge_task(spec: _MergeSpec, bucket: int, tables: list[pa.Table]) -> Iterator[tuple[int, int, str, int]]:
    """All slices of one bucket -> its consolidated rows, written as parts.

    Yields ``(bucket, seq, part json, rows)``.
    """
    import json

    from persist_lib.frontier import Antichain
    from persist_lib.shard.batch_builder import BatchBuilder
    from persist_lib.shard.consolidate import consolidate

    schemas = Schemas.from_json(spec.schemas_json)
    if not tables:
        return
    target = internal_schema(schemas)
    merged = consolidate(pa.concat_tables([t.cast(target) if not t.schema.equals(target) else t for t in tables]))
    del tables
    if merged.num_rows == 0:
        return
    blob = open_executor_blob(spec.blob_uri)
    builder = BatchBuilder(
        blob, schemas, shard=spec.shard_id, writer=spec.writer, lower=spec.lower,
        target_part_bytes=spec.target_part_bytes, max_inflight_uploads=2,
        inline_threshold=spec.inline_threshold,
    )
    upper = Antichain.empty() if spec.upper is None else Antichain([spec.upper])
    since = Antichain.empty() if spec.since is None else Antichain([spec.since])
    try:
        builder.add(merged)
        hb = builder.finish(upper, since)
    except BaseException:
        builder.abort()
        raise
    for seq, p in enumerate(hb.parts):
        yield bucket, seq, json.dumps(p.to_json(), separators=(",", ":")), p.count


# ----- driver side ------------------------------------------------------------------------


def _groups(parts: list[PartMeta], n: int) -> list[list[PartMeta]]:
    """Parts balanced by size over ``n`` groups (largest first into the lightest)."""
    buckets: list[list[PartMeta]] = [[] for _ in range(max(1, min(n, len(parts))))]
    sizes = [0] * len(buckets)
    for p in sorted(parts, key=lambda p: -p.size):
        i = sizes.index(min(sizes))
        buckets[i].append(p)
        sizes[i] += p.size
    return [b for b in buckets if b]


def _splitters(samples: list[pa.Table], weights: list[float], buckets: int, cols: list[str]) -> pa.Table | None:
    """``buckets - 1`` splitter rows at evenly spaced weighted ranks of the samples."""
    from persist_lib.shard.ranks import row_keys

    if buckets <= 1 or not samples:
        return None
    cat = pa.concat_tables(samples)
    w = np.concatenate([np.full(t.num_rows, wt, dtype=np.float64) for t, wt in zip(samples, weights, strict=True)])
    keys = row_keys([cat.column(c) for c in cols], cat.num_rows)
    order = np.argsort(keys, kind="stable")
    cum = np.cumsum(w[order])
    total = cum[-1]
    picks = []
    for i in range(1, buckets):
        j = int(np.searchsorted(cum, total * i / buckets, side="left"))
        picks.append(int(order[min(j, len(order) - 1)]))
    # Distinct splitters in order (equal ones would make empty buckets).
    uniq: list[int] = []
    seen: set[int] = set()
    for p in sorted(picks, key=lambda p: keys[p]):
        if int(keys[p]) not in seen:
            seen.add(int(keys[p]))
            uniq.append(p)
    return cat.take(pa.array(uniq, pa.int64())) if uniq else None


def spark_merge(
    spark: Any,
    client: PersistClient,
    schemas: Schemas,
    req: CompactionRequest,
    *,
    shard_id: str,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    num_buckets: int | None = None,
    target_part_bytes: int | None = None,
    cleanup_on_failure: bool = True,
    parallelism: int | None = None,
    after_upload: AfterMergeUpload | None = None,
) -> SparkMergeOutput:
    """Runs the merge of ``req`` on Spark and returns its output batch (not applied).

    ``num_buckets`` fixes the number of merge tasks; by default there is one per
    ``bucket_bytes`` of decoded input. The parts are read by ``2 * parallelism``
    tasks (default: the session's, see ``_common.default_parallelism``). ``spark``
    may be a classic or a Spark Connect session. On failure the job's output is
    deleted (best effort) and the error raised. ``after_upload`` is a test hook (see
    ``AfterMergeUpload``).
    """
    t0 = time.monotonic()
    check_session(spark, f"spark_merge of shard {shard_id}")
    if not 0 < bucket_bytes <= MAX_BUCKET_BYTES:
        raise InvalidUsage(
            f"bucket_bytes must be in (0, {MAX_BUCKET_BYTES}] (a merge task gets its bucket as Spark "
            f"Arrow batches, at most 2 GiB each), got {bucket_bytes}"
        )
    from persist_lib.spark.executors import prepare_executors

    prepare_executors(spark, blob_uri=blob_uri_of(client, f"shard {shard_id}"))  # before any state change
    tasks = default_parallelism(spark, parallelism)
    cfg = client.config
    parts = [p for b in req.inputs for p in b.parts]
    writer = new_compactor_writer_id()
    registration = PartWriter.register(
        client.machine(shard_id), purpose="spark-compaction", context=client, writer_id=writer
    )
    spec = _MergeSpec(
        blob_uri=blob_uri_of(client, f"shard {shard_id}"),
        shard_id=shard_id,
        schemas_json=schemas.to_json(),
        since_t=forward_time(req.since, req.upper),
        writer=writer,
        lower=_time(req.lower, "lower"),
        upper=req.upper.time,
        since=req.since.time,
        target_part_bytes=int(target_part_bytes or cfg.blob_target_size),
        inline_threshold=cfg.inline_threshold,
    )
    stats = SparkMergeStats(parts_in=len(parts), bytes_in=sum(p.size for p in parts))
    cols = _key_cols(schemas)
    try:
        groups = _groups(parts, tasks * 2)
        total_count = max(1, sum(p.count for p in parts))
        # 1. Sample (and measure the decoded size), unless one bucket was asked for.
        split = None
        if num_buckets != 1:
            guess = num_buckets or max(1, math.ceil(stats.bytes_in * 4 / max(bucket_bytes, 1)))
            want = guess * SAMPLES_PER_BUCKET
            items = [
                [(p.to_json(), max(1, math.ceil(want * p.count / total_count))) for p in g]
                for g in groups
            ]
            sampled = task_frame(spark, len(items)).mapInArrow(_sampler(spec, items), _SAMPLE_SCHEMA).toArrow()
            samples = [_from_ipc(s.as_buffer()) for s in sampled.column("sample")]
            counts = sampled.column("rows").to_pylist()
            weights = [n / max(1, t.num_rows) for t, n in zip(samples, counts, strict=True)]
            stats.rows_in = sum(counts)
            stats.decoded_bytes_in = sum(sampled.column("nbytes").to_pylist())
            buckets = num_buckets or max(1, math.ceil(stats.decoded_bytes_in / max(bucket_bytes, 1)))
            if stats.decoded_bytes_in / buckets > MAX_BUCKET_BYTES:
                raise InvalidUsage(
                    f"shard {shard_id}: {stats.decoded_bytes_in} decoded bytes in {buckets} buckets is over "
                    f"{MAX_BUCKET_BYTES} bytes per merge task; use more buckets (num_buckets=None)"
                )
            split = _splitters(samples, weights, buckets, cols)
        nb = 1 if split is None else split.num_rows + 1
        stats.buckets = nb
        split_ipc = _ipc(split) if split is not None else None
        # 2. Shuffle into ordered key ranges, 3. merge and write each range.
        part_groups = [[p.to_json() for p in g] for g in groups]
        merged = (
            task_frame(spark, len(part_groups))
            .mapInArrow(_shuffler(spec, split_ipc, part_groups, nb), _SLICE_SCHEMA)
            .repartition(nb, "pkey")
            .mapInArrow(_merger(spec, after_upload), _MERGED_SCHEMA)
            .toArrow()
        )
    except Exception:
        if cleanup_on_failure:
            _delete_prefix(spec)
        registration.release()
        raise
    except BaseException:
        if cleanup_on_failure:
            _delete_prefix(spec)
        raise
    import json

    out = sorted(
        zip(*(merged.column(c).to_pylist() for c in ("bucket", "seq", "part", "rows", "task")), strict=True),
        key=lambda r: (r[0], r[1]),
    )
    metas = tuple(PartMeta.from_json(json.loads(pj)) for _, _, pj, _, _ in out)
    per_bucket: dict[int, int] = {}
    per_task: dict[int, set[int]] = {}
    for b, _, _, rows, task in out:
        per_bucket[b] = per_bucket.get(b, 0) + rows
        per_task.setdefault(task, set()).add(b)
    stats.shared_merge_tasks = sum(1 for bs in per_task.values() if len(bs) > 1)
    if stats.shared_merge_tasks:
        log.warning(
            "shard %s: %d Spark merge tasks got more than one bucket (Spark's hash partitioning no longer "
            "matches partition_keys?): correct, but those tasks held several buckets",
            shard_id, stats.shared_merge_tasks,
        )
    batch = HollowBatch(lower=req.lower, upper=req.upper, since=req.since, parts=metas)
    stats.rows_out = batch.len
    stats.parts_out = len(metas)
    stats.bytes_out = batch.size
    stats.max_bucket_rows = max(per_bucket.values(), default=0)
    stats.seconds = time.monotonic() - t0
    return SparkMergeOutput(batch, stats, writer, registration)


def _time(f: Any, what: str) -> int:
    if f.time is None:
        raise InvalidUsage(f"a merge {what} can't be the empty frontier")
    return int(f.time)


def _delete_prefix(spec: _MergeSpec) -> None:
    blob = open_executor_blob(spec.blob_uri)
    try:
        for m in blob.list_keys_and_metadata(f"{spec.shard_id}/{spec.writer}/"):
            blob.delete(m.key)
    except Exception as e:  # the leaked-blob sweeper catches the rest
        log.warning("shard %s: cleaning up a failed Spark merge: %s", spec.shard_id, e)


def _uninline(machine: Machine, batch: HollowBatch, writer: str) -> HollowBatch:
    from persist_lib.shard.parts import blob_form, part_blob_key

    parts: list[PartMeta] = []
    for p in batch.parts:
        if p.inline is None:
            parts.append(p)
            continue
        key = part_blob_key(machine.shard_id, writer)
        data, as_blob = blob_form(p, machine.shard_id)  # an IPC inline part: as Parquet
        machine.blob.set(key, data)
        parts.append(replace(as_blob, key=key, inline=None))
    return replace(batch, parts=tuple(parts))


def apply_merge(
    client: PersistClient, machine: Machine, req: CompactionRequest, out: SparkMergeOutput
) -> SparkCompactionResult:
    """Applies a merge output with the in-process compactor's transition, or deletes it."""
    cfg = client.config
    output = out.batch

    def apply(o: HollowBatch) -> mt.MergeResult:
        res, _ = machine.apply(
            "apply_merge_res",
            lambda s, now: mt.apply_merge_res(
                s, now, input_ids=req.batch_ids, inputs=req.inputs, output=o,
                inline_max_total=cfg.inline_max_total, part_writer=out.writer,
            ),
        )
        assert isinstance(res, mt.MergeResult)
        return res

    try:
        res = apply(output)
        if res.outcome is mt.MergeOutcome.NOT_APPLIED_INLINE_BUDGET:
            output = _uninline(machine, output, out.writer)
            res = apply(output)
    except Exception:
        # Unknown whether it landed: keep the output (for the sweeper if it did not).
        if out.registration is not None:
            out.registration.release()
        raise
    if out.registration is not None:
        out.registration.mark_released()  # apply_merge_res released it (or it lapsed)
    deleted = False
    # "Not applied" is definite (see compactor.compact_request): delete the output.
    if not res.applied:
        reused = {k for b in req.inputs for k in b.blob_keys()}
        for k in output.blob_keys():
            if k not in reused:
                try:
                    machine.blob.delete(k)
                except Exception as e:
                    log.warning("shard %s: could not delete unapplied output %s: %s", machine.shard_id, k, e)
        deleted = True
    return SparkCompactionResult(req, res.outcome, output, out.stats, deleted)


def compact_shard(
    spark: Any,
    client: PersistClient,
    shard: str,
    *,
    min_bytes: int = DEFAULT_MIN_BYTES,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    num_buckets: int | None = None,
    max_rounds: int = 64,
    parallelism: int | None = None,
) -> dict[str, Any]:
    """Runs the shard's pending merges: those reading ``>= min_bytes`` on Spark, the
    rest in-process (``compactor.compact_request``), round after round until the spine
    wants nothing more. Returns a JSON-able summary (what a Dagster op records).
    ``spark``: a classic or a Spark Connect session; ``parallelism`` as ``spark_merge``."""
    from persist_lib.handles import maintenance
    from persist_lib.shard.compactor import compact_request
    from persist_lib.shard.spine import compaction_debt

    t0 = time.monotonic()
    check_session(spark, f"compact_shard of shard {shard}")
    m = client.machine(shard)
    s = m.fetch_latest()
    if not s.exists or s.schemas is None:
        raise InvalidUsage(f"shard {shard} does not exist (or has no schemas) at {client!r}")
    schemas = Schemas.from_json(s.schemas)
    before, debt_before = len(s.batches), compaction_debt(s)
    spark_results: list[SparkCompactionResult] = []
    local_applied = local_not_applied = rounds = 0
    local_read = local_written = 0
    failed: list[dict[str, Any]] = []
    failed_ids: set[int] = set()
    while rounds < max_rounds and not s.tombstone:
        reqs = compaction_requests(s, failed_ids)
        if not reqs:
            break
        rounds += 1
        for req in reqs:
            big = req.rewrites_data and sum(1 for b in req.inputs if b.parts) > 0 and req.num_bytes >= min_bytes
            try:
                if big:
                    out = spark_merge(
                        spark, client, schemas, req, shard_id=m.shard_id, bucket_bytes=bucket_bytes,
                        num_buckets=num_buckets, parallelism=parallelism,
                    )
                    spark_results.append(apply_merge(client, m, req, out))
                else:
                    r = compact_request(m, schemas, client.config, req, context=client)
                    local_applied += int(r.applied)
                    local_not_applied += int(not r.applied)
                    local_read += r.stats.bytes_read
                    local_written += r.stats.bytes_written
            except Exception as e:
                # A corrupt or missing input fails every attempt: quarantine it (shard
                # state), carry on with the other merges, report it in ``failed``. A
                # failing Spark job is reported by its Py4J error, which is no persist
                # error type: it counts as deterministic only for the local path.
                if big or not maintenance.is_deterministic_failure(e):
                    raise
                maintenance.quarantine(m, req, e, 1)
                failed_ids.update(req.batch_ids)
                failed.append({"batch_ids": list(req.batch_ids), "error": f"{type(e).__name__}: {e}"})
        s = m.fetch_latest()
    spark_applied = sum(1 for r in spark_results if r.applied)
    return {
        "shard": m.shard_id,
        "rounds": rounds,
        # The keys of maintenance.compact, over both engines:
        "merges_applied": spark_applied + local_applied,
        "merges_not_applied": len(spark_results) - spark_applied + local_not_applied,
        "bytes_read": sum(r.stats.bytes_in for r in spark_results) + local_read,
        "bytes_written": sum(r.stats.bytes_out for r in spark_results) + local_written,
        "spark_merges_applied": spark_applied,
        "spark_merges_not_applied": sum(1 for r in spark_results if not r.applied),
        "local_merges_applied": local_applied,
        "local_merges_not_applied": local_not_applied,
        "spark_bytes_read": sum(r.stats.bytes_in for r in spark_results),
        "spark_bytes_written": sum(r.stats.bytes_out for r in spark_results),
        "batches_before": before,
        "batches_after": len(s.batches),
        "compaction_debt_before": debt_before,
        "compaction_debt_after": compaction_debt(s),
        "seconds": round(time.monotonic() - t0, 3),
        "spark_merges": [r.to_json() for r in spark_results],
        "failed": failed,
        "quarantined_merges": maintenance.describe_quarantine(s),
    }
