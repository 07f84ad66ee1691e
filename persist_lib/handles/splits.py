"""Snapshot and time-range splits: picklable pieces of a read that another process
(a Spark executor) fetches with nothing but the blob URI.

``ReadHandle.snapshot_splits`` / ``range_splits`` plan them (and hold a seqno for
them); concatenating the fetched splits and consolidating gives the read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from persist_lib.errors import InvalidUsage
from persist_lib.handles.pushdown import ReadPushdown
from persist_lib.handles.read_plan import concat_updates
from persist_lib.handles.split_overlap import run_groups
from persist_lib.location.base import Blob
from persist_lib.shard.batch_meta import PartMeta
from persist_lib.shard.codec import KEY_PREFIX, Schemas, to_user_table
from persist_lib.shard.consolidate import consolidate, consolidate_sorted
from persist_lib.shard.kway_merge import merges_linearly
from persist_lib.shard.ranged_fetch import fetch_part_groups
from persist_lib.shard.time_filters import snapshot_at, time_range


@dataclass(frozen=True)
class SnapshotSplit:
    """A picklable piece of a snapshot that any process with the blob URI can fetch.

    Concatenating the fetched splits and consolidating gives the snapshot.
    """

    blob_uri: str
    shard_id: str
    schemas_json: dict[str, Any]
    as_of: int
    parts: tuple[PartMeta, ...]
    # The read's filter (``shard.predicate.Predicate``): parts were pruned by it when
    # planning, rows are filtered by it before consolidation when fetching.
    filter: Any = None
    # Per part (same length as ``parts``), the index of the run it belongs to in one
    # batch whose runs share no ``(k, v)`` (``read_plan.concatenating_batch``): parts of
    # different runs never hold the same record. None: nothing known (any two parts
    # may share records; splits pickled by code that predates the field read so too).
    runs: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.runs is not None and len(self.runs) != len(self.parts):
            raise InvalidUsage(
                f"shard {self.shard_id}: a snapshot split's run indices ({len(self.runs)}) must match its "
                f"parts ({len(self.parts)}); replace both together, or pass runs=None"
            )

    def __repr__(self) -> str:
        # The URI may carry credentials (an S3 secret key): never show it unredacted.
        from persist_lib.location.redaction import SensitiveUrl

        runs = "" if self.runs is None else f", runs={len(set(self.runs))}"
        return (
            f"SnapshotSplit(blob_uri={SensitiveUrl(self.blob_uri).redacted!r}, shard_id={self.shard_id!r}, "
            f"as_of={self.as_of}, parts={len(self.parts)}{runs})"
        )

    def fetch(self, blob: Blob | None = None) -> pa.Table:
        from persist_lib.location.uri import open_blob

        schemas = Schemas.from_json(self.schemas_json)
        b = blob if blob is not None else open_blob(self.blob_uri)
        pd = ReadPushdown.plan(schemas, None, self.filter, shard=self.shard_id)
        if not pd.snapshot_time_ok(self.as_of):
            return to_user_table(concat_updates([], schemas), schemas)
        linear = merges_linearly(schemas)
        out: list[pa.Table] = []
        # Parts of different (k, v)-disjoint runs share no record: each run's parts are
        # consolidated on their own and the outputs concatenated (no merge across runs).
        for group in run_groups(self.parts, self.runs):
            parts = _in_key_order(tuple(group))
            tables = [
                pd.filter_data(snapshot_at(
                    fetch_part_groups(b, p, schemas, self.shard_id, pd.snapshot_groups(p, self.as_of)),
                    self.as_of, all_at_or_before=p.tmax <= self.as_of,
                ))
                for p in parts
            ]
            whole = concat_updates(tables, schemas)
            # Parts of one sorted run (a compacted shard's), in key order: consolidated in
            # one linear pass (``consolidate_sorted`` checks the order and says None when
            # the rows are not sorted: then one sort).
            internal = consolidate_sorted(whole) if all(p.sorted for p in parts) and linear else None
            out.append(internal if internal is not None else consolidate(whole))
        return to_user_table(concat_updates(out, schemas), schemas)


@dataclass(frozen=True)
class RangeSplit:
    """A picklable piece of the updates at times in ``[lower, upper)`` (times not
    forwarded), fetched by any process with the blob URI: the time-range counterpart of
    ``SnapshotSplit``. Concatenating the fetched splits and consolidating gives
    ``ReadHandle.updates_between(lower, upper)``."""

    blob_uri: str
    shard_id: str
    schemas_json: dict[str, Any]
    lower: int
    upper: int
    parts: tuple[PartMeta, ...]
    filter: Any = None  # as for ``SnapshotSplit``

    def __repr__(self) -> str:
        from persist_lib.location.redaction import SensitiveUrl

        return (
            f"RangeSplit(blob_uri={SensitiveUrl(self.blob_uri).redacted!r}, shard_id={self.shard_id!r}, "
            f"lower={self.lower}, upper={self.upper}, parts={len(self.parts)})"
        )

    def fetch(self, blob: Blob | None = None) -> pa.Table:
        from persist_lib.location.uri import open_blob

        schemas = Schemas.from_json(self.schemas_json)
        b = blob if blob is not None else open_blob(self.blob_uri)
        pd = ReadPushdown.plan(schemas, None, self.filter, shard=self.shard_id)
        tables = [
            pd.filter_range(time_range(
                fetch_part_groups(b, p, schemas, self.shard_id, pd.range_groups(p, self.lower, self.upper)),
                self.lower, self.upper,
            ))
            for p in self.parts
        ]
        return to_user_table(consolidate(concat_updates(tables, schemas)), schemas)


def _in_key_order(parts: tuple[PartMeta, ...]) -> tuple[PartMeta, ...]:
    """``parts`` by the recorded minimum of their first key field (the order of a sorted
    run's parts), or as given when a part has no such bound."""
    if len(parts) < 2:
        return parts
    mins: list[Any] = []
    for p in parts:
        lo = next((s[1] for s in p.stats or () if s[0].startswith(KEY_PREFIX)), None)
        if lo is None:
            return parts
        mins.append(lo)
    try:
        order = sorted(range(len(parts)), key=mins.__getitem__)
    except TypeError:  # bounds of different kinds: no order to rely on
        return parts
    return tuple(parts[i] for i in order)


def balance(parts: list[PartMeta], n: int) -> list[list[PartMeta]]:
    """Greedy: the largest part into the lightest of ``n`` splits."""
    buckets: list[list[PartMeta]] = [[] for _ in range(max(1, n))]
    sizes = [0] * len(buckets)
    for p in sorted(parts, key=lambda p: -p.size):
        i = sizes.index(min(sizes))
        buckets[i].append(p)
        sizes[i] += p.size
    return buckets

