"""The range merge's grouping by time layer and its linear path (``range_merge``):
rows are cut by ``(key range, layer)`` as the tables are cut (no routing pass over the
output), and a group of key-disjoint sorted pieces is consolidated without a sort. The
output is exactly one consolidation per layer in every case: a bulk batch alone in its
layer, a bulk batch sharing its layer with small commits, parts spanning layers
(sorted and unsorted), rows cancelling across parts, and sorted-looking pieces that
are not sorted by ``(k, v, t)`` (the part's flag is not trusted)."""

from __future__ import annotations

import threading
import uuid

import numpy as np
import pyarrow as pa
import pytest

from persist_lib import Antichain
from persist_lib.errors import Determinate
from persist_lib.location.mem import MemBlob
from persist_lib.shard import range_merge
from persist_lib.shard.batch_builder import build_batch
from persist_lib.shard.codec import Schemas, internal_schema
from persist_lib.shard.compactor import merge_batches
from persist_lib.shard.consolidate import consolidate
from persist_lib.shard.memory_plan import MergeStats
from persist_lib.shard.parts import fetch_part
from persist_lib.shard.range_merge import RangeMerge, _cut
from persist_lib.shard.ranks import comparable
from persist_lib.shard.runs import batch_runs, new_compactor_writer_id


@pytest.fixture
def small_ranges_module(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranges of ~64 KiB and merges from 1,000 rows: several ranges on small data."""
    monkeypatch.setattr(range_merge, "RANGE_BYTES", 64 << 10)
    monkeypatch.setattr(range_merge, "MIN_RANGE_MERGE_ROWS", 1_000)


SCHEMAS_INT = Schemas.create(pa.schema([("a", pa.int64()), ("b", pa.string())]), pa.schema([("v", pa.string())]))
SCHEMAS_FLOAT = Schemas.create(pa.schema([("a", pa.float64())]), pa.schema([("v", pa.string())]))


def _rows(rng: np.random.Generator, schemas: Schemas, n: int, key_hi: int, t_hi: int) -> pa.Table:
    schema = internal_schema(schemas)
    if pa.types.is_floating(schema.field(0).type):
        lead = pa.array(rng.choice(np.array([-np.inf, -1.5, -0.0, 0.0, 2.0, 3.5, np.inf, np.nan]), n),
                        mask=rng.random(n) < 0.05)
    else:
        lead = pa.array(rng.integers(0, key_hi, n), mask=rng.random(n) < 0.02)
    cols = [lead]
    if len(schemas.key) == 2:
        cols.append(pa.array([f"b{j}" for j in rng.integers(0, 3, n)], mask=rng.random(n) < 0.05))
    cols += [
        pa.array([f"v{j}" for j in rng.integers(0, 3, n)]),
        pa.array(rng.integers(0, t_hi, n)),
        pa.array(rng.choice([-1, 1, 1, 2], n)),
    ]
    return pa.Table.from_arrays(cols, schema=schema)


def _canon(t: pa.Table) -> pa.Table:
    for i, f in enumerate(t.schema):
        if pa.types.is_floating(f.type):
            t = t.set_column(i, pa.field(f.name, pa.int64()), comparable(t.column(i)))
    return t


@pytest.mark.parametrize("layers", [(), (5,), (10,), (3, 7, 10)], ids=["one-run", "shared", "alone", "many"])
def test_range_merge_of_a_bulk_batch_and_small_commits(monkeypatch: pytest.MonkeyPatch, layers: tuple[int, ...]) -> None:
    """The bench's shape, small: 10 commits of 200 rows, two batches whose times span
    layers (one unsorted part, one sorted), and one bulk batch of sorted key-range
    parts at time 10 (random keys, some shared with the commits, a retraction of a
    commit's rows). Each output run is exactly the consolidation of its layer's rows;
    when the bulk batch is alone in its layer, its rows are consolidated without a
    sort (``presorted_rows``)."""
    monkeypatch.setattr(range_merge, "RANGE_BYTES", 64 << 10)
    monkeypatch.setattr(range_merge, "MIN_RANGE_MERGE_ROWS", 1_000)
    schemas = SCHEMAS_INT
    blob = MemBlob(uuid.uuid4().hex)
    rng = np.random.default_rng(5)
    inputs, tables = [], []
    for i in range(10):
        t = _rows(rng, schemas, 200, 50_000, 1)
        t = t.set_column(3, t.schema.field(3), pa.array(np.full(200, i, dtype=np.int64)))
        inputs.append(build_batch(blob, schemas, t, shard="s1", writer="w1", lower=i, upper=i + 1))
        tables.append(t)
    for unsorted in (True, False):  # times 0..9: across the layers
        t = _rows(rng, schemas, 3_000, 50_000, 10)
        inputs.append(build_batch(blob, schemas, t, shard="s1", writer="w1", lower=0, upper=10,
                                  target_part_bytes=32 << 10, **({"unsorted_min_bytes": 1} if unsorted else {})))
        tables.append(t)
    bulk = _rows(rng, schemas, 30_000, 50_000, 1)
    bulk = bulk.set_column(3, bulk.schema.field(3), pa.array(np.full(bulk.num_rows, 10, dtype=np.int64)))
    back = tables[0].slice(0, 100)  # retract rows of the first commit (at time 0: they cancel)
    back = back.set_column(4, back.schema.field(4), pa.array(-np.asarray(back.column("d"))))
    inputs.append(build_batch(blob, schemas, back, shard="s1", writer="w1", lower=0, upper=1))
    tables.append(back)
    inputs.append(build_batch(blob, schemas, bulk, shard="s1", writer="w1", lower=10, upper=11,
                              key_range_min_bytes=0, target_part_bytes=256 << 10))
    tables.append(bulk)
    assert len(inputs[-1].parts) >= 2 and all(p.sorted for p in inputs[-1].parts)
    assert any(not p.sorted for b in inputs for p in b.parts)
    out = merge_batches(
        blob, schemas, shard="s1", inputs=tuple(inputs), lower=Antichain([0]), upper=Antichain([11]),
        since=Antichain([0]), memory_budget=64 << 20, target_part_bytes=128 << 20, inline_threshold=0,
        writer=new_compactor_writer_id(layered=bool(layers)), time_layers=layers,
    )
    st = out.stats
    assert st.key_ranges >= 2 and st.steps == 0, st
    if layers and layers[-1] == 10:
        assert st.presorted_rows == sum(p.count for p in inputs[-1].parts), st
    runs = batch_runs(out.batch)
    assert len(runs) == len(layers) + 1
    got_runs = [pa.concat_tables([fetch_part(blob, p, schemas, "s1") for p in run]) for run in runs]
    everything = consolidate(pa.concat_tables(tables))
    t_col = np.asarray(everything.column("t"))
    bounds = [0, *layers, 1 << 62]
    for i, got in enumerate(got_runs):
        want = everything.filter(pa.array((t_col >= bounds[i]) & (t_col < bounds[i + 1])))
        assert _canon(got).equals(_canon(want)), i
    assert st.output_rows == everything.num_rows


def test_pieces_sorted_by_the_leading_key_only_are_sorted_by_the_full_order() -> None:
    """A table whose leading keys ascend but whose next field does not (no writer
    makes such a part; a part's flag is not trusted either): the cut sees it sorted by
    the leading key, the linear consolidation refuses it and the group is sorted."""
    n = 1_000
    t = pa.table({
        "k.a": pa.array(np.repeat(np.arange(n // 2), 2)), "k.b": pa.array(["y", "x"] * (n // 2)),
        "v.v": pa.array(["v"] * n), "t": pa.array(np.zeros(n, dtype=np.int64)),
        "d": pa.array(np.ones(n, dtype=np.int64)),
    }, schema=internal_schema(SCHEMAS_INT))
    cut = _cut(t, np.array([200], dtype=np.int64))
    assert cut.perm is None and cut.first is not None  # sorted by the leading key: sliced
    pieces = [p for p in (cut.piece(r, 0) for r in range(2)) if p is not None]
    assert len(pieces) == 2
    merge = RangeMerge.__new__(RangeMerge)
    merge.linear, merge.stats = True, MergeStats()
    got = pa.concat_tables([merge._consolidated([p]) for p in pieces])
    assert got.equals(consolidate(t)) and merge.stats.presorted_rows == 0


def test_a_table_spanning_layers_is_cut_by_range_and_layer() -> None:
    """Sorted and unsorted tables whose times span three layers: every (range, layer)
    piece holds exactly that range's rows of that layer, in the table's order."""
    rng = np.random.default_rng(9)
    t = _rows(rng, SCHEMAS_INT, 2_000, 1_000, 9)
    piv = np.array([300, 600], dtype=np.int64)
    bounds = np.array([3, 6], dtype=np.int64)

    def layer_of(times: np.ndarray) -> np.ndarray:
        return np.searchsorted(bounds, times, side="right")

    for table in (t, consolidate(t)):
        cut = _cut(table, piv, layer_of, 3)
        lead = range_merge.leading_keys(table.column(0))
        rid = np.digitize(lead, piv, right=True)
        lay = layer_of(np.asarray(table.column("t")))
        assert cut.range_rows().tolist() == np.bincount(rid, minlength=3).tolist()
        for r in range(3):
            for layer in range(3):
                p = cut.piece(r, layer)
                want = table.filter(pa.array((rid == r) & (lay == layer)))
                if p is None:
                    assert want.num_rows == 0
                    continue
                assert p.table.equals(want)
                if p.first is not None:
                    keys = range_merge.leading_keys(p.table.column(0))
                    assert (p.first, p.last) == (keys[0], keys[-1])


class _RecordingBlob(MemBlob):
    """A MemBlob recording which thread wrote each key; ``fail_after``: the set that
    many sets after the first fails (a full disk)."""

    def __init__(self, name: str, fail_after: int | None = None) -> None:
        super().__init__(name)
        self.writers: dict[str, str] = {}
        self.fail_after = fail_after
        self.lock = threading.Lock()

    def set(self, key: str, value: bytes) -> None:
        with self.lock:
            if self.fail_after is not None:
                if self.fail_after == 0:
                    raise Determinate(f"blob {key}: no space left (test)")
                self.fail_after -= 1
            self.writers[key] = threading.current_thread().name
        super().set(key, value)


def _layered_inputs(blob: MemBlob) -> list:  # type: ignore[type-arg]
    rng = np.random.default_rng(21)
    inputs = []
    for i in range(12):
        t = _rows(rng, SCHEMAS_INT, 1_000, 1_000_000, 1)
        t = t.set_column(3, t.schema.field(3), pa.array(np.full(1_000, i, dtype=np.int64)))
        inputs.append(build_batch(blob, SCHEMAS_INT, t, shard="s1", writer="w1", lower=i, upper=i + 1))
    return inputs


def _merge_layered(blob: MemBlob, inputs: list):  # type: ignore[no-untyped-def,type-arg]
    return merge_batches(
        blob, SCHEMAS_INT, shard="s1", inputs=tuple(inputs), lower=Antichain([0]), upper=Antichain([12]),
        since=Antichain([0]), memory_budget=64 << 20, target_part_bytes=128 << 20, inline_threshold=0,
        writer=new_compactor_writer_id(layered=True), time_layers=(3, 6, 9),
    )


@pytest.mark.usefixtures("small_ranges_module")
def test_the_layers_last_parts_are_written_at_once_off_the_merge_thread() -> None:
    """Every layer below the part size is one part, written when its builder finishes:
    all layers finish at once on the finishing threads, not one after the other on the
    merge's own thread (where each small layer's encode and write waited for the
    previous one's)."""
    blob = _RecordingBlob(uuid.uuid4().hex)
    inputs = _layered_inputs(blob)
    blob.writers.clear()
    out = _merge_layered(blob, inputs)
    assert len(batch_runs(out.batch)) == 4 and len(out.batch.parts) == 4
    names = [blob.writers[k] for k in out.batch.blob_keys()]
    assert all(n.startswith("persist-compactor-finish") for n in names), names


@pytest.mark.usefixtures("small_ranges_module")
def test_a_layer_failing_to_finish_leaves_no_output() -> None:
    """One layer's write fails while the others finish at once: the merge raises that
    error and every part written by any layer is deleted."""
    blob = _RecordingBlob(uuid.uuid4().hex)
    inputs = _layered_inputs(blob)
    before = {m.key for m in blob.list_keys_and_metadata("s1/")}
    blob.fail_after = 2
    with pytest.raises(Determinate, match="no space left"):
        _merge_layered(blob, inputs)
    assert {m.key for m in blob.list_keys_and_metadata("s1/")} == before


@pytest.mark.parametrize("schemas", [SCHEMAS_INT, SCHEMAS_FLOAT], ids=["int", "float"])
@pytest.mark.parametrize("split", [False, True], ids=["one-thread", "two-key-ranges"])
def test_consolidate_pieces_equals_consolidate(monkeypatch: pytest.MonkeyPatch, schemas: Schemas, split: bool) -> None:
    """``consolidate_pieces`` (chunks combined, Arrow's take) gives exactly
    ``consolidate``'s table for many-chunk inputs: nulls, floats (NaN, -0.0), equal
    rows across chunks, zero sums; and when the plan splits into two key ranges."""
    from persist_lib.shard import consolidate as cmod

    if split:
        monkeypatch.setattr(cmod, "PARALLEL_PLAN_ROWS", 500)
    rng = np.random.default_rng(17)
    for _ in range(4):
        chunks = [_rows(rng, schemas, int(rng.integers(0, 400)), 300, 3) for _ in range(int(rng.integers(1, 30)))]
        t = pa.concat_tables(chunks)
        got, want = cmod.consolidate_pieces(t), consolidate(t)
        assert _canon(got).equals(_canon(want))
        assert all(c.num_chunks <= 1 for c in got.columns)
