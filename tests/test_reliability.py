"""Randomized concurrent histories with injected faults, checked (the default tier).

Each history runs real OS processes (3 writers, 2 leased readers, a compactor, GC and a
lease expirer) against one shard on file blob + SQLite or Postgres consensus, at 5%
per-call faults plus outages and a ``kill -9`` nemesis, then the checker
(``persist_lib.testing.checker``) must find no violation. The planted-bug histories
prove the checker can fail. ``tests/test_reliability_long.py`` is the soak version.

Also here: regression tests for real bugs the harness found.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from urllib.parse import quote

import pyarrow as pa
import pytest

from persist_lib import PersistClient, PersistConfig, ShardId
from persist_lib.errors import Determinate, Indeterminate, InvalidUsage
from persist_lib.location.base import CaSResult, Consensus, VersionedData
from persist_lib.location.mem import MemBlob, MemConsensus
from persist_lib.testing.runner import HistoryResult, default_config, run_history

KEY = pa.schema([("k", pa.string())])
VAL = pa.schema([("v", pa.int64())])

SQLITE_SEEDS = range(1, 5)
PG_SEEDS = range(101, 103)
OPS = 120


def _sqlite_uri(root: Path) -> str:
    return "sqlite:///" + quote(str(root / "consensus.db"))


def _run(seed: int, root: Path, consensus_uri: str, **kw: object) -> HistoryResult:
    cfg = default_config(seed, str(root), consensus_uri, target_ops=OPS, time_limit_s=90, **kw)
    return run_history(cfg)


@pytest.mark.parametrize("seed", SQLITE_SEEDS)
def test_history_sqlite(seed: int, tmp_path: Path) -> None:
    res = _run(seed, tmp_path, _sqlite_uri(tmp_path))
    assert res.ok, res.describe()
    s = res.report.stats
    assert s["commits"] > 0 and s.get("snapshots_checked", 0) + s.get("listen_progress_checked", 0) > 0


@pytest.mark.postgres
@pytest.mark.parametrize("seed", PG_SEEDS)
def test_history_postgres(seed: int, tmp_path: Path, pg_consensus_url: str) -> None:
    res = _run(seed, tmp_path, pg_consensus_url)
    assert res.ok, res.describe()


# ----- regressions for real bugs the harness found ------------------------------------------


class _PartitionAfterCas(Consensus):
    """Applies the next CAS, reports a timeout, then fails every read (a partition)."""

    def __init__(self, inner: Consensus) -> None:
        self.inner = inner
        self.armed = False
        self.down = False

    def head(self, key: str) -> VersionedData | None:
        if self.down:
            raise Determinate("partition")
        return self.inner.head(key)

    def compare_and_set(self, key: str, expected: int | None, new: VersionedData) -> CaSResult:
        if self.down:
            raise Determinate("partition")
        res = self.inner.compare_and_set(key, expected, new)
        if self.armed:
            self.armed, self.down = False, True
            raise Indeterminate("timeout after the CAS was applied")
        return res

    def scan(self, key: str, from_seqno: int, limit: int) -> list[VersionedData]:
        if self.down:
            raise Determinate("partition")
        return self.inner.scan(key, from_seqno, limit)

    def truncate(self, key: str, seqno: int) -> int:
        return self.inner.truncate(key, seqno)

    def list_keys(self):  # type: ignore[no-untyped-def]
        return self.inner.list_keys()


def test_applied_cas_followed_by_failing_rereads_is_indeterminate() -> None:
    """Found by the history checker (``failed_write_committed``): ``Machine.apply`` turned
    an applied-then-timed-out CAS into a *Determinate* error when the re-reads that
    should resolve it failed until the deadline; ``WriteHandle`` then deleted the
    committed batch's parts, so every later read failed with ``BlobNotFound``."""
    name = uuid.uuid4().hex
    cons = _PartitionAfterCas(MemConsensus(name))
    client = PersistClient(
        MemBlob(name), cons, PersistConfig.for_tests(retry_deadline_s=0.2, inline_threshold=0)
    )
    w, r = client.open(ShardId.new(), KEY, VAL)
    cons.armed = True
    with pytest.raises(Indeterminate):
        w.compare_and_append([((("a",), (1,)), 0, 1)], 0, 1)
    cons.down = False
    assert w.fetch_recent_upper().time == 1  # it did commit ...
    assert r.snapshot(0).to_pylist() == [{"k": "a", "v": 1, "ts": 0, "diff": 1}]  # ... intact


class _TruncateDuringSweep(Consensus):
    """Truncates the log right after the sweeper's first look at it (a concurrent GC)."""

    def __init__(self, inner: Consensus) -> None:
        self.inner = inner
        self.truncate_to: int | None = None

    def head(self, key: str) -> VersionedData | None:
        return self.inner.head(key)

    def compare_and_set(self, key: str, expected: int | None, new: VersionedData) -> CaSResult:
        return self.inner.compare_and_set(key, expected, new)

    def scan(self, key: str, from_seqno: int, limit: int) -> list[VersionedData]:
        res = self.inner.scan(key, from_seqno, limit)
        if self.truncate_to is not None and from_seqno == 0:
            self.inner.truncate(key, self.truncate_to)
            self.truncate_to = None
        return res

    def truncate(self, key: str, seqno: int) -> int:
        return self.inner.truncate(key, seqno)

    def list_keys(self):  # type: ignore[no-untyped-def]
        return self.inner.list_keys()


def test_leak_sweep_survives_a_concurrent_truncation() -> None:
    """Found by the history checker (``corruption_observed`` in a GC actor's leak report):
    ``gc.live_blob_keys`` replayed consensus from where it first saw the log start; a GC
    truncating meanwhile left a gap, and ``apply_diff`` reported it as *corruption*
    ("consensus entry 59 does not follow state 32"), failing the sweep with a false alarm."""
    from persist_lib.shard import gc as gcmod

    name = uuid.uuid4().hex
    cons = _TruncateDuringSweep(MemConsensus(name))
    client = PersistClient(MemBlob(name), cons, PersistConfig.for_tests(inline_threshold=0, rollup_interval=3))
    w, _ = client.open(ShardId.new(), KEY, VAL)
    for t in range(12):
        w.compare_and_append([(((f"k{t}",), (t,)), t, 1)], t, t + 1)
    s = client.machine(w.shard_id).fetch_latest()
    latest = s.latest_rollup()
    assert latest is not None and latest[0] > 2
    expected = gcmod.unreferenced_blobs(client.blob, client.consensus, w.shard_id, now_ms=0, older_than_ms=-1)
    cons.truncate_to = latest[0]
    got = gcmod.unreferenced_blobs(client.blob, client.consensus, w.shard_id, now_ms=0, older_than_ms=-1)
    assert {b["key"] for b in got} <= {b["key"] for b in expected}


class _Other(Consensus):
    """The same consensus seen by "another process": its own describe(), so its own cache."""

    def __init__(self, inner: Consensus) -> None:
        self.inner = inner

    def head(self, key: str) -> VersionedData | None:
        return self.inner.head(key)

    def compare_and_set(self, key: str, expected: int | None, new: VersionedData) -> CaSResult:
        return self.inner.compare_and_set(key, expected, new)

    def scan(self, key: str, from_seqno: int, limit: int) -> list[VersionedData]:
        return self.inner.scan(key, from_seqno, limit)

    def truncate(self, key: str, seqno: int) -> int:
        return self.inner.truncate(key, seqno)

    def list_keys(self):  # type: ignore[no-untyped-def]
        return self.inner.list_keys()

    def describe(self) -> str:
        return "other-process"


def test_listen_below_a_since_set_by_an_indeterminate_downgrade_is_refused() -> None:
    """Found by the history checker (``listen_mismatch``): a reader's ``downgrade_since``
    committed but raised Indeterminate, so its cached since stayed old; ``listen(as_of)``
    below the durable since was accepted (validated against the stale cache), and after
    another process compacted, the listen returned old updates forwarded to the since."""
    from persist_lib.errors import InvalidUsage

    name = uuid.uuid4().hex
    mine = _PartitionAfterCas(MemConsensus(name))
    cfg = PersistConfig.for_tests(retry_deadline_s=0.2, inline_threshold=0)
    client = PersistClient(MemBlob(name), mine, cfg)
    other = PersistClient(MemBlob(name), _Other(MemConsensus(name)), PersistConfig.for_tests(inline_threshold=0))
    shard = ShardId.new()
    w, r = client.open(shard, KEY, VAL)
    for t in range(6):
        w.compare_and_append([(((f"k{t}",), (t,)), t, 1)], t, t + 1)
    mine.armed = True
    with pytest.raises(Indeterminate):
        r.downgrade_since(6)  # committed, but this process doesn't know
    mine.down = False
    assert r.since.time == 0  # the stale cache
    w2 = other.open_writer(shard, KEY, VAL)
    w2.compare_and_append([((("k6",), (6,)), 6, 1)], 6, 7)
    other.compact(shard)  # forwards times < 6 to 6 (the shard since is now 6)
    lst = r.listen(5)  # validated against the stale cache
    try:
        events = lst.next(1.0)
    except InvalidUsage:
        return  # refused: fine
    got = sorted((d["k"], d["ts"]) for e in events if hasattr(e, "table") for d in e.table.to_pylist())
    assert got == [("k6", 6)], f"listen as of 5 returned {got}"


def test_updates_between_at_the_since_returns_only_updates_in_range() -> None:
    name = uuid.uuid4().hex
    c = PersistClient.open(f"mem://{name}", f"mem://{name}", PersistConfig.for_tests(inline_threshold=0))
    w, r = c.open(ShardId.new(), KEY, VAL)
    for t in range(6):
        w.compare_and_append([(((f"k{t}",), (t,)), t, 1)], t, t + 1)
    r.downgrade_since(3)
    c.compact(w.shard_id)  # forwards times < 3 to 3
    with pytest.raises(InvalidUsage, match="not beyond this reader's since"):
        r.updates_between(3, 6)  # the updates at 3 include history forwarded to 3
    got = sorted((d["k"], d["ts"]) for d in r.updates_between(4, 6).to_pylist())
    assert got == [("k4", 4), ("k5", 5)], got


def test_leak_sweep_retries_when_rollups_vanish_under_it() -> None:
    """Found by the history checker (``unexpected_exception`` in a leak report): while the
    sweeper replayed, a concurrent GC (background GC in a writer) deleted the rollups it
    was about to load; ``live_blob_keys`` then raised a bare ``ExternalError`` ("no rollup
    to replay the live state versions from") instead of starting over."""
    from persist_lib.location.base import Blob
    from persist_lib.shard import gc as gcmod

    class Rollups(Blob):
        """Rollup blobs read as missing during the sweeper's first attempt."""

        def __init__(self, inner: Blob) -> None:
            self.inner, self.vanish = inner, False

        def get(self, key: str) -> bytes | None:
            return None if self.vanish and "/rollup/" in key else self.inner.get(key)

        def set(self, key: str, value: bytes) -> None:
            self.inner.set(key, value)

        def delete(self, key: str) -> int | None:
            return self.inner.delete(key)

        def list_keys_and_metadata(self, prefix: str):  # type: ignore[no-untyped-def]
            return self.inner.list_keys_and_metadata(prefix)

    class Scans(_TruncateDuringSweep):
        attempts = 0

        def scan(self, key: str, from_seqno: int, limit: int) -> list[VersionedData]:
            if from_seqno == 0 and limit == 1:
                blob.vanish = not blob.vanish  # on for the first attempt, off for the retry
                Scans.attempts += 1
            return self.inner.scan(key, from_seqno, limit)

    name = uuid.uuid4().hex
    blob = Rollups(MemBlob(name))
    cons = Scans(MemConsensus(name))
    client = PersistClient(blob, cons, PersistConfig.for_tests(inline_threshold=0, rollup_interval=3))
    w, r = client.open(ShardId.new(), KEY, VAL)
    for t in range(12):
        w.compare_and_append([(((f"k{t}",), (t,)), t, 1)], t, t + 1)
    r.heartbeat()  # moves its seqno hold up, so GC may truncate
    client.gc(w.shard_id)  # truncates: the sweeper must start from a rollup
    assert cons.inner.scan(w.shard_id, 0, 1)[0].seqno > 1
    # A part of a writer that never registered: the one blob the sweep must report.
    leaked = f"{w.shard_id}/w{uuid.uuid4()}/p{uuid.uuid4()}"
    blob.set(leaked, b"leaked part")
    live_before = {m.key for m in blob.list_keys_and_metadata(f"{w.shard_id}/")} - {leaked}
    Scans.attempts = 0
    now = int(time.time() * 1000) + 3_600_000
    got = gcmod.unreferenced_blobs(blob, client.consensus, w.shard_id, now_ms=now, older_than_ms=0)
    assert Scans.attempts == 2, "the first attempt saw the rollups vanish and started over"
    assert [g["key"] for g in got] == [leaked]
    # Deleting what it reports removes the leak and nothing the shard still reads.
    gcmod.unreferenced_blobs(blob, client.consensus, w.shard_id, now_ms=now, older_than_ms=0, delete=True)
    assert {m.key for m in blob.list_keys_and_metadata(f"{w.shard_id}/")} == live_before
    assert sorted(r.snapshot(11).to_pylist(), key=lambda x: x["k"]) == sorted(
        ({"k": f"k{t}", "v": t, "ts": 11, "diff": 1} for t in range(12)), key=lambda x: x["k"]
    )


def test_a_skipped_append_is_never_credited_with_a_commit_its_caa_made() -> None:
    """Soak seed 1171 (SQLite): a caa [57, 59) hit an applied-then-timeout CAS, found its
    own commit on retry (so it reports no seqno) and returned ok; the same writer's next
    op, a definite append of [57, 59), found the shard already there and wrote nothing.
    With the writer's clock 250 ms ahead, the commit's walltime lay nearer the append's
    window, the append was credited, and the caa reported as acked_write_lost. An append
    now says it skipped (``WriteHandle.last_append_skipped``) and is never a candidate."""
    from persist_lib.testing.checker import CheckReport, Commit, attribute, check_write_outcomes
    from persist_lib.testing.history import OK, History, Op

    wid = "w-skew"
    caa = Op("w2.1.22", "caa", "w2", 1, {"writer_id": wid, "expected": 57, "new": 59, "updates": []},
             invoke_mono=1.0, invoke_wall_ms=1000.0, outcome=OK, result={"seqno": None},
             complete_mono=1.01, complete_wall_ms=1009.0, completed=True)
    app = Op("w2.1.23", "append", "w2", 1, {"writer_id": wid, "lower": 57, "upper": 59, "n": 0},
             invoke_mono=1.03, invoke_wall_ms=1030.0, outcome=OK, result={"seqno": None, "skipped": True},
             complete_mono=1.031, complete_wall_ms=1030.4, completed=True)
    commit = Commit(88, wid, 57, 59, [], walltime_ms=1162)  # nearer the append's window
    report = CheckReport()
    attribute([commit], History([caa, app], []), seed=1171, report=report)
    check_write_outcomes([commit], History([caa, app], []), report)
    assert commit.op is caa and report.violations == []


def test_append_reports_whether_it_skipped() -> None:
    name = uuid.uuid4().hex
    c = PersistClient.open(f"mem://{name}", f"mem://{name}", PersistConfig.for_tests())
    w, _ = c.open(ShardId.new(), pa.schema([("k", pa.int64())]), pa.schema([("v", pa.int64())]))
    w.append([(((1,), (1,)), 0, 1)], 0, 2)
    assert not w.last_append_skipped and w.last_commit_seqno is not None
    w.append([(((1,), (1,)), 0, 1)], 0, 2)  # already there: nothing written
    assert w.last_append_skipped and w.last_commit_seqno is None
    w.append([(((2,), (2,)), 2, 1)], 1, 3)  # only times >= the upper (2) are added
    assert not w.last_append_skipped
    c.close()
