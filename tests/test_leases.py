"""Leases kept alive: long CLI commands heartbeat, and the heartbeat thread outlives its loop.

Issue 26, defect 8: ``persist compact``, ``persist snapshot`` and ``persist sql`` ran
without background heartbeats, so a merge or a read longer than the lease was expired
by maintenance meanwhile (a merge was then refused and redone, a read lost its holds).
Defect 9: the heartbeat thread was restarted only when a new handle was opened; now the
thread reruns its own loop, so the leases of the handles already open stay alive.
"""

from __future__ import annotations

import importlib
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from persist_lib import PersistClient, PersistConfig, ShardId
from persist_lib.handles.read import ReadHandle
from persist_lib.location.uri import open_blob, open_consensus
from persist_lib.shard import compactor as compactor_mod
from persist_lib.testing.hooks import InterruptingConsensus, InterruptPlan

# The module (the package's ``main`` attribute is the entry-point function).
cli_mod = importlib.import_module("persist_lib.cli.main")

KEY = pa.schema([("k", pa.int64())])
VAL = pa.schema([("v", pa.string())])
LEASE_MS = 1000  # the CLI's leases in these tests: a heartbeat is due every 250 ms
OUTLIVE = 2.2  # a slowed step lasts this many leases


def _location(tmp_path: Path) -> tuple[str, str]:
    (tmp_path / "blob").mkdir(parents=True, exist_ok=True)
    return f"file://{tmp_path / 'blob'}", f"sqlite:///{tmp_path / 'consensus.db'}"


def _shard_with_batches(loc: tuple[str, str], n: int = 6) -> ShardId:
    """A shard with ``n`` small appends (pending merges), written with long leases."""
    with PersistClient.open(*loc, PersistConfig.for_tests(inline_threshold=0)) as c:
        shard = ShardId.new()
        w, r = c.open(shard, KEY, VAL)
        for t in range(n):
            w.compare_and_append([(((i,), (f"v{t}",)), t, 1) for i in range(50)], t, t + 1)
        w.expire()
        r.expire()
    return shard


@pytest.fixture
def short_cli_leases(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI's client gets 1 s leases (and a fast heartbeat tick) and writes merge
    output to blob; the rest of the configuration is what the CLI asks for."""
    real = PersistConfig

    def config(**kw: Any) -> PersistConfig:
        return real(**{
            **kw, "reader_lease_ms": LEASE_MS, "writer_lease_ms": LEASE_MS, "heartbeat_tick_s": 0.05,
            "inline_threshold": 0,  # merge output goes to blob: linking it needs the lease
        })

    monkeypatch.setattr(cli_mod, "PersistConfig", config)


def _outlive_the_lease(loc: tuple[str, str], shard: ShardId) -> list[dict[str, Any]]:
    """Stands for a long merge or read: lasts ``OUTLIVE`` leases while a maintenance
    job (another client) expires lapsed leases every 50 ms; returns what it expired."""
    expired: list[dict[str, Any]] = []
    with PersistClient.open(*loc, PersistConfig.for_tests()) as maint:
        end = time.monotonic() + OUTLIVE * LEASE_MS / 1000
        while time.monotonic() < end:
            got = maint.expire_leases(shard).get(str(shard))
            if got:
                expired.append(got)
            time.sleep(0.05)
    return expired


def _cli(loc: tuple[str, str], args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    rc = cli_mod.main(["--blob", loc[0], "--consensus", loc[1], *args])
    out = capsys.readouterr()
    assert rc == 0, out.err
    return out.out


# ----- defect 8: long CLI commands keep their leases -------------------------------------


def test_a_compaction_longer_than_its_lease_is_applied_in_one_go(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], short_cli_leases: None
) -> None:
    loc = _location(tmp_path)
    shard = _shard_with_batches(loc)
    real_merge = compactor_mod.merge_batches
    expired: list[dict[str, Any]] = []

    def slow_merge(*a: Any, **kw: Any) -> Any:
        out = real_merge(*a, **kw)
        if not expired:  # the first merge outlives its part writer's lease
            expired.extend(_outlive_the_lease(loc, shard) or [{}])
        return out

    monkeypatch.setattr(compactor_mod, "merge_batches", slow_merge)
    doc = json.loads(_cli(loc, ["--json", "compact", str(shard)], capsys))
    # The merge was applied, not refused and redone; nothing was expired under it.
    assert doc["merges_not_applied"] == 0, doc
    assert expired == [{}], expired
    assert doc["merges_applied"] >= 1 and doc["compaction_debt_after"] == 0, doc


def _slow_reads(
    monkeypatch: pytest.MonkeyPatch, loc: tuple[str, str], shard: ShardId
) -> list[tuple[bool, list[dict[str, Any]]]]:
    """Makes the first ``snapshot_batches`` of a read outlive the reader's lease; records
    (whether the reader was still registered after it, what the expirer expired)."""
    real = ReadHandle.snapshot_batches
    seen: list[tuple[bool, list[dict[str, Any]]]] = []

    def slow(self: ReadHandle, *a: Any, **kw: Any) -> Any:
        stream = real(self, *a, **kw)
        if not seen:
            expired = _outlive_the_lease(loc, shard)
            state = self._machine.fetch_latest()
            seen.append((self.reader_id in state.leased_readers, expired))
        return stream

    monkeypatch.setattr(ReadHandle, "snapshot_batches", slow)
    return seen


def test_a_snapshot_longer_than_its_lease_keeps_its_reader(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], short_cli_leases: None
) -> None:
    loc = _location(tmp_path)
    shard = _shard_with_batches(loc, 3)
    seen = _slow_reads(monkeypatch, loc, shard)
    rows = [json.loads(line) for line in _cli(loc, ["--json", "snapshot", str(shard)], capsys).splitlines()]
    assert seen == [(True, [])], seen
    assert len(rows) == 150 and {r["diff"] for r in rows} == {1}


def test_a_sql_query_longer_than_its_lease_keeps_its_reader(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], short_cli_leases: None
) -> None:
    pytest.importorskip("duckdb")
    loc = _location(tmp_path)
    shard = _shard_with_batches(loc, 3)
    seen = _slow_reads(monkeypatch, loc, shard)
    query = f"SELECT count(*) AS n, sum(diff) AS d FROM {shard}"  # noqa: S608 - a shard id
    out = _cli(loc, ["sql", "--json", query], capsys)
    assert seen == [(True, [])], seen
    assert json.loads(out) == [{"n": 150, "d": 150}]


# ----- defect 9: the heartbeat thread is the watchdog of its loop ------------------------


def _wait_for(cond: Callable[[], bool], timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return False


@pytest.fixture
def interrupted_client(tmp_path: Path) -> Iterator[tuple[PersistClient, InterruptPlan]]:
    """A client with background heartbeats whose consensus raises one interrupt (a
    BaseException) in a CAS once the plan is enabled."""
    blob, consensus = _location(tmp_path)
    plan = InterruptPlan(seed=5, rate=1.0, limit=1)
    plan.enabled = False
    cfg = PersistConfig.for_tests(background_heartbeats=True, heartbeat_tick_s=0.02, reader_lease_ms=400)
    client = PersistClient(open_blob(blob), InterruptingConsensus(open_consensus(consensus), plan), cfg)
    try:
        yield client, plan
    finally:
        client.close()


def test_the_heartbeat_loop_is_rerun_when_it_dies(interrupted_client: tuple[PersistClient, InterruptPlan]) -> None:
    """An interrupt inside a heartbeat ends the loop (it handles Exceptions only); the
    thread reruns it, so the reader's lease is renewed again without a new handle."""
    client, plan = interrupted_client
    shard = ShardId.new()
    r = client.open_leased_reader(shard, KEY, VAL)
    thread = client._hb_thread
    assert thread is not None
    plan.enabled = True  # the next CAS, a heartbeat, is interrupted
    assert _wait_for(lambda: sum(plan.counts.values()) == 1)
    died_at = client.config.now_ms()

    def renewed() -> bool:
        return client.machine(shard).fetch_latest().leased_readers[r.reader_id].last_heartbeat_ms > died_at

    assert _wait_for(renewed), "the lease was not renewed after the heartbeat loop died"
    assert client._hb_thread is thread and thread.is_alive()
    assert client.heartbeat_loop_restarts == 1
    r.expire()
