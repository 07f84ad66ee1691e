"""Sorted runs: what a merge's inputs are.

A *run* is a sequence of parts whose rows are sorted across part boundaries. A batch
written by a user is a set of runs of one part each (``BatchBuilder`` sorts each part
on its own); a batch written by the compactor is one run (its writer id starts with
``COMPACTOR_WRITER_PREFIX``), or, written in time layers (``shard.time_layers``), the
runs its ``run_splits`` record (its writer id starts with ``LAYERED_WRITER_PREFIX``, which
code that predates the splits doesn't take for one run: it reads one run per part).
That is only a hint: crossing a part boundary inside a run checks the order, and a
violation (``RunOrderViolation``) restarts the merge with one run per part. ``RunSource`` is a run as the merge engine takes it: parts, a
decoded table, or a run spilled to a local file.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import pyarrow as pa

from persist_lib.shard.batch_meta import HollowBatch, PartMeta, run_splits_fit
from persist_lib.shard.codec import Schemas
from persist_lib.shard.memory_plan import estimate_decoded_bytes

COMPACTOR_WRITER_PREFIX = "cmp-"
# The writer of a compactor output in time layers: not ``cmp-``, so that code without
# ``HollowBatch.run_splits`` reads its parts as one run each (correct, if slower).
LAYERED_WRITER_PREFIX = "cml-"


def new_compactor_writer_id(*, layered: bool = False) -> str:
    return f"{LAYERED_WRITER_PREFIX if layered else COMPACTOR_WRITER_PREFIX}{uuid.uuid4()}"


def is_layered_writer(writer: str) -> bool:
    return writer.startswith(LAYERED_WRITER_PREFIX)


def _writer_of(key: str) -> str:
    parts = key.split("/")
    return parts[1] if len(parts) >= 3 else ""


class RunOrderViolation(Exception):
    """Parts assumed to form one sorted run don't; merge again with a run per part."""


def batch_runs(b: HollowBatch) -> list[list[PartMeta]]:
    """The sorted runs of a batch: those its ``run_splits`` record (a time-layered
    compactor output), one run if a compactor wrote it, else one per part (an unsorted
    part is a run once ``Run`` has sorted it)."""
    if b.run_splits is not None and run_splits_fit(b.run_splits, len(b.parts)):
        bounds = [0, *b.run_splits, len(b.parts)]
        return [list(b.parts[lo:hi]) for lo, hi in zip(bounds, bounds[1:], strict=False) if hi > lo]
    if len(b.parts) > 1:
        writers = {_writer_of(p.key) for p in b.parts if p.key is not None}
        if len(writers) == 1 and next(iter(writers)).startswith(COMPACTOR_WRITER_PREFIX):
            return [list(b.parts)]
    return [[p] for p in b.parts]



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
