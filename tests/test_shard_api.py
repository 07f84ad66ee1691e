"""The public shard API: writes, reads, frontiers, errors (issue: persist_lib core)."""

from __future__ import annotations

import uuid

import pyarrow as pa
import pytest

from persist_lib import Antichain, PersistClient, PersistConfig, ShardId
from persist_lib.errors import (
    CorruptionError,
    Indeterminate,
    InvalidUri,
    InvalidUsage,
    LeaseExpired,
    SchemaMismatch,
    UpperMismatch,
)
from persist_lib.handles.listen import ListenProgress, ListenUpdates
from persist_lib.location.base import CaSResult, Consensus, VersionedData
from persist_lib.location.mem import MemBlob, MemConsensus
from persist_lib.shard.machine import clear_state_cache

KEY = pa.schema([("k", pa.string())])
VAL = pa.schema([("v", pa.int64())])


def mem_client(**cfg: object) -> PersistClient:
    name = uuid.uuid4().hex
    return PersistClient.open(f"mem://{name}", f"mem://{name}", PersistConfig.for_tests(**cfg))


@pytest.fixture
def client() -> PersistClient:
    return mem_client()


def rows(table: pa.Table) -> list[tuple]:
    return sorted((r["k"], r["v"], r["ts"], r["diff"]) for r in table.to_pylist())


def test_append_snapshot_listen(client: PersistClient) -> None:
    shard = ShardId.new()
    w, r = client.open(shard, KEY, VAL)
    assert w.upper == Antichain([0])
    w.compare_and_append([((("a",), (1,)), 0, 1), ((("b",), (2,)), 0, 1)], 0, 1)
    w.compare_and_append([((("a",), (1,)), 1, -1), ((("a",), (3,)), 1, 1)], 1, 3)
    assert w.upper == Antichain([3])
    assert rows(r.snapshot(0)) == [("a", 1, 0, 1), ("b", 2, 0, 1)]
    assert rows(r.snapshot(2)) == [("a", 3, 2, 1), ("b", 2, 2, 1)]
    listen = r.listen(0)
    events = listen.next(1.0)
    ups = [e for e in events if isinstance(e, ListenUpdates)]
    assert rows(ups[0].table) == [("a", 1, 1, -1), ("a", 3, 1, 1)]
    assert isinstance(events[-1], ListenProgress) and events[-1].upper == Antichain([3])
    assert listen.next(0.05) == []
    w.compare_and_append([((("c",), (9,)), 5, 1)], 3, 6)
    events = listen.next(1.0)
    assert rows(events[0].table) == [("c", 9, 5, 1)]


def test_table_input_and_consolidation(client: PersistClient) -> None:
    w, r = client.open(ShardId.new(), KEY, VAL)
    t = pa.table({"k": ["x", "x", "y"], "v": [1, 1, 2], "ts": [0, 0, 0], "diff": [1, 1, 1]})
    w.compare_and_append(t, 0, 1)
    assert rows(r.snapshot(0)) == [("x", 1, 0, 2), ("y", 2, 0, 1)]
    w.compare_and_append(pa.table({"k": ["x"], "v": [1], "ts": [1], "diff": [-2]}), 1, 2)
    assert rows(r.snapshot(1)) == [("y", 2, 1, 1)]


def test_upper_mismatch_changes_nothing(client: PersistClient) -> None:
    w, r = client.open(ShardId.new(), KEY, VAL)
    w.compare_and_append([((("a",), (1,)), 0, 1)], 0, 1)
    before = client.inspect(w.shard_id)
    with pytest.raises(UpperMismatch) as ei:
        w.compare_and_append([((("z",), (1,)), 0, 1)], 0, 1)
    assert ei.value.current == Antichain([1])
    assert "expected upper [0]" in str(ei.value) and w.shard_id in str(ei.value)
    after = client.inspect(w.shard_id)
    assert after["batches"] == before["batches"] and after["upper"] == [1]
    # the losing batch's blobs were deleted
    keys = {m.key for m in client.blob.list_keys_and_metadata(w.shard_id)}
    live = {p["key"] for b in after["batches"] for p in b["parts"]}
    assert keys <= live | {k for k in keys if "/rollup/" in k}


def test_definite_append_semantics(client: PersistClient) -> None:
    shard = ShardId.new()
    w1, r = client.open(shard, KEY, VAL)
    w2 = client.open_writer(shard, KEY, VAL)
    data = [((("a",), (1,)), 0, 1), ((("b",), (1,)), 1, 1), ((("c",), (1,)), 2, 1)]
    w1.append(data[:2], 0, 2)
    # a second instance writing the identical data over [0, 3): only t >= 2 is added
    w2.append(data, 0, 3)
    assert rows(r.snapshot(2)) == [("a", 1, 2, 1), ("b", 1, 2, 1), ("c", 1, 2, 1)]
    # entirely behind the upper: a successful no-op
    w1.append(data, 0, 3)
    assert rows(r.snapshot(2)) == [("a", 1, 2, 1), ("b", 1, 2, 1), ("c", 1, 2, 1)]
    # a gap is refused
    with pytest.raises(UpperMismatch):
        w1.append([((("d",), (1,)), 5, 1)], 5, 6)


def test_bad_times_are_rejected_and_change_nothing(client: PersistClient) -> None:
    w, r = client.open(ShardId.new(), KEY, VAL)
    w.compare_and_append([((("a",), (1,)), 0, 1)], 0, 1)
    before = client.inspect(w.shard_id)
    nblobs = len(list(client.blob.list_keys_and_metadata(w.shard_id)))
    for bad, lo, hi in [(0, 1, 2), (2, 1, 2), (7, 1, 5)]:
        with pytest.raises(InvalidUsage, match=rf"update time {bad} is outside"):
            w.compare_and_append([((("a",), (1,)), bad, 1)], lo, hi)
    with pytest.raises(InvalidUsage, match="never moves backwards"):
        w.compare_and_append([], 1, 0)
    after = client.inspect(w.shard_id)
    assert after["seqno"] == before["seqno"]
    assert len(list(client.blob.list_keys_and_metadata(w.shard_id))) == nblobs


def test_as_of_before_since_and_downgrade_backwards(client: PersistClient) -> None:
    w, r = client.open(ShardId.new(), KEY, VAL)
    w.compare_and_append([((("a",), (1,)), 0, 1)], 0, 5)
    r.downgrade_since(3)
    assert r.since == Antichain([3])
    with pytest.raises(InvalidUsage, match="before this reader's since"):
        r.snapshot(2)
    with pytest.raises(InvalidUsage, match="never moves backwards"):
        r.downgrade_since(1)
    assert r.since == Antichain([3])
    assert rows(r.snapshot(3)) == [("a", 1, 3, 1)]


def test_since_is_min_over_readers(client: PersistClient) -> None:
    shard = ShardId.new()
    w, r1 = client.open(shard, KEY, VAL)
    r2 = client.open_leased_reader(shard, KEY, VAL)
    w.compare_and_append([], 0, 10)
    r1.downgrade_since(8)
    assert client.inspect(shard)["since"] == [0]
    r2.downgrade_since(5)
    assert client.inspect(shard)["since"] == [5]
    r2.expire()
    assert client.inspect(shard)["since"] == [8]


def test_schema_mismatch_on_open(client: PersistClient) -> None:
    shard = ShardId.new()
    client.open(shard, KEY, VAL)
    with pytest.raises(SchemaMismatch, match=str(shard)):
        client.open(shard, KEY, pa.schema([("v", pa.string())]))


def test_use_after_lease_expiry() -> None:
    now = [1_000_000]
    client = mem_client(now_ms=lambda: now[0], reader_lease_ms=1000, writer_lease_ms=1000)
    shard = ShardId.new()
    w, r = client.open(shard, KEY, VAL)
    w.compare_and_append([((("a",), (1,)), 0, 1)], 0, 1)
    now[0] += 5000
    expired = client.expire_leases(shard)
    assert expired[str(shard)]["readers"] == [r.reader_id]
    with pytest.raises(LeaseExpired, match=r.reader_id):
        r.snapshot(0)
    with pytest.raises(LeaseExpired):
        r.downgrade_since(1)
    with pytest.raises(LeaseExpired, match=w.writer_id):
        w.compare_and_append([((("b",), (1,)), 1, 1)], 1, 2)
    assert client.inspect(shard)["upper"] == [1]


def test_corrupted_part_raises() -> None:
    client = mem_client(inline_threshold=0)
    w, r = client.open(ShardId.new(), KEY, VAL)
    w.compare_and_append([((("a",), (i,)), 0, 1) for i in range(100)], 0, 1)
    key = client.inspect(w.shard_id)["batches"][0]["parts"][0]["key"]
    data = bytearray(client.blob.get(key) or b"")
    data[len(data) // 2] ^= 0x10
    client.raw_blob.delete(key)
    client.raw_blob.set(key, bytes(data))
    with pytest.raises(CorruptionError, match=key):
        r.snapshot(0)


def test_malformed_inputs() -> None:
    with pytest.raises(InvalidUri):
        PersistClient.open("nope://x", "mem://y")
    with pytest.raises(InvalidUsage, match="not a valid shard id"):
        ShardId.parse("hello")
    client = mem_client()
    with pytest.raises(InvalidUsage, match="not a valid shard id"):
        client.open("s123", KEY, VAL)
    with pytest.raises(InvalidUsage):
        client.open(ShardId.new(), KEY, pa.schema([("ts", pa.int64())]))


class ApplyThenTimeout(Consensus):
    """Applies the first ``n`` CAS calls and then reports a timeout (indeterminate)."""

    def __init__(self, inner: Consensus, n: int) -> None:
        self.inner, self.n = inner, n

    def head(self, key: str) -> VersionedData | None:
        return self.inner.head(key)

    def compare_and_set(self, key: str, expected: int | None, new: VersionedData) -> CaSResult:
        res = self.inner.compare_and_set(key, expected, new)
        if self.n > 0 and res is CaSResult.COMMITTED:
            self.n -= 1
            raise Indeterminate("injected: applied, then timed out")
        return res

    def scan(self, key: str, from_seqno: int, limit: int) -> list[VersionedData]:
        return self.inner.scan(key, from_seqno, limit)

    def truncate(self, key: str, seqno: int) -> int:
        return self.inner.truncate(key, seqno)

    def list_keys(self):  # type: ignore[no-untyped-def]
        return self.inner.list_keys()

    def describe(self) -> str:
        return "apply-then-timeout:" + self.inner.describe()


def test_indeterminate_after_successful_cas_never_duplicates() -> None:
    name = uuid.uuid4().hex
    cons = ApplyThenTimeout(MemConsensus(name), 0)
    client = PersistClient(MemBlob(name), cons, PersistConfig.for_tests())
    w, r = client.open(ShardId.new(), KEY, VAL)
    for t in range(5):
        cons.n = 1  # the append's CAS lands, then the caller is told "timeout"
        w.compare_and_append([((("a",), (1,)), t, 1)], t, t + 1)
    assert rows(r.snapshot(4)) == [("a", 1, 4, 5)]
    assert client.inspect(w.shard_id)["upper"] == [5]


class ScanCounting(Consensus):
    """Passes everything through; counts the entries ``scan`` returns (the diffs a
    machine replays on top of its starting state)."""

    def __init__(self, inner: Consensus) -> None:
        self.inner = inner
        self.scanned = 0

    def head(self, key: str) -> VersionedData | None:
        return self.inner.head(key)

    def compare_and_set(self, key: str, expected: int | None, new: VersionedData) -> CaSResult:
        return self.inner.compare_and_set(key, expected, new)

    def scan(self, key: str, from_seqno: int, limit: int) -> list[VersionedData]:
        out = self.inner.scan(key, from_seqno, limit)
        self.scanned += len(out)
        return out

    def truncate(self, key: str, seqno: int) -> int:
        return self.inner.truncate(key, seqno)

    def list_keys(self):  # type: ignore[no-untyped-def]
        return self.inner.list_keys()

    def describe(self) -> str:
        return "scan-counting:" + self.inner.describe()


INTERVAL = 16  # the rollup interval the bound is checked against


@pytest.mark.parametrize(
    "write_interval",
    [
        INTERVAL,
        pytest.param(
            10**9,
            marks=pytest.mark.xfail(
                strict=True, reason="rollups disabled by config: the open must replay every diff"
            ),
            id="rollups-disabled-must-fail",
        ),
    ],
    ids=lambda v: f"rollup_interval={v}",
)
def test_reopen_after_many_commits_replays_a_bounded_number_of_diffs(write_interval: int) -> None:
    """Opening a shard after many commits costs one rollup load plus at most about
    ``rollup_interval`` diffs, however many commits there were (docs/design.md section 5). The
    second case writes with rollups disabled and must fail the bound (strict xfail):
    the check is not vacuous."""
    commits = 15 * INTERVAL
    client = mem_client(rollup_interval=write_interval)
    shard = ShardId.new()
    w, r = client.open(shard, KEY, VAL)
    for t in range(commits):
        w.compare_and_append([((("a",), (t,)), t, 1)], t, t + 1)
    state = client.inspect(shard)
    assert state["seqno"] >= commits
    clear_state_cache()  # a cold open, as in a new process
    counting = ScanCounting(client.raw_consensus)
    fresh = PersistClient(client.raw_blob, counting, PersistConfig.for_tests(rollup_interval=INTERVAL))
    m = fresh.machine(shard)
    s = m.fetch_latest()
    assert s.seqno == state["seqno"]
    assert fresh.inspect(shard) == state
    replayed = counting.scanned
    assert m.metrics.rollup_loads == 1, "a cold open starts from the latest rollup"
    # the latest rollup the head points to: the open replays exactly the diffs after it
    latest_rollup = max((int(k) for k in state["rollups"]), default=0)
    assert replayed == s.seqno - latest_rollup
    assert replayed <= 2 * INTERVAL, (
        f"opening the shard at seqno {s.seqno} replayed {replayed} diffs (latest rollup at "
        f"{latest_rollup}): replay on open is not bounded by ~rollup_interval={INTERVAL}"
    )
    r2 = fresh.open_leased_reader(shard, KEY, VAL)
    assert len(r2.snapshot(commits - 1)) == commits


def test_critical_since_handle_fencing(client: PersistClient) -> None:
    shard = ShardId.new()
    w, r = client.open(shard, KEY, VAL)
    h = client.open_critical_since(shard, KEY, VAL, initial_opaque="epoch-1")
    r.downgrade_since(100)
    w.compare_and_append([], 0, 50)
    assert h.since == Antichain([0])
    assert client.inspect(shard)["since"] == [0]  # the critical reader holds it back
    res = h.compare_and_downgrade_since("epoch-0", "epoch-2", 10)
    assert not res.ok and res.current_opaque == "epoch-1"
    res = h.compare_and_downgrade_since("epoch-1", "epoch-2", 10)
    assert res.ok and h.since == Antichain([10])
    assert client.inspect(shard)["since"] == [10]
    # re-opening by id (after a restart) finds the same registration
    h2 = client.open_critical_since(shard, KEY, VAL, reader_id=h.reader_id)
    assert h2.opaque == "epoch-2"


def test_snapshot_splits_equal_snapshot(client: PersistClient) -> None:
    client.config.blob_target_size = 4096
    client.config.inline_threshold = 0
    w, r = client.open(ShardId.new(), KEY, VAL)
    for t in range(4):
        w.compare_and_append([(((f"k{i}",), (i * t,)), t, 1) for i in range(300)], t, t + 1)
    splits = r.snapshot_splits(3, 3)
    assert len(splits) == 3
    import pickle

    tables = [pickle.loads(pickle.dumps(s)).fetch(client.blob) for s in splits]
    merged = pa.concat_tables(tables)
    from collections import Counter

    c: Counter = Counter()
    for x in merged.to_pylist():
        c[(x["k"], x["v"], x["ts"])] += x["diff"]
    assert sorted((k, v, t, d) for (k, v, t), d in c.items() if d) == rows(r.snapshot(3))
    r.release_splits()


def test_range_splits_equal_updates_between(client: PersistClient) -> None:
    """Range splits fetched elsewhere give ``updates_between``; a lower at the since is
    refused like ``updates_between`` refuses it, and a refused call keeps no hold."""
    import pickle

    client.config.blob_target_size = 4096
    client.config.inline_threshold = 0
    w, r = client.open(ShardId.new(), KEY, VAL)
    for t in range(5):
        w.compare_and_append([(((f"k{i}",), (i * t,)), t, 1 if t % 2 else -1) for i in range(200)], t, t + 1)
    splits = r.range_splits(1, 4, 3)
    assert 1 <= len(splits) <= 3 and "RangeSplit(" in repr(splits[0])
    merged = pa.concat_tables([pickle.loads(pickle.dumps(s)).fetch(client.blob) for s in splits])
    got = sorted((x["k"], x["v"], x["ts"], x["diff"]) for x in merged.to_pylist())
    assert got == rows(r.updates_between(1, 4))
    assert {ts for _, _, ts, _ in got} == {1, 2, 3}
    r.release_splits()
    r.downgrade_since(2)
    holds_before = dict(r._holds)
    for lower in (1, 2):
        with pytest.raises(InvalidUsage, match="not beyond"):
            r.range_splits(lower, 4, 2)
    with pytest.raises(InvalidUsage, match="backwards"):
        r.range_splits(4, 3, 2)
    assert dict(r._holds) == holds_before and not r._split_holds
    assert r.range_splits(3, 4, 2)[0].lower == 3
    r.release_splits()


def test_empty_value_schema_and_closing_upper(client: PersistClient) -> None:
    w, r = client.open(ShardId.new(), KEY, pa.schema([]))
    w.compare_and_append([((("a",), ()), 0, 1)], 0, 1)
    w.compare_and_append([], 1, Antichain())
    assert client.inspect(w.shard_id)["upper"] == []
    snap = r.snapshot(10)
    assert snap.to_pylist() == [{"k": "a", "ts": 10, "diff": 1}]
    with pytest.raises(InvalidUsage):
        w.compare_and_append([], Antichain(), Antichain())


def test_round_trip_on_every_location(location: tuple[str, str]) -> None:
    """The same API on mem+mem, file+sqlite and s3(moto)+postgres."""
    blob_uri, consensus_uri = location
    cfg = PersistConfig.for_tests(inline_threshold=0, rollup_interval=8)
    client = PersistClient.open(blob_uri, consensus_uri, cfg)
    shard = ShardId.new()
    w, r = client.open(shard, KEY, VAL)
    listen = r.listen(0)
    for t in range(20):
        w.compare_and_append([(((f"k{t % 3}",), (t,)), t, 1)], t, t + 1)
    assert len(r.snapshot(19)) == 20
    got = listen.read_until(20, timeout_s=10)
    assert sorted(got["ts"].to_pylist()) == list(range(1, 20))
    # a second client with a cold cache (another process, in effect) sees the same shard
    clear_state_cache()
    other = PersistClient.open(blob_uri, consensus_uri, PersistConfig.for_tests())
    r2 = other.open_leased_reader(shard, KEY, VAL)
    assert rows(r2.snapshot(19)) == rows(r.snapshot(19))
    assert other.inspect(shard)["rollups"], "rollups were written and used"
    assert str(shard) in other.list_shards()
    other.close()
    client.close()


def test_close_waits_for_a_background_rollup(tmp_path: object) -> None:
    """A rollup written off the writer's path is still using blob and consensus when the
    client closes: close waits for it (it used to die in its thread on a closed SQLite).

    The rollup's upload is held at a gate: close must still be running while it is held
    (a close that returned then would not have waited), and once released, the rollup
    finishes before close returns, without an error in its thread."""
    import threading
    from pathlib import Path

    from persist_lib.location.file_blob import FileBlob
    from persist_lib.location.sqlite_consensus import SqliteConsensus

    started, release = threading.Event(), threading.Event()
    order: list[str] = []

    class GatedRollupBlob(FileBlob):
        def set(self, key: str, value: bytes) -> None:
            if "/rollup/" in key and not started.is_set():
                started.set()
                assert release.wait(60), "the test never released the rollup"
                super().set(key, value)
                order.append("rollup written")
                return
            super().set(key, value)

    root = Path(str(tmp_path))
    errors: list[object] = []
    old_hook = threading.excepthook
    threading.excepthook = lambda a: errors.append(a.exc_value)
    try:
        c = PersistClient(
            GatedRollupBlob(root / "blob"), SqliteConsensus(root / "c.db"),
            PersistConfig.for_tests(rollup_interval=2, rollup_in_background=True),
        )
        w = c.open_writer(ShardId.new(), KEY, VAL)
        for t in range(3):
            w.compare_and_append([((("a",), (t,)), t, 1)], t, t + 1)
        assert started.wait(30), "no background rollup started"
        assert order == [], "the rollup is held at the gate"

        def close() -> None:
            c.close()
            order.append("closed")

        closer = threading.Thread(target=close)
        closer.start()
        closer.join(1.0)  # a close that does not wait returns well within this
        alive = closer.is_alive()
        release.set()
        closer.join(60)
        assert alive, f"close returned while the rollup was still running: {order}"
        assert not closer.is_alive()
    finally:
        release.set()
        threading.excepthook = old_hook
    assert order == ["rollup written", "closed"]
    assert errors == []
