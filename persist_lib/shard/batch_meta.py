"""Metadata of batches and parts as recorded in shard state ("hollow" batches).

A *part* is one immutable Parquet blob (or, when tiny, bytes inlined in state) of
updates, normally sorted by ``(k, v, t)`` and consolidated. A bulk write may store a
part *unsorted* (``PartMeta.sorted`` false: rows as they came, not consolidated), so
that the writer's path is an encode, not a sort; readers consolidate across parts
anyway, and the compactor sorts such a part when it loads it (``kway_merge.Run``). A *batch* is a list of parts plus a description
``[lower, upper)`` (every update time ``t`` satisfies ``lower <= t < upper``) and a
``since`` (times below it may have been forwarded to it by compaction).

A batch the compactor wrote in *time layers* (``shard.time_layers``) records where each
of its sorted runs starts (``HollowBatch.run_splits``): each run holds the updates of
one time range, so a read as of an old time skips the later runs' parts by their
``tmin``. The field is optional: state without it reads as before, and code that
predates it reads such a batch as one run per part (its parts are written under a
writer id code of that age doesn't take for one sorted run: ``runs.batch_runs``).

A layered batch may also carry the *(k, v)-disjoint* mark (``HollowBatch.kv_disjoint``):
its runs were routed by each ``(k, v)``'s oldest retained time, so no ``(k, v)`` is in
two runs and a read may concatenate the runs' consolidated outputs instead of merging
them. The mark is only honoured together with valid ``run_splits`` (without them the
runs are not known); state without it, or code that predates it, reads the runs by
merging them, which is correct for any batch.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Any

from persist_lib.frontier import Antichain


@dataclass(frozen=True)
class PartMeta:
    """One part of a batch: where its bytes are and how to verify them."""

    key: str | None  # blob key; None when the part is inlined in state
    size: int  # encoded bytes
    count: int  # number of updates (rows)
    sha256: str  # hex digest of the encoded bytes, verified on every read
    tmin: int  # smallest update time in the part
    tmax: int  # largest update time in the part
    inline: bytes | None = None  # the encoded bytes, for tiny parts kept in state
    sorted: bool = True  # False: rows in arrival order, not consolidated (a bulk write)
    # Arrow bytes of the part decoded, as its writer measured them (None: written before
    # writers recorded it): merges plan their memory with it (memory_plan.estimate_decoded_bytes)
    decoded: int | None = None
    # Column statistics recorded at write time (``shard.stats``): ``(column, min, max,
    # null count)`` per internal column with exact bounds. None: written before writers
    # recorded them (or by a writer that didn't); reads then assume anything may match.
    stats: tuple[tuple[str, Any, Any, int], ...] | None = None
    # An indexed part (``shard.part_index``): the length and SHA-256 of its Parquet
    # footer, which holds each row group's byte range and SHA-256, so a read can fetch
    # and verify only some row groups; and the largest smallest-time of its row groups
    # (a snapshot as of that time or later can't skip a group by time). None: read
    # whole (older parts, small parts).
    footer: tuple[int, str, int] | None = None

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "size": self.size,
            "count": self.count,
            "sha256": self.sha256,
            "tmin": self.tmin,
            "tmax": self.tmax,
        }
        if self.key is not None:
            d["key"] = self.key
        if self.inline is not None:
            d["inline"] = base64.b64encode(self.inline).decode("ascii")
        if not self.sorted:
            d["unsorted"] = True
        if self.decoded is not None:
            d["decoded"] = self.decoded
        if self.stats is not None:
            # An optional key: state readers that predate it ignore it.
            d["stats"] = [list(s) for s in self.stats]
        if self.footer is not None:
            d["footer"] = list(self.footer)  # optional, like "stats"
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> PartMeta:
        inline = d.get("inline")
        return cls(
            key=d.get("key"),
            size=int(d["size"]),
            count=int(d["count"]),
            sha256=str(d["sha256"]),
            tmin=int(d["tmin"]),
            tmax=int(d["tmax"]),
            inline=base64.b64decode(inline) if inline is not None else None,
            sorted=not d.get("unsorted", False),
            decoded=int(d["decoded"]) if d.get("decoded") is not None else None,
            stats=_stats_from_json(d.get("stats")),
            footer=_footer_from_json(d.get("footer")),
        )

    @property
    def location(self) -> str:
        return self.key if self.key is not None else "<inline>"


def _footer_from_json(raw: Any) -> tuple[int, str, int] | None:
    if raw is None:
        return None
    length, sha, group_tmin = raw
    return int(length), str(sha), int(group_tmin)


def _stats_from_json(raw: Any) -> tuple[tuple[str, Any, Any, int], ...] | None:
    if raw is None:
        return None
    return tuple((str(n), lo, hi, int(nulls)) for n, lo, hi, nulls in raw)


@dataclass(frozen=True)
class HollowBatch:
    """A batch as state knows it: description plus part metadata, not the data."""

    lower: Antichain
    upper: Antichain
    since: Antichain
    parts: tuple[PartMeta, ...] = field(default_factory=tuple)
    # Where the batch's sorted runs start after the first (indices into ``parts``,
    # increasing, each in ``(0, len(parts))``): a time-layered compactor output. None:
    # the runs follow from the parts' writer (``runs.batch_runs``).
    run_splits: tuple[int, ...] | None = None
    # The runs hold disjoint sets of ``(k, v)`` (``time_layers``: each ``(k, v)`` whole in
    # one layer): a read may concatenate them. False: merge them (any batch).
    kv_disjoint: bool = False

    @property
    def runs_concatenate(self) -> bool:
        """Whether a read may concatenate this batch's runs (consolidated one by one)
        instead of merging them: marked (k, v)-disjoint with valid run splits."""
        return self.kv_disjoint and self.run_splits is not None and run_splits_fit(self.run_splits, len(self.parts))

    @property
    def len(self) -> int:
        """Number of updates in the batch."""
        return sum(p.count for p in self.parts)

    @property
    def size(self) -> int:
        """Encoded bytes of the batch."""
        return sum(p.size for p in self.parts)

    def blob_keys(self) -> list[str]:
        return [p.key for p in self.parts if p.key is not None]

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "lower": self.lower.to_json(),
            "upper": self.upper.to_json(),
            "since": self.since.to_json(),
            "parts": [p.to_json() for p in self.parts],
        }
        if self.run_splits is not None:
            d["run_splits"] = list(self.run_splits)  # optional: older readers ignore it
        if self.kv_disjoint:
            d["kv_disjoint"] = True  # optional: older readers merge the runs (correct)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> HollowBatch:
        parts = tuple(PartMeta.from_json(p) for p in d["parts"])
        splits = _run_splits_from_json(d.get("run_splits"), len(parts))
        return cls(
            lower=Antichain.from_json(d["lower"]),
            upper=Antichain.from_json(d["upper"]),
            since=Antichain.from_json(d["since"]),
            parts=parts,
            run_splits=splits,
            # (dropped with the splits: without them the runs are not known)
            kv_disjoint=bool(d.get("kv_disjoint", False)) and splits is not None,
        )


def _run_splits_from_json(raw: Any, num_parts: int) -> tuple[int, ...] | None:
    """Recorded run starts; None (the runs then follow from the writers) when absent or
    not increasing indices inside the parts: the splits are a read hint, and a read
    that takes one run per part is correct whatever they say."""
    if raw is None:
        return None
    try:
        splits = tuple(int(i) for i in raw)
    except (TypeError, ValueError):
        return None
    return splits if run_splits_fit(splits, num_parts) else None


def run_splits_fit(splits: tuple[int, ...], num_parts: int) -> bool:
    """Whether ``splits`` are increasing part indices in ``(0, num_parts)``."""
    prev = 0
    for i in splits:
        if not prev < i < num_parts:
            return False
        prev = i
    return True
