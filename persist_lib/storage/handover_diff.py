"""The change at a handover, streamed: ``-old@(h-1) + new@h`` in bounded memory.

At a handover at ``h`` from rendition ``old`` to ``new`` a collection listener emits,
at time ``h``, the negation of ``old``'s snapshot at ``h - 1`` plus ``new``'s snapshot
at ``h``, consolidated: a record equal in both cancels, so a rebuild that changed
nothing emits nothing. Both snapshots are as large as the collection; this builds the
diff without holding either.

**Which shards meet.** Keys are routed by ``hash(key) % num_shards``
(``routing.route``), so a key of old shard ``i`` can only be in a new shard ``j`` with
``i ≡ j (mod gcd(n_old, n_new))``: the shards fall into ``gcd`` independent groups
(one pair of shards per group when the counts are equal, everything in one group when
they are coprime). Each group is merged on its own and its diff emitted before the
next group is read.

**Memory.** Each shard's snapshot is read as a stream (``ReadHandle.snapshot_batches``,
sorted by ``(k, v)``), one shard at a time, its rows given time ``h`` (and, for the old
rendition, negated diffs): a sorted run. Runs are kept decoded while the group's runs
hold at most a quarter of the budget; beyond that they go to local Arrow IPC spill
files. A group that stayed in memory is consolidated at once (what the in-memory diff
did); otherwise its runs are merged by the read path's k-way merge under the budget
(``read_merge.merge_local_runs``: intermediate runs spilled, files deleted when the
group is done). So the diff holds about the budget at once — each shard stream gets
three quarters of it, the decoded runs the rest — and needs local disk for the
collection's size (lz4-compressed).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from persist_lib.errors import InvalidUsage
from persist_lib.handles.read import ReadHandle
from persist_lib.handles.read_plan import row_width
from persist_lib.shard.codec import D_COL, T_COL, Schemas, internal_schema, to_user_table
from persist_lib.shard.consolidate import consolidate
from persist_lib.shard.memory_plan import MergeStats
from persist_lib.shard.read_merge import MiB, SpillDir, SpillWriter, merge_local_runs
from persist_lib.shard.runs import RunSource


def shard_groups(n_old: int, n_new: int) -> list[tuple[list[int], list[int]]]:
    """The shards of two renditions that can hold the same key, as ``(old indexes, new
    indexes)`` groups: shard ``i`` of ``n`` holds the keys with ``hash % n == i``, and
    ``hash % gcd(n_old, n_new)`` is the same for a key in both renditions."""
    g = math.gcd(n_old, n_new)
    return [
        ([i for i in range(n_old) if i % g == r], [j for j in range(n_new) if j % g == r]) for r in range(g)
    ]


@dataclass
class SnapshotSide:
    """One side of the diff: a rendition's shard readers, the time to read them at (None:
    nothing, the old side of a handover at 0), and the sign its diffs get."""

    readers: Sequence[ReadHandle]
    as_of: int | None
    sign: int


def handover_diff(
    old: SnapshotSide,
    new: SnapshotSide,
    at: int,
    schemas: Schemas,
    *,
    memory_budget: int,
    timeout_s: float | None = None,
    stats: MergeStats | None = None,
    spill_dir: str | None = None,
) -> Iterator[pa.Table]:
    """``-old@(h-1) + new@h`` at time ``at`` (user layout), consolidated, as tables of
    about 1/32 of the budget at most, group by group (``shard_groups``) and in ``(k, v)``
    order within a group. ``stats`` gathers the most the reads and the merge held at
    once. A generator: nothing is read before the first ``next``; closing it releases
    the shard streams and deletes its spill files."""
    if memory_budget < 1 * MiB:
        raise InvalidUsage(f"memory budget must be >= 1 MiB, got {memory_budget} bytes")
    st = stats if stats is not None else MergeStats()
    max_rows = max(1024, (memory_budget // 32) // row_width(schemas))
    for olds, news in shard_groups(len(old.readers), len(new.readers)):
        members = [(old, i) for i in olds] + [(new, j) for j in news]
        for t in _group_diff(members, at, schemas, memory_budget, st, spill_dir, timeout_s):
            yield from to_user_table(t, schemas).to_batches(max_chunksize=max_rows)


def _group_diff(
    members: list[tuple[SnapshotSide, int]], at: int, schemas: Schemas, budget: int, st: MergeStats,
    spill_dir: str | None, timeout_s: float | None,
) -> Iterator[pa.Table]:
    schema = internal_schema(schemas)
    spill = SpillDir(spill_dir)
    in_memory: list[pa.Table] = []
    held = 0  # decoded bytes of the group's in-memory runs
    sources: list[RunSource] = []
    try:
        for side, i in members:
            if side.as_of is None:
                continue
            stream = side.readers[i].snapshot_batches(
                side.as_of, memory_budget=max(MiB, budget - budget // 4), timeout_s=timeout_s
            )
            run: list[pa.Table] = []
            writer: SpillWriter | None = None
            try:
                with stream:
                    for b in stream:
                        t = _as_run_rows(b, schema, at, side.sign)
                        if writer is not None:
                            writer.write(t)
                            continue
                        run.append(t)
                        held += t.nbytes
                        st.peak_bytes_held = max(st.peak_bytes_held, held)
                        if held > budget // 4:  # too much decoded: this run goes to a file
                            writer = SpillWriter(spill.new_file(), schema, st)
                            for r in run:
                                writer.write(r)
                            held -= sum(r.nbytes for r in run)
                            run = []
            except BaseException:
                if writer is not None:
                    writer.abort()
                raise
            add_stream_stats(st, stream.stats, held)
            if writer is not None:
                src = writer.finish()
                if src is not None:
                    sources.append(src)
            elif run:
                in_memory.append(pa.concat_tables(run) if len(run) > 1 else run[0])
        if not sources:
            # Small enough to have stayed decoded: one consolidate, as a whole diff.
            if in_memory:
                out = consolidate(pa.concat_tables(in_memory))
                st.output_rows += out.num_rows
                in_memory = []
                if out.num_rows:
                    yield out
            return
        sources += [RunSource.of_table(t) for t in in_memory]
        in_memory = []
        yield from merge_local_runs(
            schemas, "handover", sources, budget, st, spill, purpose="handover diff"
        )
    finally:
        spill.remove()


def _as_run_rows(batch: pa.RecordBatch, schema: pa.Schema, at: int, sign: int) -> pa.Table:
    """A snapshot batch (user layout, sorted by ``(k, v)``) in the internal layout with
    time ``at`` and diffs times ``sign``: still sorted by ``(k, v, t)``."""
    t = pa.Table.from_arrays(batch.columns, schema=schema)
    ti = schema.get_field_index(T_COL)
    t = t.set_column(ti, schema.field(ti), pa.array(np.full(t.num_rows, at, dtype=np.int64)))
    if sign < 0:
        di = schema.get_field_index(D_COL)
        t = t.set_column(di, schema.field(di), pc.negate(t.column(D_COL)))
    return t


def add_stream_stats(st: MergeStats, s: MergeStats, held: int = 0) -> None:
    """Adds what a shard stream read, spilled and held at most to ``st`` (its merge's
    own figures — passes, steps, output — stay its own): its peak came on top of
    ``held`` bytes its reader kept meanwhile (streams read one at a time: the peaks
    don't add up)."""
    st.peak_bytes_held = max(st.peak_bytes_held, held + s.peak_bytes_held)
    st.peak_rows_held = max(st.peak_rows_held, s.peak_rows_held)
    st.bytes_read += s.bytes_read
    st.rows_read += s.rows_read
    st.intermediate_bytes += s.intermediate_bytes
