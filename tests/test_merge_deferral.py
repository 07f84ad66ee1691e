"""Burst deferral (``persist_lib.handles.merge_deferral``): under a burst of small commits
the background compactor merges the tail several batches at a time instead of two at a
time, and once the commits stop it still compacts the shard fully."""

from __future__ import annotations

import threading
import time
from collections import Counter
from pathlib import Path

import pyarrow as pa

from persist_lib import PersistClient, PersistConfig, ShardId
from persist_lib.handles.merge_deferral import DeferralPolicy, SettleTimer
from persist_lib.shard.spine import compaction_requests, healthy_batch_count

KEY = pa.schema([("k", pa.int64())])
VAL = pa.schema([("v", pa.string())])
ROWS = 10


def file_client(d: Path) -> PersistClient:
    """File blob + SQLite consensus: the embedded default the small-append goal runs on."""
    (d / "blob").mkdir()
    return PersistClient.open(
        f"file://{d / 'blob'}",
        f"sqlite:///{d / 'consensus.db'}",
        PersistConfig.for_tests(compaction_enabled=True, compaction_workers=1, inline_threshold=0),
    )


def commit_spans(client: PersistClient, shard: ShardId) -> list[int]:
    """How many commits each batch of the trace covers (commit ``t`` is ``[t, t + 1)``)."""
    s = client.machine(shard).cached()
    out = []
    for _, b in s.trace_batches():
        lo, hi = b.lower.time, b.upper.time
        assert lo is not None and hi is not None
        out.append(hi - lo)
    return out


def updates(t: int) -> list:
    return [(((t * ROWS + i,), (f"v{t}",)), t, 1) for i in range(ROWS)]


def test_burst_merges_the_tail_several_batches_at_a_time_then_settles(tmp_path: Path) -> None:
    """While commits keep coming (well inside the quiet period), no merge of fewer than
    ``max_fanin`` small batches runs: every merged batch covers >= 4 commits. (Before,
    the spine's pair merges produced batches of 2 and 3 commits.) Once the commits stop,
    the quiet period passes, ``wait_idle`` waits for it, and the shard ends fully
    compacted with every update readable exactly once."""
    client = file_client(tmp_path)
    bg = client.background_compactor()
    bg.deferral = DeferralPolicy(quiet_s=2.0, max_fanin=4, max_updates=1_000_000)
    shard = ShardId.new()
    w, r = client.open(shard, KEY, VAL)
    n = 22
    seen_spans: set[int] = set()
    for t in range(n):
        w.compare_and_append(updates(t), t, t + 1)
        seen_spans.update(commit_spans(client, shard))
    merged = {s for s in seen_spans if s > 1}
    assert merged, "no merge ran during the burst"
    assert min(merged) >= 4, f"merges of fewer than 4 commits ran during the burst: {sorted(seen_spans)}"
    assert bg.stats()["held_back"] > 0
    assert bg.wait_idle(60)  # includes the quiet period: then the held-back tail merges
    s = client.machine(shard).fetch_latest()
    assert compaction_requests(s) == []
    total = sum(b.len for _, b in s.trace_batches())
    assert total == n * ROWS
    assert len(s.trace_batches()) <= healthy_batch_count(total)
    got = Counter((row["k"], row["v"], row["diff"]) for row in r.snapshot(n - 1).to_pylist())
    assert got == Counter((t * ROWS + i, f"v{t}", 1) for t in range(n) for i in range(ROWS))
    client.close()


def test_a_lone_commit_is_merged_once_the_quiet_period_passes(tmp_path: Path) -> None:
    """A held-back merge is not left behind when no further commit comes: the settle
    timer offers the shard again on its own."""
    client = file_client(tmp_path)
    bg = client.background_compactor()
    bg.deferral = DeferralPolicy(quiet_s=0.2, max_fanin=8, max_updates=1_000_000)
    shard = ShardId.new()
    w, _ = client.open(shard, KEY, VAL)
    w.compare_and_append(updates(0), 0, 1)
    w.compare_and_append(updates(1), 1, 2)
    assert bg.wait_idle(60)
    assert bg.stats()["held_back"] > 0
    assert commit_spans(client, shard) == [2]
    client.close()


def test_large_merges_and_disabled_policy_are_never_held_back(tmp_path: Path) -> None:
    """A merge of more than ``max_updates`` updates runs at once, as does every merge
    when the policy is off (``max_fanin <= 2``): nothing is held, no timer armed."""
    client = file_client(tmp_path)
    bg = client.background_compactor()
    bg.deferral = DeferralPolicy(quiet_s=60.0, max_fanin=8, max_updates=ROWS)
    shard = ShardId.new()
    w, _ = client.open(shard, KEY, VAL)
    for t in range(4):
        w.compare_and_append(updates(t), t, t + 1)
    assert bg.wait_idle(30)  # a 60 s quiet period armed would time this out
    bg.deferral = DeferralPolicy(quiet_s=60.0, max_fanin=2)
    for t in range(4, 8):
        w.compare_and_append(updates(t), t, t + 1)
    assert bg.wait_idle(30)
    assert bg.stats()["held_back"] == 0
    assert compaction_requests(client.machine(shard).fetch_latest()) == []
    client.close()


def test_close_with_a_merge_held_back_stops_the_timer(tmp_path: Path) -> None:
    client = file_client(tmp_path)
    bg = client.background_compactor()
    bg.deferral = DeferralPolicy(quiet_s=60.0, max_fanin=8, max_updates=1_000_000)
    shard = ShardId.new()
    w, _ = client.open(shard, KEY, VAL)
    for t in range(3):
        w.compare_and_append(updates(t), t, t + 1)
    assert bg.stats()["held_back"] > 0
    assert any(t.name == "persist-compaction-settle" for t in threading.enumerate())
    client.close()  # must not wait out the 60 s quiet period
    assert not any(t.name == "persist-compaction-settle" for t in threading.enumerate())


def test_rearming_a_later_deadline_does_not_wake_the_timer_thread() -> None:
    """Under a burst each commit re-arms its shard with a later deadline: the timer
    thread, asleep until the earlier one, is not woken for it (waking it handed it the
    GIL once per commit, inside the writer's commit). An earlier deadline (another
    shard's shorter quiet period) still wakes it, and every target settles once."""
    settled: list[str] = []
    done = threading.Event()

    def on_settle(target: str) -> None:
        settled.append(target)
        if len(settled) == 2:
            done.set()

    timer = SettleTimer(on_settle, lambda: None)
    wakes = 0
    cond = timer._cond
    orig = cond.notify_all

    def counting_notify_all() -> None:
        nonlocal wakes
        wakes += 1
        orig()

    cond.notify_all = counting_notify_all  # type: ignore[method-assign]
    try:
        for _ in range(200):
            timer.arm("a", "a", 60.0)  # (the first starts the thread)
        assert wakes == 0, f"{wakes} wake-ups for deadlines later than the one awaited"
        give_up = time.monotonic() + 10
        with cond:  # (polled: the thread notifies nobody when it goes to sleep)
            while timer._sleep_until is None and time.monotonic() < give_up:
                cond.wait(0.005)
            assert timer._sleep_until is not None, "the timer thread never went to sleep"
        # Earlier deadlines than the 60 s one the thread sleeps towards: each must wake
        # it (or be found before it sleeps), so both fire long before 60 s.
        timer.arm("b", "b", 0.0)
        timer.arm("a", "a", 0.0)
        assert done.wait(10), f"settled: {settled}"
        assert sorted(settled) == ["a", "b"]
    finally:
        timer.close()
