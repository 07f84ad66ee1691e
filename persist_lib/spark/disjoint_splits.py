"""Snapshot splits that no record can straddle: one shard's parts, cut into key ranges.

``ReadHandle.snapshot_splits`` balances parts over splits by size, so two splits can
hold the same record (parts of overlapping key ranges, or sharing an endpoint) and
``read_snapshot`` must consolidate across splits (a ``groupBy``, or the marked rows of
``split_overlap``). When the parts' recorded ranges of an integer first key field are
disjoint but for shared endpoints (``split_overlap.disjoint_overlaps``: a compacted
shard, with or without history), the same parts can be regrouped in key order and cut
only where the next part starts strictly above every key before it. Each split then
consolidates its own records on its executor (``SnapshotSplit.fetch``: all times of a
``(key, value)`` are in that split's parts), and the splits' rows, concatenated, are the
snapshot: no cross-split grouping, no shuffle, and nothing to materialize just to
mark shared rows.

Only the grouping changes: the splits keep the reader's blob, shard, schemas, as-of and
filter, and the parts are those the reader planned (and holds).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from persist_lib.handles.split_overlap import disjoint_overlaps, run_groups
from persist_lib.handles.splits import SnapshotSplit
from persist_lib.shard.batch_meta import PartMeta
from persist_lib.shard.codec import KEY_PREFIX, Schemas


def _range(p: PartMeta, column: str) -> tuple[int, int]:
    """The part's recorded (min, max) of ``column`` (present: ``disjoint_overlaps``
    checked every part has them)."""
    for name, lo, hi, _ in p.stats or ():
        if name == column:
            return int(lo), int(hi)
    raise AssertionError(f"part {p.key}: no bounds of {column}")  # pragma: no cover


def key_range_splits(splits: Sequence[SnapshotSplit], schemas: Schemas, n: int) -> list[SnapshotSplit] | None:
    """``splits``' parts regrouped into at most ``n`` key-contiguous splits that share
    no record, balanced by bytes; None when the parts' ranges can't show that (the
    caller consolidates across splits as before). ``splits`` must come from one
    ``snapshot_splits`` call (one shard, one as-of, one filter).

    When the splits know their parts' runs (``SnapshotSplit.runs``: one batch of
    (k, v)-disjoint time layers), each run is cut on its own (its parts' ranges need be
    disjoint only within it) at every gap between its parts' key ranges, and the groups
    are packed into ``n`` splits balanced by bytes: groups of different runs share no
    record, nor do two groups of one run, so any packing is valid (a split consolidates
    each run's parts on its own). Cutting the runs into shares of ``n`` instead left
    whole runs as the units to pack: a 4M-row shard's two splits held 1.56M and 2.25M
    rows, and the larger one set the read's time."""
    parts = [p for s in splits for p in s.parts]
    if not splits or not parts or len({(s.shard_id, s.as_of) for s in splits}) != 1:
        return None
    known = [s.runs for s in splits]
    runs = None if any(r is None for r in known) else [i for r in known for i in r or ()]
    column = KEY_PREFIX + schemas.key.field(0).name if len(schemas.key) else ""
    ids = sorted(set(runs)) if runs is not None else [0]
    groups: list[tuple[int, list[PartMeta]]] = []
    for run_id, members in zip(ids, run_groups(parts, runs), strict=True):
        planned = disjoint_overlaps(members, schemas)
        if planned is None:
            return None
        share = n if runs is None else len(members)  # one run: at every gap
        groups += [(run_id, g) for g in _key_contiguous(planned[0], column, share)]
    bins = _packed(groups, n) if len(groups) > n else [[g] for g in groups]
    return [
        dataclasses.replace(
            splits[0], parts=tuple(p for _, g in b for p in g),
            runs=tuple(r for r, g in b for _ in g) if runs is not None else None,
        )
        for b in bins
    ]


def _key_contiguous(ordered: list[PartMeta], column: str, n: int) -> list[list[PartMeta]]:
    """``ordered`` (parts in key order, ranges disjoint but for shared endpoints) cut
    into at most ``n`` key-contiguous groups balanced by bytes, cut only where the next
    part starts strictly above every key before it (so no record is in two groups)."""
    ranges = [_range(p, column) for p in ordered]
    left = sum(p.size for p in ordered)  # bytes not yet in a closed group
    target = left / max(1, n)
    groups: list[list[PartMeta]] = [[]]
    acc = 0
    top = ranges[0][1]
    for p, (lo, hi) in zip(ordered, ranges, strict=True):
        # Cut before p when p would take the group past its share of what is left,
        # and only at a strict gap: no key of p is in the group so far.
        if groups[-1] and acc + p.size / 2 > target and lo > top and len(groups) < n:
            left -= acc
            groups.append([])
            target = left / (n - len(groups) + 1)
            acc = 0
        groups[-1].append(p)
        acc += p.size
        top = max(top, hi)
    return groups


Group = tuple[int, list[PartMeta]]  # a run's index and a key-contiguous group of its parts


def _packed(groups: list[Group], n: int) -> list[list[Group]]:
    """``groups`` packed into ``n`` bins balanced by bytes (the largest group into the
    lightest bin): groups of different runs share no record, so any packing is valid."""
    bins: list[list[Group]] = [[] for _ in range(n)]
    sizes = [0] * n
    for g in sorted(groups, key=lambda g: -sum(p.size for p in g[1])):
        i = sizes.index(min(sizes))
        bins[i].append(g)
        sizes[i] += sum(p.size for p in g[1])
    return [b for b in bins if b]
