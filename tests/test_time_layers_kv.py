"""(k, v)-whole time layers (``shard.time_layers``, ``compaction_layer_kv_whole``): each
``(k, v)`` whole in the layer of its oldest retained update, the batch marked
``kv_disjoint``, and a snapshot concatenating the layers' consolidated outputs.

Real components: ``mem://`` clients (in-memory blob and consensus), a file-blob client
where parts are corrupted or deleted on disk.
"""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from persist_lib import PersistClient, PersistConfig, ShardId
from persist_lib.errors import CorruptionError
from persist_lib.handles import maintenance as mn
from persist_lib.handles import snapshot as snapshot_mod
from persist_lib.handles.read_plan import concatenating_read
from persist_lib.shard import time_layers
from persist_lib.shard.batch_meta import HollowBatch
from persist_lib.shard.codec import D_COL, T_COL
from persist_lib.shard.runs import batch_runs
from persist_lib.shard.time_layers import (
    KvRouter,
    KvWholeBounds,
    LayeredOutput,
    layer_bounds,
    oldest_layers,
    split_rows_by_layer,
)
from tests.support.time_layers import Row, assert_kv_layers, kv_of, mem_client, model, rows

VAL = pa.schema([("v", pa.string())])
INT_KEY = pa.schema([("k", pa.int64())])
STR_KEY = pa.schema([("k", pa.string())])

# ----- routing ----------------------------------------------------------------------


def test_rows_go_to_the_layer_of_their_kv_oldest_time_across_tables() -> None:
    """``oldest_layers``: every row of a (k, v) in the layer of its first (oldest) row;
    a LayeredOutput fed the same rows cut at any point routes them the same way."""
    rng = random.Random(3)
    rows = sorted({(rng.randrange(6), f"v{rng.randrange(2)}", rng.randrange(8)) for _ in range(40)})
    table = pa.table({
        "k": [r[0] for r in rows], "v": [r[1] for r in rows], T_COL: [r[2] for r in rows], D_COL: [1] * len(rows),
    })
    bounds = KvWholeBounds((3, 6))

    def layer_of(times: np.ndarray) -> np.ndarray:
        return np.searchsorted(np.asarray(bounds), times, side="right")

    got = oldest_layers(table, layer_of).tolist()
    oldest: dict[tuple[int, str], int] = {}
    for k, v, t in rows:
        oldest.setdefault((k, v), t)
    want = [int(layer_of(np.array([oldest[(k, v)]]))[0]) for k, v, _ in rows]
    assert got == want
    assert got != layer_of(table.column(T_COL).to_numpy()).tolist()  # (routing by row time differs)
    for cut in range(1, len(rows)):
        router = KvRouter(layer_of)
        a = router.route(table.slice(0, cut))
        b = router.route(table.slice(cut))
        assert [*a.tolist(), *b.tolist()] == want, cut
    # The in-memory merge's split (rows given as indices into a table), a slice at a time.
    out = LayeredOutput(bounds, lambda: None)  # type: ignore[arg-type,return-value]
    order = np.arange(len(rows))[::-1].copy()
    flipped = table.take(pa.array(order))  # rows stored in reverse, read in order by index
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(time_layers, "ROUTE_ROWS", 7)
        split = list(split_rows_by_layer(out, flipped, order, np.ones(len(rows), dtype=np.int64)))
    for layer, (idx, _) in enumerate(split):
        assert sorted(len(rows) - 1 - idx) == [i for i, w in enumerate(want) if w == layer]


def test_kv_whole_bounds_drop_the_two_times_and_first_share_rules() -> None:
    from persist_lib.shard.batch_meta import PartMeta

    four = [PartMeta(key="s/w/p", size=1, count=1000, sha256="", tmin=t, tmax=t) for t in range(4)]
    assert layer_bounds(four, 0, max_layers=6, min_rows=1, max_first_share=0.25) == ()
    kv = layer_bounds(four, 0, max_layers=6, min_rows=1, max_first_share=0.25, kv_whole=True)
    assert isinstance(kv, KvWholeBounds) and kv == (1, 2)


# ----- the property: every as-of equals the uncompacted shard and the model -----------


@st.composite
def _histories(draw: Any) -> dict[str, Any]:
    ops = draw(st.lists(st.sampled_from(["append", "append", "append", "since", "compact"]), min_size=3, max_size=16))
    return {
        "ops": ops,
        "layers": draw(st.integers(2, 5)),
        "in_memory": draw(st.booleans()),
        "str_keys": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**32 - 1)),
    }


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_histories())
def test_snapshot_at_every_as_of_equals_the_uncompacted_shard(h: dict[str, Any]) -> None:
    """The same random history (keys colliding, retractions, multiplicities, a (k, v)
    updated at many times, since advanced between merges) written to three shards: never
    compacted, compacted in (k, v)-whole layers, compacted in row-time layers. At every
    as-of in [since, upper) all three snapshots equal the model; every marked batch
    holds (k, v)-disjoint, consolidated runs in order of their (k, v)'s oldest times."""
    rng = random.Random(h["seed"])
    key = STR_KEY if h["str_keys"] else INT_KEY
    cfg = {"compaction_time_layers": h["layers"], "compaction_in_memory": h["in_memory"],
           "compaction_layer_max_first_share": 1.0}
    clients = {
        "plain": mem_client(compaction_enabled=False),
        "kv": mem_client(**cfg, compaction_layer_kv_whole=True),
        "time": mem_client(**cfg, compaction_layer_kv_whole=False),
    }
    handles = {name: (ShardId.new(), c) for name, c in clients.items()}
    opened = {name: c.open(s, key, VAL) for name, (s, c) in handles.items()}
    log: list[Row] = []
    upper = since = 0
    for op in h["ops"] + ["append", "compact"]:
        if op == "append":
            width = rng.choice([1, 2, 4])
            ups: list[Row] = []
            for _ in range(rng.randint(1, 50)):
                k = rng.randrange(25)
                ups.append((f"key{k}" if h["str_keys"] else k, f"v{rng.randrange(3)}", upper + rng.randrange(width),
                            rng.choice([1, 1, 2, -1])))
            for w, _ in opened.values():
                w.compare_and_append([(((k,), (v,)), t, d) for k, v, t, d in ups], upper, upper + width)
            log += ups
            upper += width
        elif op == "since" and upper > since:
            since = rng.randint(since, upper - 1)
            for _, r in opened.values():
                r.downgrade_since(since)
        elif op == "compact":
            for name in ("kv", "time"):
                mn.compact(clients[name], handles[name][0])
    kv_shard, kv_client = handles["kv"]
    for _, b in kv_client.machine(kv_shard).fetch_latest().trace_batches():
        if b.kv_disjoint:
            assert_kv_layers(b, kv_client.blob, opened["kv"][0].schemas, str(kv_shard))
    for as_of in range(since, upper):
        want = model(log, as_of)
        for name, (_, r) in opened.items():
            assert rows(r.snapshot(as_of)) == want, (name, as_of)
    for w, r in opened.values():
        w.expire()
        r.expire()


# ----- what is read, and what is not ------------------------------------------------


def _file_client(tmp_path: Path, **cfg: Any) -> PersistClient:
    base: dict[str, Any] = {"compaction_layer_min_rows": 1, "inline_threshold": 0, "blob_target_size": 4 << 10}
    return PersistClient.open(
        f"file://{tmp_path}/blob", f"sqlite:///{tmp_path}/c.db", PersistConfig.for_tests(**{**base, **cfg})
    )


def _four_commits(client: PersistClient, rows: int = 400) -> tuple[ShardId, Any, Any, list[Row]]:
    """The bench's shape, small: four commits at times 0..3 of random keys (some updated
    again later), compacted with history retained."""
    shard = ShardId.new()
    w, r = client.open(shard, INT_KEY, VAL)
    rng = random.Random(5)
    log: list[Row] = []
    for t in range(4):
        ups = [(rng.randrange(3000), f"v{rng.randrange(2)}", t, rng.choice([1, 1, -1])) for _ in range(rows)]
        w.compare_and_append([(((k,), (v,)), tt, d) for k, v, tt, d in ups], t, t + 1)
        log += ups
    mn.compact(client, shard)
    return shard, w, r, log


def _the_batch(client: PersistClient, shard: ShardId) -> HollowBatch:
    (b,) = [b for _, b in client.machine(shard).fetch_latest().trace_batches()]
    return b


def test_four_commits_compact_into_marked_layers_and_reads_concatenate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four equal commits (the bench's shape) are layered (the row-time layout wrote one
    run here), the batch is marked, and snapshots at every time take the concatenating
    read and equal the model."""
    client = _file_client(tmp_path)
    shard, w, r, log = _four_commits(client)
    b = _the_batch(client, shard)
    assert b.kv_disjoint and b.runs_concatenate and len(batch_runs(b)) >= 3
    assert_kv_layers(b, client.blob, w.schemas, str(shard))
    calls: list[int] = []
    orig = snapshot_mod.SnapshotReader._concatenated_runs

    def spy(self: Any, runs: list[Any], *args: Any) -> Any:
        calls.append(len(runs))
        return orig(self, runs, *args)

    monkeypatch.setattr(snapshot_mod.SnapshotReader, "_concatenated_runs", spy)
    for as_of in range(4):
        assert rows(r.snapshot(as_of)) == model(log, as_of), as_of
    assert calls and max(calls) >= 3
    # The streamed snapshot keeps its (k, v) order (it merges the runs).
    with r.snapshot_batches(3) as s:
        streamed = pa.Table.from_batches(list(s))
    assert rows(streamed) == model(log, 3)
    assert kv_of(streamed) == sorted(kv_of(streamed))
    w.expire()
    r.expire()
    client.close()


def test_an_unmarked_batch_is_merged_not_concatenated() -> None:
    """A batch without the mark (older state, the row-time layout, or splits that don't
    fit) never takes the concatenating read; state without the key decodes unmarked."""
    client = mem_client()
    shard, w, r, log = _four_commits(client)
    b = _the_batch(client, shard)
    assert HollowBatch.from_json(b.to_json()) == b
    old = b.to_json()
    del old["kv_disjoint"]
    assert not HollowBatch.from_json(old).kv_disjoint
    bad = {**b.to_json(), "run_splits": [len(b.parts) + 2]}
    assert not HollowBatch.from_json(bad).runs_concatenate
    state = client.machine(shard).fetch_latest()
    assert concatenating_read(state, 3, lambda p: True)
    bid = next(i for i, _ in state.trace_batches())
    unmarked = replace(state, batches={**state.batches, bid: replace(b, kv_disjoint=False)})
    assert not concatenating_read(unmarked, 3, lambda p: True)
    w.expire()
    r.expire()


def _corrupt(tmp_path: Path, key: str) -> None:
    (path,) = [p for p in (tmp_path / "blob").rglob("*") if p.is_file() and str(p).endswith(key.split("/")[-1])]
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_skipped_layer_is_never_fetched_and_a_read_one_is_verified(tmp_path: Path) -> None:
    """Corrupting every part of the layers after the as-of leaves the old read intact
    (they are never fetched); a read that needs a corrupted part fails its checksum."""
    client = _file_client(tmp_path)
    shard, w, r, log = _four_commits(client)
    b = _the_batch(client, shard)
    as_of = 0
    later = [p for p in b.parts if p.tmin > as_of]
    assert later and sum(p.count for p in later) > b.len // 2
    for p in later:
        assert p.key is not None
        _corrupt(tmp_path, p.key)
    assert rows(r.snapshot(as_of)) == model(log, as_of)
    with pytest.raises(CorruptionError):
        r.snapshot(3)
    first = next(p for p in b.parts if p.tmin <= as_of)
    assert first.key is not None
    _corrupt(tmp_path, first.key)
    with pytest.raises(CorruptionError):
        r.snapshot(as_of)
    w.expire()
    r.expire()
    client.close()


def test_layers_of_a_marked_batch_are_planned_by_their_oldest_times() -> None:
    """A (k, v)-whole layer's parts reach late times (later updates of old (k, v)), but
    their (k, v)'s oldest times end where the next run starts: the next merge plans
    with that range, so an old layer stays small instead of being spread to the end."""
    from persist_lib import Antichain
    from persist_lib.shard.batch_meta import PartMeta
    from persist_lib.shard.time_layers import planning_parts

    def part(tmin: int, tmax: int, count: int) -> PartMeta:
        return PartMeta(key="s/cml-x/p", size=1, count=count, sha256="", tmin=tmin, tmax=tmax)

    layered = HollowBatch(
        Antichain([0]), Antichain([64]), Antichain([0]),
        parts=(part(0, 63, 1000), part(8, 63, 1000), part(16, 63, 2000), part(32, 63, 4000)),
        run_splits=(1, 2, 3), kv_disjoint=True,
    )
    newer = HollowBatch(Antichain([64]), Antichain([72]), Antichain([0]), parts=(part(64, 71, 8000),))
    planned = planning_parts([layered, newer], kv_whole=True)
    assert [(p.tmin, p.tmax) for p in planned] == [(0, 7), (8, 15), (16, 31), (32, 63), (64, 71)]
    assert planning_parts([replace(layered, kv_disjoint=False), newer], kv_whole=True) == [*layered.parts, *newer.parts]
    kw: dict[str, Any] = {"max_layers": 5, "min_rows": 1, "kv_whole": True}
    assert layer_bounds(planned, 0, **kw)[0] <= 8  # the first layer: the first run's (k, v)
    assert layer_bounds([*layered.parts, *newer.parts], 0, **kw)[0] > 8  # (spread to 63, it would not be)
