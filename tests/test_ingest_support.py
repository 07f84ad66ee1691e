"""Helpers shared by the ingestion tests: landing-zone fixtures, a worker process, and
shard comparison at every time. (A few sanity tests of the helpers live here too.)"""

from __future__ import annotations

import csv
import json
import os
import random
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from persist_lib import PersistClient, PersistConfig
from persist_lib.ingest.decode import ERRORS_KEY, ERRORS_VAL, RAW_KEY, RAW_VAL
from persist_lib.ingest.outputs import shard_id_for
from persist_lib.ingest.remap import REMAP_KEY, REMAP_VAL

ROOT = Path(__file__).resolve().parents[1]

KEY = pa.schema([("id", pa.int64())])
VAL = pa.schema([("name", pa.string()), ("qty", pa.float64()), ("tag", pa.string())])
DELETE = "_deleted"

ROLE_SCHEMAS: dict[str, tuple[pa.Schema, pa.Schema]] = {
    "data": (KEY, VAL),
    "state": (KEY, VAL),
    "errors": (ERRORS_KEY, ERRORS_VAL),
    "raw": (RAW_KEY, RAW_VAL),
    "remap": (REMAP_KEY, REMAP_VAL),
}


@dataclass
class Zone:
    """A generated landing zone and what an upsert ingestion of it must produce."""

    path: Path
    final: dict[int, tuple[Any, ...]] = field(default_factory=dict)  # upsert result
    appended: Counter[tuple[Any, ...]] = field(default_factory=Counter)  # append-only result
    bad: int = 0  # records that must become errors
    records: int = 0


def make_zone(path: Path, *, seed: int = 7, files: int = 10, rows: int = 40, keys: int = 60, malformed: bool = True) -> Zone:
    """Files in name order mixing JSON lines, CSV and Parquet with upserts and deletes.

    With ``malformed``: bad JSON, wrong types, missing keys, a bad CSV value, an empty
    file and an unreadable (corrupt) Parquet file.
    """
    rng = random.Random(seed)
    path.mkdir(parents=True, exist_ok=True)
    z = Zone(path)
    for i in range(files):
        kind = ("jsonl", "jsonl", "csv", "parquet")[i % 4]
        name = f"f{i:03d}.{kind}"
        recs: list[dict[str, Any]] = []
        lines: list[str] = []
        for j in range(rows):
            k = rng.randrange(keys)
            if rng.random() < 0.15:
                rec: dict[str, Any] = {"id": k, DELETE: True}
            else:
                rec = {"id": k, "name": f"n{i}-{j}", "qty": float(rng.randrange(1000)) / 4, "tag": rng.choice(["a", "b", None])}
            if kind == "csv" and not rec.get(DELETE) and rec.get("tag") is None:
                rec["tag"] = ""  # CSV has no null strings: an empty field is ""
            bad_line = None
            if malformed and kind == "jsonl" and rng.random() < 0.08:
                bad_line = rng.choice(['{"id": 1, "name": ', '{"id": "seven", "name": "x"}', '{"name": "no key"}', "[1, 2, 3]"])
            if bad_line is not None:
                lines.append(bad_line)
                z.bad += 1
                z.records += 1
                continue
            recs.append(rec)
            lines.append(json.dumps(rec))
            z.records += 1
            _apply(z, rec)
        if kind == "jsonl":
            (path / name).write_text("\n".join(lines) + "\n")
        elif kind == "csv":
            with open(path / name, "w", newline="") as f:
                w = csv.writer(f)
                w.writerow(["id", "name", "qty", "tag", DELETE])
                for r in recs:
                    w.writerow([r["id"], r.get("name", ""), r.get("qty", ""), r.get("tag") or "", "true" if r.get(DELETE) else ""])
        else:
            t = pa.table(
                {
                    "id": pa.array([r["id"] for r in recs], pa.int64()),
                    "name": pa.array([r.get("name") for r in recs], pa.string()),
                    "qty": pa.array([r.get("qty") for r in recs], pa.float64()),
                    "tag": pa.array([r.get("tag") for r in recs], pa.string()),
                    DELETE: pa.array([bool(r.get(DELETE)) for r in recs], pa.bool_()),
                }
            )
            pq.write_table(t, path / name)
    if malformed:
        (path / "f001a.jsonl").write_text("")  # empty file
        (path / "f002a.parquet").write_bytes(b"PAR1 this is not parquet")  # unreadable
        z.bad += 1
        z.records += 1
    return z


def _apply(z: Zone, rec: dict[str, Any]) -> None:
    k = rec["id"]
    if rec.get(DELETE):
        z.final.pop(k, None)
    else:
        v = (rec["name"], rec["qty"], rec.get("tag"))
        z.final[k] = v
        z.appended[(k, *v)] += 1


WORKER = r"""
import json, sys
import pyarrow as pa
from persist_lib import PersistClient, PersistConfig
from persist_lib.ingest import IngestConfig, Ingestion, LandingZoneSource
p = json.loads(sys.argv[1])
client = PersistClient.open(p["blob"], p["consensus"], PersistConfig.for_tests())
K = pa.schema([("id", pa.int64())])
V = pa.schema([("name", pa.string()), ("qty", pa.float64()), ("tag", pa.string())])
clock = (lambda: p["clock"]) if p.get("clock") is not None else None
ing = Ingestion(
    client, p["name"], LandingZoneSource(p["dir"]), K, V,
    envelope=p.get("envelope", "upsert"), delete_field=p.get("delete_field", "_deleted"),
    config=IngestConfig(max_records_per_binding=p["n"], keep_raw=p.get("keep_raw", False)),
    clock=clock,
    progress=(lambda pr: None if pr.done else print("progress", pr.bindings, flush=True))
    if p.get("report_progress") else None,
)
print("started", flush=True)
if p.get("barrier"):
    import os, time
    while not os.path.exists(p["barrier"]):
        time.sleep(0.005)
s = ing.run_once()
s["applied"] = [[t, {k: list(v) for k, v in f.items()}] for t, f in ing.applied]
ing.close()
client.close()
print(json.dumps(s, default=str))
"""


def worker_cmd(params: dict[str, Any]) -> list[str]:
    return [sys.executable, "-c", WORKER, json.dumps(params)]


def worker_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def run_worker(params: dict[str, Any], timeout: float = 300) -> dict[str, Any]:
    res = subprocess.run(worker_cmd(params), capture_output=True, text=True, timeout=timeout, env=worker_env())
    assert res.returncode == 0, f"worker failed ({res.returncode}):\n{res.stderr[-4000:]}"
    return dict(json.loads(res.stdout.strip().splitlines()[-1]))


def file_location(tmp: Path, tag: str) -> tuple[str, str]:
    (tmp / f"blob-{tag}").mkdir(parents=True, exist_ok=True)
    return f"file://{tmp / f'blob-{tag}'}", f"sqlite:///{tmp / f'consensus-{tag}.db'}"


@dataclass
class ShardHistory:
    since: int
    upper: int
    at: dict[int, Counter[tuple[Any, ...]]]  # contents at every time in [since, upper)


def shard_history(client: PersistClient, name: str, role: str) -> ShardHistory:
    """The accumulated contents of an ingestion shard at every time in [since, upper)."""
    k, v = ROLE_SCHEMAS[role]
    r = client.open_leased_reader(shard_id_for(name, role), k, v, purpose="test-compare")
    try:
        since = r.since.time or 0
        upper = r._machine.fetch_latest().upper.time or 0
        cols = k.names + v.names
        at: dict[int, Counter[tuple[Any, ...]]] = {}
        for t in range(since, upper):
            snap = r.snapshot(t)
            c: Counter[tuple[Any, ...]] = Counter()
            for row in snap.to_pylist():
                c[tuple(row[n] for n in cols)] += row["diff"]
            at[t] = +c
        return ShardHistory(since, upper, at)
    finally:
        r.expire()


def compare_locations(a: tuple[str, str], b: tuple[str, str], name: str, roles: list[str]) -> dict[str, int]:
    """Asserts both locations hold identical ingestion shards at every time; returns uppers."""
    ca = PersistClient.open(a[0], a[1], PersistConfig.for_tests())
    cb = PersistClient.open(b[0], b[1], PersistConfig.for_tests())
    uppers = {}
    try:
        for role in roles:
            ha = shard_history(ca, name, role)
            hb = shard_history(cb, name, role)
            assert ha.upper == hb.upper, f"{role}: uppers differ: {ha.upper} vs {hb.upper}"
            lo = max(ha.since, hb.since)
            for t in range(lo, ha.upper):
                assert ha.at[t] == hb.at[t], f"{role}: contents differ at time {t}"
            uppers[role] = ha.upper
    finally:
        ca.close()
        cb.close()
    return uppers
