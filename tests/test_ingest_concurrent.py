"""Two concurrent instances (two OS processes) ingest the same landing zone into the
same outputs: they agree on every binding (each uses what it reads back from the remap
shard), and the output holds every record exactly once, at the time its address was
bound: no duplicates, no gaps."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from persist_lib import PersistClient, PersistConfig
from persist_lib.ingest.outputs import shard_id_for
from persist_lib.ingest.remap import REMAP_KEY, REMAP_VAL
from tests.test_ingest_support import KEY, VAL, file_location, worker_cmd, worker_env


def _zone(path: Path, files: int, rows: int) -> dict[int, tuple[str, int]]:
    """JSON-lines files with unique ids; returns id -> (file, row)."""
    path.mkdir(parents=True)
    where: dict[int, tuple[str, int]] = {}
    i = 0
    for f in range(files):
        name = f"part-{f:04d}.jsonl"
        lines = []
        for r in range(rows):
            lines.append(json.dumps({"id": i, "name": f"r{i}", "qty": i / 2}))
            where[i] = (name, r)
            i += 1
        (path / name).write_text("\n".join(lines) + "\n")
    return where


def _bindings(client: PersistClient, name: str) -> list[tuple[int, tuple[str, int]]]:
    """(time, frontier) of every binding in the remap shard, from its updates."""
    r = client.open_leased_reader(shard_id_for(name, "remap"), REMAP_KEY, REMAP_VAL)
    upper = r._machine.fetch_latest().upper.time or 0
    # (times are ms since the epoch; the since trails the upper by the since window)
    since = r.since.time or 0
    # The since's own updates include history forwarded to it: read it as a snapshot.
    ups = r.snapshot(since).to_pylist() + r.updates_between(since + 1, upper).to_pylist()
    r.expire()
    out = []
    for u in ups:
        if u["diff"] == 1 and u["partition"] == "files":
            f, row = json.loads(u["address"])
            out.append((u["ts"], (f, row)))
    return sorted(out)


def test_two_processes_one_definite_output(tmp_path: Path) -> None:
    where = _zone(tmp_path / "zone", files=12, rows=25)
    loc = file_location(tmp_path, "shared")
    barrier = tmp_path / "go"
    params = {
        "blob": loc[0], "consensus": loc[1], "dir": str(tmp_path / "zone"), "name": "twin",
        "n": 10, "envelope": "append_only", "delete_field": None, "barrier": str(barrier),
    }
    procs = [
        subprocess.Popen(worker_cmd(params), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=worker_env())
        for _ in range(2)
    ]
    for p in procs:
        assert p.stdout is not None
        assert p.stdout.readline().strip() == "started"
    barrier.write_text("go")
    summaries = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        summaries.append(json.loads(out.strip().splitlines()[-1]))

    client = PersistClient.open(loc[0], loc[1], PersistConfig.for_tests())
    bindings = _bindings(client, "twin")
    times = [t for t, _ in bindings]
    assert len(times) == len(set(times)) and len(bindings) >= 30
    frontiers = [f for _, f in bindings]
    assert frontiers == sorted(frontiers)
    # both instances applied exactly the committed bindings (read back, never proposed)
    committed = {t: [f[0], f[1]] for t, f in bindings}
    for s in summaries:
        for t, fr in s["applied"]:
            assert committed[t] == fr["files"], f"instance applied {fr} at {t}, remap has {committed[t]}"
        # every binding from where it resumed (the later starter may resume past the
        # other's durable outputs)
        assert {t for t, _ in s["applied"]} == {t for t in committed if t >= s["resumed_at"]}
        assert s["upper"] > max(times)  # (then the upper follows the clock: time advances)
    # every record exactly once, at the time its address was bound
    r = client.open_leased_reader(shard_id_for("twin", "data"), KEY, VAL)
    since = r.since.time or 0
    ups = r.snapshot(since).to_pylist() + r.updates_between(since + 1, max(times) + 1).to_pylist()
    r.expire()
    assert all(u["diff"] == 1 for u in ups)
    ids = [u["id"] for u in ups]
    assert sorted(ids) == sorted(where), "duplicates or gaps"

    def bound_time(addr: tuple[str, int]) -> int:
        return next(t for t, f in bindings if addr < f)

    for u in ups:
        assert u["ts"] == bound_time(where[u["id"]]), u
    # the instances really overlapped: each adopted or verified the other's work
    contention = sum(s["lost_races"] + s["appends_verified"] + s["bindings_adopted"] for s in summaries)
    assert contention > 0
    client.close()
