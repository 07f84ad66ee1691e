"""Projection and filter pushdown (issue 28): statistics recorded at write time, parts
skipped by them, and reads that equal the full read filtered and projected afterwards."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hs

from persist_lib import PersistClient, PersistConfig, ShardId
from persist_lib.errors import CorruptionError, InvalidUsage
from persist_lib.handles.listen import ListenUpdates
from persist_lib.handles.write import WriteHandle
from persist_lib.shard.batch_meta import HollowBatch, PartMeta
from persist_lib.shard.predicate import Predicate, Term

KEY = pa.schema([("id", pa.int64())])
VAL = pa.schema([("name", pa.string()), ("score", pa.int64())])


def mem_client(**cfg: object) -> PersistClient:
    name = uuid.uuid4().hex
    return PersistClient.open(f"mem://{name}", f"mem://{name}", PersistConfig.for_tests(metrics=True, **cfg))


def updates(rows: list[tuple[int, str | None, int | None, int, int]]) -> pa.Table:
    return pa.table(
        {
            "id": pa.array([r[0] for r in rows], pa.int64()),
            "name": pa.array([r[1] for r in rows], pa.string()),
            "score": pa.array([r[2] for r in rows], pa.int64()),
            "ts": pa.array([r[3] for r in rows], pa.int64()),
            "diff": pa.array([r[4] for r in rows], pa.int64()),
        }
    )


def append(w: WriteHandle, rows: list[Any], lower: int, upper: int, *, stats: bool = True) -> HollowBatch:
    b = w.builder(lower)
    b.record_stats = stats
    b.add(w.normalize(updates(rows)))
    batch = b.finish(upper)
    w.compare_and_append_batch(batch, lower, upper)
    return batch


def parts_read(client: PersistClient, shard: ShardId) -> tuple[int, int]:
    assert client.metrics is not None
    sm = client.metrics.shard(str(shard))
    return sm.parts_read, sm.bytes_read


def as_rows(t: pa.Table) -> list[tuple[Any, ...]]:
    return sorted((tuple(r.values()) for r in t.to_pylist()), key=repr)


# -- statistics ------------------------------------------------------------------------


def test_stats_recorded_per_part_and_optional_in_state() -> None:
    client = mem_client()
    shard = ShardId.new()
    w, _ = client.open(shard, KEY, VAL)
    batch = append(w, [(5, "b", None, 0, 1), (2, None, None, 1, 1), (9, "a", None, 2, 1)], 0, 3)
    (p,) = batch.parts
    got = {c: (lo, hi, n) for c, lo, hi, n in p.stats or ()}
    assert got == {"t": (0, 2, 0), "k.id": (2, 9, 0), "v.name": ("a", "b", 1), "v.score": (None, None, 3)}
    # In state: an optional key; a part recorded without it (an old part) parses as before.
    d = p.to_json()
    assert PartMeta.from_json(json.loads(json.dumps(d))) == p
    old = {k: v for k, v in d.items() if k != "stats"}
    assert PartMeta.from_json(old).stats is None
    # A builder told not to record them writes parts like the old writers did.
    old_batch = append(w, [(1, "x", 1, 3, 1)], 3, 4, stats=False)
    assert old_batch.parts[0].stats is None and "stats" not in old_batch.parts[0].to_json()


def test_compaction_output_has_stats() -> None:
    """Compacting parts written without statistics writes parts with them."""
    client = mem_client()
    shard = ShardId.new()
    w, r = client.open(shard, KEY, VAL)
    for i in range(8):
        append(w, [(i * 10 + j, f"n{j}", j, i, 1) for j in range(50)], i, i + 1, stats=False)
    r.downgrade_since(7)
    client.compact(shard, raise_on_failure=True)
    state = r._machine.fetch_latest()
    batches = [b for _, b in state.trace_batches()]
    assert len(batches) < 8  # something was merged
    merged = [p for b in batches if b.since.time == 7 or len(b.parts) and b.lower.time != b.upper.time for p in b.parts]
    assert any(p.stats is not None for p in merged)
    full = r.snapshot(7)
    got = r.snapshot(7, filter=[("id", ">=", 70)])
    assert as_rows(got) == as_rows(full.filter(pa.compute.greater_equal(full["id"], 70)))


# -- pruning ---------------------------------------------------------------------------


def test_selective_filter_fetches_only_matching_parts() -> None:
    client = mem_client(inline_threshold=0)
    shard = ShardId.new()
    w, r = client.open(shard, KEY, VAL)
    for i in range(10):  # ten parts with disjoint key ranges
        append(w, [(i * 100 + j, f"n{j}", j, i, 1) for j in range(100)], i, i + 1)
    parts0, bytes0 = parts_read(client, shard)
    full = r.snapshot(9)
    parts1, bytes1 = parts_read(client, shard)
    assert parts1 - parts0 == 10
    got = r.snapshot(9, filter=[("id", "==", 512)])
    parts2, bytes2 = parts_read(client, shard)
    assert parts2 - parts1 == 1
    assert (bytes2 - bytes1) * 5 < bytes1 - bytes0
    assert as_rows(got) == [(512, "n12", 12, 9, 1)]
    assert as_rows(got) == as_rows(full.filter(pa.compute.equal(full["id"], 512)))
    # IN over two ranges: two parts.
    r.snapshot(9, filter=[("id", "in", [5, 905])])
    assert parts_read(client, shard)[0] - parts2 == 2


def test_old_parts_without_stats_are_always_read() -> None:
    client = mem_client(inline_threshold=0)
    shard = ShardId.new()
    w, r = client.open(shard, KEY, VAL)
    append(w, [(1, "a", 1, 0, 1)], 0, 1, stats=False)
    append(w, [(2, "b", 2, 1, 1)], 1, 2)
    p0, _ = parts_read(client, shard)
    assert as_rows(r.snapshot(1, filter=[("id", "==", 1)])) == [(1, "a", 1, 1, 1)]
    # The part with stats (id 2) was skipped; the old one could not be.
    assert parts_read(client, shard)[0] - p0 == 1


def test_checksum_verified_on_every_part_read() -> None:
    client = mem_client(inline_threshold=0)
    shard = ShardId.new()
    w, r = client.open(shard, KEY, VAL)
    b1 = append(w, [(i, "a" * 20, i, 0, 1) for i in range(500)], 0, 1)
    append(w, [(1000 + i, "b" * 20, i, 1, 1) for i in range(500)], 1, 2)
    key = b1.parts[0].key
    assert key is not None
    raw = bytearray(client.blob.get(key) or b"")
    raw[len(raw) // 2] ^= 0xFF
    client.blob.set(key, bytes(raw))
    # The corrupt part is pruned by the filter: never fetched, the read succeeds.
    assert len(r.snapshot(1, filter=[("id", ">=", 1000)])) == 500
    # A filter that keeps it must verify it, and fail.
    with pytest.raises(CorruptionError):
        r.snapshot(1, filter=[("id", "<", 10)])


# -- exactness of filtering before consolidation -----------------------------------------


def test_value_filter_before_consolidation_is_exact() -> None:
    """A record updated from one value to another (retraction and insertion in other
    parts): filtering rows by a predicate on (k, v) before consolidating drops whole
    (k, v) groups, so the result is the full snapshot filtered."""
    client = mem_client()
    shard = ShardId.new()
    w, r = client.open(shard, KEY, VAL)
    append(w, [(1, "old", 10, 0, 1), (2, "keep", 5, 0, 1)], 0, 1)
    append(w, [(1, "old", 10, 1, -1), (1, "new", 20, 1, 1)], 1, 2, stats=False)
    append(w, [(2, "keep", 5, 2, 1), (2, "keep", 5, 2, -1), (3, "new", 20, 2, 2)], 2, 3)
    for spec in ([("name", "==", "old")], [("score", ">", 9)], [("name", "!=", "keep")], [("id", "<=", 1)]):
        full = r.snapshot(2)
        pred = Predicate.of(spec)
        assert pred is not None
        want = [row for row in full.to_pylist() if py_eval(pred, row)]
        assert as_rows(r.snapshot(2, filter=spec)) == sorted((tuple(x.values()) for x in want), key=repr)
    assert len(r.snapshot(2, filter=[("name", "==", "old")])) == 0


def test_ts_filter_is_applied_after_forwarding() -> None:
    """A snapshot forwards every time to its as-of, so a ``ts`` conjunct is decided on the
    as-of: filtering rows by their stored time before consolidating would keep the
    insertion at ts 0 and drop its retraction at ts 1 (wrong)."""
    client = mem_client()
    shard = ShardId.new()
    w, r = client.open(shard, KEY, VAL)
    append(w, [(1, "a", 1, 0, 1)], 0, 1)
    append(w, [(1, "a", 1, 1, -1)], 1, 2)
    assert len(r.snapshot(1, filter=[("ts", "<", 1)])) == 0
    assert len(r.snapshot(1, filter=[("ts", "==", 1)])) == 0  # the record was deleted
    assert as_rows(r.snapshot(0, filter=[("ts", "==", 0)])) == [(1, "a", 1, 0, 1)]
    # A range read keeps times: its ts conjunct compares each update's own time.
    assert as_rows(r.updates_between(0, 2, filter=[("ts", ">=", 1)])) == [(1, "a", 1, 1, -1)]


# -- errors ----------------------------------------------------------------------------


def test_bad_filters_and_columns_are_typed_errors() -> None:
    client = mem_client()
    shard = ShardId.new()
    w, r = client.open(shard, KEY, VAL)
    append(w, [(1, "a", 1, 0, 1)], 0, 1)
    with pytest.raises(InvalidUsage, match="no column 'nope'"):
        r.snapshot(0, filter=[("nope", "==", 1)])
    with pytest.raises(InvalidUsage, match="is not a int64"):
        r.snapshot(0, filter=[("id", "==", "x")])
    with pytest.raises(InvalidUsage, match="unknown operator"):
        r.snapshot(0, filter=[("id", "~", 1)])
    with pytest.raises(InvalidUsage, match="is_null"):
        r.snapshot(0, filter=[("id", "==", None)])
    with pytest.raises(InvalidUsage, match=r"columns \['bad'\]"):
        r.snapshot(0, columns=["bad"])
    with pytest.raises(InvalidUsage, match="list of column names"):
        r.snapshot(0, columns="name")
    assert r._held_seqnos() == {}


# -- the property: filtered/projected read == full read filtered/projected -----------------


def py_eval(pred: Predicate, row: dict[str, Any]) -> bool:
    """An independent evaluator of a predicate on one user row (SQL null semantics)."""
    for t in pred.terms:
        v = row[t.column]
        if t.op == "is_null":
            ok = v is None
        elif t.op == "is_not_null":
            ok = v is not None
        elif v is None:
            ok = False
        elif t.op == "in":
            ok = v in t.value
        else:
            ok = {
                "==": v == t.value, "!=": v != t.value, "<": v < t.value, "<=": v <= t.value,
                ">": v > t.value, ">=": v >= t.value,
            }[t.op]
        if not ok:
            return False
    return True


NAMES = [None, "a", "b", "c", "d"]
row_st = hs.tuples(
    hs.integers(0, 30), hs.sampled_from(NAMES), hs.one_of(hs.none(), hs.integers(-3, 3)), hs.sampled_from([-1, 1, 2])
)
term_st = hs.one_of(
    hs.builds(Term, hs.just("id"), hs.sampled_from(["==", "!=", "<", "<=", ">", ">="]), hs.integers(-1, 31)),
    hs.builds(Term, hs.just("id"), hs.just("in"), hs.lists(hs.integers(0, 30), max_size=4)),
    hs.builds(Term, hs.just("name"), hs.sampled_from(["==", "!=", "<", ">="]), hs.sampled_from(NAMES[1:])),
    hs.builds(Term, hs.just("name"), hs.just("in"), hs.lists(hs.sampled_from(NAMES[1:]), max_size=3)),
    hs.builds(Term, hs.sampled_from(["name", "score"]), hs.sampled_from(["is_null", "is_not_null"])),
    hs.builds(Term, hs.just("score"), hs.sampled_from(["<", ">", "=="]), hs.integers(-3, 3)),
    hs.builds(Term, hs.just("ts"), hs.sampled_from(["<", ">=", "=="]), hs.integers(0, 6)),
)


@settings(max_examples=120, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    batches=hs.lists(hs.tuples(hs.lists(row_st, min_size=1, max_size=12), hs.booleans()), min_size=1, max_size=5),
    terms=hs.lists(term_st, min_size=1, max_size=3),
    columns=hs.one_of(hs.none(), hs.lists(hs.sampled_from(["id", "name", "score"]), unique=True)),
    as_of_back=hs.integers(0, 4),
    compact=hs.booleans(),
)
def test_pushdown_equals_read_then_filter(
    batches: list[tuple[list[tuple[int, str | None, int | None, int]], bool]],
    terms: list[Term],
    columns: list[str] | None,
    as_of_back: int,
    compact: bool,
) -> None:
    """Over random updates in batches with and without statistics (some compacted,
    their times forwarded), random conjunctions and projections: the pushed-down read
    equals the full read filtered and projected afterwards (snapshot, its stream, and
    the time-range read)."""
    client = mem_client()
    shard = ShardId.new()
    w, r = client.open(shard, KEY, VAL)
    for t, (rows, stats) in enumerate(batches):
        # Sorted by id, so parts with stats hold narrow key ranges that filters can skip.
        append(w, sorted(((i, n, s, t, d) for i, n, s, d in rows), key=lambda x: x[0]), t, t + 1, stats=stats)
    upper = len(batches)
    as_of = max(0, upper - 1 - as_of_back)
    pred = Predicate(tuple(terms))
    lower = 0
    if compact and as_of > 0:
        r.downgrade_since(as_of)  # compaction may now forward times up to as_of
        client.compact(shard, raise_on_failure=True)
        lower = as_of + 1

    def expect(full: pa.Table) -> list[tuple[Any, ...]]:
        keep = [row for row in full.to_pylist() if py_eval(pred, row)]
        cols = [c for c in full.column_names if columns is None or c in columns or c in ("ts", "diff")]
        return sorted((tuple(row[c] for c in cols) for row in keep), key=repr)

    got = r.snapshot(as_of, columns=columns, filter=pred)
    assert as_rows(got) == expect(r.snapshot(as_of))
    with r.snapshot_batches(as_of, columns=columns, filter=pred) as s:
        streamed = pa.Table.from_batches(list(s), schema=s.schema)
    assert streamed.schema == got.schema
    assert as_rows(streamed) == as_rows(got)
    if lower < upper:
        ranged = r.updates_between(lower, upper, columns=columns, filter=pred)
        assert as_rows(ranged) == expect(r.updates_between(lower, upper))


def test_streamed_snapshot_and_listen_filter() -> None:
    """The streaming (beyond the memory budget) snapshot and listen paths filter too."""
    client = mem_client()
    shard = ShardId.new()
    w, r = client.open(shard, KEY, VAL)
    n = 40_000
    append(w, [(i, f"name-{i % 7}", i % 11, 0, 1) for i in range(n)], 0, 1)
    append(w, [(i, f"name-{i % 7}", i % 11, 1, -1) for i in range(0, n, 2)], 1, 2, stats=False)
    spec = [("score", "==", 3), ("id", "<", 30_000)]
    pred = Predicate.of(spec)
    assert pred is not None
    full = r.snapshot(1)
    want = sorted((row["id"], row["diff"]) for row in full.to_pylist() if py_eval(pred, row))
    with r.snapshot_batches(1, memory_budget=1 << 20, columns=["id"], filter=spec) as s:
        t = pa.Table.from_batches(list(s), schema=s.schema)
        assert s.stats.passes >= 1  # the k-way merge ran (the streaming path)
    assert t.column_names == ["id", "ts", "diff"]
    assert sorted(zip(t["id"].to_pylist(), t["diff"].to_pylist(), strict=True)) == want
    listen = r.listen(0, memory_budget=1 << 20, columns=["id", "score"], filter=spec)
    got: list[tuple[int, int]] = []
    while listen.frontier.less_than(2):
        for e in listen.next(1.0):
            if isinstance(e, ListenUpdates):
                assert e.table.column_names == ["id", "score", "ts", "diff"]
                got += zip(e.table["id"].to_pylist(), e.table["diff"].to_pylist(), strict=True)
    assert sorted(got) == sorted(
        (i, -1) for i in range(0, 30_000, 2) if i % 11 == 3
    )


def test_nan_values_keep_their_part() -> None:
    """NaN is not ordered: a float column holding one gets no bounds, so a filter it
    satisfies (``!=``) can't skip its part."""
    client = mem_client(inline_threshold=0)
    shard = ShardId.new()
    w, r = client.open(shard, KEY, pa.schema([("x", pa.float64())]))
    b = w.builder(0)
    b.add(w.normalize(pa.table({"id": [1, 2], "x": [1.0, float("nan")], "ts": [0, 0], "diff": [1, 1]})))
    batch = b.finish(1)
    w.compare_and_append_batch(batch, 0, 1)
    assert {c for c, *_ in batch.parts[0].stats or ()} == {"t", "k.id"}
    got = r.snapshot(0, filter=[("x", "!=", 1.0)])
    assert got["id"].to_pylist() == [2]


def test_types_without_a_min_max_kernel_are_written_without_bounds() -> None:
    """Arrow has no min/max for float16 or durations: such columns get no bounds and the
    write succeeds (it used to fail inside the statistics), and filters on them still
    read right (the part is kept)."""
    client = mem_client(inline_threshold=0)
    shard = ShardId.new()
    val = pa.schema([("h", pa.float16()), ("d", pa.duration("us"))])
    w, r = client.open(shard, KEY, val)
    b = w.builder(0)
    rows = pa.table(
        {
            "id": pa.array([1, 2], pa.int64()),
            "h": pa.array([1.5, 2.5], pa.float16()),
            "d": pa.array([5, 7], pa.duration("us")),
            "ts": [0, 0],
            "diff": [1, 1],
        }
    )
    b.add(w.normalize(rows))
    batch = b.finish(1)
    w.compare_and_append_batch(batch, 0, 1)
    assert {c for c, *_ in batch.parts[0].stats or ()} == {"t", "k.id"}
    assert r.snapshot(0)["d"].to_pylist() == rows["d"].to_pylist()
    got = r.snapshot(0, filter=[("id", "==", 2)])
    assert got["id"].to_pylist() == [2]


@settings(max_examples=400, deadline=None, database=None)
@given(
    ids=hs.lists(hs.one_of(hs.none(), hs.integers(-5, 5)), min_size=1, max_size=6),
    names=hs.lists(hs.one_of(hs.none(), hs.sampled_from(["", "a", "ab", "b"])), min_size=6, max_size=6),
    term=hs.one_of(
        hs.builds(Term, hs.just("score"), hs.sampled_from(["==", "!=", "<", "<=", ">", ">="]), hs.integers(-6, 6)),
        hs.builds(Term, hs.just("score"), hs.just("in"), hs.lists(hs.integers(-6, 6), max_size=3)),
        hs.builds(Term, hs.just("name"), hs.sampled_from(["==", "!=", "<", "<=", ">", ">="]),
                  hs.sampled_from(["", "a", "ab", "b", "c"])),
        hs.builds(Term, hs.sampled_from(["name", "score"]), hs.sampled_from(["is_null", "is_not_null"])),
    ),
)
def test_statistics_never_rule_out_a_matching_row(
    ids: list[int | None], names: list[str | None], term: Term
) -> None:
    """Pruning is sound: if any row of a part satisfies a term, the part's statistics
    don't rule the term out."""
    from persist_lib.shard.codec import Schemas
    from persist_lib.shard.stats import parse_stats, part_stats

    schemas = Schemas.create(KEY, VAL)
    n = len(ids)
    t = pa.table({
        "k.id": pa.array(range(n), pa.int64()), "v.name": pa.array(names[:n], pa.string()),
        "v.score": pa.array(ids, pa.int64()), "t": pa.array([0] * n, pa.int64()), "d": pa.array([1] * n, pa.int64()),
    })
    bound = Predicate((term,)).bind(schemas, shard="s")
    m = bound.mask(t)
    assert m is not None
    if any(m.to_pylist()):
        assert bound.may_match(parse_stats(part_stats(t, schemas), schemas), n)


def test_temporal_columns_prune_by_their_physical_bounds() -> None:
    """Dates and timestamps (with a time zone) are kept as their integer physical value
    and compared with the filter's constants converted the same way."""
    import datetime as dt

    client = mem_client(inline_threshold=0)
    shard = ShardId.new()
    val = pa.schema([("day", pa.date32()), ("at", pa.timestamp("us", tz="UTC"))])
    w, r = client.open(shard, KEY, val)
    utc = dt.UTC
    for i in range(4):
        day = dt.date(2024, 1, 1) + dt.timedelta(days=i)
        w.compare_and_append(
            pa.table({
                "id": [i], "day": pa.array([day], pa.date32()),
                "at": pa.array([dt.datetime(2024, 1, 1, i, tzinfo=utc)], pa.timestamp("us", tz="UTC")),
                "ts": [i], "diff": [1],
            }),
            i, i + 1,
        )
    p0, _ = parts_read(client, shard)
    got = r.snapshot(3, filter=[("day", ">=", dt.date(2024, 1, 3))])
    assert got["id"].to_pylist() == [2, 3]
    p1, _ = parts_read(client, shard)
    assert p1 - p0 == 2
    got = r.snapshot(3, filter=[("at", "<", dt.datetime(2024, 1, 1, 1, 30, tzinfo=utc))])
    assert got["id"].to_pylist() == [0, 1]
    assert parts_read(client, shard)[0] - p1 == 2
