"""Spark-driven ingestion of a file landing zone: the same recipe, decoding on executors.

``SparkIngestion`` *is* the in-process ``ingest.Ingestion`` — same remap shard, same
minting of bindings (which files and rows at which time), same envelope, same
verified definite appends — except where the bound records are decoded. When it
catches up on bindings, the driver collects the chunks each binding covers
(``(file, rows [r0, r1))``, exactly as the in-process replay would), and one Spark job
per group of bindings decodes them on executors: each task re-reads its files from
the landing zone, checks each against what the driver saw (row count and size, or
``SourceDataGone``), and calls the very same ``FileChunk.decode(spec)`` the
in-process ingester calls. Decoding is row-wise and deterministic, so the decoded
rows and error records are identical; the driver then applies them binding by binding
in time order (transform, envelope, error/raw records, appends at the same flush
points), so the outputs are identical to an in-process run with the same bindings.

Trivial chunks (unreadable files, whose content is one error record from the remap
shard's notes, and empty ranges) are decoded on the driver.

A Kafka topic (``KafkaSource``) is distributed the same way, with *offset ranges* for
files: the driver reads with a ``KafkaRangeReader`` (ranges up to each partition's high
watermark, bound without fetching a message), and each task reads one
``(partition, [start, end))`` piece with its own consumer (``kafka.ranges.read_range``) and
decodes it with the source's own ``decode_messages``. A task is a pure function of its
range, so a retried or speculative attempt returns the same result; the driver applies
the bindings and commits the consumer group's offsets once the outputs are durable,
exactly as in-process. Postgres CDC is not distributed (a replication stream can only be
consumed by the driver).

A typed ingestion error raised in a task (``SourceDataGone``, ``KafkaOffsetOutOfRange``,
``SourceTimeout``, ...) reaches the driver's caller as that type, with its message and
fields, instead of Spark's generic task failure.

The job is a DataFrame job (``spark.range`` task inputs, ``mapInArrow`` returning the
pickled ``Decoded`` results in pieces of at most ``RESULT_PIECE_BYTES``), so the same
code runs on a classic session and through Spark Connect, where a result row must
fit one gRPC message.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import json
import pickle
import re
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from persist_lib.config_rules import Rule, rule_problems
from persist_lib.ingest import errors as ingest_errors
from persist_lib.ingest.addresses import Address
from persist_lib.ingest.decode import Decoded, DecodeSpec
from persist_lib.ingest.driver import Ingestion, _Acc
from persist_lib.ingest.errors import (
    IngestConfigError,
    IngestError,
    InvalidIngestConfig,
    SourceDataGone,
)
from persist_lib.ingest.kafka import KafkaSource
from persist_lib.ingest.kafka.ranges import KafkaRangeChunk, read_range
from persist_lib.ingest.landing_zone import LandingZoneSource
from persist_lib.ingest.landing_zone.files import FileChunk, _UnreadableFile
from persist_lib.ingest.remap import Binding
from persist_lib.ingest.source import Chunk
from persist_lib.spark._common import (
    binary_rows,
    check_session,
    default_parallelism,
    task_frame,
    task_ids,
)

if TYPE_CHECKING:  # pragma: no cover
    from persist_lib.handles.client import PersistClient

DEFAULT_RECORDS_PER_JOB = 1_000_000
MIN_PIECE_RECORDS = 20_000  # smaller ranges aren't worth a task of their own

#: ``SparkIngestion``'s own options, checked together (``persist_lib.config_rules``).
SPARK_INGEST_RULES: dict[str, Rule] = {
    "records_per_job": Rule("int", lo=1, unit="records", meaning="bound records decoded per Spark job"),
    "min_piece_records": Rule("int", lo=1, unit="records", meaning="the smallest piece a bound range is cut into"),
    "parallelism": Rule("int", lo=1, optional=True, meaning="None: the session's default parallelism"),
}
RESULT_PIECE_BYTES = 8 << 20  # a decoded result travels to the driver in rows of this size

_RESULT_SCHEMA = "idx int, piece int, seq int, data binary"
_RESULT_ARROW = pa.schema(
    [("idx", pa.int32()), ("piece", pa.int32()), ("seq", pa.int32()), ("data", pa.binary())]
)


@dataclass(frozen=True)
class _FileRange:
    """Rows ``[r0, r1)`` of a landed file, as the driver saw it (picklable)."""

    index: int  # position among the group's chunks
    piece: int  # ordinal of this piece of the chunk (large chunks are decoded in pieces)
    file: str
    r0: int
    r1: int
    rows: int  # the file's row count when the driver read it
    size: int  # and its size in bytes


@dataclass(frozen=True)
class _OffsetRange:
    """Offsets ``[start, end)`` of a Kafka partition, bound by the driver (picklable)."""

    index: int
    piece: int
    partition: int
    start: int
    end: int


@dataclass(frozen=True)
class _SourceSpec:
    uri: str
    format: str
    pattern: str | None
    csv_delimiter: str

    def __repr__(self) -> str:  # the landing zone URI may carry an S3 secret key
        from persist_lib.location.redaction import redacted_dataclass_repr

        return redacted_dataclass_repr(self)

    @classmethod
    def of(cls, s: LandingZoneSource) -> _SourceSpec:
        return cls(s.uri, s.format, s.pattern, s.csv_delimiter)


class _Predecoded(Chunk):
    """A chunk whose decoding was done elsewhere (on an executor)."""

    def __init__(self, chunk: Chunk, decoded: Decoded) -> None:
        self.partition = chunk.partition
        self.start = chunk.start
        self.end = chunk.end
        self.num_records = chunk.num_records
        self.num_blank = chunk.num_blank
        self.nbytes = chunk.nbytes
        self.notes = chunk.notes
        self._decoded = decoded

    def split(self, at: Address) -> tuple[Chunk | None, Chunk | None]:
        raise NotImplementedError("a pre-decoded chunk is only applied, never split")

    def take(self, n: int) -> tuple[Chunk, Chunk | None]:
        raise NotImplementedError("a pre-decoded chunk is only applied, never split")

    def decode(self, spec: DecodeSpec) -> Decoded:
        return self._decoded


def _decode_task(
    src: _SourceSpec, spec: DecodeSpec, ranges: Iterable[_FileRange]
) -> Iterator[tuple[int, int, Decoded]]:
    """Executor: re-reads each file once, checks it, decodes its ranges like the driver."""
    from persist_lib.ingest.landing_zone.files import Unreadable, parse_file

    source = LandingZoneSource(src.uri, format=src.format, pattern=src.pattern, csv_delimiter=src.csv_delimiter)
    parsed: Any = None
    current = None
    for r in sorted(ranges, key=lambda r: (r.file, r.r0)):
        if r.file != current:
            current = r.file
            try:
                data = source._store.read(r.file)
                parsed = parse_file(r.file, data, source.format_for(r.file) or "jsonl", csv_delimiter=src.csv_delimiter)
            except (FileNotFoundError, Unreadable) as e:
                raise SourceDataGone(
                    f"landing zone {source.describe()['uri']}: file {r.file!r} was readable by the driver but not on a "
                    f"Spark executor ({type(e).__name__}: {e}); landed files must not change"
                ) from e
            if parsed.rows != r.rows or parsed.size != r.size:
                raise SourceDataGone(
                    f"landing zone {source.describe()['uri']}: file {r.file!r} has {parsed.rows} rows / {parsed.size} "
                    f"bytes on the executor but {r.rows} rows / {r.size} bytes on the driver; landed "
                    "files must not change"
                )
        yield r.index, r.piece, FileChunk(r.file, parsed, r.r0, r.r1).decode(spec)


AfterRead = Callable[[int, int, int], None]  # (partition, start, end) -> None


def _kafka_task(
    settings: dict[str, Any], envelope: str, spec: DecodeSpec, after_read: AfterRead | None,
    ranges: Iterable[_OffsetRange],
) -> Iterator[tuple[int, int, tuple[Decoded, int, int]]]:
    """Executor: reads each bound offset range with its own consumer and decodes it as the
    driver would; returns the messages found and their value bytes beside the result."""
    src = KafkaSource(**settings)
    src.bind_envelope(envelope)
    for r in ranges:
        msgs = read_range(src, r.partition, r.start, r.end)
        if after_read is not None:
            after_read(r.partition, r.start, r.end)
        nbytes = sum(map(len, filter(None, msgs.vals)))
        yield r.index, r.piece, (src.decode_messages(str(r.partition), msgs, spec), len(msgs), nbytes)


_TASK_ERROR = re.compile(r"\[persist-task-error:([A-Za-z0-9+/=]+)\]")
_ERROR_FIELDS = ("topic", "partition", "offset", "low", "high")


def _task_error_text(e: IngestError) -> str:
    """A typed ingestion error as a tag that survives Spark's task failure text."""
    doc = {
        "type": type(e).__name__,
        "message": str(e),
        "fields": {k: getattr(e, k) for k in _ERROR_FIELDS if hasattr(e, k)},
    }
    return f"[persist-task-error:{base64.b64encode(json.dumps(doc).encode()).decode()}]"


def task_error(e: BaseException) -> IngestError | None:
    """The typed ingestion error a failed Spark job carries (see ``_task_error_text``)."""
    m = _TASK_ERROR.search(str(e))
    if m is None:
        return None
    try:
        doc = json.loads(base64.b64decode(m.group(1)))
    except ValueError:
        return None
    cls = getattr(ingest_errors, str(doc.get("type")), None)
    if not (isinstance(cls, type) and issubclass(cls, IngestError)):
        return None
    err = cls.__new__(cls)
    Exception.__init__(err, str(doc.get("message")))
    for k, v in dict(doc.get("fields") or {}).items():
        if k in _ERROR_FIELDS:
            setattr(err, k, v)
    return err


def _decoder(
    task: Callable[[Any], Iterable[tuple[int, int, Any]]], tasks: list[list[Any]]
) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """The ``mapInArrow`` function: task ``i`` runs ``task(tasks[i])`` and returns each
    result pickled (as an RDD ``collect`` would), in pieces."""

    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for t in task_ids(batches):
            try:
                for index, piece, result in task(tasks[t]):
                    data = pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
                    pieces = binary_rows(data, RESULT_PIECE_BYTES)
                    n = len(pieces)
                    yield pa.RecordBatch.from_pydict(
                        {"idx": [index] * n, "piece": [piece] * n, "seq": list(range(n)), "data": pieces},
                        schema=_RESULT_ARROW,
                    )
            except IngestError as e:
                raise RuntimeError(_task_error_text(e)) from e

    return run


def _unpickle_results(table: pa.Table) -> list[tuple[int, int, Any]]:
    """The rows of ``_decoder``'s output back as ``(index, piece, Decoded)``."""
    chunks: dict[tuple[int, int], list[tuple[int, bytes]]] = {}
    data = table.column("data")
    keys = zip(
        table.column("idx").to_pylist(), table.column("piece").to_pylist(), table.column("seq").to_pylist(),
        strict=True,
    )
    for j, (i, p, q) in enumerate(keys):
        chunks.setdefault((i, p), []).append((q, data[j].as_py()))
    out = []
    for (i, p), pieces in chunks.items():
        blob = b"".join(d for _, d in sorted(pieces, key=lambda x: x[0]))
        out.append((i, p, pickle.loads(blob)))
    return out


class SparkIngestion(Ingestion):
    """``ingest.Ingestion`` whose bound records are decoded by Spark executors.

    Takes the ``Ingestion`` arguments plus ``spark``, ``records_per_job`` (bound
    records decoded per Spark job: the driver holds one job's decoded rows at a
    time), ``min_piece_records`` (a bound range is decoded in pieces of at least this
    many records, so one large file still spreads over the executors) and
    ``parallelism`` (a job has ``2 * parallelism`` tasks; default: the session's, see
    ``_common.default_parallelism``). ``spark`` may be a classic or a Spark Connect
    session. ``after_read`` (tests): called in a Kafka task after it read a range
    ``(partition, start, end)``, before decoding it -- where the fault tests kill the worker.
    """

    def __init__(
        self,
        spark: Any,
        client: PersistClient,
        name: str,
        source: LandingZoneSource | KafkaSource,
        key_schema: pa.Schema,
        val_schema: pa.Schema,
        *,
        records_per_job: int = DEFAULT_RECORDS_PER_JOB,
        min_piece_records: int = MIN_PIECE_RECORDS,
        parallelism: int | None = None,
        after_read: AfterRead | None = None,
        **kwargs: Any,
    ) -> None:
        if isinstance(source, KafkaSource):
            # (a copy that reads offset ranges; the caller's source object is left as it is)
            source = dataclasses.replace(source, ranges=True)
        elif not isinstance(source, LandingZoneSource):
            raise IngestConfigError(
                f"Spark ingestion reads file landing zones (LandingZoneSource) and Kafka topics "
                f"(KafkaSource), got {type(source).__name__}; ingest other sources with ingest.Ingestion"
            )
        found = rule_problems(
            SPARK_INGEST_RULES,
            {"records_per_job": records_per_job, "min_piece_records": min_piece_records, "parallelism": parallelism},
            {"records_per_job": DEFAULT_RECORDS_PER_JOB, "min_piece_records": MIN_PIECE_RECORDS, "parallelism": None},
        )
        if found:
            raise InvalidIngestConfig(found, what="SparkIngestion options")
        super().__init__(client, name, source, key_schema, val_schema, **kwargs)
        self.spark = spark
        self.parallelism = parallelism
        self.after_read = after_read
        self._zone = source if isinstance(source, LandingZoneSource) else None
        self._kafka = source if isinstance(source, KafkaSource) else None
        self.records_per_job = records_per_job
        self.min_piece_records = min_piece_records
        self._group: list[tuple[Binding, list[Chunk]]] = []
        self._group_records = 0
        self._collected_t = 0
        self._defer = False
        self.spark_stats: dict[str, Any] = {
            "jobs": 0, "tasks": 0, "chunks_on_executors": 0, "chunks_on_driver": 0,
            "records_on_executors": 0, "decode_seconds": 0.0,
        }

    # ----- the recipe's step 4, with decoding moved to Spark --------------------------
    #
    # ``_catch_up`` only *collects* the chunks of newly bound ranges (reading them off the
    # source exactly as Ingestion._catch_up does); ``_drain`` decodes a group on Spark and
    # applies it binding by binding, with Ingestion's flush rule. In ``run_once`` groups
    # span several minting rounds (one Spark job per ``records_per_job`` records, not one
    # per binding); ``run`` drains after every round to keep latency low.

    def _catch_up(self) -> None:
        remap = self.remap
        start = max(self._t, self._collected_t)
        for b in remap.bindings_between(start, remap.upper):
            self.reader.add_notes(b.notes)
            chunks = self._take_upto(b.frontier)
            self._group.append((b, chunks))
            self._group_records += sum(c.num_records for c in chunks)
        self._collected_t = max(self._collected_t, remap.upper)
        if not self._defer or self._group_records >= self.records_per_job:
            self._drain()

    def _drain(self) -> None:
        group, upper = self._group, self._collected_t
        self._group, self._group_records = [], 0
        acc = _Acc()
        if group:
            decoded = self._decode([c for _, cs in group for c in cs])
            i = 0
            for b, chunks in group:
                pre: list[Chunk] = []
                for c in chunks:
                    pre.append(_Predecoded(c, decoded[i]))
                    i += 1
                self._apply(b, pre, acc)
                if acc.records >= self.config.max_append_records:
                    self._flush(acc, b.time + 1)
        self._flush(acc, upper)

    def _resync(self) -> None:
        super()._resync()
        self._group, self._group_records = [], 0
        self._collected_t = self._t

    def run_once(self, *, max_records: int | None = None) -> dict[str, Any]:
        """``Ingestion.run_once`` with bound records decoded in few, large Spark jobs."""
        check_session(self.spark, f"Spark ingestion {self.name!r}")
        self._defer = True
        try:
            self._begin()  # (the summary describes this run only)
            self.spark_stats = {k: type(v)() for k, v in self.spark_stats.items()}
            advanced = False
            while True:
                self._guarded(self._catch_up)
                done = self._stats.records + self._group_records
                if max_records is not None and done >= max_records:
                    break
                r = self._guarded(functools.partial(self._mint, advance_time=not advanced))
                if r == "advance":
                    advanced = True
                elif r == "idle":
                    break
            self._guarded(self._catch_up)
            self._guarded(self._drain)
        finally:
            self._defer = False
        self._report(done=True)
        return self.summary(mode="once")

    def _decode(self, chunks: list[Chunk]) -> list[Decoded]:
        """Decodes ``chunks`` (in order): file and offset ranges on executors, trivial ones here."""
        check_session(self.spark, f"Spark ingestion {self.name!r}")
        t0 = time.monotonic()
        out: list[Decoded | None] = [None] * len(chunks)
        files: list[tuple[int, FileChunk]] = []
        ranges: list[tuple[int, KafkaRangeChunk]] = []
        for i, c in enumerate(chunks):
            if isinstance(c, FileChunk) and c.num_records > 0 and not isinstance(c.parsed, _UnreadableFile):
                files.append((i, c))
            elif isinstance(c, KafkaRangeChunk) and c.num_records > 0:
                ranges.append((i, c))
            else:  # (unreadable files, empty ranges, Kafka messages the driver fetched itself)
                out[i] = c.decode(self.spec)
                self.spark_stats["chunks_on_driver"] += 1
        if files:
            self._decode_files(files, out)
        if ranges:
            self._decode_ranges(ranges, out)
        missing = [i for i, d in enumerate(out) if d is None]
        if missing:
            raise AssertionError(f"chunks {missing[:5]} were not decoded")
        self.spark_stats["decode_seconds"] += time.monotonic() - t0
        return [d for d in out if d is not None]

    def _piece(self, total: int) -> tuple[int, int]:
        """(tasks per job, records per piece) for a job of ``total`` records."""
        par = default_parallelism(self.spark, self.parallelism) * 2
        return par, max(self.min_piece_records, -(-total // par))

    def _run_job(self, task: Callable[[Any], Iterable[tuple[int, int, Any]]], tasks: list[list[Any]]) -> list[tuple[int, int, Any]]:
        """One Spark job of ``tasks``; a typed ingestion error of a task is raised as such."""
        try:
            table = task_frame(self.spark, len(tasks)).mapInArrow(_decoder(task, tasks), _RESULT_SCHEMA).toArrow()
        except Exception as e:
            typed = task_error(e)
            if typed is not None:
                raise typed from None
            raise
        st = self.spark_stats
        st["jobs"] += 1
        st["tasks"] += len(tasks)
        return _unpickle_results(table)

    def _decode_files(self, todo: list[tuple[int, FileChunk]], out: list[Decoded | None]) -> None:
        assert self._zone is not None
        from persist_lib.spark.executors import prepare_executors

        prepare_executors(self.spark, blob_uri=self._zone.uri)
        total = sum(c.num_records for _, c in todo)
        par, piece = self._piece(total)
        # Decoding is row-wise (a record decodes the same in any chunk), so a large
        # range may be decoded in pieces and the pieces concatenated in order.
        ranges = [
            _FileRange(i, n, c.file, r0, min(r0 + piece, c.r1), c.parsed.rows, c.parsed.size)
            for i, c in todo
            for n, r0 in enumerate(range(c.r0, c.r1, piece))
        ]
        src, spec = _SourceSpec.of(self._zone), self.spec
        results = self._run_job(
            functools.partial(_decode_task, src, spec),
            _tasks(ranges, par, key=lambda r: (r.file, r.r0), size=lambda r: r.r1 - r.r0),
        )
        pieces: dict[int, list[tuple[int, Decoded]]] = {}
        for i, n, d in results:
            pieces.setdefault(i, []).append((n, d))
        for i, ps in pieces.items():
            out[i] = _combine([d for _, d in sorted(ps, key=lambda x: x[0])], self.spec)
        self.spark_stats["chunks_on_executors"] += len(todo)
        self.spark_stats["records_on_executors"] += total

    def _decode_ranges(self, todo: list[tuple[int, KafkaRangeChunk]], out: list[Decoded | None]) -> None:
        """Kafka offset ranges: one task per (partition, offset range) piece."""
        src = self._kafka
        assert src is not None
        from persist_lib.spark.executors import prepare_executors

        prepare_executors(self.spark, modules=("confluent_kafka",))
        total = sum(c.num_records for _, c in todo)
        par, piece = self._piece(total)
        ranges = [
            _OffsetRange(i, n, int(c.partition), s, min(s + piece, int(c.end[0])))
            for i, c in todo
            for n, s in enumerate(range(int(c.start[0]), int(c.end[0]), piece))
        ]
        results = self._run_job(
            functools.partial(_kafka_task, src.settings(), self.envelope.kind, self.spec, self.after_read),
            _tasks(ranges, par, key=lambda r: (r.partition, r.start), size=lambda r: r.end - r.start),
        )
        pieces: dict[int, list[tuple[int, tuple[Decoded, int, int]]]] = {}
        for i, n, r in results:
            pieces.setdefault(i, []).append((n, r))
        chunks = dict(todo)
        found = 0
        for i, ps in pieces.items():
            parts = [r for _, r in sorted(ps, key=lambda x: x[0])]
            out[i] = _combine([d for d, _, _ in parts], self.spec)
            c = chunks[i]
            c.num_records = sum(n for _, n, _ in parts)  # (messages found: offsets may have gaps)
            c.nbytes = sum(b for _, _, b in parts)
            found += c.num_records
        self.spark_stats["chunks_on_executors"] += len(todo)
        self.spark_stats["records_on_executors"] += found

    def summary(self, mode: str) -> dict[str, Any]:
        s = super().summary(mode)
        s["spark"] = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in self.spark_stats.items()}
        return s


def _tasks(items: list[Any], n: int, *, key: Callable[[Any], Any], size: Callable[[Any], int]) -> list[list[Any]]:
    """Items in ``key`` order cut into about ``n`` contiguous groups of about equal
    ``size`` (so a task mostly parses the files it needs once)."""
    ordered = sorted(items, key=key)
    total = sum(size(r) for r in ordered)
    per = max(1, -(-total // max(1, n)))
    tasks: list[list[Any]] = [[]]
    acc = 0
    for r in ordered:
        if acc >= per and tasks[-1]:
            tasks.append([])
            acc = 0
        tasks[-1].append(r)
        acc += size(r)
    return tasks


def _combine(decs: list[Decoded], spec: DecodeSpec) -> Decoded:
    """The pieces of one chunk's decoding, concatenated in row order."""
    if len(decs) == 1:
        return decs[0]
    rows = [d.rows for d in decs]
    schema = rows[0].schema
    raws = [d.raw for d in decs if d.raw is not None]
    return Decoded(
        pa.concat_tables([r if r.schema.equals(schema) else r.cast(schema) for r in rows]),
        [e for d in decs for e in d.errors],
        pa.concat_tables(raws) if raws else None,
    )


def ingest_kafka(
    spark: Any,
    client: PersistClient,
    name: str,
    source: KafkaSource,
    key_schema: pa.Schema,
    val_schema: pa.Schema,
    **kwargs: Any,
) -> dict[str, Any]:
    """One ``SparkIngestion(...).run_once()`` of a Kafka topic, handles released afterwards."""
    max_records = kwargs.pop("max_records", None)
    with SparkIngestion(spark, client, name, source, key_schema, val_schema, **kwargs) as ing:
        return ing.run_once(max_records=max_records)


def ingest_landing_zone(
    spark: Any,
    client: PersistClient,
    name: str,
    source: LandingZoneSource,
    key_schema: pa.Schema,
    val_schema: pa.Schema,
    **kwargs: Any,
) -> dict[str, Any]:
    """One ``SparkIngestion(...).run_once()`` with its handles released afterwards.

    The Spark counterpart of ``ingest.run_once``; the summary has a ``spark`` entry.
    """
    max_records = kwargs.pop("max_records", None)
    with SparkIngestion(spark, client, name, source, key_schema, val_schema, **kwargs) as ing:
        return ing.run_once(max_records=max_records)

