"""The compactor: a streaming k-way merge of sorted runs under a memory budget.

A *run* is a sequence of parts whose rows are sorted across part boundaries. A batch
written by a user is a set of runs of one part each (``BatchBuilder`` sorts each part
on its own); a batch written by this compactor is one run (its writer id starts with
``COMPACTOR_WRITER_PREFIX``). That is only a hint: crossing a part boundary inside a
run checks the order, and a violation restarts the merge with one run per part.

**Memory.** Every part is verified (SHA-256 of the whole blob) before a byte of it is
decoded, then decoded whole and its encoded bytes dropped (Arrow's Parquet reader
materializes a row group's decompressed column chunks even for small record batches,
and our parts are one row group: "incremental" reads would save nothing). So memory is
bounded by the number of parts open at once — one per run — as in Materialize: the
merge holds per run its decoded part, a buffer of chunks sliced from it, and its share
of one merge step's working set (ranks, sort order, the emitted copy), and the output
goes through a ``BatchBuilder`` with a small part target. The smallest runs, up to
1/16 of the budget decoded, are first folded into one in-memory run by a single
vectorized consolidate (a k-way merge of hundreds of tiny runs would spend a step per
few rows). When the remaining runs don't fit the budget together they are merged in
groups first (as many of the smallest runs as fit; the intermediate runs are written
to blob and deleted afterwards). What the open parts leave of the budget is shared by
the runs' chunks in proportion to their row counts, so a huge run next to small ones
advances in big chunks. ``MergeStats`` records the most rows and bytes held at once,
which tests assert on and the benchmark compares with the process's RSS.

**One merge step.** Let ``F`` be the smallest *last* buffered row over the runs that
have more input: every future row of every run is ``>= F``, so all buffered rows
``< F`` can be emitted, consolidated (equal ``(k, v, t)`` summed; zeros dropped).
Rows are compared by ``ranks.row_keys`` ranks computed over one concatenation,
which is what makes rows of different chunks comparable. Times below ``since`` are
forwarded to ``since`` as chunks are read; forwarding is monotone, so runs stay sorted.

**Applying.** The output is written under a part writer registered for the merge
(``persist_lib.shard.part_writers``), so the leaked-blob sweeper leaves it alone however
long the merge runs. One ``apply_merge_res`` transition replaces exactly the inputs
and releases that registration. If it doesn't apply (the inputs changed), the
output's blobs are deleted; if applying fails in a way that leaves its outcome
unknown, the output is kept (a leak, for the sweeper, beats a dangling reference).
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from persist_lib.config import PersistConfig
from persist_lib.errors import BlobNotFound, CorruptionError, ExternalError, InvalidUsage
from persist_lib.frontier import Antichain
from persist_lib.location.base import Blob
from persist_lib.shard import maintenance_transitions as mt
from persist_lib.shard.batch_builder import BatchBuilder
from persist_lib.shard.batch_meta import HollowBatch, PartMeta
from persist_lib.shard.codec import D_COL, T_COL, Schemas, internal_schema
from persist_lib.shard.consolidate import consolidate, consolidation_plan, gather_updates
from persist_lib.shard.kernels import RowSource
from persist_lib.shard.machine import Machine
from persist_lib.shard.part_writers import PartWriter
from persist_lib.shard.parts import (
    FORMAT_VERSION,
    META_FORMAT,
    META_SCHEMAS,
    check_part_strings,
    part_blob_key,
    verify_part_bytes,
)
from persist_lib.shard.ranks import row_keys, row_keys_with_hint, to_numpy
from persist_lib.shard.sorted_checks import (
    SORTED_WITH_TIES,
    UNSORTED,
    count_less,
    linear_kernels_apply,
    sorted_state,
)
from persist_lib.shard.spine import CompactionRequest
from persist_lib.shard.time_filters import advance_to_since, time_range

if TYPE_CHECKING:  # pragma: no cover
    from persist_lib.handles.client import PersistClient

log = logging.getLogger(__name__)

COMPACTOR_WRITER_PREFIX = "cmp-"
MiB = 1 << 20


_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _upload_pool() -> ThreadPoolExecutor:
    """One process-wide pool for output part uploads (a pool per merge costs more than
    a small merge itself). Builders bound their own in-flight uploads."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=4, thread_name_prefix="persist-compactor-upload")
        return _POOL


class _DecodedCache:
    """Decoded small parts by (SHA-256, schemas): a merge's output is often the next
    merge's input, and decoding a tiny Parquet file costs more than merging it. Only a
    lookup *after* the fetched bytes passed their checksum may use it."""

    def __init__(self, max_bytes: int = 16 * MiB, max_entry: int = 1 * MiB) -> None:
        self.max_bytes = max_bytes
        self.max_entry = max_entry
        self._d: OrderedDict[tuple[str, str], pa.Table] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0

    def get(self, sha: str, fp: str) -> pa.Table | None:
        with self._lock:
            t = self._d.get((sha, fp))
            if t is not None:
                self._d.move_to_end((sha, fp))
                self.hits += 1
            return t

    def put(self, sha: str, fp: str, t: pa.Table) -> None:
        n = t.nbytes
        if n > self.max_entry:
            return
        with self._lock:
            if (sha, fp) in self._d:
                return
            self._d[(sha, fp)] = t
            self._bytes += n
            while self._bytes > self.max_bytes and self._d:
                _, old = self._d.popitem(last=False)
                self._bytes -= old.nbytes


_DECODED = _DecodedCache()


def _missing_part(shard: str, key: str, purpose: str) -> BlobNotFound:
    if purpose == "compaction":
        return BlobNotFound(
            f"shard {shard}: compaction input part {key} is missing (it was garbage "
            "collected: the inputs were replaced meanwhile); the merge is abandoned"
        )
    return BlobNotFound(
        f"shard {shard}: part {key} is missing ({purpose}): it was deleted (garbage collected "
        "while still referenced?) or never written; re-read the shard state and retry"
    )


def fetch_part_bytes(blob: Blob, p: PartMeta, shard: str, purpose: str = "compaction") -> bytes:
    """A part's encoded bytes (inline or from blob), not yet verified."""
    if p.inline is not None:
        return p.inline
    if p.key is None:
        raise CorruptionError(f"shard {shard}: part metadata has neither a blob key nor inline bytes: {p}")
    got = blob.get(p.key)
    if got is None:
        raise _missing_part(shard, p.key, purpose)
    return got


def fetch_small_part(
    blob: Blob, p: PartMeta, schemas: Schemas, shard: str, purpose: str = "compaction"
) -> pa.Table:
    """``parts.fetch_part`` for small parts, with the decoded-part cache behind the
    checksum: the bytes are always fetched and verified first."""
    data = fetch_part_bytes(blob, p, shard, purpose)
    verify_part_bytes(data, expected_sha256=p.sha256, expected_size=p.size, shard=shard, key=p.location)
    fp = schemas.fingerprint()
    hit = _DECODED.get(p.sha256, fp)
    if hit is not None:
        return hit
    t = decode_whole(data, p, schemas, shard)
    _DECODED.put(p.sha256, fp, t)
    return t


def _release_unused() -> None:
    """Hands freed pages back to the OS (Arrow's mimalloc/jemalloc pools and glibc keep
    them otherwise, and RSS then grows well past what is live). Called once per part
    loaded: cheap next to decoding a part."""
    try:
        pa.default_memory_pool().release_unused()
    except Exception:  # noqa: BLE001 - best effort, older pyarrow
        pass
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _load_libc() -> Any:
    try:
        import ctypes
        import ctypes.util

        name = ctypes.util.find_library("c")
        lib = ctypes.CDLL(name) if name else None
        return lib if lib is not None and hasattr(lib, "malloc_trim") else None
    except OSError:
        return None


_LIBC = _load_libc()


def new_compactor_writer_id() -> str:
    return f"{COMPACTOR_WRITER_PREFIX}{uuid.uuid4()}"


def _writer_of(key: str) -> str:
    parts = key.split("/")
    return parts[1] if len(parts) >= 3 else ""


# ----- memory plan ----------------------------------------------------------------------


# Bytes of numpy working set per row in one merge step (row ranks, combined keys,
# sort order, run boundaries, sums, take indices: about 20 int64 arrays).
STEP_BYTES_PER_ROW = 160


@dataclass(frozen=True)
class MemoryPlan:
    """How a budget is split: output part size, the room runs may use, the step room."""

    budget: int
    output_part_bytes: int
    room: int  # for the runs of one pass: decoded parts held + buffers + one step
    step_bytes: int  # for the buffers and step working set of all runs of a pass together

    @classmethod
    def for_runs(
        cls, budget: int, run_decoded: list[int], max_part_encoded: int, target_part_bytes: int,
    ) -> MemoryPlan:
        """Output parts get 1/32 of the budget: the builder holds ~3.5 of them as Arrow
        data and re-consolidates each one as it flushes (numpy ranks and sort order,
        ~160 bytes per row), ~8 output parts' worth in all (25% of the budget).
        60% is for the runs: per open run its decoded part (``run_decoded``: the largest
        part's estimate, per run) plus at least ``MIN_RUN_BYTES`` of buffered chunks and
        step working set, and once the encoded bytes of a part being decoded. Whatever
        the open parts leave of that room goes to the steps (bigger chunks mean fewer,
        cheaper merge steps). When the parts alone exceed the budget (parts as large as
        the budget), steps still get ``budget / 16``: the budget is exceeded anyway and
        tiny steps would only make the merge slow."""
        if budget < 1 * MiB:
            raise InvalidUsage(f"compaction memory budget must be >= 1 MiB, got {budget} bytes")
        out = max(16 << 10, min(target_part_bytes, budget // 32))
        # Decoding a part briefly holds its encoded bytes and a second decoded copy
        # (Parquet's column chunks): the encoded bytes come out of the runs' room, the
        # copy out of the 40% left beside runs and output.
        room = int(budget * 0.6) - max_part_encoded
        k = max(1, len(run_decoded))
        free = room - sum(run_decoded)
        if free >= k * MIN_RUN_BYTES:
            step = min(k * 64 * MiB, free // 2)
        else:
            step = max(k * MIN_RUN_BYTES, budget // 16)
        return cls(budget, out, room, step)

    def fits(self, run_decoded: list[int]) -> bool:
        """Whether these runs can be merged in one pass within the room."""
        return sum(run_decoded) + len(run_decoded) * MIN_RUN_BYTES <= self.room


# Parts decoded one at a time and at least this large use Arrow's threads.
PARALLEL_DECODE_BYTES = 256 << 10
# The least a run gets for its buffered chunks and its share of a step.
MIN_RUN_BYTES = 256 << 10
# Rows per step chunk, per byte of a row (buffered ~1.5 chunks, plus ~1.5 chunks of step
# working set): see ``_Merger.chunk_rows``.
MIN_CHUNK_ROWS = 64


def estimate_decoded_bytes(p: PartMeta, schemas: Schemas) -> int:
    """Arrow bytes of a decoded part, before decoding it: fixed-width fields exactly,
    variable-width ones from the part's encoded bytes per row (compressed data expands
    ~2-4x; we take 4x to be safe), and never less than what its writer measured
    (``PartMeta.decoded``): repetitive strings compress far more than 4x (~300:1 for
    long repeated ones), and merges planned with the guess alone held several times
    their budget."""
    fixed, variable = _row_layout(schemas)
    per_row_var = 4.0 * p.size / max(p.count, 1) if variable else 0.0
    guess = int(p.count * (fixed + per_row_var)) + 4096
    return guess if p.decoded is None else max(guess, p.decoded + 4096)


@functools.lru_cache(maxsize=256)
def _row_layout(schemas: Schemas) -> tuple[int, int]:
    """(fixed bytes per row, number of variable-width fields) of the internal layout."""
    fixed = 0
    variable = 0
    for f in internal_schema(schemas):
        bw = _byte_width(f.type)
        if bw is None:
            variable += 1
            fixed += 4  # offsets
        else:
            fixed += bw
    return fixed, variable


def _byte_width(t: pa.DataType) -> int | None:
    if pa.types.is_boolean(t):
        return 1
    try:
        return int(t.bit_width) // 8 if t.bit_width >= 8 else 1
    except ValueError:
        return None


@dataclass
class MergeStats:
    """What a merge did; ``peak_*`` are the most held at once (the memory bound)."""

    runs: int = 0
    passes: int = 0
    fan_in: int = 0
    rows_read: int = 0  # including re-reads of intermediate runs
    output_rows: int = 0
    bytes_read: int = 0
    bytes_written: int = 0  # output parts (blob or inline), including intermediate runs
    intermediate_bytes: int = 0
    peak_rows_held: int = 0
    peak_bytes_held: int = 0  # run buffers, encoded parts held, one step's working set
    output_reserve_bytes: int = 0  # what the output builder may hold (~8 output parts)
    steps: int = 0
    restarted_per_part: bool = False
    unsorted_parts_sorted: int = 0  # parts a bulk write stored unsorted, sorted on load

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


class _RunOrderViolation(Exception):
    """Parts assumed to form one sorted run don't; merge again with a run per part."""


# ----- reading runs ---------------------------------------------------------------------


def _corrupt(shard: str, key: str, what: str) -> CorruptionError:
    return CorruptionError(
        f"shard {shard}: part {key}: {what}; the blob was altered or truncated; nothing was "
        "returned. Stop and investigate the blob store (do not retry blindly)"
    )


def _raw_to_internal(raw: pa.Table, schemas: Schemas, target: pa.Schema, shard: str, key: str) -> pa.Table:
    """Flattens a decoded Parquet slice (``k``/``v`` structs) into the internal layout
    (the same mapping ``parts.decode_part`` applies to a whole part)."""
    try:
        cols: list[pa.ChunkedArray] = list(raw.column("k").flatten())
        if len(schemas.val):
            cols += raw.column("v").flatten()
        cols += [raw.column(T_COL), raw.column(D_COL)]
        if len(cols) != len(target):
            raise ValueError(f"{len(cols)} fields, expected {len(target)}")
        out = []
        for col, f in zip(cols, target, strict=True):
            if str(col.type) != str(f.type):
                col = pc.cast(col, f.type, safe=True)
            out.append(col)
        table = pa.Table.from_arrays(out, schema=target)
    except Exception as e:
        raise _corrupt(shard, key, f"part does not match {schemas.describe()} ({e})") from e
    if table.column(T_COL).null_count or table.column(D_COL).null_count:
        raise _corrupt(shard, key, "null times or diffs")
    return table


def _open_verified(data: bytes, part: PartMeta, schemas: Schemas, shard: str) -> pq.ParquetFile:
    """Verifies a part's bytes (size and SHA-256) and its Parquet metadata, then opens it."""
    key = part.location
    verify_part_bytes(data, expected_sha256=part.sha256, expected_size=part.size, shard=shard, key=key)
    try:
        pf = pq.ParquetFile(pa.BufferReader(data), pre_buffer=False)
        meta = pf.schema_arrow.metadata or {}
    except Exception as e:
        raise _corrupt(shard, key, f"cannot decode Parquet ({type(e).__name__}: {e})") from e
    if meta.get(META_FORMAT) != FORMAT_VERSION.encode():
        raise _corrupt(shard, key, f"unknown part format {meta.get(META_FORMAT)!r}")
    if meta.get(META_SCHEMAS) != schemas.fingerprint().encode():
        raise _corrupt(shard, key, f"part was written for other schemas than {schemas.describe()}")
    expected_cols = ["k", "v", T_COL, D_COL] if len(schemas.val) else ["k", T_COL, D_COL]
    if pf.schema_arrow.names != expected_cols:
        raise _corrupt(shard, key, f"columns {pf.schema_arrow.names}, expected {expected_cols}")
    return pf


def decode_whole(
    data: bytes, part: PartMeta, schemas: Schemas, shard: str, *, use_threads: bool = False
) -> pa.Table:
    """Verifies and decodes a whole (small) part into the internal layout.

    Same checks as ``parts.decode_part`` but through ``ParquetFile.read``, which costs
    ~0.3 ms for a tiny part against ~2 ms for ``pq.read_table`` (dataset machinery).
    ``use_threads``: decode columns in parallel (Arrow's pool), for a part decoded
    while nothing else is (a ~1 MB part: 1.7x faster).
    """
    pf = _open_verified(data, part, schemas, shard)
    try:
        raw = pf.read(use_threads=use_threads)
    except Exception as e:
        raise _corrupt(shard, part.location, f"cannot decode Parquet ({type(e).__name__}: {e})") from e
    table = _raw_to_internal(raw, schemas, internal_schema(schemas), shard, part.location)
    check_part_strings(table, schemas, shard, part.location)  # (never merged into a new part)
    return table


def _consolidate_sorted_equal(t: pa.Table) -> pa.Table:
    """Collapses a table whose rows are all equal in ``(k, v, t)`` to one row (or none)."""
    if t.num_rows <= 1:
        return t if t.num_rows == 0 or t.column(D_COL)[0].as_py() != 0 else t.slice(0, 0)
    total = int(np.sum(to_numpy(t.column(D_COL)), dtype=np.int64))
    if total == 0:
        return t.slice(0, 0)
    one = t.slice(0, 1)
    di = one.schema.get_field_index(D_COL)
    return one.set_column(di, one.schema.field(di), pa.array([total], pa.int64()))


def _has_adjacent_equal_rows(t: pa.Table) -> bool:
    """Whether two neighbouring rows of ``t`` (sorted by ``(k, v, t)``) may be equal in
    ``(k, v, t)``: in a sorted table equal rows are neighbours, so when none are, the
    table is already consolidated (given nonzero diffs) and consolidating it again —
    a sort — would change nothing. A linear, vectorized comparison; conservative (True)
    for nested types. Equality here may differ from the ranking's on floats (NaN, -0.0):
    a missed duplicate is summed by the merge step anyway."""
    n = t.num_rows
    if n < 2:
        return False
    names = [T_COL] + [c for c in t.column_names if c not in (T_COL, D_COL)]
    mask: pa.ChunkedArray | pa.Array | None = None
    for name in names:
        col = t.column(name)
        if pa.types.is_nested(col.type):
            return True
        a, b = col.slice(0, n - 1), col.slice(1)
        try:
            eq = pc.equal(a, b)
            if col.null_count:
                eq = pc.or_kleene(pc.fill_null(eq, False), pc.and_(pc.is_null(a), pc.is_null(b)))
            mask = eq if mask is None else pc.and_(mask, eq)
            if not pc.any(mask).as_py():
                return False
        except (pa.ArrowNotImplementedError, pa.ArrowInvalid, pa.ArrowTypeError):
            return True  # a type Arrow can't compare: consolidate to be sure
    return True


def _consolidate(t: pa.Table) -> pa.Table:
    from persist_lib.shard.consolidate import consolidate

    return consolidate(t)


class _Run:
    """A sorted run being read part by part, chunk by chunk, with its buffer of
    not-yet-emitted rows.

    A part is verified and decoded whole, then its encoded bytes are dropped: Arrow's
    Parquet reader materializes a row group's decompressed column chunks even when
    asked for small record batches (measured: 2.2 MB held to yield 2,000 rows of a
    2.3 MB column chunk), and our parts are one row group, so reading them
    "incrementally" saves nothing. The merge bounds memory instead by the number of
    parts open at once (one per run) and chunked merges.
    """

    def __init__(self, merger: _Merger, src: RunSource, check_order: bool) -> None:
        self.m = merger
        self.parts = src.parts or []
        self.total_rows = src.rows  # for this run's share of a step
        self.check_order = check_order
        self.next_part = 0
        self.part: pa.Table | None = None  # the decoded current part
        self.offset = 0
        self.part_bytes = 0  # decoded bytes of the current part
        self.prev_last: pa.Table | None = None  # last row of the previous part (order check)
        self.buf: pa.Table | None = None
        self.exhausted = False
        self._first_of_part = False
        self.spill = src.spill
        # Whether the current part's chunks need the time filter (spilled and folded
        # runs were filtered when they were made; a part whose times lie inside the
        # range needs none).
        self._filter = False
        # Whether forwarding can make rows of the current part equal: not if the part
        # holds one time (it is consolidated, so its (k, v) are distinct).
        self._may_collide = True
        self._tied_with_prev = False  # (linear kernels) the last chunk's first row = the row before
        self._spill_file: pa.OSFile | None = None
        self._spill_reader: pa.ipc.RecordBatchFileReader | None = None
        if src.table is not None:  # already decoded (small runs folded in memory)
            self.part, self.part_bytes = src.table, src.table.nbytes
            self._first_of_part = True

    @property
    def rows(self) -> int:
        return 0 if self.buf is None else self.buf.num_rows

    def held_bytes(self) -> int:
        """The decoded part plus buffered rows (counted as copies: an upper bound)."""
        return self.part_bytes + int(self.rows * self.m.row_width)

    def close(self) -> None:
        """Drops the decoded data and closes a spilled run's file."""
        self.part = self.buf = self.prev_last = None
        self._close_spill_file()

    def _close_spill_file(self) -> None:
        self._spill_reader = None
        if self._spill_file is not None:
            self._spill_file.close()
            self._spill_file = None

    def _load_next_spilled(self) -> bool:
        """The next record batch of a run spilled to a local file (bounded in size by the
        merge step that wrote it): read on its own, not memory-mapped."""
        m = self.m
        sp = self.spill
        assert sp is not None
        if self.next_part >= sp.batches:
            self._close_spill_file()  # (its buffered rows are still to be merged)
            return False
        if self._spill_reader is None:
            self._spill_file = pa.OSFile(sp.path, "rb")
            self._spill_reader = pa.ipc.open_file(self._spill_file)
        table = pa.Table.from_batches([self._spill_reader.get_batch(self.next_part)])
        self.next_part += 1
        m.observe_row_width(table)
        m.account_transient(table.nbytes)
        self.part, self.offset, self.part_bytes = table, 0, table.nbytes
        m.stats.rows_read += table.num_rows
        self._first_of_part = True
        return True

    def next_part_is_unsorted(self) -> bool:
        return (
            self.spill is None
            and self.part is None
            and self.next_part < len(self.parts)
            and not self.parts[self.next_part].sorted
        )

    def prepare_next_part(self, use_threads: bool = False) -> tuple[pa.Table, int]:
        """Fetches, verifies, decodes (and sorts, if unsorted) the next part without
        touching shared state: safe to run for several runs at once (then without
        ``use_threads``: see ``decode_whole``)."""
        m = self.m
        p = self.parts[self.next_part]
        data = m.fetch_bytes(p)
        n = len(data)
        table = decode_whole(data, p, m.schemas, m.shard, use_threads=use_threads and n > PARALLEL_DECODE_BYTES)
        del data
        if not p.sorted:
            # A bulk write stored it in arrival order: sort and consolidate it now (the
            # sort moved here from the writer's path).
            table = consolidate(table)
        return table, n

    def _load_next_part(self, prepared: tuple[pa.Table, int] | None = None) -> bool:
        m = self.m
        self.part, self.part_bytes = None, 0
        if self.spill is not None:
            return self._load_next_spilled()
        if self.next_part >= len(self.parts):
            return False
        p = self.parts[self.next_part]
        self._filter = (m.lower is not None and p.tmin < m.lower) or (m.upper is not None and p.tmax >= m.upper)
        self._may_collide = p.tmin != p.tmax
        self.part = None  # let the previous part go before decoding the next
        table, nbytes = prepared if prepared is not None else self.prepare_next_part(use_threads=True)
        self.next_part += 1
        m.stats.bytes_read += nbytes
        m.observe_row_width(table)
        m.account_transient(nbytes + 2 * table.nbytes)
        if not p.sorted:
            m.stats.unsorted_parts_sorted += 1
        _release_unused()
        self.part, self.offset, self.part_bytes = table, 0, table.nbytes
        m.stats.rows_read += table.num_rows
        self._first_of_part = True
        return True

    def _next_chunk(self) -> pa.Table | None:
        m = self.m
        while True:
            if self.part is None or self.offset >= self.part.num_rows:
                if not self._load_next_part():
                    return None
                continue
            assert self.part is not None
            c = self.part.slice(self.offset, m.chunk_rows(self))
            self.offset += c.num_rows
            if self.offset >= self.part.num_rows:
                self.part, self.part_bytes = None, 0  # the slice keeps what it needs alive
            if self._filter:
                c = time_range(c, m.lower, m.upper)  # a filter: the chunk stays sorted
            if m.since is not None:
                before = c
                c = advance_to_since(c, m.since)
                if (
                    not m.linear
                    and c is not before
                    and c.num_rows > 1
                    and self._may_collide
                    and _has_adjacent_equal_rows(c)
                ):
                    c = _consolidate(c)  # forwarding made equal rows: fold them now
            if c.num_rows == 0:
                continue
            if m.linear:
                return self._checked_chunk(c)
            if self._first_of_part:
                self._first_of_part = False
                if self.check_order and self.prev_last is not None:
                    pair = pa.concat_tables([self.prev_last, c.slice(0, 1)])
                    k = row_keys([pair.column(n) for n in pair.column_names if n != D_COL], 2)
                    if k[0] > k[1]:
                        raise _RunOrderViolation()
            if self.check_order:
                self.prev_last = c.slice(c.num_rows - 1, 1)
            return c

    def _order_error(self) -> Exception:
        if self.check_order:
            return _RunOrderViolation()
        return CorruptionError(
            f"shard {self.m.shard}: a part of the compaction input is not sorted by "
            "(k, v, t); it was written by a faulty writer. Nothing was applied"
        )

    def _checked_chunk(self, c: pa.Table) -> pa.Table:
        """The linear kernels' order check (``_Merger.linear``): the chunk is sorted and
        its first row is not below the previous chunk's last row, so every neighbouring
        pair of the run is checked once, before any of its rows is emitted (the merge
        step's bounds rely on it). A chunk with equal neighbours (forwarding to since
        made them, or a writer didn't consolidate) is consolidated: it stays sorted.
        ``_tied_with_prev`` tells ``refill`` that the first row equals the last one."""
        m = self.m
        state = sorted_state([c.column(n) for n in m.key_cols])
        if state == UNSORTED:
            raise self._order_error()
        if state == SORTED_WITH_TIES:
            c = _consolidate(c)
            if c.num_rows == 0:
                return c
        self._tied_with_prev = False
        if self.prev_last is not None:
            pair = pa.concat_tables([self.prev_last, c.slice(0, 1)])
            edge = sorted_state([pair.column(n) for n in m.key_cols])
            if edge == UNSORTED:
                raise self._order_error()
            self._tied_with_prev = edge == SORTED_WITH_TIES
        self.prev_last = c.slice(c.num_rows - 1, 1)
        self._first_of_part = False
        return c

    def refill(self) -> None:
        """Reads the next non-empty chunk into the buffer (or marks the run exhausted).

        With the linear kernels the buffer stays consolidated: a chunk whose first row
        equals the buffer's last row (equal rows across a chunk boundary, after
        forwarding) has the two summed into one."""
        if self.exhausted:
            return
        while True:
            c = self._next_chunk()
            if c is None:
                self.exhausted = True
                return
            if c.num_rows:
                break
        if self.buf is None or self.buf.num_rows == 0:
            self.buf = c
        elif self._tied_with_prev:
            nb = self.buf.num_rows
            edge = _consolidate_sorted_equal(pa.concat_tables([self.buf.slice(nb - 1, 1), c.slice(0, 1)]))
            self.buf = pa.concat_tables([self.buf.slice(0, nb - 1), edge, c.slice(1)])
        else:
            self.buf = pa.concat_tables([self.buf, c])
        self._tied_with_prev = False


class _Merger:
    """One k-way merge pass of some runs, into a sink (a ``BatchBuilder``: ``merge``) or
    as an iterator of consolidated tables (``iter_merge``).

    Every chunk read is first filtered to times in ``[lower, upper)`` (when given), then
    forwarded to ``since``: both keep a sorted run sorted.
    """

    def __init__(
        self,
        blob: Blob,
        schemas: Schemas,
        shard: str,
        since: int | None,
        plan: MemoryPlan,
        stats: MergeStats,
        *,
        lower: int | None = None,
        upper: int | None = None,
        purpose: str = "compaction",
    ) -> None:
        self.blob = blob
        self.schemas = schemas
        self.shard = shard
        self.since = since
        self.lower = lower
        self.upper = upper
        self.purpose = purpose
        self.plan = plan
        self.stats = stats
        self.row_width = 64.0
        self.runs: list[_Run] = []
        self.total_rows = 0
        schema = internal_schema(schemas)
        self.key_cols = self._key_cols = [n for n in schema.names if n != D_COL]
        # Flat key types: chunks are checked for order as they are read, and a step
        # finds each run's bound by a search instead of ranking every buffered row.
        self.linear = linear_kernels_apply(schema.field(n).type for n in self.key_cols)

    def fetch_bytes(self, p: PartMeta) -> bytes:
        return fetch_part_bytes(self.blob, p, self.shard, self.purpose)

    def observe_row_width(self, t: pa.Table) -> None:
        if t.num_rows:
            self.row_width = max(8.0, t.nbytes / t.num_rows)

    def account_transient(self, extra: int) -> None:
        """A part being decoded holds its encoded bytes and the decoded table at once."""
        held = sum(r.held_bytes() for r in self.runs) + extra
        self.stats.peak_bytes_held = max(self.stats.peak_bytes_held, held)

    def chunk_rows(self, run: _Run) -> int:
        """Rows per chunk of ``run``: a run buffers up to ~1.5 chunks and a step works on
        them. The pass's step room is shared in proportion to the runs' row counts, so
        that every run's chunk spans about the same stretch of the key space: a huge run
        next to tiny ones then advances in big chunks (equal chunks would make it advance
        by a tiny run's chunk per step)."""
        per_row = 1.5 * self.row_width + 1.5 * (self.row_width + STEP_BYTES_PER_ROW)
        share = run.total_rows / max(self.total_rows, 1)
        return max(MIN_CHUNK_ROWS, int(self.plan.step_bytes * share / per_row))

    def _account(self, runs: list[_Run], extra_rows: int = 0, extra_bytes: int = 0) -> None:
        rows = sum(r.rows for r in runs) + extra_rows
        held = sum(r.held_bytes() for r in runs) + extra_bytes
        s = self.stats
        s.peak_rows_held = max(s.peak_rows_held, rows)
        s.peak_bytes_held = max(s.peak_bytes_held, held)

    def merge(self, runs: list[_Run], sink: BatchBuilder) -> None:
        for out in self.iter_merge(runs):
            sink.add(out)

    def iter_merge(self, runs: list[_Run]) -> Iterator[pa.Table]:
        """The merged runs as consolidated tables (internal layout), in ``(k, v, t)``
        order across tables; each table is one step's output (bounded by the plan)."""
        self.runs = runs
        self.total_rows = sum(r.total_rows for r in runs)
        try:
            self._load_unsorted_in_parallel(runs)
            for r in runs:
                r.refill()
            while True:
                active = [r for r in runs if r.rows > 0]
                if not active:
                    if all(r.exhausted for r in runs):
                        return
                    for r in runs:
                        r.refill()
                    continue
                self._account(runs)
                self.stats.steps += 1
                out = self._step_linear(runs, active) if self.linear else self._step(runs, active)
                if out is not None:
                    yield out
        finally:
            # Runs and merger reference each other: drop the decoded data now rather
            # than when the cyclic garbage collector gets to it.
            for r in runs:
                r.close()
            self.runs = []

    def _load_unsorted_in_parallel(self, runs: list[_Run]) -> None:
        """Runs that start with an unsorted part (a bulk write's) get it decoded and
        sorted on two threads at once: the sort moved off the writer's path, where a
        bulk write's parts were sorted in parallel, and must not become serial here.
        Every run holds its first part after the first refill anyway, so this holds no
        more than the sequential way (Arrow and numpy release the GIL while sorting)."""
        todo = [r for r in runs if r.next_part_is_unsorted()]
        if len(todo) < 2:
            return
        with ThreadPoolExecutor(max_workers=2, thread_name_prefix="persist-sort") as pool:
            prepared = list(pool.map(lambda r: r.prepare_next_part(), todo))
        for r, prep in zip(todo, prepared, strict=True):
            r._load_next_part(prep)
            r._first_of_part = True

    def _step(self, runs: list[_Run], active: list[_Run]) -> pa.Table | None:
        # Rank the first and last buffered row of every active run together.
        out: pa.Table | None = None
        ends = []
        for r in active:
            assert r.buf is not None
            ends += [r.buf.slice(0, 1), r.buf.slice(r.buf.num_rows - 1, 1)]
        et = pa.concat_tables(ends)
        ek = row_keys([et.column(n) for n in self._key_cols], et.num_rows)
        firsts, lasts = ek[0::2], ek[1::2]
        open_idx = [i for i, r in enumerate(active) if not r.exhausted]
        if open_idx:
            f_i = min(open_idx, key=lambda i: lasts[i])
            kf_end = lasts[f_i]
            included = [i for i in range(len(active)) if firsts[i] < kf_end]
        else:
            f_i, kf_end = -1, None
            included = list(range(len(active)))
        if included:
            tables = [active[i].buf for i in included]
            if f_i >= 0:
                fb = active[f_i].buf
                assert fb is not None
                tables.append(fb.slice(fb.num_rows - 1, 1))  # F itself, as a ranking sentinel
            cat = pa.concat_tables(tables)  # type: ignore[arg-type]
            n = cat.num_rows
            keys = row_keys([cat.column(c) for c in self._key_cols], n)
            kf = keys[-1] if f_i >= 0 else None
            self._account(runs, extra_rows=n, extra_bytes=n * (int(self.row_width) + STEP_BYTES_PER_ROW))
            off = 0
            take_masks = []
            for i in included:
                r = active[i]
                assert r.buf is not None
                m = r.buf.num_rows
                rk = keys[off : off + m]
                if m > 1 and not bool(np.all(rk[1:] >= rk[:-1])):
                    raise _RunOrderViolation() if r.check_order else CorruptionError(
                        f"shard {self.shard}: a part of the compaction input is not sorted by "
                        "(k, v, t); it was written by a faulty writer. Nothing was applied"
                    )
                cnt = m if kf is None else int(np.count_nonzero(rk < kf))
                take_masks.append((off, cnt))
                r.buf = r.buf.slice(cnt)
                off += m
            idx = np.concatenate([np.arange(o, o + c, dtype=np.int64) for o, c in take_masks])
            if len(idx):
                out = self._emit(cat, keys, idx)
        # Runs whose last row is F hold only rows equal to F now: fold them, refill.
        for i, r in enumerate(active):
            if r.buf is not None and r.buf.num_rows and kf_end is not None and lasts[i] == kf_end:
                r.buf = _consolidate_sorted_equal(r.buf)
        # Top up every run below half a chunk, so that all runs advance together and a
        # step emits about half a chunk per run (refilling only the run that bounded F
        # would rank every buffer again to emit one chunk: O(runs) work per row).
        for r in runs:
            if not r.exhausted and r.rows < max(2, self.chunk_rows(r) // 2):
                r.refill()
        return out

    def _step_linear(self, runs: list[_Run], active: list[_Run]) -> pa.Table | None:
        """``_step`` for flat key types, whose runs were checked for order as they were
        read (``_Run._checked_chunk``) and whose buffers are consolidated: each run's
        rows below ``F`` are found by a search (``count_less``), and only the rows
        emitted are ranked — once, as a concatenation of sorted runs, which numpy's
        stable sort merges in near-linear time. Rows coming from a single run need no
        ranking at all."""
        ends = []
        for r in active:
            assert r.buf is not None
            ends += [r.buf.slice(0, 1), r.buf.slice(r.buf.num_rows - 1, 1)]
        et = pa.concat_tables(ends)
        ek = row_keys([et.column(n) for n in self.key_cols], et.num_rows)
        firsts, lasts = ek[0::2], ek[1::2]
        open_idx = [i for i, r in enumerate(active) if not r.exhausted]
        f_row: pa.Table | None = None
        kf_end = None
        if open_idx:
            f_i = min(open_idx, key=lambda i: lasts[i])
            kf_end = lasts[f_i]
            included = [i for i in range(len(active)) if firsts[i] < kf_end]
            fb = active[f_i].buf
            assert fb is not None
            f_row = fb.slice(fb.num_rows - 1, 1)
        else:
            included = list(range(len(active)))
        segments: list[pa.Table] = []
        for i in included:
            r = active[i]
            assert r.buf is not None
            m = r.buf.num_rows
            cnt = m if f_row is None else count_less(r.buf, self.key_cols, f_row)
            if cnt:
                segments.append(r.buf.slice(0, cnt))
                r.buf = r.buf.slice(cnt)
        out: pa.Table | None = None
        if len(segments) == 1:
            out = self._emit_consolidated(segments[0])
        elif segments:
            cat = pa.concat_tables(segments)
            n = cat.num_rows
            self._account(runs, extra_rows=n, extra_bytes=n * (int(self.row_width) + STEP_BYTES_PER_ROW))
            keys, _ = row_keys_with_hint([cat.column(c) for c in self.key_cols], n, presorted_runs=True)
            out = self._emit(cat, keys, None)
        # Runs whose last row is F hold only rows equal to F now (they are sorted): fold.
        for i, r in enumerate(active):
            if r.buf is not None and r.buf.num_rows and kf_end is not None and lasts[i] == kf_end:
                r.buf = _consolidate_sorted_equal(r.buf)
        for r in runs:
            if not r.exhausted and r.rows < max(2, self.chunk_rows(r) // 2):
                r.refill()
        return out

    def _emit_consolidated(self, t: pa.Table) -> pa.Table | None:
        """Rows of one run's consolidated buffer: emitted as they are, minus zero diffs
        (a writer that left some, or sums folded to zero)."""
        d = t.column(D_COL)
        if pc.any(pc.equal(d, 0)).as_py():
            t = t.filter(pc.not_equal(d, 0))
        if t.num_rows == 0:
            return None
        self.stats.output_rows += t.num_rows
        return t

    def _emit(self, cat: pa.Table, keys: np.ndarray, idx: np.ndarray | None) -> pa.Table | None:
        if idx is None:
            idx = np.arange(cat.num_rows, dtype=np.int64)
        k = keys[idx]
        order = np.argsort(k, kind="stable")
        sk = k[order]
        n = len(sk)
        boundary = np.empty(n, dtype=bool)
        boundary[0] = True
        np.not_equal(sk[1:], sk[:-1], out=boundary[1:])
        starts = np.flatnonzero(boundary)
        d = to_numpy(cat.column(D_COL))[idx][order]
        sums = np.add.reduceat(d, starts)
        keep = sums != 0
        if not keep.any():
            return None
        rows = idx[order[starts[keep]]]
        out = cat.take(pa.array(rows))
        di = out.schema.get_field_index(D_COL)
        out = out.set_column(di, out.schema.field(di), pa.array(sums[keep], pa.int64()))
        self.stats.output_rows += out.num_rows
        return out


# ----- merging batches ------------------------------------------------------------------


def forward_time(since: Antichain, upper: Antichain) -> int | None:
    """The time history is forwarded to: ``since``, but never past ``upper - 1``.

    Every time of a batch ``[lower, upper)`` below ``min(since, upper - 1)`` collapses to
    that one time, which consolidates exactly as much as forwarding to ``since`` would
    (readers read at ``as_of >= since``; listeners never revisit a batch below their
    frontier) while keeping every update time inside the batch's description.
    """
    candidates = [t for t in (since.time, None if upper.time is None else upper.time - 1) if t is not None]
    return min(candidates) if candidates else None


def batch_runs(b: HollowBatch) -> list[list[PartMeta]]:
    """The sorted runs of a batch: one run if a compactor wrote it, else one per part
    (an unsorted part is a run once ``_Run`` has sorted it)."""
    if len(b.parts) > 1:
        writers = {_writer_of(p.key) for p in b.parts if p.key is not None}
        if len(writers) == 1 and next(iter(writers)).startswith(COMPACTOR_WRITER_PREFIX):
            return [list(b.parts)]
    return [[p] for p in b.parts]


@dataclass
class MergeOutput:
    batch: HollowBatch
    stats: MergeStats
    intermediate_keys: list[str] = field(default_factory=list)


def merge_batches(
    blob: Blob,
    schemas: Schemas,
    *,
    shard: str,
    inputs: tuple[HollowBatch, ...],
    lower: Antichain,
    upper: Antichain,
    since: Antichain,
    memory_budget: int,
    target_part_bytes: int,
    inline_threshold: int,
    writer: str | None = None,
    in_memory: bool | None = None,
) -> MergeOutput:
    """Merges ``inputs`` into one batch ``[lower, upper)`` forwarded to ``since``.

    Output parts are written to blob (tiny ones inline) under a compactor writer id;
    intermediate runs are deleted before returning. On error, everything written is
    deleted (best effort) and the error re-raised. ``in_memory``: None chooses by the
    budget (``_may_merge_in_memory``); False forces the streaming k-way merge (tests).
    """
    writer = writer or new_compactor_writer_id()
    since_t = forward_time(since, upper)
    runs_parts: list[list[PartMeta]] = [run for b in inputs for run in batch_runs(b)]
    try:
        return _merge(
            blob, schemas, shard, runs_parts, lower, upper, since, since_t, memory_budget,
            target_part_bytes, inline_threshold, writer, check_order=True, in_memory=in_memory,
        )
    except _RunOrderViolation:
        log.warning("shard %s: compactor runs were not sorted; merging with a run per part", shard)
        per_part = [[p] for b in inputs for p in b.parts]
        out = _merge(
            blob, schemas, shard, per_part, lower, upper, since, since_t, memory_budget,
            target_part_bytes, inline_threshold, writer, check_order=False, in_memory=in_memory,
        )
        out.stats.restarted_per_part = True
        return out


def _merge(
    blob: Blob,
    schemas: Schemas,
    shard: str,
    runs_parts: list[list[PartMeta]],
    lower: Antichain,
    upper: Antichain,
    since: Antichain,
    since_t: int | None,
    budget: int,
    target_part_bytes: int,
    inline_threshold: int,
    writer: str,
    *,
    check_order: bool,
    in_memory: bool | None = None,
) -> MergeOutput:
    max_encoded = max((p.size for run in runs_parts for p in run), default=0)
    sources = [RunSource.of_parts(run, schemas) for run in runs_parts]
    plan = MemoryPlan.for_runs(budget, [r.max_decoded for r in sources], max_encoded, target_part_bytes)
    stats = MergeStats(runs=len(runs_parts), output_reserve_bytes=8 * plan.output_part_bytes)
    intermediate: list[str] = []
    ctx = _MergeCtx(blob, schemas, shard, since_t, budget, max_encoded, target_part_bytes, stats, check_order)

    def builder(inline: int) -> BatchBuilder:
        return BatchBuilder(
            blob, schemas, shard=shard, writer=writer, lower=lower,
            target_part_bytes=plan.output_part_bytes, max_inflight_uploads=1,
            inline_threshold=inline, executor=_upload_pool(), consolidated=True,
        )

    planned = None
    if in_memory is not False and _may_merge_in_memory(runs_parts, sources, schemas, budget, plan):
        # Everything may fit: decode every part (in parallel) while the decoded bytes
        # stay within the budget, sort all rows once, and gather the output slice by
        # slice while earlier slices encode. If the parts decode larger than the budget
        # allows, the decoded data is dropped and the streaming merge runs instead.
        planned = _plan_in_memory(blob, schemas, shard, runs_parts, since_t, stats, plan, budget)
    if planned is not None:
        source, rows, diffs = planned
        del planned
        stats.passes = 1
        # Parts of at most IN_MEMORY_PART_BYTES: two encode while the next is gathered,
        # the last one alone is short, and readers decode such parts in parallel.
        part_bytes = min(plan.output_part_bytes, IN_MEMORY_PART_BYTES)
        out = BatchBuilder(
            blob, schemas, shard=shard, writer=writer, lower=lower,
            target_part_bytes=part_bytes, max_inflight_uploads=2,
            inline_threshold=inline_threshold, executor=_upload_pool(), consolidated=True,
        )
        merged: pa.Table | None = None
        try:
            stats.output_rows = len(rows)
            for lo, hi in _slices(len(rows), source.table, part_bytes):
                merged = gather_updates(source, rows[lo:hi], diffs[lo:hi])
                out.add(merged)
            del source
            batch = out.finish(upper, since)
        except BaseException:
            out.abort()
            raise
        stats.bytes_written = batch.size
        if merged is not None and len(batch.parts) == 1 and batch.parts[0].count == merged.num_rows:
            _DECODED.put(batch.parts[0].sha256, schemas.fingerprint(), merged)
        return MergeOutput(batch, stats, [])

    def to_blob(group: list[RunSource]) -> RunSource | None:
        # An intermediate run: written to blob, deleted once the merge is done.
        b = builder(0)
        try:
            for t in ctx.iter_pass(group):
                b.add(t)
            hb = b.finish(upper)
        except BaseException:
            b.abort()
            raise
        intermediate.extend(hb.blob_keys())
        stats.intermediate_bytes += hb.size
        stats.bytes_written += hb.size
        return RunSource.of_parts(list(hb.parts), schemas) if hb.parts else None

    try:
        level = ctx.fold_smallest(sources)
        level = ctx.reduce_to_fit(level, plan, to_blob)
        stats.passes += 1
        out = builder(inline_threshold)
        try:
            for t in ctx.iter_pass(level):
                out.add(t)
            batch = out.finish(upper, since)
        except BaseException:
            out.abort()
            raise
        stats.bytes_written += batch.size
        return MergeOutput(batch, stats, intermediate)
    finally:
        for k in intermediate:
            try:
                blob.delete(k)
            except ExternalError as e:  # the leaked-blob sweeper finds it later
                log.warning("shard %s: could not delete intermediate run part %s: %s", shard, k, e)


@dataclass
class _MergeCtx:
    """What every pass of one merge shares: the plan's inputs and the chunk transform
    (time filter ``[lower, upper)``, then forwarding to ``since``)."""

    blob: Blob
    schemas: Schemas
    shard: str
    since: int | None
    budget: int
    max_encoded: int
    target_part_bytes: int
    stats: MergeStats
    check_order: bool
    lower: int | None = None
    upper: int | None = None
    purpose: str = "compaction"

    def iter_pass(self, group: list[RunSource]) -> Iterator[pa.Table]:
        """One k-way merge pass of ``group`` (planned for just these runs)."""
        # Forwarding and filtering are idempotent, so every pass applies them
        # (intermediate runs are cheap to re-filter).
        p = MemoryPlan.for_runs(
            self.budget, [r.max_decoded for r in group], self.max_encoded, self.target_part_bytes
        )
        self.stats.fan_in = max(self.stats.fan_in, len(group))
        merger = _Merger(
            self.blob, self.schemas, self.shard, self.since, p, self.stats,
            lower=self.lower, upper=self.upper, purpose=self.purpose,
        )
        return merger.iter_merge([_Run(merger, src, self.check_order) for src in group])

    def fold_smallest(self, sources: list[RunSource]) -> list[RunSource]:
        """The smallest runs, up to 1/16 of the budget decoded, folded into one in-memory
        run with a single consolidate: a k-way merge of many tiny runs costs a step per
        few rows, a consolidate ~0.3 us per row. Returns the runs to merge."""
        level = sorted(sources, key=lambda r: r.total_decoded)
        folded = 0
        est = 0
        while folded < len(level) and est + level[folded].total_decoded <= self.budget // 16:
            est += level[folded].total_decoded
            folded += 1
        if folded >= 2 and not _few_linear_runs(len(level), self.schemas):
            self.stats.passes += 1
            groups = [r.parts or [] for r in level[:folded]]
            table = _fold_in_memory(
                self.blob, self.schemas, self.shard, groups, self.since, self.stats,
                lower=self.lower, upper=self.upper, purpose=self.purpose,
            )
            level = [RunSource.of_table(table)] + level[folded:]
        return level

    def reduce_to_fit(
        self,
        level: list[RunSource],
        plan: MemoryPlan,
        write_run: Callable[[list[RunSource]], RunSource | None],
    ) -> list[RunSource]:
        """While the runs don't fit the plan together, merges as many of the smallest as
        fit (at least two) into an intermediate run (``write_run``: to blob or a local
        file); returns runs that fit (or two that don't)."""
        while not plan.fits([r.max_decoded for r in level]) and len(level) > 2:
            level.sort(key=lambda r: r.total_decoded)
            g = 2
            while g < len(level) and plan.fits([r.max_decoded for r in level[: g + 1]]):
                g += 1
            group, level = level[:g], level[g:]
            self.stats.passes += 1
            new = write_run(group)
            if new is not None:
                level.append(new)
        return level


@dataclass
class SpilledRun:
    """A sorted run written to a local Arrow IPC file (record batches of bounded size)."""

    path: str
    batches: int


@dataclass
class RunSource:
    """A run to merge: its parts in blob/inline, (folded small runs) a decoded table, or
    (an intermediate run of a read) a local file."""

    parts: list[PartMeta] | None
    table: pa.Table | None
    rows: int
    max_decoded: int  # the most one decoded part of it holds at once (estimated)
    total_decoded: int  # all of it decoded (estimated)
    spill: SpilledRun | None = None

    @classmethod
    def of_parts(cls, parts: list[PartMeta], schemas: Schemas) -> RunSource:
        dec = [estimate_decoded_bytes(p, schemas) for p in parts]
        return cls(parts, None, sum(p.count for p in parts), max(dec, default=0), sum(dec))

    @classmethod
    def of_table(cls, table: pa.Table) -> RunSource:
        return cls(None, table, table.num_rows, table.nbytes, table.nbytes)


def _fold_in_memory(
    blob: Blob, schemas: Schemas, shard: str, runs: list[list[PartMeta]], since_t: int | None,
    stats: MergeStats, *, lower: int | None = None, upper: int | None = None,
    purpose: str = "compaction",
) -> pa.Table:
    """Decodes every part of ``runs`` whole, filters to ``[lower, upper)``, forwards and
    consolidates them at once."""
    tables = []
    enc = 0
    for run in runs:
        for p in run:
            t = fetch_small_part(blob, p, schemas, shard, purpose)
            enc += p.size
            stats.bytes_read += p.size
            stats.rows_read += t.num_rows
            if lower is not None or upper is not None:
                t = time_range(t, lower, upper)
            tables.append(advance_to_since(t, since_t) if since_t is not None else t)
    rows = sum(t.num_rows for t in tables)
    decoded = sum(t.nbytes for t in tables)
    stats.peak_rows_held = max(stats.peak_rows_held, rows)
    stats.peak_bytes_held = max(stats.peak_bytes_held, enc + 2 * decoded + rows * STEP_BYTES_PER_ROW)
    if not tables:
        return internal_schema(schemas).empty_table()
    return _consolidate(pa.concat_tables(tables))


# Bytes per row of the in-memory merge's working set beside the decoded rows, measured
# (tracemalloc and RSS, 5.2M rows of (int64, string)): the sort's numpy arrays peak at
# ~50 (packed keys, the permutation, tie groups, the diffs gathered and summed) with
# ~23 of them held until the output is written (row indices, summed diffs); polars'
# sort buffers ~16. Rounded up for what the allocators keep.
SORT_BYTES_PER_ROW = 96
# polars' copy of a string or binary column (for fast gathers): 16-byte views per row
# plus the bytes.
VIEW_BYTES_PER_ROW = 16
# Output parts of in-memory merges (Arrow bytes).
IN_MEMORY_PART_BYTES = 8 * MiB
# In-memory merges of at least this many encoded bytes decode their parts in parallel.
PARALLEL_DECODE_MIN_BYTES = 1 * MiB

_DECODE_POOL: ThreadPoolExecutor | None = None


def _reset_pools_in_child() -> None:
    """A forked child has none of the pools' threads: it makes new pools when needed."""
    global _POOL, _DECODE_POOL
    _POOL = _DECODE_POOL = None


os.register_at_fork(after_in_child=_reset_pools_in_child)


def _decode_pool() -> ThreadPoolExecutor:
    """One process-wide pool for decoding the parts of in-memory merges (Parquet
    decoding, SHA-256 and Arrow's casts release the GIL)."""
    global _DECODE_POOL
    with _POOL_LOCK:
        if _DECODE_POOL is None:
            workers = max(2, min(4, os.cpu_count() or 2))
            _DECODE_POOL = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="persist-decode")
        return _DECODE_POOL


def _in_memory_overhead(rows: int, schemas: Schemas, plan: MemoryPlan) -> int:
    """What an in-memory merge of ``rows`` rows holds beside the decoded rows and the
    bytes of their variable-width columns: the sort's working set, polars' views of the
    variable-width columns and the output slices being gathered and encoded (~4 output
    parts)."""
    variable = _row_layout(schemas)[1]
    return rows * (SORT_BYTES_PER_ROW + variable * VIEW_BYTES_PER_ROW) + 4 * plan.output_part_bytes


def _may_merge_in_memory(
    runs_parts: list[list[PartMeta]], sources: list[RunSource], schemas: Schemas, budget: int, plan: MemoryPlan
) -> bool:
    """Whether to try the in-memory merge (one sort of all rows) rather than the
    streaming k-way merge: when the rows' fixed-width bytes and the working set fit the
    budget (the variable-width bytes are only known once decoded: ``_plan_in_memory``
    checks them as it decodes), unless the inputs are a few sorted runs of flat key
    types, which the linear merge steps combine without sorting their rows."""
    rows = sum(r.rows for r in sources)
    fixed = _row_layout(schemas)[0]
    if rows * fixed + _in_memory_overhead(rows, schemas, plan) > budget:
        return False
    unsorted = any(not p.sorted for run in runs_parts for p in run)
    return unsorted or not _few_linear_runs(len(runs_parts), schemas)


def _slices(n: int, table: pa.Table, part_bytes: int) -> Iterator[tuple[int, int]]:
    """Row ranges of about ``part_bytes`` of ``table``'s rows each."""
    per_row = max(table.nbytes / max(table.num_rows, 1), 1.0)
    step = max(1, int(part_bytes / per_row))
    for lo in range(0, n, step):
        yield lo, min(n, lo + step)


def _decode_parts(
    blob: Blob, schemas: Schemas, shard: str, runs: list[list[PartMeta]], since_t: int | None,
    *, lower: int | None = None, upper: int | None = None, purpose: str = "compaction",
    limit: int | None = None,
) -> list[pa.Table] | None:
    """Every part of ``runs``, verified and decoded whole, filtered to ``[lower, upper)``
    and forwarded to ``since_t`` — on the decode pool when there is enough to decode.
    ``limit``: the most the decoded tables may hold, counting their variable-width
    columns twice (polars copies them); past it, None (the rest is not decoded)."""
    parts = [p for run in runs for p in run]

    def load(p: PartMeta, threads: bool) -> pa.Table:
        if estimate_decoded_bytes(p, schemas) <= _DECODED.max_entry:
            t = fetch_small_part(blob, p, schemas, shard, purpose)
        else:
            data = fetch_part_bytes(blob, p, shard, purpose)
            t = decode_whole(data, p, schemas, shard, use_threads=threads)
            del data
        if lower is not None or upper is not None:
            t = time_range(t, lower, upper)
        return advance_to_since(t, since_t) if since_t is not None else t

    def held(t: pa.Table) -> int:
        return t.nbytes + sum(c.nbytes for c, f in zip(t.columns, t.schema, strict=True) if _byte_width(f.type) is None)

    if len(parts) <= 1 or sum(p.size for p in parts) < PARALLEL_DECODE_MIN_BYTES:
        out: list[pa.Table] = []
        total = 0
        for p in parts:
            out.append(load(p, True))
            total += held(out[-1])
            if limit is not None and total > limit:
                return None
        return out
    pool = _decode_pool()
    futures = [pool.submit(load, p, False) for p in parts]
    tables: list[pa.Table] = []
    total = 0
    try:
        for f in futures:
            tables.append(f.result())
            total += held(tables[-1])
            if limit is not None and total > limit:
                return None
        return tables
    finally:
        for f in futures:
            f.cancel()  # (no-op for those done) only on an early return or an error


def _concat_to_one_chunk(tables: list[pa.Table], schema: pa.Schema) -> pa.Table:
    """The tables concatenated into one chunk per column, column by column, each
    column's pieces let go once copied (``tables`` is emptied): the copy costs one
    column at a time, and every gather afterwards reads one contiguous array (Arrow's
    ``take`` on a chunked array concatenates it again on every call)."""
    pieces = [[c for t in tables for c in t.column(i).chunks] for i in range(len(schema))]
    tables.clear()
    cols: list[pa.Array] = []
    for i, f in enumerate(schema):
        chunks, pieces[i] = pieces[i], []
        cols.append(pa.concat_arrays(chunks) if chunks else pa.array([], f.type))
        del chunks
    return pa.Table.from_arrays(cols, schema=schema)


def _plan_in_memory(
    blob: Blob, schemas: Schemas, shard: str, runs: list[list[PartMeta]], since_t: int | None,
    stats: MergeStats, plan: MemoryPlan, budget: int,
) -> tuple[RowSource, np.ndarray, np.ndarray] | None:
    """Decodes every part and sorts all rows once: the concatenation (as a
    ``RowSource`` to gather the output from), and the rows and summed diffs of its
    consolidation (``consolidation_plan``). None when the decoded parts turn out not to
    fit the budget beside the working set (nothing is kept)."""
    parts = [p for run in runs for p in run]
    rows_in = sum(p.count for p in parts)
    limit = budget - _in_memory_overhead(rows_in, schemas, plan)
    tables = _decode_parts(blob, schemas, shard, runs, since_t, limit=limit)
    if tables is None:
        log.info("shard %s: the merge's parts decode larger than its budget allows in memory; streaming", shard)
        _release_unused()
        return None
    held = sum(t.nbytes for t in tables)
    stats.bytes_read += sum(p.size for p in parts)
    stats.rows_read += sum(t.num_rows for t in tables)
    stats.unsorted_parts_sorted += sum(1 for p in parts if not p.sorted)
    table = _concat_to_one_chunk(tables, internal_schema(schemas))
    rows = table.num_rows
    stats.peak_rows_held = max(stats.peak_rows_held, rows)
    var_bytes = sum(c.nbytes for c, f in zip(table.columns, table.schema, strict=True) if _byte_width(f.type) is None)
    stats.peak_bytes_held = max(
        stats.peak_bytes_held, max(held, table.nbytes) + var_bytes + _in_memory_overhead(rows, schemas, plan)
    )
    source = RowSource(table)
    if rows == 0:
        return source, np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    keep, diffs = consolidation_plan(table, source)
    return source, keep, diffs


# ----- streaming merges (reads) -----------------------------------------------------------


# Up to this many sorted runs of flat key types are merged (linear kernels) rather
# than decoded whole and consolidated at once: merging a few sorted runs costs less
# than sorting all their rows.
FEW_RUNS = 4


def _few_linear_runs(n_runs: int, schemas: Schemas) -> bool:
    return n_runs <= FEW_RUNS and merges_linearly(schemas)


def merges_linearly(schemas: Schemas) -> bool:
    """Whether merges of this shard's runs use the linear kernels (flat key types)."""
    schema = internal_schema(schemas)
    return linear_kernels_apply(f.type for f in schema if f.name != D_COL)


def merge_decoded_runs(
    schemas: Schemas, shard: str, runs: list[pa.Table], memory_budget: int, stats: MergeStats
) -> list[pa.Table] | None:
    """Merges runs already decoded (each sorted by ``(k, v, t)``, times already forwarded)
    into consolidated tables, without sorting them again: the k-way merge over in-memory
    runs. For a few runs of flat key types (``merges_linearly``) this beats one
    ``consolidate`` of their concatenation, which sorts every row (a compacted shard is
    one sorted run: its read then costs linear checks). Returns None when a run turns
    out not to be sorted (the caller consolidates instead)."""
    sources = [RunSource.of_table(t) for t in runs if t.num_rows]
    if not sources:
        return []
    plan = MemoryPlan.for_runs(memory_budget, [s.max_decoded for s in sources], 0, memory_budget)
    merger = _Merger(_NO_BLOB, schemas, shard, None, plan, stats, purpose="read")
    try:
        return list(merger.iter_merge([_Run(merger, src, True) for src in sources]))
    except _RunOrderViolation:
        return None


class _NoBlob:
    """The blob of a merge over decoded runs: never read."""

    def get(self, key: str) -> bytes | None:  # pragma: no cover - never called
        raise AssertionError(f"merge of decoded runs fetched {key}")


_NO_BLOB: Any = _NoBlob()


def stream_merge(
    blob: Blob,
    schemas: Schemas,
    *,
    shard: str,
    runs: list[list[PartMeta]],
    memory_budget: int,
    since: int | None = None,
    lower: int | None = None,
    upper: int | None = None,
    spill_dir: str | None = None,
    stats: MergeStats | None = None,
    purpose: str = "read",
) -> Iterator[pa.Table]:
    """The updates of ``runs`` (each a list of parts sorted across part boundaries)
    filtered to times in ``[lower, upper)``, forwarded to ``since`` and consolidated, as
    a stream of tables (internal layout) in ``(k, v, t)`` order across tables — the
    compactor's k-way merge, emitting to the caller instead of to a ``BatchBuilder``.

    Memory is planned as for compaction (``MemoryPlan``): the smallest runs are folded
    in memory, and when the remaining runs don't fit the budget together they are
    merged in groups into intermediate runs written to local Arrow IPC files under
    ``spill_dir`` (a temporary directory, deleted when the stream ends or is closed);
    a reader never writes to blob. Each yielded table is one merge step's output.

    A generator: nothing is fetched before the first ``next``; ``close()`` (or dropping
    it) releases what it holds. A batch that claims to be one sorted run (a compactor
    output) but isn't is re-merged with a run per part when nothing was yielded yet;
    later, it raises ``CorruptionError`` (the rows already yielded can't be taken back).
    """
    if memory_budget < 1 * MiB:
        raise InvalidUsage(f"memory budget must be >= 1 MiB, got {memory_budget} bytes")
    st = stats if stats is not None else MergeStats()
    runs = [r for r in runs if r]
    st.runs += len(runs)  # (stats may add up several streams)
    if not runs:
        return
    yielded = False
    try:
        for t in _coalesce(
            _stream_runs(blob, schemas, shard, runs, memory_budget, since, lower, upper,
                         spill_dir, st, purpose, check_order=True),
            memory_budget // 64,
        ):
            yielded = True
            yield t
    except _RunOrderViolation:
        if yielded:
            raise CorruptionError(
                f"shard {shard}: a batch written by the compactor is not one sorted run (its "
                "parts overlap); the read stopped after returning part of its rows. Read "
                "again with a snapshot() (it re-merges with a run per part) and investigate "
                "the compactor that wrote it"
            ) from None
        log.warning("shard %s: compactor runs were not sorted; reading with a run per part", shard)
        st.restarted_per_part = True
        per_part = [[p] for run in runs for p in run]
        yield from _coalesce(
            _stream_runs(blob, schemas, shard, per_part, memory_budget, since, lower, upper,
                         spill_dir, st, purpose, check_order=False),
            memory_budget // 64,
        )


def _coalesce(tables: Iterator[pa.Table], min_bytes: int) -> Iterator[pa.Table]:
    """Joins consecutive small tables (merge steps near the end of a run emit a few rows
    each) until they hold ``min_bytes``; larger ones pass through."""
    pending: list[pa.Table] = []
    held = 0
    for t in tables:
        pending.append(t)
        held += t.nbytes
        if held >= min_bytes:
            yield pending[0] if len(pending) == 1 else pa.concat_tables(pending).combine_chunks()
            pending, held = [], 0
    if pending:
        yield pending[0] if len(pending) == 1 else pa.concat_tables(pending).combine_chunks()


def _stream_runs(
    blob: Blob, schemas: Schemas, shard: str, runs_parts: list[list[PartMeta]], budget: int,
    since: int | None, lower: int | None, upper: int | None, spill_dir: str | None,
    stats: MergeStats, purpose: str, *, check_order: bool,
) -> Iterator[pa.Table]:
    max_encoded = max((p.size for run in runs_parts for p in run), default=0)
    sources = [RunSource.of_parts(run, schemas) for run in runs_parts]
    # No output parts here: the consumer holds what it is handed. The plan's share for
    # them (1/32 of the budget, ~8x) covers the yielded table and its conversions.
    target = budget
    plan = MemoryPlan.for_runs(budget, [r.max_decoded for r in sources], max_encoded, target)
    ctx = _MergeCtx(
        blob, schemas, shard, since, budget, max_encoded, target, stats, check_order,
        lower=lower, upper=upper, purpose=purpose,
    )
    tmpdir: str | None = None
    schema = internal_schema(schemas)
    total_in = sum(p.size for run in runs_parts for p in run)
    if total_in <= budget // 64 and not _few_linear_runs(len(runs_parts), schemas):
        stats.passes += 1
        merged = _fold_in_memory(
            blob, schemas, shard, runs_parts, since, stats, lower=lower, upper=upper, purpose=purpose
        )
        stats.output_rows += merged.num_rows
        if merged.num_rows:
            yield merged
        return

    def to_local_file(group: list[RunSource]) -> RunSource | None:
        nonlocal tmpdir
        if tmpdir is None:
            tmpdir = tempfile.mkdtemp(prefix="persist-merge-", dir=spill_dir)
        path = os.path.join(tmpdir, f"run-{uuid.uuid4().hex}.arrow")
        rows = batches = max_bytes = total = 0
        opts = pa.ipc.IpcWriteOptions(compression="lz4" if pa.Codec.is_available("lz4") else None)
        with pa.OSFile(path, "wb") as f, pa.ipc.new_file(f, schema, options=opts) as w:
            for t in ctx.iter_pass(group):
                for b in t.to_batches():
                    w.write_batch(b)
                    rows += b.num_rows
                    batches += 1
                    max_bytes = max(max_bytes, b.nbytes)
                    total += b.nbytes
        stats.intermediate_bytes += os.path.getsize(path)
        for src in group:  # a spilled input run is no longer needed
            if src.spill is not None:
                os.unlink(src.spill.path)
        if rows == 0:
            os.unlink(path)
            return None
        return RunSource(None, None, rows, max_bytes, total, SpilledRun(path, batches))

    try:
        level = ctx.fold_smallest(sources)
        level = ctx.reduce_to_fit(level, plan, to_local_file)
        stats.passes += 1
        yield from ctx.iter_pass(level)
    finally:
        if tmpdir is not None:
            shutil.rmtree(tmpdir, ignore_errors=True)


# ----- the compactor --------------------------------------------------------------------


@dataclass
class CompactionResult:
    request: CompactionRequest
    outcome: mt.MergeOutcome
    output: HollowBatch | None
    stats: MergeStats
    seconds: float
    deleted_output: bool = False

    @property
    def applied(self) -> bool:
        return self.outcome in (mt.MergeOutcome.APPLIED, mt.MergeOutcome.ALREADY_APPLIED)

    def to_json(self) -> dict[str, Any]:
        return {
            "request": self.request.describe(),
            "outcome": self.outcome.value,
            "output_updates": self.output.len if self.output is not None else 0,
            "output_bytes": self.output.size if self.output is not None else 0,
            "output_parts": len(self.output.parts) if self.output is not None else 0,
            "seconds": round(self.seconds, 4),
            "stats": self.stats.to_json(),
        }


def _metadata_only_output(req: CompactionRequest) -> HollowBatch:
    """For a request with at most one non-empty input: widen it, reuse its parts."""
    non_empty = [b for b in req.inputs if b.parts]
    assert len(non_empty) <= 1
    since = non_empty[0].since if non_empty else req.since
    parts = non_empty[0].parts if non_empty else ()
    return HollowBatch(lower=req.lower, upper=req.upper, since=since, parts=parts)


def compact_request(
    machine: Machine,
    schemas: Schemas,
    config: PersistConfig,
    req: CompactionRequest,
    *,
    client: PersistClient | None = None,
) -> CompactionResult:
    """Runs one merge and applies it with one transition (or deletes its output).

    A merge that rewrites data first registers a part writer (``part_writers``): its
    output is linked only while that registration holds, so the leaked-blob sweeper can
    never delete output that is about to be linked, however long the merge takes.
    ``client`` (optional) heartbeats the registration during long merges.
    """
    t0 = time.monotonic()
    stats = MergeStats()
    pw: PartWriter | None = None
    if not req.rewrites_data or sum(1 for b in req.inputs if b.parts) == 0:
        output = _metadata_only_output(req)
        produced_keys: list[str] = []
    else:
        pw = PartWriter.register(
            machine, purpose="compaction", client=client, writer_id=new_compactor_writer_id()
        )
        try:
            merged = merge_batches(
                machine.blob, schemas, shard=machine.shard_id, inputs=req.inputs, lower=req.lower,
                upper=req.upper, since=req.since, memory_budget=config.compaction_memory_budget,
                target_part_bytes=config.blob_target_size, inline_threshold=config.inline_threshold,
                writer=pw.writer_id, in_memory=None if config.compaction_in_memory else False,
            )
        except BlobNotFound:
            # The compactor holds no seqno: an input may have been replaced by another
            # merge and collected meanwhile. Then this merge is moot (and wrote nothing:
            # the merge deletes its partial output); otherwise a live blob is missing.
            pw.release()
            if inputs_still_current(machine.fetch_latest(), req):
                raise
            return CompactionResult(
                req, mt.MergeOutcome.NOT_APPLIED_NO_MATCH, None, stats, time.monotonic() - t0, True
            )
        except Exception:
            pw.release()
            raise
        output, stats = merged.batch, merged.stats
        reused = {k for b in req.inputs for k in b.blob_keys()}
        produced_keys = [k for k in output.blob_keys() if k not in reused]
    writer_id = pw.writer_id if pw is not None else None
    try:
        res = _apply(machine, config, req, output, writer_id)
        if res.outcome is mt.MergeOutcome.NOT_APPLIED_INLINE_BUDGET:
            output = _uninline(machine, output, writer_id)
            reused = {k for b in req.inputs for k in b.blob_keys()}
            produced_keys = [k for k in output.blob_keys() if k not in reused]
            res = _apply(machine, config, req, output, writer_id)
    except Exception:
        # It is unknown whether the merge landed: the output is kept (a leak, for the
        # sweeper once the registration is gone, beats a dangling reference).
        if pw is not None:
            pw.release()  # a no-op if the merge landed (it released it)
        raise
    if pw is not None:
        pw.mark_released()  # every outcome of apply_merge_res released (or lost) it
    # "Not applied" is definite: the transition ran against a state without our output
    # (our own earlier landed CAS would show as ALREADY_APPLIED), and our part writer is
    # unregistered now, so nothing can link the output any more.
    deleted = False
    if not res.applied:
        _delete_keys(machine, produced_keys)
        deleted = True
    return CompactionResult(req, res.outcome, output, stats, time.monotonic() - t0, deleted)


def _delete_keys(machine: Machine, keys: list[str]) -> None:
    for k in keys:
        try:
            machine.blob.delete(k)
        except ExternalError as e:  # the leaked-blob sweeper finds it later
            log.warning("shard %s: could not delete unapplied output %s: %s", machine.shard_id, k, e)


def inputs_still_current(state: Any, req: CompactionRequest) -> bool:
    """Whether every input batch of ``req`` is still in ``state`` with the same parts."""
    for bid, want in zip(req.batch_ids, req.inputs, strict=True):
        cur = state.batches.get(bid)
        if cur is None or [p.key for p in cur.parts] != [p.key for p in want.parts]:
            return False
    return True


def _apply(
    machine: Machine, config: PersistConfig, req: CompactionRequest, output: HollowBatch,
    part_writer: str | None,
) -> mt.MergeResult:
    res, _ = machine.apply(
        "apply_merge_res",
        lambda s, now: mt.apply_merge_res(
            s, now, input_ids=req.batch_ids, inputs=req.inputs, output=output,
            inline_max_total=config.inline_max_total, part_writer=part_writer,
        ),
    )
    assert isinstance(res, mt.MergeResult)
    return res


def _uninline(machine: Machine, batch: HollowBatch, writer: str | None) -> HollowBatch:
    """Moves inline output parts to blob, under the merge's registered part writer."""
    if writer is None:
        raise InvalidUsage(
            f"shard {machine.shard_id}: a metadata-only merge can't need more inline room"
        )
    parts: list[PartMeta] = []
    for p in batch.parts:
        if p.inline is None:
            parts.append(p)
            continue
        key = part_blob_key(machine.shard_id, writer)
        machine.blob.set(key, p.inline)
        parts.append(replace(p, key=key, inline=None))
    return replace(batch, parts=tuple(parts))
