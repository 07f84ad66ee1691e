"""Crashes during maintenance: ``kill -9`` of a compaction / GC process at random points,
and crashes injected between GC's steps. Afterwards every readable time has the same
contents, the leaked-blob sweeper removes what the killed process left behind, and
maintenance resumes to completion.

Locations are file blob + SQLite consensus, so a subprocess shares them.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import textwrap
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from persist_lib import PersistClient, PersistConfig, ShardId
from persist_lib.handles import maintenance as mn
from persist_lib.shard import gc as gcmod
from persist_lib.shard.runs import COMPACTOR_WRITER_PREFIX, LAYERED_WRITER_PREFIX
from tests.support.durable_ops import with_durable_op_counter

KEY = pa.schema([("k", pa.int64())])
VAL = pa.schema([("v", pa.string())])
SINCE = 10
UPPER = 30
ROOT = str(Path(__file__).resolve().parents[1])

CHILD = with_durable_op_counter(textwrap.dedent(
    """
    import sys
    from persist_lib import PersistClient, PersistConfig
    from persist_lib.handles import maintenance as mn
    blob, cons, shard, mode = sys.argv[1:5]
    cfg = PersistConfig.for_tests(
        blob_target_size=8192, inline_threshold=0, rollup_interval=4,
        compaction_memory_budget=1 << 20,
    )
    # Warm up (first-use costs of Arrow kernels) on a throwaway shard, so that kill
    # points drawn after "ready" land in the real work.
    import pyarrow as pa
    from persist_lib import ShardId
    warm = PersistClient.open("mem://warm", "mem://warm", cfg)
    ws = ShardId.new()
    w, _ = warm.open(ws, pa.schema([("k", pa.int64())]), pa.schema([("v", pa.string())]))
    for t in range(3):
        w.compare_and_append([(((i,), ("x",)), t, 1) for i in range(400)], t, t + 1)
    mn.compact(warm, ws)
    # Every durable operation on the shard's locations prints "op N" once it returned:
    # the parent kills after a chosen one, so each kill lands after work started.
    # @COUNT_DURABLE_OPS
    client = PersistClient.open(blob, cons, cfg)
    client.machine(shard).fetch_latest()
    print("ready", flush=True)
    if mode == "compact":
        mn.compact(client, shard)
    mn.gc(client, shard)
    with lock:
        print("done", ops[0], flush=True)
    """
))


def config() -> PersistConfig:
    return PersistConfig.for_tests(
        blob_target_size=8192, inline_threshold=0, rollup_interval=4, compaction_memory_budget=1 << 20
    )


def uris(d: Path) -> tuple[str, str]:
    return f"file://{d / 'blob'}", f"sqlite:///{d / 'consensus.db'}"


def contents(table: pa.Table) -> dict:
    c: Counter = Counter()
    for r in table.to_pylist():
        c[(r["k"], r["v"])] += r["diff"]
    return {k: v for k, v in c.items() if v}


def build_template(d: Path, shard: ShardId, compacted: bool) -> dict[int, dict]:
    """A shard of ~20 multi-part batches whose since is SINCE and that nobody reads.

    Returns the contents at every readable time. ``compacted``: compaction already ran
    (garbage waits for GC and consensus is long).
    """
    (d / "blob").mkdir(parents=True)
    client = PersistClient.open(*uris(d), config())
    w, r = client.open(shard, KEY, VAL)
    rng = random.Random(42)
    t = 0
    while t < UPPER:
        hi = min(UPPER, t + rng.randint(1, 2))
        ups = [
            (((rng.randrange(300),), (f"v{rng.randrange(3)}",)), rng.randrange(t, hi), rng.choice([-1, 1, 1]))
            for _ in range(rng.randint(600, 1500))
        ]
        w.compare_and_append(ups, t, hi)
        t = hi
    expected = {t: contents(r.snapshot(t)) for t in range(SINCE, UPPER)}
    r.downgrade_since(SINCE)
    if compacted:
        mn.compact(client, shard)
    r.expire()  # nobody holds a seqno: the child's GC may delete what it replaced
    w.expire()
    client.close()
    return expected


def verify(client: PersistClient, shard: ShardId, expected: dict[int, dict]) -> None:
    r = client.open_leased_reader(shard, KEY, VAL)
    try:
        for t, exp in expected.items():
            assert contents(r.snapshot(t)) == exp, f"contents differ at time {t}"
    finally:
        r.expire()


def kill_trial(tmp: Path, template: Path, shard: ShardId, mode: str, kill_after: int, expected: dict[int, dict]) -> dict[str, Any]:
    """Runs the maintenance child on a copy of ``template`` and ``kill -9``s it right
    after its ``kill_after``-th durable operation (blob set/delete, consensus CAS or
    truncate), then checks that recovery loses nothing and leaves nothing behind."""
    d = tmp / f"trial-{uuid.uuid4().hex[:8]}"
    shutil.copytree(template, d)
    blob, cons = uris(d)
    before = _durable(d)
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.Popen(
        [sys.executable, "-c", CHILD, blob, cons, str(shard), mode],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    assert p.stdout is not None
    line = p.stdout.readline()
    assert line.strip() == "ready", (line, p.stderr.read() if p.stderr else "")
    seen = 0
    while seen < kill_after:
        line = p.stdout.readline()
        if not line.startswith("op "):
            break  # "done" (or EOF): it finished before the chosen operation
        seen = int(line.split()[1])
    try:
        os.kill(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # it had already exited
    p.wait(30)
    out = line + p.stdout.read()
    finished = "done" in out  # it completed its work before the kill landed
    if p.returncode != -signal.SIGKILL:
        assert p.returncode == 0, p.stderr.read() if p.stderr else ""
    if not finished:
        assert seen == kill_after >= 1
        assert _durable(d) != before, "killed after a durable operation, yet nothing changed"
    client = PersistClient.open(blob, cons, config())
    try:
        # A killed compactor's part-writer registration protects its output from the
        # sweeper until lease expiry removes it (here: with a clock past every lease).
        # What the killed process left (listed before this process writes anything).
        left_by_killed = {b.key for b in client.blob.list_keys_and_metadata(f"{shard}/")}
        client.expire_leases(shard, now=client.config.now_ms() + 48 * 3_600_000)
        leaked = mn.unreferenced_blobs(client, shard, 0, delete=True)
        for b in leaked:
            writer = b["key"].split("/")[1]
            assert writer.startswith((COMPACTOR_WRITER_PREFIX, LAYERED_WRITER_PREFIX)) or writer == "rollup", b
        assert all(b["deleted"] for b in leaked)
        assert mn.unreferenced_blobs(client, shard, 0) == []
        verify(client, shard, expected)
        # Maintenance resumes to completion; GC leaves nothing behind.
        mn.compact(client, shard)
        g = mn.gc(client, shard)
        assert not g["errors"]
        verify(client, shard, expected)
        # A rollup the killed process uploaded but never linked was spared by the first
        # sweep (it might still have been linked); once the resumed maintenance linked a
        # rollup at or past its seqno it is an orphan, and this sweep removes it. Nothing
        # else may be left.
        late = mn.unreferenced_blobs(client, shard, 0, delete=True)
        for b in late:
            r = gcmod.rollup_seqno_of(b["key"])
            latest = client.machine(shard).fetch_latest().latest_rollup()
            assert b["key"] in left_by_killed, b  # never one of this process's own
            assert r is not None and latest is not None and r <= latest[0], b
        assert mn.unreferenced_blobs(client, shard, 0) == []
        s = client.machine(shard).fetch_latest()
        assert not gcmod.eligible_garbage(s)
        # Nothing is left but what the state references (no registration protects a leak).
        listed = {b.key for b in client.blob.list_keys_and_metadata(f"{shard}/")}
        assert listed <= gcmod.live_blob_keys(client.blob, client.consensus, str(shard)), (
            listed - gcmod.live_blob_keys(client.blob, client.consensus, str(shard))
        )
        return {"mode": mode, "kill_after": kill_after, "finished": finished, "leaked": len(leaked)}
    finally:
        client.close()
        shutil.rmtree(d, ignore_errors=True)


def _durable(d: Path) -> tuple[frozenset[str], int, int]:
    """What a maintenance process changes durably: the blob files and the consensus log."""
    blobs = frozenset(str(f.relative_to(d)) for f in (d / "blob").rglob("*") if f.is_file())
    con = sqlite3.connect(d / "consensus.db")
    try:
        n, top = con.execute("SELECT count(*), coalesce(max(seqno), 0) FROM consensus").fetchone()
    finally:
        con.close()
    return blobs, int(n), int(top)


@pytest.fixture(scope="module")
def templates(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("crash-templates")
    shard = ShardId.new()
    exp = build_template(base / "raw", shard, compacted=False)
    exp2 = build_template(base / "compacted", shard, compacted=True)
    assert exp == exp2
    # Calibrate: how many durable operations an uninterrupted child does (kill points
    # are drawn among them).
    out: dict[str, Any] = {"shard": shard, "expected": exp, "raw": base / "raw", "compacted": base / "compacted"}
    for mode, tpl in (("compact", base / "raw"), ("gc", base / "compacted")):
        d = base / f"calibrate-{mode}"
        shutil.copytree(tpl, d)
        env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
        p = subprocess.Popen(
            [sys.executable, "-c", CHILD, *uris(d), str(shard), mode],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        )
        assert p.stdout is not None
        assert p.stdout.readline().strip() == "ready"
        rest, err = p.communicate(timeout=120)
        assert p.returncode == 0 and "done" in rest, err
        out[f"ops_{mode}"] = int(rest.split("done")[1].split()[0])
        assert out[f"ops_{mode}"] >= 5, (mode, rest)
    return out


def _run_trials(
    tmp_path: Path, templates: dict[str, Any], n_trials: int, seed: int
) -> list[dict[str, Any]]:
    """``n_trials`` kills (two compactions to one GC), each right after a durable
    operation drawn uniformly from the first N-1 of an uninterrupted run's N."""
    rng = random.Random(seed)
    results: list[dict[str, Any]] = []
    for i in range(n_trials):
        mode = "compact" if i % 3 != 2 else "gc"
        tpl = templates["raw"] if mode == "compact" else templates["compacted"]
        k = rng.randint(1, templates[f"ops_{mode}"] - 1)
        results.append(kill_trial(tmp_path, tpl, templates["shard"], mode, k, templates["expected"]))
    return results


def test_kill_9_during_compaction_and_gc(tmp_path: Path, templates: dict[str, Any]) -> None:
    results = _run_trials(tmp_path, templates, 3, seed=1)
    print("durable operations:", templates["ops_compact"], templates["ops_gc"])
    print("kill -9 trials:", results)
    # Each kill landed mid-operation (after its chosen durable operation, before the end);
    # a kill that came too late would be a trial that tested nothing.
    assert [r["finished"] for r in results] == [False, False, False], results
    assert [r["mode"] for r in results] == ["compact", "compact", "gc"]


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_kill_9_soak(tmp_path: Path, templates: dict[str, Any]) -> None:
    results = _run_trials(tmp_path, templates, 60, seed=2)
    killed = [r for r in results if not r["finished"]]
    print(f"kill -9 soak: {len(results)} trials, {len(killed)} killed mid-run, "
          f"{sum(r['leaked'] for r in results)} leaked blobs swept")
    assert len(killed) >= 55


# ----- crashes injected between GC steps ---------------------------------------------------


class Crash(Exception):
    pass


@pytest.mark.parametrize("step", ["delete_blobs", "remove_entries", "truncate", "delete_rollups", "remove_rollups"])
def test_gc_resumes_after_crash_at_each_step(tmp_path: Path, step: str, monkeypatch: pytest.MonkeyPatch) -> None:
    name = uuid.uuid4().hex
    client = PersistClient.open(f"mem://{name}", f"mem://{name}", config())
    shard = ShardId.new()
    w, r = client.open(shard, KEY, VAL)
    for t in range(12):
        w.compare_and_append([(((i,), (f"v{t}",)), t, 1) for i in range(100)], t, t + 1)
    expected = {t: contents(r.snapshot(t)) for t in range(4, 12)}
    r.downgrade_since(4)
    mn.compact(client, shard)
    r.heartbeat()
    m = client.machine(shard)
    deletes = {"n": 0}
    real_delete = type(client.raw_blob).delete
    real_apply = type(m).apply
    real_truncate = type(client.raw_consensus).truncate

    def delete(self, key: str):  # type: ignore[no-untyped-def]
        is_rollup = "/rollup/" in key
        if (step == "delete_blobs" and not is_rollup) or (step == "delete_rollups" and is_rollup):
            deletes["n"] += 1
            if deletes["n"] == 2:
                raise Crash(step)
        return real_delete(self, key)

    def apply(self, name: str, fn):  # type: ignore[no-untyped-def]
        if (step, name) in (("remove_entries", "gc_remove_garbage"), ("remove_rollups", "gc_remove_rollups")):
            raise Crash(step)
        return real_apply(self, name, fn)

    def truncate(self, key: str, seqno: int):  # type: ignore[no-untyped-def]
        if step == "truncate":
            raise Crash(step)
        return real_truncate(self, key, seqno)

    monkeypatch.setattr(type(client.raw_blob), "delete", delete)
    monkeypatch.setattr(type(m), "apply", apply)
    monkeypatch.setattr(type(client.raw_consensus), "truncate", truncate)
    with pytest.raises(Crash):
        mn.gc(client, shard)
    monkeypatch.undo()
    for t, exp in expected.items():
        assert contents(r.snapshot(t)) == exp
    res = mn.gc(client, shard)
    assert not res["errors"]
    s = m.fetch_latest()
    assert not gcmod.eligible_garbage(s)
    assert all(seqno >= (gcmod.oldest_needed_rollup(s) or 0) for seqno in s.rollups)
    assert mn.unreferenced_blobs(client, shard, 0) == []
    assert not mn.gc(client, shard)["blobs_deleted"]
    for t, exp in expected.items():
        assert contents(r.snapshot(t)) == exp
