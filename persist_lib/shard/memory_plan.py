"""Memory planning of merges: how a budget is split, what a decoded part will hold.

A merge never decodes a part to learn its size: ``estimate_decoded_bytes`` bounds it
from the part's metadata, ``MemoryPlan`` splits the budget between the open runs, the
merge steps and the output parts, and ``MergeStats`` records the most rows and bytes a
merge held at once (what tests assert on and the benchmarks compare with the RSS).
Shared by the compactor and the read path.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from persist_lib.errors import InvalidUsage
from persist_lib.shard.batch_meta import PartMeta
from persist_lib.shard.codec import Schemas, internal_schema

MiB = 1 << 20


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
# working set): see ``Merger.chunk_rows``.
MIN_CHUNK_ROWS = 64


def estimate_decoded_bytes(p: PartMeta, schemas: Schemas) -> int:
    """Arrow bytes of a decoded part, before decoding it: fixed-width fields exactly,
    variable-width ones from the part's encoded bytes per row (compressed data expands
    ~2-4x; we take 4x to be safe), and never less than what its writer measured
    (``PartMeta.decoded``): repetitive strings compress far more than 4x (~300:1 for
    long repeated ones), and merges planned with the guess alone held several times
    their budget."""
    fixed, variable = row_layout(schemas)
    per_row_var = 4.0 * p.size / max(p.count, 1) if variable else 0.0
    guess = int(p.count * (fixed + per_row_var)) + 4096
    return guess if p.decoded is None else max(guess, p.decoded + 4096)


def decoded_bytes_or_estimate(p: PartMeta, schemas: Schemas) -> int:
    """Arrow bytes of a decoded part: what its writer measured (``PartMeta.decoded``)
    when recorded, else ``estimate_decoded_bytes``. For plans that check the decoded
    sizes as parts are decoded anyway (``range_merge``): the 4x guess of the estimate
    makes zstd-compressed strings look ~1.5x their size."""
    return p.decoded + 4096 if p.decoded is not None else estimate_decoded_bytes(p, schemas)


@functools.lru_cache(maxsize=256)
def row_layout(schemas: Schemas) -> tuple[int, int]:
    """(fixed bytes per row, number of variable-width fields) of the internal layout."""
    fixed = 0
    variable = 0
    for f in internal_schema(schemas):
        bw = byte_width(f.type)
        if bw is None:
            variable += 1
            fixed += 4  # offsets
        else:
            fixed += bw
    return fixed, variable


def byte_width(t: pa.DataType) -> int | None:
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
    key_ranges: int = 0  # key ranges of a range merge (``range_merge``), consolidated in parallel
    presorted_rows: int = 0  # rows a range merge consolidated in linear time (key-disjoint sorted pieces)

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)
