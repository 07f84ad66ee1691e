"""Crash determinism: an ingestion killed with ``kill -9`` at random points and
restarted leaves output, state, errors, raw and remap shards whose contents at every
time equal those of an uninterrupted run.

Both runs mint with the same injected clock (a constant), so the minted times depend
only on the remap upper (``max(clock, upper)``) and each binding's extent only on the
source contents (``max_records_per_binding``): a correct recipe makes the two runs
identical, time by time.
"""

from __future__ import annotations

import random
import subprocess
from pathlib import Path

import pytest

from persist_lib import PersistClient, PersistConfig
from persist_lib.ingest.outputs import shard_id_for
from tests.test_ingest_support import (
    KEY,
    VAL,
    compare_locations,
    file_location,
    make_zone,
    run_worker,
    worker_cmd,
    worker_env,
)

ROLES = ["data", "errors", "raw", "state", "remap"]


def _params(loc: tuple[str, str], zone: Path, n: int) -> dict:
    return {
        "blob": loc[0], "consensus": loc[1], "dir": str(zone), "name": "crashy",
        "n": n, "clock": 1, "keep_raw": True, "envelope": "upsert",
    }


def _crash_and_restart(params: dict, kills: int, seed: int, window: float) -> dict:
    """Starts the worker and kills it with SIGKILL, ``kills`` times; then runs it to
    completion. Returns the final summary and the number of kills that hit a running
    process.

    Kill points are chosen by progress, not by wall time alone (time-only delays drawn
    from the reference run's duration missed whenever the machine's load changed between
    the runs: a restarted life finished its remaining work before the delay): a quarter
    of the lives are killed during start-up and rehydration, the others a random moment
    after their first durable append."""
    rng = random.Random(seed)
    hits = 0
    for _ in range(kills):
        p = dict(params, report_progress=True)
        proc = subprocess.Popen(worker_cmd(p), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=worker_env(), text=True)
        assert proc.stdout is not None
        proc.stdout.readline()  # "started": imports done, the ingestion begins
        if rng.random() < 0.25:
            delay = rng.uniform(0.0, 0.2 * window)  # start-up, rehydration, first reads
        else:
            line = proc.stdout.readline()
            while line and not line.startswith("progress"):
                line = proc.stdout.readline()
            delay = rng.uniform(0.0, window / (2 * max(kills, 4)))
        try:
            proc.wait(timeout=delay)
        except subprocess.TimeoutExpired:
            proc.kill()  # SIGKILL: no cleanup, no atexit, leases left behind
            hits += 1
        proc.wait()
        proc.stdout.close()
    final = run_worker(params)
    final["kills_hit"] = hits
    return final


def _check_against_model(loc: tuple[str, str], zone, upper: int) -> None:
    c = PersistClient.open(loc[0], loc[1], PersistConfig.for_tests())
    try:
        r = c.open_leased_reader(shard_id_for("crashy", "data"), KEY, VAL)
        snap = r.snapshot(upper - 1).to_pylist()
        got = {row["id"]: (row["name"], row["qty"], row["tag"]) for row in snap}
        assert all(row["diff"] == 1 for row in snap)
        assert got == zone.final
    finally:
        c.close()


def _run(tmp_path: Path, kills: int, seed: int, files: int, rows: int, n: int) -> None:
    zone = make_zone(tmp_path / "zone", seed=seed, files=files, rows=rows)
    ref = file_location(tmp_path, "ref")
    crashy = file_location(tmp_path, "crashy")
    s_ref = run_worker(_params(ref, zone.path, n))
    # kill within the ingestion itself (the reference run's duration, after start-up)
    s = _crash_and_restart(_params(crashy, zone.path, n), kills, seed, window=max(0.3, s_ref["duration_s"]))
    assert s_ref["upper"] == s["upper"] and s_ref["upper"] > 1
    uppers = compare_locations(ref, crashy, "crashy", ROLES)
    assert set(uppers.values()) == {s_ref["upper"]}
    _check_against_model(ref, zone, s_ref["upper"])
    assert s_ref["errors"] == zone.bad
    assert s["kills_hit"] >= max(1, (kills * 2) // 3), f"only {s['kills_hit']} of {kills} kills hit a running ingestion"


def test_kill9_restarts_match_uninterrupted_run(tmp_path: Path) -> None:
    _run(tmp_path, kills=3, seed=11, files=8, rows=30, n=20)


@pytest.mark.slow
def test_kill9_many_restarts_match_uninterrupted_run(tmp_path: Path) -> None:
    _run(tmp_path, kills=24, seed=5, files=16, rows=60, n=25)
