"""Regression tests for issue 13: no data loss under interrupts, cancellations, clock
skew, long writes, failing background work — each failed on the code before the fix
(a4074fd) and passes after."""

from __future__ import annotations

import gc as pygc
import json
import logging
import threading
import time
import uuid
from collections import Counter
from typing import Any

import pyarrow as pa
import pytest

from persist_lib import Antichain, PersistClient, PersistConfig, ShardId
from persist_lib.errors import (
    CorruptionError,
    Indeterminate,
    LeaseExpired,
    StateFormatTooNew,
    UpperMismatch,
)
from persist_lib.location.base import CaSResult, Consensus, VersionedData
from persist_lib.shard import machine as machine_mod
from persist_lib.shard import maintenance_transitions as mt
from persist_lib.shard import state as st
from persist_lib.shard.machine import frame
from persist_lib.testing.hooks import Cancelled, Interrupt, clock_skew

KEY = pa.schema([("k", pa.int64())])
VAL = pa.schema([("v", pa.string())])
HOUR_MS = 3_600_000


def mem_client(**cfg: object) -> PersistClient:
    name = uuid.uuid4().hex
    base: dict[str, object] = {"inline_threshold": 0}
    base.update(cfg)
    return PersistClient.open(f"mem://{name}", f"mem://{name}", PersistConfig.for_tests(**base))


def updates(t: int, n: int = 50, tag: str = "x") -> list[Any]:
    return [(((i,), (f"{tag}{t}",)), t, 1) for i in range(n)]


def contents(table: pa.Table) -> dict[tuple[int, str], int]:
    c: Counter[tuple[int, str]] = Counter()
    for r in table.to_pylist():
        c[(r["k"], r["v"])] += r["diff"]
    return {k: v for k, v in c.items() if v}


def blob_keys(client: PersistClient, shard: ShardId) -> set[str]:
    return {m.key for m in client.blob.list_keys_and_metadata(f"{shard}/")}


class _AfterCas(Consensus):
    """Applies compare_and_set, then raises ``exc`` (once per arming)."""

    def __init__(self, inner: Consensus) -> None:
        self.inner = inner
        self.raise_after: BaseException | None = None
        self.on_applied: Any = None

    def describe(self) -> str:
        return self.inner.describe()

    def head(self, key: str) -> VersionedData | None:
        return self.inner.head(key)

    def compare_and_set(self, key: str, expected: int | None, new: VersionedData) -> CaSResult:
        res = self.inner.compare_and_set(key, expected, new)
        exc, self.raise_after = self.raise_after, None
        if exc is not None and res is CaSResult.COMMITTED:
            if self.on_applied is not None:
                self.on_applied()
            raise exc
        return res

    def scan(self, key: str, from_seqno: int, limit: int) -> list[VersionedData]:
        return self.inner.scan(key, from_seqno, limit)

    def truncate(self, key: str, seqno: int) -> int:
        return self.inner.truncate(key, seqno)

    def list_keys(self) -> Any:
        return self.inner.list_keys()

    def wait_for_change(self, key: str, seqno: int | None, timeout_s: float) -> None:
        self.inner.wait_for_change(key, seqno, timeout_s)


def after_cas_client(**cfg: object) -> tuple[PersistClient, _AfterCas]:
    from persist_lib.location.mem import MemBlob, MemConsensus

    name = uuid.uuid4().hex
    base: dict[str, object] = {"inline_threshold": 0}
    base.update(cfg)
    cons = _AfterCas(MemConsensus(name))
    return PersistClient(MemBlob(name), cons, PersistConfig.for_tests(**base)), cons


# ----- defect 1: committed data deleted -------------------------------------------------


@pytest.mark.parametrize("exc", [Interrupt("ctrl-c"), Cancelled("run cancelled"), KeyboardInterrupt(), SystemExit(1)])
def test_interrupt_after_the_cas_landed_keeps_the_committed_parts(exc: BaseException) -> None:
    client, cons = after_cas_client()
    shard = ShardId.new()
    w, r = client.open(shard, KEY, VAL)
    w.compare_and_append(updates(0), 0, 1)
    cons.raise_after = exc
    with pytest.raises(type(exc)):
        w.compare_and_append(updates(1), 1, 2)
    assert w.fetch_recent_upper() == Antichain([2])  # the CAS landed
    assert contents(r.snapshot(1)) == {**{(i, "x1"): 1 for i in range(50)}, **{(i, "x0"): 1 for i in range(50)}}


def test_lease_expired_while_rerunning_after_a_landed_cas_is_indeterminate_and_keeps_parts() -> None:
    """The CAS lands, the call reports Indeterminate, and before the retry re-reads the
    state a lease expiry removes the writer: the re-run raises LeaseExpired. That used to
    delete the committed parts."""
    from persist_lib.errors import Indeterminate as Ind

    client, cons = after_cas_client()
    shard = ShardId.new()
    w, r = client.open(shard, KEY, VAL)
    other = PersistClient(client.raw_blob, cons.inner, client.config)

    def expire_everyone() -> None:
        other.expire_leases(shard, now=client.config.now_ms() + 10 * HOUR_MS)

    cons.on_applied = expire_everyone
    cons.raise_after = Ind("connection lost after commit")
    with pytest.raises(Indeterminate):
        w.compare_and_append(updates(0), 0, 1)
    r2 = other.open_leased_reader(shard, KEY, VAL)
    assert contents(r2.snapshot(0)) == {(i, "x0"): 1 for i in range(50)}


def test_post_commit_failures_never_fail_or_undo_the_write() -> None:
    client = mem_client(rollup_interval=1)
    shard = ShardId.new()
    w, r = client.open(shard, KEY, VAL)
    m = client.machine(shard)

    def bad_callback(_: st.ShardState) -> None:
        raise RuntimeError("a post-commit callback bug")

    m.on_commit.append(bad_callback)
    orig_set = client.blob.set

    def rollup_set_fails(key: str, value: bytes) -> None:
        if "/rollup/" in key:
            raise CorruptionError("simulated: the rollup upload failed strangely")
        orig_set(key, value)

    client.blob.set = rollup_set_fails  # type: ignore[method-assign]
    w.compare_and_append(updates(0), 0, 1)  # neither the callback nor the rollup fails it
    client.blob.set = orig_set  # type: ignore[method-assign]
    assert contents(r.snapshot(0)) == {(i, "x0"): 1 for i in range(50)}


def test_only_a_definite_loss_deletes_the_batch() -> None:
    client = mem_client()
    shard = ShardId.new()
    w, _ = client.open(shard, KEY, VAL)
    w2 = client.open_writer(shard, KEY, VAL)
    w.compare_and_append(updates(0), 0, 1)
    before = blob_keys(client, shard)
    with pytest.raises(UpperMismatch):
        w2.compare_and_append(updates(5), 0, 6)
    assert blob_keys(client, shard) == before  # the loser's parts were deleted


def test_interrupt_before_any_cas_leaves_parts_for_the_sweeper_only() -> None:
    """An interrupt while uploading leaves parts; they are swept once the writer is gone."""
    client = mem_client()
    shard = ShardId.new()
    w, r = client.open(shard, KEY, VAL)
    orig_set = client.blob.set
    calls = {"n": 0}

    def set_then_interrupt(key: str, value: bytes) -> None:
        orig_set(key, value)
        calls["n"] += 1
        raise Interrupt("interrupted during upload")

    client.blob.set = set_then_interrupt  # type: ignore[method-assign]
    with pytest.raises(Interrupt):
        w.compare_and_append(updates(0), 0, 1)
    client.blob.set = orig_set  # type: ignore[method-assign]
    assert calls["n"] >= 1
    # The writer is still registered: nothing is swept.
    assert client.unreferenced_blobs(shard, 0, delete=True) == []
    w.expire()
    swept = client.unreferenced_blobs(shard, 0, delete=True)
    assert all(s["deleted"] for s in swept)
    assert blob_keys(client, shard) == set()  # the builder's cleanup or the sweep got them
    assert r.upper == Antichain([0])


# ----- defect 2: the sweeper vs writes in flight -------------------------------------------


def test_sweep_with_a_clock_an_hour_ahead_spares_a_batch_still_being_built() -> None:
    client = mem_client(blob_target_size=4096)
    shard = ShardId.new()
    w, r = client.open(shard, KEY, VAL)
    b = w.builder(0)
    b.add(w.normalize(updates(0, n=2000)))
    batch = b.finish(1)
    assert batch.blob_keys()
    with clock_skew(client.config, 61 * 60_000):
        swept = client.unreferenced_blobs(shard, delete=True)  # default grace: 1 h
    assert swept == []
    w.compare_and_append_batch(batch, 0, 1)
    assert contents(r.snapshot(0)) == {(i, "x0"): 1 for i in range(2000)}


def test_parts_of_an_expired_writer_are_never_linked() -> None:
    client = mem_client(blob_target_size=4096)
    shard = ShardId.new()
    w, r = client.open(shard, KEY, VAL)
    b = w.builder(0)
    b.add(w.normalize(updates(0, n=500)))
    batch = b.finish(1)
    client.expire_leases(shard, now=client.config.now_ms() + 10 * HOUR_MS)
    w2 = client.open_writer(shard, KEY, VAL)
    swept = client.unreferenced_blobs(shard, 0, delete=True)
    assert {s["key"] for s in swept} == set(batch.blob_keys())
    with pytest.raises(LeaseExpired):
        w.compare_and_append_batch(batch, 0, 1)
    # Another writer's batch made of those (deleted) parts is refused too.
    with pytest.raises(LeaseExpired):
        w2.compare_and_append_batch(batch, 0, 1)
    r2 = client.open_leased_reader(shard, KEY, VAL)
    assert r2.upper == Antichain([0])


def test_rollup_written_but_not_yet_linked_survives_a_sweep() -> None:
    client = mem_client(rollup_interval=0)
    shard = ShardId.new()
    w, r = client.open(shard, KEY, VAL)
    for t in range(3):
        w.compare_and_append(updates(t), t, t + 1)
    m = client.machine(shard)
    orig_apply = m.apply
    swept: list[Any] = []

    def apply_after_sweep(name: str, fn: Any, progress: Any = None) -> Any:
        if name == "add_rollup":  # the rollup blob is written, not linked yet
            with clock_skew(client.config, 10 * HOUR_MS):
                swept.extend(client.unreferenced_blobs(shard, 0, delete=True))
        return orig_apply(name, fn, progress)

    m.apply = apply_after_sweep  # type: ignore[method-assign]
    assert m.write_rollup()
    m.apply = orig_apply  # type: ignore[method-assign]
    assert swept == []
    latest = m.fetch_latest().latest_rollup()
    assert latest is not None and client.blob.get(latest[1].key) is not None
    # A stale rollup (a newer one is linked) is sweepable.
    stale = machine_mod.rollup_key(str(shard), 1)
    client.blob.set(stale, b"x")
    assert {s["key"] for s in client.unreferenced_blobs(shard, 0, delete=True)} == {stale}


def test_quiescent_sweep_waits_for_this_processs_background_rollup() -> None:
    """Soak seed 1128 (session 4): the final GC's commit started a background rollup; the
    quiescent sweep (no in-flight guard) listed the uploaded, not yet linked rollup as
    leaked and deleted it just before it was linked, so the shard's latest rollup was gone."""
    client = mem_client(rollup_interval=2, rollup_in_background=True)
    shard = ShardId.new()
    w, r = client.open(shard, KEY, VAL)
    m = client.machine(shard)
    orig_apply = m.apply
    uploaded = threading.Event()

    def slow_link(name: str, fn: Any, progress: Any = None) -> Any:
        if name == "add_rollup":  # the rollup blob is uploaded; its CAS is slow
            uploaded.set()
            time.sleep(0.5)
        return orig_apply(name, fn, progress)

    m.apply = slow_link  # type: ignore[method-assign]
    t = 0
    while not uploaded.is_set() and t < 20:
        w.compare_and_append(updates(t), t, t + 1)
        t += 1
        uploaded.wait(0.05)
    assert uploaded.is_set(), "no background rollup started"
    swept = client.unreferenced_blobs(shard, 0, delete=True, quiescent=True)
    m.wait_background()
    m.apply = orig_apply  # type: ignore[method-assign]
    assert [s["key"] for s in swept if "/rollup/" in s["key"]] == []
    latest = m.fetch_latest().latest_rollup()
    assert latest is not None and client.blob.get(latest[1].key) is not None
    client.close()


def test_add_rollup_refuses_a_rollup_outside_the_link_window() -> None:
    from persist_lib.shard import transitions as tr

    s = st.ShardState("s", seqno=tr.ROLLUP_LINK_WINDOW + 10)
    new, linked = tr.add_rollup(s, 0, seqno=5, key="s/rollup/5-x", size=1)
    assert new is None and linked is False
    new, linked = tr.add_rollup(s, 0, seqno=20, key="s/rollup/20-x", size=1)
    assert new is not None and linked is True


# ----- defect 3: a failing background merge ----------------------------------------------


def test_failing_background_merge_backs_off_and_is_quarantined(caplog: pytest.LogCaptureFixture) -> None:
    client = mem_client(
        compaction_enabled=True, compaction_workers=1, blob_target_size=2048,
        compaction_retry_backoff_s=0.05, compaction_retry_backoff_max_s=0.2,
    )
    shard = ShardId.new()
    w, r = client.open(shard, KEY, VAL)
    bg = client.background_compactor()
    w.compare_and_append(updates(0), 0, 1)
    m = client.machine(shard)
    (bid, batch), = m.fetch_latest().batches.items()
    key = batch.parts[0].key
    assert key is not None
    good = client.blob.get(key)
    assert good is not None
    client.raw_blob.set(key, good[: len(good) // 2])  # corrupt: truncated
    calls = {"n": 0}
    orig_get = client.blob.get

    def counting_get(k: str) -> bytes | None:
        if k == key:
            calls["n"] += 1
        return orig_get(k)

    client.blob.get = counting_get  # type: ignore[method-assign]
    caplog.set_level(logging.WARNING, logger="persist_lib")
    w.compare_and_append(updates(1), 1, 2)  # a merge of the two batches is due
    deadline = time.monotonic() + 20
    while not m.fetch_latest().quarantined_merges and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1.0)  # a hot loop would run thousands of merges in this second
    bg.wait_idle(10)
    s = m.fetch_latest()
    (entry,) = s.quarantined_merges.values()
    assert bid in entry.batch_ids and "CorruptionError" in entry.error
    assert calls["n"] <= 4, calls  # one fetch per attempt: 2 attempts, not thousands
    assert bg.stats()["quarantined"] == 1
    assert any(rec.levelno >= logging.ERROR and "quarantined" in rec.getMessage() for rec in caplog.records)
    info = client.inspect(shard)
    assert info["quarantined_merges"][0]["batch_ids"] == list(entry.batch_ids)
    # More commits don't retry it either.
    n = calls["n"]
    w.compare_and_append(updates(2), 2, 3)
    bg.wait_idle(10)
    assert calls["n"] == n
    # Repaired: an operator's retry compacts it and clears the quarantine.
    client.raw_blob.set(key, good)
    bg.close()
    res = client.compact(shard, retry_quarantined=True)
    assert res["merges_applied"] >= 1
    assert not m.fetch_latest().quarantined_merges
    assert contents(r.snapshot(2)) == {(i, f"x{t}"): 1 for i in range(50) for t in range(3)}


def test_manual_compaction_quarantines_and_raises() -> None:
    client = mem_client(blob_target_size=2048)
    shard = ShardId.new()
    w, _ = client.open(shard, KEY, VAL)
    for t in range(2):
        w.compare_and_append(updates(t), t, t + 1)
    m = client.machine(shard)
    key = next(iter(m.fetch_latest().batches.values())).parts[0].key
    assert key is not None
    client.raw_blob.delete(key)  # a live part is missing
    from persist_lib.errors import BlobNotFound

    with pytest.raises(BlobNotFound):
        client.compact(shard)
    assert len(m.fetch_latest().quarantined_merges) == 1
    res = client.compact(shard)  # skipped now, no error
    assert res["merges_applied"] == 0 and res["quarantined_merges"]


# ----- defect 4: the heartbeat thread --------------------------------------------------


def _last_heartbeat_ms(client: PersistClient, shard: ShardId, reader_id: str) -> int:
    return client.machine(shard).fetch_latest().leased_readers[reader_id].last_heartbeat_ms


def _wait_for_heartbeat_after(client: PersistClient, shard: ShardId, reader_id: str, t_ms: int) -> bool:
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if _last_heartbeat_ms(client, shard, reader_id) > t_ms:
            return True
        time.sleep(0.02)
    return False


@pytest.mark.parametrize("exc", [CorruptionError("bad state"), RuntimeError("a bug"), ZeroDivisionError()])
def test_heartbeat_thread_survives_unexpected_errors(exc: Exception) -> None:
    """One unexpected error used to kill the thread: every lease then lapsed."""
    client = mem_client(background_heartbeats=True, heartbeat_tick_s=0.02, reader_lease_ms=400)
    shard = ShardId.new()
    w, r = client.open(shard, KEY, VAL)
    orig = r.heartbeat
    failed_at: list[int] = []

    def failing_once() -> None:
        if not failed_at:
            failed_at.append(client.config.now_ms())
            raise exc
        orig()

    r.heartbeat = failing_once  # type: ignore[method-assign]
    deadline = time.monotonic() + 15
    while not failed_at and time.monotonic() < deadline:
        time.sleep(0.02)
    assert failed_at
    assert _wait_for_heartbeat_after(client, shard, r.reader_id, failed_at[0])
    assert client._hb_thread is not None and client._hb_thread.is_alive()
    assert client.heartbeat_failures == 1
    client.close()


# ----- defect 6: linear GC transitions ------------------------------------------------------


def test_gc_transitions_remove_exactly_the_given_entries_at_scale() -> None:
    n = 40_000  # quadratic code took minutes here; linear takes well under a second
    garbage = {f"s/w/p{i}": st.GarbageEntry(i, 1) for i in range(n)}
    s = st.ShardState("s", seqno=5, garbage=garbage)
    drop = tuple(f"s/w/p{i}" for i in range(0, n, 2))
    new, removed = mt.gc_remove_garbage(s, 0, keys=drop, gc_seqno=5)
    assert new is not None and removed == n // 2
    assert set(new.garbage) == {f"s/w/p{i}" for i in range(1, n, 2)}
    rollups = {i: st.RollupRef(f"s/rollup/{i}-x") for i in range(n)}
    s2 = st.ShardState("s", seqno=n + 1, rollups=rollups)
    new2, removed2 = mt.gc_remove_rollups(s2, 0, seqnos=tuple(range(n)))
    assert new2 is not None and removed2 == n - 1 and set(new2.rollups) == {n - 1}


# ----- defect 10: _uninline's parts ---------------------------------------------------------


def test_uninlined_parts_are_deleted_when_the_retry_loses() -> None:
    client = mem_client(inline_threshold=1 << 20, inline_max_total=1)
    shard = ShardId.new()
    w, r = client.open(shard, KEY, VAL)
    w2 = client.open_writer(shard, KEY, VAL)
    # Every write meets inline backpressure (a 1-byte budget) and moves its parts to blob.
    w.compare_and_append(updates(0, n=3), 0, 1)
    before = blob_keys(client, shard)
    orig_set = client.blob.set
    done = {"raced": False}

    def set_then_race(key: str, value: bytes) -> None:
        orig_set(key, value)
        if key.split("/")[1] == w.writer_id and not done["raced"]:
            done["raced"] = True
            client.blob.set = orig_set  # type: ignore[method-assign]
            w2.compare_and_append([], 1, 5)  # the upper moves on: w's retry loses

    client.blob.set = set_then_race  # type: ignore[method-assign]
    with pytest.raises(UpperMismatch):
        w.compare_and_append(updates(1, n=3), 1, 2)  # backpressure -> uninline -> loses
    client.blob.set = orig_set  # type: ignore[method-assign]
    assert done["raced"]
    assert blob_keys(client, shard) == before


# ----- defect 11: newer minor / major state formats ---------------------------------------


def _put_entry(client: PersistClient, shard: str, seqno: int, doc: dict[str, Any]) -> None:
    data = frame(json.dumps(doc).encode())
    assert client.raw_consensus.compare_and_set(shard, seqno - 1 if seqno > 1 else None, VersionedData(seqno, data)) is CaSResult.COMMITTED


def test_state_from_a_newer_minor_format_is_read_and_its_fields_carried() -> None:
    client = mem_client(rollup_interval=0)
    shard = ShardId.new()
    w, r = client.open(shard, KEY, VAL)
    w.compare_and_append(updates(0), 0, 1)
    s = client.machine(shard).fetch_latest()
    # A newer minor writer adds a scalar and a map we don't know.
    _put_entry(client, str(shard), s.seqno + 1, {
        "format": [st.FORMAT_MAJOR, st.FORMAT_MINOR + 7], "kind": "diff", "prev": s.seqno,
        "rollup": None,
        "scalars": {"seqno": s.seqno + 1, "future_flag": True},
        "maps": {"future_map": {"set": {"a": {"x": 1}}, "del": []}},
    })
    machine_mod.clear_state_cache()
    c2 = PersistClient(client.raw_blob, client.raw_consensus, client.config)
    w2, r2 = c2.open(shard, KEY, VAL)
    w2.compare_and_append(updates(1), 1, 2)
    assert contents(r2.snapshot(1)) == {**{(i, "x0"): 1 for i in range(50)}, **{(i, "x1"): 1 for i in range(50)}}
    m2 = c2.machine(shard)
    assert m2.write_rollup()
    latest = m2.fetch_latest().latest_rollup()
    assert latest is not None
    body = json.loads(machine_mod.unframe(c2.blob.get(latest[1].key) or b"", shard="x", what="r"))
    assert body["scalars"]["future_flag"] is True and body["maps"]["future_map"] == {"a": {"x": 1}}


def test_state_from_a_newer_major_format_is_refused_clearly() -> None:
    client = mem_client()
    shard = ShardId.new()
    client.open(shard, KEY, VAL)
    s = client.machine(shard).fetch_latest()
    _put_entry(client, str(shard), s.seqno + 1, {
        "format": [st.FORMAT_MAJOR + 1, 0], "kind": "diff", "prev": s.seqno, "rollup": None,
        "scalars": {"seqno": s.seqno + 1}, "maps": {},
    })
    machine_mod.clear_state_cache()
    c2 = PersistClient(client.raw_blob, client.raw_consensus, client.config)
    with pytest.raises(StateFormatTooNew, match="upgrade persist_lib"):
        c2.open(shard, KEY, VAL)


# ----- defect 8 (caches): bounded machines and state cache -----------------------------------


def test_client_and_state_cache_stay_bounded_over_many_shards() -> None:
    client = mem_client(max_cached_shards=20)
    for _ in range(200):
        shard = ShardId.new()
        w, r = client.open(shard, KEY, VAL)
        w.compare_and_append(updates(0, n=1), 0, 1)
        client.inspect(shard)
        w.expire()
        r.expire()
    del w, r
    pygc.collect()
    assert len(client._machines) <= 20
    mine = [k for k in machine_mod._CACHE.keys() if k[0] == client.consensus.describe()]
    assert len(mine) <= 20


def test_threads_share_one_machine_under_eviction() -> None:
    client = mem_client(max_cached_shards=2)
    shard = ShardId.new()
    w, r = client.open(shard, KEY, VAL)
    errors: list[BaseException] = []

    def churn() -> None:
        try:
            for _ in range(50):
                client.inspect(client.open_writer(ShardId.new(), KEY, VAL).shard_id)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=churn) for _ in range(2)]
    for t in threads:
        t.start()
    for t in range(20):
        w.compare_and_append(updates(t, n=1), t, t + 1)
    for th in threads:
        th.join()
    assert not errors
    assert contents(r.snapshot(19)) == {(0, f"x{t}"): 1 for t in range(20)}


def test_a_log_replaced_under_a_live_process_is_an_error_not_a_livelock(tmp_path: Any) -> None:
    """The machine used to spin forever when its cached state was ahead of the log (a
    consensus file replaced under a live process, or two logs sharing a cache key)."""
    import os

    path = tmp_path / "c.db"
    c1 = PersistClient.open(f"file://{tmp_path}/blob", f"sqlite:///{path}", PersistConfig.for_tests())
    shard = ShardId.new()
    w, _ = c1.open(shard, KEY, VAL)
    for t in range(3):
        w.compare_and_append(updates(t, n=1), t, t + 1)
    c1.consensus.close()
    for suffix in ("", "-wal", "-shm"):
        if os.path.exists(f"{path}{suffix}"):
            os.remove(f"{path}{suffix}")
    c2 = PersistClient.open(f"file://{tmp_path}/blob", f"sqlite:///{path}", PersistConfig.for_tests())
    out: list[BaseException | None] = []

    def attempt() -> None:
        try:
            c2.open(shard, KEY, VAL)
            out.append(None)
        except BaseException as e:  # noqa: BLE001
            out.append(e)

    t = threading.Thread(target=attempt, daemon=True)
    t.start()
    t.join(30)
    assert out and isinstance(out[0], CorruptionError), out
    assert "replaced" in str(out[0])
