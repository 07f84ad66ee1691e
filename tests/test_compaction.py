"""Compaction: the spine keeps batches logarithmic, the merge streams under a budget, and
results are applied exactly (or not at all)."""

from __future__ import annotations

import math
import time
import uuid
from collections import Counter

import numpy as np
import pyarrow as pa
import pytest

from persist_lib import Antichain, PersistClient, PersistConfig, ShardId
from persist_lib.errors import CorruptionError, LeaseExpired
from persist_lib.handles import maintenance as mn
from persist_lib.shard import maintenance_transitions as mt
from persist_lib.shard.batch_builder import build_batch
from persist_lib.shard.batch_meta import HollowBatch
from persist_lib.shard.codec import Schemas, internal_schema, normalize_updates
from persist_lib.shard.compactor import compact_request, merge_batches
from persist_lib.shard.consolidate import consolidate
from persist_lib.shard.part_writers import PartWriter
from persist_lib.shard.parts import encode_part, fetch_part, part_meta_for
from persist_lib.shard.runs import COMPACTOR_WRITER_PREFIX, new_compactor_writer_id
from persist_lib.shard.spine import compaction_requests
from persist_lib.shard.time_filters import advance_to_since

KEY = pa.schema([("k", pa.int64())])
VAL = pa.schema([("v", pa.string())])


def mem_client(**cfg: object) -> PersistClient:
    name = uuid.uuid4().hex
    return PersistClient.open(f"mem://{name}", f"mem://{name}", PersistConfig.for_tests(**cfg))


def contents(table: pa.Table) -> dict:
    """Accumulated multiplicities (negative ones kept, zeros dropped)."""
    c: Counter = Counter()
    for r in table.to_pylist():
        c[(r["k"], r["v"])] += r["diff"]
    return {k: v for k, v in c.items() if v != 0}


def inline_batch(schemas: Schemas, shard: str, updates: list, lo: int, hi: int) -> HollowBatch:
    """A one-part inline batch, built without a BatchBuilder (keeps 10k appends quick)."""
    t = normalize_updates(updates, schemas, shard=shard)
    data = encode_part(t, schemas)
    return HollowBatch(Antichain([lo]), Antichain([hi]), Antichain([lo]), (part_meta_for(data, t, None, inline=True),))


@pytest.mark.slow  # (~25-35 s: the default suite's budget; test_spine and the stateful tier cover the rule)
def test_10k_single_update_appends_keep_batches_logarithmic() -> None:
    """Compaction driven after every append keeps batches <= 2*log2(N) + 2."""
    n = 10_000
    client = mem_client()
    shard = ShardId.new()
    w, r = client.open(shard, KEY, VAL)
    bound = 2 * math.log2(n) + 2
    max_batches = 0
    updates_rewritten = 0
    for t in range(n):
        w.compare_and_append_batch(inline_batch(w.schemas, str(shard), [(((t,), (f"v{t}",)), t, 1)], t, t + 1), t, t + 1)
        res = mn.compact(client, shard)
        updates_rewritten += res["rows_rewritten"]
        max_batches = max(max_batches, res["batches_after"])
        assert res["batches_after"] <= bound, (t, res)
        if t % 1000 == 999:  # as a deployment would: heartbeat, GC (truncates consensus)
            r.heartbeat()
            mn.gc(client, shard)
    s = client.machine(shard).fetch_latest()
    assert max_batches <= bound
    assert len(s.batches) <= math.log2(n) + 1
    # Each update is rewritten about log2(N) times at most.
    assert updates_rewritten / n <= math.log2(n) + 2
    snap = r.snapshot(n - 1)
    assert snap.num_rows == n and set(snap.column("k").to_pylist()) == set(range(n))


def _random_updates(rng: np.random.Generator, lo: int, hi: int, n: int) -> list:
    ks = rng.integers(0, 50, n)
    vs = rng.integers(0, 3, n)
    ts = rng.integers(lo, hi, n)
    ds = rng.choice([-1, 1, 2], n)
    return [(((int(k),), (f"v{int(v)}",)), int(t), int(d)) for k, v, t, d in zip(ks, vs, ts, ds, strict=True)]


def test_compaction_preserves_every_readable_time() -> None:
    """Random multi-part batches: snapshots at every time >= since are unchanged."""
    client = mem_client(blob_target_size=4096, inline_threshold=512)
    shard = ShardId.new()
    w, r = client.open(shard, KEY, VAL)
    rng = np.random.default_rng(3)
    upper = 0
    for _ in range(12):
        hi = upper + int(rng.integers(1, 8))
        w.compare_and_append(_random_updates(rng, upper, hi, int(rng.integers(1, 400))), upper, hi)
        upper = hi
    before = {t: contents(r.snapshot(t)) for t in range(upper)}
    r.downgrade_since(upper // 2)
    res = mn.compact(client, shard)
    assert res["merges_applied"] >= 1 and res["compaction_debt_after"] == 0
    s = client.machine(shard).fetch_latest()
    assert len(s.batches) <= math.log2(max(sum(b.len for b in s.batches.values()), 2)) + 1
    for t in range(upper // 2, upper):
        assert contents(r.snapshot(t)) == before[t], t
    # Forwarded history: no update time below the since remains.
    for b in s.batches.values():
        for p in b.parts:
            assert p.tmin >= min(upper // 2, (b.upper.time or 1) - 1)
    # Listening from the since still reproduces the later changes.
    listen = r.listen(upper // 2)
    tail = listen.read_until(upper)
    acc = Counter(before[upper // 2])
    for row in tail.to_pylist():
        acc[(row["k"], row["v"])] += row["diff"]
    assert {k: v for k, v in acc.items() if v != 0} == before[upper - 1]


def test_logical_compaction_folds_history() -> None:
    """1,000 updates of one key; since advanced past them -> one consolidated record."""
    client = mem_client(blob_target_size=1 << 20)
    shard = ShardId.new()
    w, r = client.open(shard, KEY, VAL)
    n = 1000
    # One key whose value changes at every time: retract the old value, add the new one.
    for t in range(0, n, 100):
        ups = []
        for tt in range(t, t + 100):
            if tt > 0:
                ups.append((((7,), (f"v{tt - 1}",)), tt, -1))
            ups.append((((7,), (f"v{tt}",)), tt, 1))
        w.compare_and_append(ups, t, t + 100)
    s0 = client.machine(shard).fetch_latest()
    bytes_before = sum(b.size for b in s0.batches.values())
    updates_before = sum(b.len for b in s0.batches.values())
    assert updates_before == 2 * n - 1
    mn.compact(client, shard)
    r.downgrade_since(n)
    w.compare_and_append([], n, n + 1)
    mn.compact(client, shard)
    s1 = client.machine(shard).fetch_latest()
    updates_after = sum(b.len for b in s1.batches.values())
    bytes_after = sum(b.size for b in s1.batches.values())
    assert updates_after == 1
    assert bytes_after < bytes_before / 5
    assert contents(r.snapshot(n)) == {(7, f"v{n - 1}"): 1}


def _table(schemas: Schemas, rng: np.random.Generator, n: int, lo: int, hi: int) -> pa.Table:
    return pa.table(
        {
            "k.k": pa.array(rng.integers(0, n // 2, n)),
            "v.v": pa.array([f"x{i % 7}" for i in range(n)]),
            "t": pa.array(rng.integers(lo, hi, n)),
            "d": pa.array(rng.choice([-1, 1, 3], n)),
        },
        schema=internal_schema(schemas),
    )


def test_streaming_merge_under_budget() -> None:
    """300k updates in many parts merged under an 8 MiB budget: the merge streams
    (bounded rows/bytes held) and equals a whole-table consolidation."""
    from persist_lib.location.mem import MemBlob

    schemas = Schemas.create(KEY, VAL)
    blob = MemBlob(uuid.uuid4().hex)
    rng = np.random.default_rng(11)
    inputs, tables = [], []
    for i in range(6):
        t = _table(schemas, rng, 50_000, i * 100, i * 100 + 100)
        inputs.append(build_batch(blob, schemas, t, shard="s1", writer="w1", lower=i * 100, upper=i * 100 + 100, target_part_bytes=512 << 10))
        tables.append(t)
    budget = 8 << 20
    since = 250
    out = merge_batches(
        blob, schemas, shard="s1", inputs=tuple(inputs), lower=Antichain([0]), upper=Antichain([600]),
        since=Antichain([since]), memory_budget=budget, target_part_bytes=128 << 20, inline_threshold=4096,
    )
    st = out.stats
    total_rows = sum(t.num_rows for t in tables)
    assert st.runs == sum(len(b.parts) for b in inputs) > 6
    assert st.peak_bytes_held + st.output_reserve_bytes <= budget, st
    assert st.peak_rows_held < total_rows / 4, st  # never the whole input at once
    got_parts = [fetch_part(blob, p, schemas, "s1") for p in out.batch.parts]
    got = pa.concat_tables(got_parts)
    expected = consolidate(advance_to_since(pa.concat_tables(tables), since))
    assert consolidate(got).equals(got), "the output is one sorted, consolidated run"
    assert got.equals(expected)
    # Intermediate runs (if any) were deleted: only inputs and outputs remain.
    keys = {m.key for m in blob.list_keys_and_metadata("s1/")}
    assert keys == {k for b in inputs for k in b.blob_keys()} | set(out.batch.blob_keys())
    assert all(k.split("/")[1].startswith(COMPACTOR_WRITER_PREFIX) for k in out.batch.blob_keys())


@pytest.mark.parametrize("in_memory", [False, None])
@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_skewed_runs_merge_equals_consolidation(seed: int, in_memory: bool | None) -> None:
    """Runs of very different sizes and key ranges (a big run over a narrow key range,
    many tiny runs over a wide one, medium runs in several parts) under budgets that
    force folding small runs in memory, intermediate passes and proportional chunks:
    the output always equals one whole-table consolidation."""
    from persist_lib.location.mem import MemBlob

    schemas = Schemas.create(KEY, VAL)
    blob = MemBlob(uuid.uuid4().hex)
    rng = np.random.default_rng(seed)
    inputs, tables = [], []
    specs = [(int(rng.integers(1, 40)), 0, 1_000_000) for _ in range(int(rng.integers(5, 40)))]
    specs += [(int(rng.integers(20_000, 60_000)), 500_000, 500_000 + int(rng.integers(10, 5_000)))]
    specs += [(int(rng.integers(2_000, 20_000)), 0, int(rng.integers(10, 2_000_000))) for _ in range(3)]
    rng.shuffle(specs)
    for i, (n, klo, khi) in enumerate(specs):
        t = pa.table(
            {
                "k.k": pa.array(rng.integers(klo, khi, n)),
                "v.v": pa.array([f"x{j % 3}" for j in rng.integers(0, 3, n)]),
                "t": pa.array(rng.integers(i * 10, i * 10 + 10, n)),
                "d": pa.array(rng.choice([-1, 1, 2], n)),
            },
            schema=internal_schema(schemas),
        )
        inputs.append(build_batch(
            blob, schemas, t, shard="s1", writer="w1", lower=i * 10, upper=i * 10 + 10,
            target_part_bytes=int(rng.choice([16 << 10, 256 << 10])), inline_threshold=512,
        ))
        tables.append(t)
    budget = int(rng.choice([1 << 20, 4 << 20, 16 << 20]))
    since = int(rng.integers(0, len(specs) * 10))
    upper = len(specs) * 10
    out = merge_batches(
        blob, schemas, shard="s1", inputs=tuple(inputs), lower=Antichain([0]), upper=Antichain([upper]),
        since=Antichain([since]), memory_budget=budget, target_part_bytes=128 << 20, inline_threshold=0,
        in_memory=in_memory,
    )
    got = pa.concat_tables([fetch_part(blob, p, schemas, "s1") for p in out.batch.parts])
    expected = consolidate(advance_to_since(pa.concat_tables(tables), min(since, upper - 1)))
    assert consolidate(got).equals(got), "the output is one sorted, consolidated run"
    assert got.equals(expected), out.stats
    if in_memory is False:  # the streaming k-way merge, forced
        assert out.stats.passes >= 1 and out.stats.steps >= 1, out.stats
    keys = {m.key for m in blob.list_keys_and_metadata("s1/")}
    assert keys == {k for b in inputs for k in b.blob_keys()} | set(out.batch.blob_keys())


def test_unsorted_compactor_run_falls_back_to_a_run_per_part() -> None:
    """A batch that claims to be one run (compactor writer) but isn't is merged correctly."""
    from persist_lib.location.mem import MemBlob

    schemas = Schemas.create(KEY, VAL)
    blob = MemBlob(uuid.uuid4().hex)
    rng = np.random.default_rng(5)
    writer = COMPACTOR_WRITER_PREFIX + str(uuid.uuid4())
    t = _table(schemas, rng, 6000, 0, 10)
    b = build_batch(blob, schemas, t, shard="s1", writer=writer, lower=0, upper=10, target_part_bytes=16 << 10, inline_threshold=0)
    assert len(b.parts) > 1
    out = merge_batches(
        blob, schemas, shard="s1", inputs=(b,), lower=Antichain([0]), upper=Antichain([10]),
        since=Antichain([0]), memory_budget=2 << 20, target_part_bytes=1 << 20, inline_threshold=0,
        in_memory=False,
    )
    assert out.stats.restarted_per_part
    got = pa.concat_tables([fetch_part(blob, p, schemas, "s1") for p in out.batch.parts])
    assert got.equals(consolidate(t))


def test_changed_inputs_are_not_applied_and_output_deleted() -> None:
    client = mem_client(blob_target_size=2048, inline_threshold=0)
    shard = ShardId.new()
    w, r = client.open(shard, KEY, VAL)
    for t in range(2):
        w.compare_and_append([(((i,), ("x",)), t, 1) for i in range(200)], t, t + 1)
    m = client.machine(shard)
    s = m.fetch_latest()
    (req,) = compaction_requests(s)
    # Someone else compacts first.
    mn.compact(client, shard)
    blobs_before = {k.key for k in client.blob.list_keys_and_metadata(f"{shard}/")}
    res = compact_request(m, Schemas.create(KEY, VAL), client.config, req)
    assert res.outcome is mt.MergeOutcome.NOT_APPLIED_NO_MATCH and res.deleted_output
    assert {k.key for k in client.blob.list_keys_and_metadata(f"{shard}/")} == blobs_before
    assert contents(r.snapshot(1)) == {(i, "x"): 2 for i in range(200)}


def test_apply_merge_res_is_idempotent() -> None:
    """Re-running the transition after an indeterminate CAS recognises the applied output,
    even after a later merge replaced it (then its blobs must not be deleted)."""
    client = mem_client(blob_target_size=2048, inline_threshold=0)
    shard = ShardId.new()
    w, _ = client.open(shard, KEY, VAL)
    for t in range(2):
        w.compare_and_append([(((i,), ("x",)), t, 1) for i in range(100)], t, t + 1)
    m = client.machine(shard)
    pw = PartWriter.register(m, purpose="test", writer_id=new_compactor_writer_id())
    s = m.fetch_latest()
    (req,) = compaction_requests(s)
    out = merge_batches(
        m.blob, Schemas.create(KEY, VAL), shard=str(shard), inputs=req.inputs, lower=req.lower,
        upper=req.upper, since=req.since, memory_budget=8 << 20, target_part_bytes=2048, inline_threshold=0,
        writer=pw.writer_id,
    ).batch
    # Output of a writer that is not registered is never linked.
    unreg, res0 = mt.apply_merge_res(
        s.evolve(writers={}), 0, input_ids=req.batch_ids, inputs=req.inputs, output=out
    )
    assert unreg is None and res0.outcome is mt.MergeOutcome.NOT_APPLIED_WRITER_EXPIRED
    new, res = mt.apply_merge_res(
        s, 0, input_ids=req.batch_ids, inputs=req.inputs, output=out, part_writer=pw.writer_id
    )
    assert new is not None and res.outcome is mt.MergeOutcome.APPLIED
    assert pw.writer_id not in new.writers  # released in the same state change
    assert set(res.garbage_keys) == {k for b in req.inputs for k in b.blob_keys()}
    assert all(new.garbage[k].seqno == s.seqno for k in res.garbage_keys)  # last referencing version
    new = new.evolve(seqno=s.seqno + 1)
    again, res2 = mt.apply_merge_res(new, 0, input_ids=req.batch_ids, inputs=req.inputs, output=out)
    assert again is None and res2.outcome is mt.MergeOutcome.ALREADY_APPLIED
    # A later merge moved the output to garbage: still recognised as applied.
    moved = new.evolve(batches={}, garbage={**new.garbage, **{k: mt.GarbageEntry(new.seqno, 1) for k in out.blob_keys()}})
    _, res3 = mt.apply_merge_res(moved, 0, input_ids=req.batch_ids, inputs=req.inputs, output=out)
    assert res3.outcome is mt.MergeOutcome.ALREADY_APPLIED


def test_progress_only_append_during_compaction_still_applies() -> None:
    client = mem_client()
    shard = ShardId.new()
    w, r = client.open(shard, KEY, VAL)
    w.compare_and_append([(((1,), ("a",)), 0, 1)], 0, 1)
    w.compare_and_append([(((2,), ("b",)), 1, 1)], 1, 2)
    m = client.machine(shard)
    (req,) = compaction_requests(m.fetch_latest())
    w.compare_and_append([], 2, 9)  # widens the newest batch (no data)
    res = compact_request(m, Schemas.create(KEY, VAL), client.config, req)
    assert res.outcome is mt.MergeOutcome.APPLIED
    s = m.fetch_latest()
    (b,) = s.batches.values()
    assert b.upper == Antichain([9]) and s.upper == Antichain([9])
    assert contents(r.snapshot(8)) == {(1, "a"): 1, (2, "b"): 1}


def test_corrupt_input_fails_compaction_and_changes_nothing() -> None:
    client = mem_client(blob_target_size=2048, inline_threshold=0)
    shard = ShardId.new()
    w, _ = client.open(shard, KEY, VAL)
    for t in range(2):
        w.compare_and_append([(((i,), ("x",)), t, 1) for i in range(100)], t, t + 1)
    m = client.machine(shard)
    s = m.fetch_latest()
    key = next(iter(s.batches.values())).parts[0].key
    assert key is not None
    data = bytearray(client.blob.get(key) or b"")
    data[len(data) // 2] ^= 0xFF
    client.raw_blob.set(key, bytes(data))
    with pytest.raises(CorruptionError):
        mn.compact(client, shard)
    assert m.fetch_latest().batches == s.batches


def test_background_compaction_keeps_up() -> None:
    client = mem_client(compaction_enabled=True, compaction_workers=1, rollup_interval=16, inline_threshold=0)
    shard = ShardId.new()
    w, r = client.open(shard, KEY, VAL)
    n = 300
    for t in range(n):
        w.compare_and_append([(((t,), ("x",)), t, 1)], t, t + 1)
        if t % 50 == 0:
            r.heartbeat()  # lets GC move past the versions this reader no longer needs
    bg = client.background_compactor()
    assert bg.wait_idle(60)
    # Idle means no request is pending; a final pass settles what the last commit derived.
    deadline = time.monotonic() + 30
    while compaction_requests(client.machine(shard).fetch_latest()) and time.monotonic() < deadline:
        time.sleep(0.05)
        bg.wait_idle(10)
    s = client.machine(shard).fetch_latest()
    assert len(s.batches) <= 2 * math.log2(n) + 2
    stats = bg.stats()
    assert stats["applied"] > 0 and stats["failed"] == 0 and stats["gc_runs"] > 0
    assert client.consensus.scan(str(shard), 0, 1)[0].seqno > 1  # background GC truncated
    assert r.snapshot(n - 1).num_rows == n
    client.close()


def test_expired_reader_stops_holding_back_compaction() -> None:
    now = [1_000_000]
    client = mem_client(now_ms=lambda: now[0], reader_lease_ms=1000)
    shard = ShardId.new()
    w, r_old = client.open(shard, KEY, VAL)
    r_new = client.open_leased_reader(shard, KEY, VAL)
    for t in range(10):
        ups = [(((1,), (f"v{t}",)), t, 1)] + ([(((1,), (f"v{t - 1}",)), t, -1)] if t else [])
        w.compare_and_append(ups, t, t + 1)
    mn.compact(client, shard)
    r_new.downgrade_since(9)
    s = client.machine(shard).fetch_latest()
    assert s.since == Antichain([0])  # r_old holds it back
    now[0] += 5000
    r_new.heartbeat()
    expired = client.expire_leases(shard)
    assert r_old.reader_id in expired[str(shard)]["readers"]
    with pytest.raises(LeaseExpired):
        r_old.snapshot(9)
    s = client.machine(shard).fetch_latest()
    assert s.since == Antichain([9])
    mn.compact(client, shard)
    s = client.machine(shard).fetch_latest()
    assert sum(b.len for b in s.batches.values()) == 1  # history folded past the old since
    assert contents(r_new.snapshot(9)) == {(1, "v9"): 1}


def test_long_merge_output_is_protected_from_the_sweeper_until_applied() -> None:
    """Issue 13 defect 2 (compaction side): the sweeper used to rely on a time grace only;
    a merge running longer than it (or a sweeper clock ahead) lost its output. Now the
    output's writer is registered while the merge runs: a sweep with grace 0 and a clock
    hours ahead in the middle of the merge deletes none of it, and the merge applies."""
    from persist_lib.testing.hooks import clock_skew

    client = mem_client(blob_target_size=2048, inline_threshold=0)
    shard = ShardId.new()
    w, r = client.open(shard, KEY, VAL)
    for t in range(2):
        w.compare_and_append([(((i,), ("x",)), t, 1) for i in range(100)], t, t + 1)
    m = client.machine(shard)
    (req,) = compaction_requests(m.fetch_latest())
    swept: list[dict[str, object]] = []
    orig_set = client.blob.set

    def set_then_sweep(key: str, value: bytes) -> None:
        orig_set(key, value)
        if "/cmp-" in key:  # a merge output part just landed: sweep with the clock ahead
            with clock_skew(client.config, 3 * 3_600_000):
                swept.extend(client.unreferenced_blobs(shard, older_than_ms=0, delete=True))

    client.blob.set = set_then_sweep  # type: ignore[method-assign]
    try:
        res = compact_request(m, Schemas.create(KEY, VAL), client.config, req, context=client)
    finally:
        client.blob.set = orig_set  # type: ignore[method-assign]
    assert swept == []
    assert res.outcome is mt.MergeOutcome.APPLIED
    assert not any(wid.startswith("cmp-") for wid in m.fetch_latest().writers)
    assert contents(r.snapshot(1)) == {(i, "x"): 2 for i in range(100)}


def test_merge_whose_registration_lapsed_is_not_applied_and_its_output_deleted() -> None:
    client = mem_client(blob_target_size=2048, inline_threshold=0)
    shard = ShardId.new()
    w, r = client.open(shard, KEY, VAL)
    for t in range(2):
        w.compare_and_append([(((i,), ("x",)), t, 1) for i in range(100)], t, t + 1)
    m = client.machine(shard)
    before = m.fetch_latest().batches
    (req,) = compaction_requests(m.fetch_latest())
    orig_set = client.blob.set
    expired: list[object] = []

    def set_then_expire(key: str, value: bytes) -> None:
        orig_set(key, value)
        if "/cmp-" in key and not expired:  # lease expiry with a clock far ahead
            expired.append(client.expire_leases(shard, now=client.config.now_ms() + 10 * 3_600_000))

    client.blob.set = set_then_expire  # type: ignore[method-assign]
    try:
        res = compact_request(m, Schemas.create(KEY, VAL), client.config, req, context=client)
    finally:
        client.blob.set = orig_set  # type: ignore[method-assign]
    assert res.outcome is mt.MergeOutcome.NOT_APPLIED_WRITER_EXPIRED and res.deleted_output
    assert m.fetch_latest().batches == before
    assert not [k for k in client.blob.list_keys_and_metadata(f"{shard}/") if "/cmp-" in k.key]


def test_in_memory_merge_falls_back_to_streaming_when_parts_decode_too_large() -> None:
    """Whether a merge fits in memory depends on the decoded size of variable-width
    columns, known only once decoded: parts that compress 1000:1 look small, decode past
    the budget, and the merge streams instead (never holding them all), still exact."""
    from persist_lib.location.mem import MemBlob

    schemas = Schemas.create(KEY, VAL)
    blob = MemBlob(uuid.uuid4().hex)
    rng = np.random.default_rng(3)
    inputs, tables = [], []
    for i in range(3):
        n = 4_000
        t = pa.table(
            {
                "k.k": pa.array(rng.integers(0, 10_000, n)),
                "v.v": pa.array(["x" * 2_000 + str(j % 3) for j in range(n)]),
                "t": pa.array(np.full(n, i, dtype=np.int64)),
                "d": pa.array(np.ones(n, dtype=np.int64)),
            },
            schema=internal_schema(schemas),
        )
        inputs.append(build_batch(blob, schemas, t, shard="s1", writer="w1", lower=i, upper=i + 1,
                                  target_part_bytes=4 << 20, unsorted_min_bytes=1 << 20))
        tables.append(t)
    assert all(not p.sorted for b in inputs for p in b.parts)  # in-memory would be tried
    assert sum(p.size for b in inputs for p in b.parts) < 1 << 20 < sum(t.nbytes for t in tables) // 16
    out = merge_batches(
        blob, schemas, shard="s1", inputs=tuple(inputs), lower=Antichain([0]), upper=Antichain([3]),
        since=Antichain([0]), memory_budget=12 << 20, target_part_bytes=128 << 20, inline_threshold=0,
    )
    got = pa.concat_tables([fetch_part(blob, p, schemas, "s1") for p in out.batch.parts])
    assert got.equals(consolidate(pa.concat_tables(tables)))
    assert out.stats.steps >= 1, out.stats  # the streaming merge ran (the in-memory one has no steps)


@pytest.mark.parametrize("in_memory", [False, None], ids=["streaming", "chosen"])
def test_merges_stay_within_budget_when_parts_compress_far_more_than_assumed(in_memory: bool | None) -> None:
    """Decoded sizes were estimated from encoded bytes (x4): strings that compress
    ~300:1 decode ~75x larger than that, and the merge folded and held far past its
    budget. Writers now record each part's decoded size and the estimate never goes
    below it: many small parts of such strings merge within the budget, exactly."""
    from persist_lib.location.mem import MemBlob
    from persist_lib.shard.memory_plan import estimate_decoded_bytes

    schemas = Schemas.create(KEY, VAL)
    blob = MemBlob(uuid.uuid4().hex)
    rng = np.random.default_rng(5)
    inputs, tables = [], []
    for i in range(24):
        n = 400
        t = pa.table(
            {
                "k.k": pa.array(np.sort(rng.integers(0, 100_000, n))),
                "v.v": pa.array(["y" * 2_000 + str(j % 5) for j in range(n)]),
                "t": pa.array(np.full(n, i, dtype=np.int64)),
                "d": pa.array(np.ones(n, dtype=np.int64)),
            },
            schema=internal_schema(schemas),
        )
        inputs.append(build_batch(blob, schemas, consolidate(t), shard="s1", writer="w1", lower=i, upper=i + 1,
                                  target_part_bytes=8 << 20, inline_threshold=0))
        tables.append(t)
    parts = [p for b in inputs for p in b.parts]
    assert all(p.decoded is not None and p.decoded >= 400 * 2_000 for p in parts)
    assert all(estimate_decoded_bytes(p, schemas) >= p.decoded for p in parts)  # type: ignore[operator]
    budget = 12 << 20
    assert sum(t.nbytes for t in tables) > budget  # (19 MB decoded; encoded: ~70 KB)
    out = merge_batches(
        blob, schemas, shard="s1", inputs=tuple(inputs), lower=Antichain([0]), upper=Antichain([24]),
        since=Antichain([0]), memory_budget=budget, target_part_bytes=1 << 20, inline_threshold=0,
        in_memory=in_memory,
    )
    st = out.stats
    assert st.peak_bytes_held + st.output_reserve_bytes <= budget, st
    got = pa.concat_tables([fetch_part(blob, p, schemas, "s1") for p in out.batch.parts])
    assert got.equals(consolidate(pa.concat_tables(tables)))
