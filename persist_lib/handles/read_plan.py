"""Planning a read: which parts of a shard's trace it touches, and what reading them
whole would cost in memory.

Every read (snapshot, time range, listen, splits) starts by choosing parts; the
snapshot and listen paths then compare the cost of decoding them at once with the
read's memory budget to choose between the simple whole read and the streaming merge.
"""

from __future__ import annotations

from collections.abc import Callable

import pyarrow as pa

from persist_lib.shard import state as st
from persist_lib.shard.batch_meta import HollowBatch, PartMeta
from persist_lib.shard.codec import Schemas, empty_updates, internal_schema
from persist_lib.shard.memory_plan import STEP_BYTES_PER_ROW, estimate_decoded_bytes

MiB = 1 << 20


def decoded_bytes(p: PartMeta, schemas: Schemas) -> int:
    """Arrow bytes of part ``p`` decoded, for a read's plan: what its writer measured
    (``PartMeta.decoded``: the table it encoded, which decoding gives back), else the
    merges' estimate from its encoded size (``memory_plan.estimate_decoded_bytes``,
    which takes the larger of the two to be safe for compaction's budget). The estimate
    alone assumes variable-width columns expand 4x, ~1.5x more than random strings do
    (issue 28: 1M rows of the bench, 39 MB decoded, estimated 58 MB)."""
    if p.decoded is not None:
        return p.decoded + 4096
    return estimate_decoded_bytes(p, schemas)


def whole_read_bytes(parts: list[PartMeta], schemas: Schemas, *, beyond_result: bool = False) -> int:
    """What reading ``parts`` whole costs at peak: the decoded parts (fetched in
    parallel), the consolidation's copies of them and the consolidated output, plus the
    consolidate's working set per row.

    ``beyond_result``: without the output, for a caller that returns the whole result
    anyway (``snapshot``, not ``snapshot_batches``): the streaming path's budget does not
    count the table built from the stream either, so both paths are compared on the
    memory they use beyond it."""
    dec = sum(decoded_bytes(p, schemas) for p in parts)
    rows = sum(p.count for p in parts)
    return (2 if beyond_result else 3) * dec + rows * STEP_BYTES_PER_ROW


def sorted_run_read_bytes(parts: list[PartMeta], schemas: Schemas, *, beyond_result: bool = False) -> int:
    """What reading one sorted run whole costs at peak (``consolidate_sorted``): its
    decoded parts, which are the result when no two rows share a ``(k, v)``, one filtered
    copy when some do, and the forwarded times and comparison masks per row
    (``beyond_result``: see ``whole_read_bytes``)."""
    dec = sum(decoded_bytes(p, schemas) for p in parts)
    rows = sum(p.count for p in parts)
    return (1 if beyond_result else 2) * dec + rows * SORTED_RUN_BYTES_PER_ROW


# Per row of a sorted-run read: the forwarded time (8), comparison results and masks
# (~10), the summed diffs when rows tie (8).
SORTED_RUN_BYTES_PER_ROW = 32


def row_width(schemas: Schemas) -> int:
    """Bytes per row of the internal layout (variable-width fields counted as 32)."""
    w = 0
    for f in internal_schema(schemas):
        try:
            w += max(1, f.type.bit_width // 8)
        except ValueError:
            w += 32
    return w


def batch_overlaps(b: HollowBatch, lower: int, upper: int | None) -> bool:
    """Whether batch ``b`` may hold updates at times in ``[lower, upper)``."""
    return (b.upper.is_empty() or (b.upper.time or 0) > lower) and (upper is None or (b.lower.time or 0) < upper)


def part_overlaps(p: PartMeta, lower: int, upper: int | None) -> bool:
    """Whether part ``p`` may hold updates at times in ``[lower, upper)``."""
    return p.tmax >= lower and (upper is None or p.tmin < upper)


def parts_in_range(state: st.ShardState, lower: int, upper: int | None) -> list[PartMeta]:
    """The parts that may hold updates at times in ``[lower, upper)`` (``None``: no
    upper bound)."""
    return [
        p
        for _, b in state.trace_batches()
        if batch_overlaps(b, lower, upper)
        for p in b.parts
        if part_overlaps(p, lower, upper)
    ]


def concatenating_batch(
    state: st.ShardState, as_of: int, keeps: Callable[[PartMeta], bool]
) -> HollowBatch | None:
    """The batch a snapshot at ``as_of`` may read by concatenating its runs instead of
    merging them: the parts it keeps (times at or before ``as_of``, and ``keeps``) all
    belong to this one batch, and its runs are (k, v)-disjoint
    (``HollowBatch.runs_concatenate``). None otherwise: runs of different batches may
    hold the same ``(k, v)``, so any second batch means a merge."""
    found: HollowBatch | None = None
    for _, b in state.trace_batches():
        if not b.lower.less_equal(as_of) or not any(p.tmin <= as_of and keeps(p) for p in b.parts):
            continue
        if found is not None:
            return None
        found = b
    return found if found is not None and found.runs_concatenate else None


def concatenating_read(state: st.ShardState, as_of: int, keeps: Callable[[PartMeta], bool]) -> bool:
    """Whether a snapshot at ``as_of`` may concatenate its runs (``concatenating_batch``)."""
    return concatenating_batch(state, as_of, keeps) is not None


def concat_updates(tables: list[pa.Table], schemas: Schemas) -> pa.Table:
    """``tables`` as one update table (an empty one of ``schemas`` when there are none)."""
    if not tables:
        return empty_updates(schemas)
    return pa.concat_tables(tables)

