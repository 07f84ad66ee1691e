"""Time layers: a compactor output that keeps retained history apart by time (issue 28).

A merge's output is sorted by ``(k, v, t)``, so one output run mixes every time the
merge retained (the times between the since and the upper): a read as of an old time
would have to fetch all of it to find the few updates at or before its as-of. When the
retained history is large, the compactor instead writes one sorted, consolidated run
per *time layer* ``[b_i, b_{i+1})`` and records where each run starts
(``HollowBatch.run_splits``). Every part of a later layer has ``tmin`` beyond the
earlier layers' times, so a snapshot as of a time in layer ``i`` skips the parts of
every later layer by their ``tmin`` (``handles.snapshot``) without fetching them.

**Layer bounds** (``layer_bounds``) are planned from the inputs' part metadata before
the merge: each part spreads its ``count`` updates evenly over ``[tmin, tmax]``
(forwarded to the since), which is exact for the parts of single-time commits and of
earlier layers and an estimate for older one-run outputs. The layers are geometric from
the newest end: with ``max_layers = L`` the bounds sit where about ``N / 2^(L-1)``,
..., ``N / 4``, ``N / 2`` of the ``N`` updates lie before them, so a read as of any time
past the first bound fetches at most about twice the updates at or before it, a read as
of the latest time merges at most ``L`` runs per batch, and layers of fewer than
``min_rows`` updates are not split off. A layer spans two distinct times at least (one
run per commit would make a read merge as many runs as the commits it spans: the first
layer of four equal commits is the first two). Layers cost every read at the latest
time a merge of the runs instead of one linear pass (four equal commits in two layers:
2x slower at 1M rows, ~4x at 4M and 16M; docs/benchmarks.md, sessions 14 and 15), so a merge writes them only when the first layer holds at most
``max_first_share`` (``compaction_layer_max_first_share``, 1/4) of its updates: an old
read then skips most of the batch. History that falls below the since is forwarded
to one time by the next merge and so collapses into one layer.

``LayeredOutput`` writes the layers: a ``BatchBuilder`` per layer (rows routed by time,
each layer's rows staying in ``(k, v, t)`` order), assembled into one batch.

**(k, v)-whole layers** (``compaction_layer_kv_whole``, bounds given as
``KvWholeBounds``): each ``(k, v)`` goes whole (every update of it) into the layer of
its *oldest* retained update (its time forwarded to the since), not each row into the
layer of its own time. The layers then hold disjoint sets of ``(k, v)``: a read at any
as-of consolidates within each layer only and concatenates the layers' outputs
(``HollowBatch.kv_disjoint`` marks such a batch), so a read at the latest time costs
about what one run costs instead of a k-way merge of the layers. A read as of an old
time still skips a layer whose parts all start after it (``tmin``): every ``(k, v)``
of layer ``i`` has its oldest update at or after the layer's lower bound. With reads
concatenating, neither the two-times rule nor ``max_first_share`` is needed: the
bounds are the geometric plan's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace

import numpy as np
import pyarrow as pa

from persist_lib.frontier import Antichain
from persist_lib.shard.batch_builder import BatchBuilder
from persist_lib.shard.batch_meta import HollowBatch, PartMeta
from persist_lib.shard.codec import D_COL, T_COL
from persist_lib.shard.ranks import row_keys, to_numpy
from persist_lib.shard.runs import batch_runs
from persist_lib.shard.sorted_checks import linear_kernels_apply, sorted_ties


class KvWholeBounds(tuple[int, ...]):
    """Layer bounds of a (k, v)-whole layout (see the module doc): each ``(k, v)`` is
    routed by its oldest time and the output batch is marked ``kv_disjoint``. A plain
    tuple of bounds routes each row by its own time."""

    __slots__ = ()


def _atoms(parts: Sequence[PartMeta], since_t: int | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per part: its smallest and largest time forwarded to ``since_t``, and its count."""
    parts = [p for p in parts if p.count > 0]
    lo = np.array([p.tmin for p in parts], dtype=np.float64)
    hi = np.array([p.tmax for p in parts], dtype=np.float64)
    if since_t is not None:
        lo = np.maximum(lo, since_t)
        hi = np.maximum(hi, since_t)
    return lo, hi, np.array([p.count for p in parts], dtype=np.float64)


def layer_bounds(
    parts: Sequence[PartMeta], since_t: int | None, *, max_layers: int, min_rows: int,
    max_first_share: float = 1.0, kv_whole: bool = False,
) -> tuple[int, ...]:
    """The times where the layers of a merge of ``parts`` (forwarded to ``since_t``)
    start after the first, increasing; empty for one layer (see the module doc).
    ``max_first_share``: no layers at all when the first would hold more than this
    share of the updates (an old read would skip too little to pay for the merge that
    every read at the latest time then runs). ``kv_whole``: bounds of a (k, v)-whole
    layout (``KvWholeBounds``; reads concatenate the layers, so a layer may hold one
    time and ``max_first_share`` does not apply)."""
    if kv_whole:
        return KvWholeBounds(_bounds(parts, since_t, max_layers, min_rows, 1.0, min_times=1))
    return _bounds(parts, since_t, max_layers, min_rows, max_first_share, min_times=2)


def planning_parts(batches: Sequence[HollowBatch], *, kv_whole: bool) -> list[PartMeta]:
    """The parts of a merge of ``batches`` as ``layer_bounds`` weighs them. For a
    (k, v)-whole layout what counts is where each ``(k, v)``'s *oldest* time falls: a
    part of a (k, v)-disjoint batch holds the whole history of ``(k, v)`` whose oldest
    times lie between its run's start and the next run's, so its ``tmax`` (a late update
    of an old ``(k, v)``) is capped there, or its updates would be spread as far as that
    late time and the first layers planned far too wide. Other parts as they are."""
    out: list[PartMeta] = []
    for b in batches:
        if not kv_whole or not b.runs_concatenate:
            out.extend(b.parts)
            continue
        runs = batch_runs(b)
        starts = [min(p.tmin for p in run) for run in runs]
        for i, run in enumerate(runs):
            cap = starts[i + 1] - 1 if i + 1 < len(runs) else None
            out.extend(p if cap is None or p.tmax <= cap else replace(p, tmax=max(p.tmin, cap)) for p in run)
    return out


def _bounds(
    parts: Sequence[PartMeta], since_t: int | None, max_layers: int, min_rows: int, max_first_share: float,
    *, min_times: int,
) -> tuple[int, ...]:
    if max_layers < 2:
        return ()
    lo, hi, count = _atoms(parts, since_t)
    n = float(count.sum())
    if n < 2 * max(min_rows, 1) or not len(lo) or lo.min() == hi.max():
        return ()
    width = hi - lo + 1

    def before(x: int) -> float:
        """Estimated updates at times < x."""
        return float((count * np.clip((x - lo) / width, 0.0, 1.0)).sum())

    points = np.unique(lo[width == 1])
    ranges = width > 1

    def two_times_from(start: int, x: int) -> int | None:
        """``x``, or the smallest bound past it, such that ``[start, x)`` holds at least
        two distinct times (None: there is no such bound)."""
        if min_times < 2:
            return x
        overlap = np.minimum(hi[ranges] + 1, x) - np.maximum(lo[ranges], start)
        if len(overlap) and overlap.max() >= 2:
            return x
        i = int(np.searchsorted(points, start))
        if i + 1 >= len(points):
            return None
        return max(x, int(points[i + 1]) + 1)

    first, last = int(lo.min()), int(hi.max())
    bounds: list[int] = []
    done = 0.0
    for j in range(max_layers - 1):
        target = n / (1 << (max_layers - 1 - j))
        if target < min_rows:
            continue
        a, b = first + 1, last + 1  # the smallest x in (first, last + 1] with before(x) >= target
        while a < b:
            mid = (a + b) // 2
            if before(mid) >= target:
                b = mid
            else:
                a = mid + 1
        # A layer spans two times at least: one run per commit would make a read merge
        # as many runs as the commits it spans.
        spread = two_times_from(bounds[-1] if bounds else first, a)
        if spread is None:
            continue
        a = spread
        at = before(a)
        if (bounds and a <= bounds[-1]) or at - done < min_rows or n - at < min_rows:
            continue
        if not bounds and at > max_first_share * n:
            return ()
        bounds.append(a)
        done = at
    return tuple(bounds)


# Rows routed at once by ``split_rows_by_layer`` (a (k, v)-whole layout).
ROUTE_ROWS = 1 << 16


def split_rows_by_layer(
    out: LayeredOutput, table: pa.Table, rows: np.ndarray, diffs: np.ndarray
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """For each layer of ``out`` in order: the entries of ``rows`` (indices into
    ``table``, in output order) that belong to it (by their time, or, (k, v)-whole, by
    their ``(k, v)``'s oldest time), and their ``diffs``."""
    if out.kv_whole:
        # Routed a slice at a time: a copy of the key columns of one slice, not of all.
        keys, router = table.select([c for c in table.column_names if c != D_COL]), KvRouter(out.layer_of)
        layers = np.concatenate([
            router.route(keys.take(pa.array(rows[lo:lo + ROUTE_ROWS]))) for lo in range(0, len(rows), ROUTE_ROWS)
        ] or [np.zeros(0, dtype=np.int64)])
    else:
        layers = out.layer_of(table.column(T_COL).to_numpy()[rows])
    for layer in range(out.num_layers):
        sel = np.flatnonzero(layers == layer)
        yield rows[sel], diffs[sel]


def kv_starts(table: pa.Table) -> np.ndarray:
    """For rows sorted by ``(k, v, t)``: True where a row's ``(k, v)`` differs from the
    row before it (the first row of each ``(k, v)``)."""
    n = table.num_rows
    start = np.ones(n, dtype=bool)
    if n < 2:
        return start
    cols = [table.column(c) for c in table.column_names if c not in (T_COL, D_COL)]
    tied = sorted_ties(cols) if linear_kernels_apply(c.type for c in cols) else None
    if tied is not None:
        start[tied + 1] = False
    else:  # (nested types; or, never for a merge's output, rows not sorted by (k, v))
        key = row_keys(cols, n)
        start[1:] = key[1:] != key[:-1]
    return start


def oldest_layers(
    table: pa.Table, layer_of: Callable[[np.ndarray], np.ndarray], carried: int | None = None
) -> np.ndarray:
    """The layer of each row of ``table`` (sorted by ``(k, v, t)``) in a (k, v)-whole
    layout: the layer of the time of its ``(k, v)``'s first row, the oldest.
    ``carried``: the layer of the ``(k, v)`` the first row continues (its first rows
    were in an earlier table); None: the first row starts a ``(k, v)``."""
    start = kv_starts(table)
    if carried is not None:
        start[0] = False
    group = np.cumsum(start) - 1
    firsts = np.flatnonzero(start)
    times = to_numpy(table.column(T_COL))
    group_layer = layer_of(times[firsts])
    if carried is not None:
        group_layer = np.concatenate([[carried], group_layer])
        group = group + 1
    return np.asarray(group_layer, dtype=np.int64)[group]


class KvRouter:
    """Routes consecutive tables of one ``(k, v, t)``-ordered stream to (k, v)-whole
    layers (``oldest_layers``): a ``(k, v)`` continuing from the previous table keeps
    the layer its first rows went to."""

    def __init__(self, layer_of: Callable[[np.ndarray], np.ndarray]) -> None:
        self.layer_of = layer_of
        self._last: pa.Table | None = None  # the last row routed (k, v, t columns)
        self._last_layer = 0

    def route(self, table: pa.Table) -> np.ndarray:
        """The layer of each row of ``table``, the next table of the stream."""
        keys = table.select([c for c in table.column_names if c != D_COL])
        if not keys.num_rows:
            return np.zeros(0, dtype=np.int64)
        if self._last is None:
            layers = oldest_layers(keys, self.layer_of)
        else:
            layers = oldest_layers(pa.concat_tables([self._last, keys]), self.layer_of, self._last_layer)[1:]
        self._last = keys.slice(keys.num_rows - 1)
        self._last_layer = int(layers[-1])
        return layers


class LayeredOutput:
    """A merge output written as one sorted run per time layer: layer ``i`` holds the
    updates at times in ``[bounds[i-1], bounds[i])`` (open-ended at both ends), or, for
    ``KvWholeBounds``, the ``(k, v)`` whose oldest time is in it. Rows must come in
    ``(k, v, t)`` order across ``add`` calls, as for one ``BatchBuilder``."""

    def __init__(self, bounds: Sequence[int], new_builder: Callable[[], BatchBuilder]) -> None:
        self.kv_whole = isinstance(bounds, KvWholeBounds)
        self.bounds = np.asarray(bounds, dtype=np.int64)
        self._router = KvRouter(self.layer_of)  # (k, v)-whole routing across add_routed calls
        self._new = new_builder
        self._builders: list[BatchBuilder | None] = [None] * (len(bounds) + 1)
        self._done: list[HollowBatch | None] = [None] * (len(bounds) + 1)

    @property
    def num_layers(self) -> int:
        return len(self._builders)

    def layer_of(self, times: np.ndarray) -> np.ndarray:
        """The layer of each time."""
        return np.searchsorted(self.bounds, times, side="right")

    @property
    def cut_layer_of(self) -> Callable[[np.ndarray], np.ndarray] | None:
        """What a merge may group its input rows by before consolidating (rows equal in
        ``(k, v, t)`` share it): the time's layer; None for a (k, v)-whole layout, whose
        layer depends on other rows (the merge's output is routed: ``add_merged``)."""
        return None if self.kv_whole else self.layer_of

    @property
    def cut_layers(self) -> int:
        return 1 if self.kv_whole else self.num_layers

    def add_merged(self, layer: int, table: pa.Table) -> None:
        """Adds rows a merge grouped by ``cut_layer_of`` (``layer``; 0 when it is None)."""
        if self.kv_whole:
            self.add_routed(table)
        else:
            self.add(layer, table)

    def add(self, layer: int, table: pa.Table) -> None:
        """Adds rows that all belong to ``layer``."""
        b = self._builders[layer]
        if b is None:
            if self._done[layer] is not None:
                raise AssertionError(f"time layer {layer} was already finished")
            b = self._builders[layer] = self._new()
        b.add(table)

    def add_routed(self, table: pa.Table) -> None:
        """Adds rows of any layers, each to its own (order kept within each)."""
        if not table.num_rows:
            return
        if not len(self.bounds):
            self.add(0, table)
            return
        if self.kv_whole:
            layers = self._router.route(table)
        else:
            layers = self.layer_of(table.column(T_COL).to_numpy())
        lo, hi = int(layers.min()), int(layers.max())
        if lo == hi:
            self.add(lo, table)
            return
        for layer in range(lo, hi + 1):
            mask = layers == layer
            if mask.any():
                self.add(layer, table.filter(pa.array(mask)))

    def finish_layer(self, layer: int, upper: Antichain, since: Antichain) -> None:
        """Flushes ``layer`` (nothing more is added to it) and waits for its uploads."""
        b = self._builders[layer]
        if b is not None:
            self._done[layer] = b.finish(upper, since)

    def finish(self, lower: Antichain, upper: Antichain, since: Antichain) -> HollowBatch:
        """The batch ``[lower, upper)``: every layer's parts, oldest layer first, with the
        start of each run recorded. On an error everything written is deleted."""
        try:
            for i in range(self.num_layers):
                if self._done[i] is None:
                    self.finish_layer(i, upper, since)
        except BaseException:
            self.abort()
            raise
        parts: list[PartMeta] = []
        splits: list[int] = []
        for hb in self._done:
            if hb is None or not hb.parts:
                continue
            if parts:
                splits.append(len(parts))
            parts.extend(hb.parts)
        return HollowBatch(
            lower=lower, upper=upper, since=since, parts=tuple(parts), run_splits=tuple(splits),
            kv_disjoint=self.kv_whole and bool(splits),
        )

    def abort(self) -> None:
        """Deletes every part written (best effort), finished layers' too."""
        for b in self._builders:
            if b is not None:
                b.abort()
