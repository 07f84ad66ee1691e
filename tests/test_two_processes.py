"""Two OS processes share a shard: one appends, the other snapshots and listens.

Each sees exactly the same collection at every time (definiteness across processes),
on the embedded default location (file blob + SQLite consensus).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pyarrow as pa

from persist_lib import PersistClient, PersistConfig, ShardId
from persist_lib.handles.listen import ListenUpdates

KEY = pa.schema([("k", pa.int64())])
VAL = pa.schema([("v", pa.string())])

WRITER = textwrap.dedent(
    """
    import json, random, sys
    import pyarrow as pa
    from persist_lib import PersistClient, PersistConfig
    blob, cons, shard, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    client = PersistClient.open(blob, cons, PersistConfig.for_tests())
    w = client.open_writer(shard, pa.schema([("k", pa.int64())]), pa.schema([("v", pa.string())]))
    rng = random.Random(7)
    live = {}
    log = []
    for t in range(n):
        ups = []
        for _ in range(rng.randint(0, 5)):
            k = rng.randint(0, 20)
            if k in live:
                ups.append(((( k,), (live.pop(k),)), t, -1))
            else:
                live[k] = f"v{t}"
                ups.append((((k,), (live[k],)), t, 1))
        w.compare_and_append(ups, t, t + 1)
        log.append([[u[0][0][0], u[0][1][0], u[1], u[2]] for u in ups])
    print(json.dumps(log))
    """
)


def _accumulate(log: list[list[list]], upto: int) -> Counter:
    c: Counter = Counter()
    for t, ups in enumerate(log[: upto + 1]):
        for k, v, tt, d in ups:
            assert tt == t
            c[(k, v)] += d
    return +c


def test_one_process_appends_other_snapshots_and_listens(tmp_path: Path) -> None:
    blob = f"file://{tmp_path / 'blob'}"
    cons = f"sqlite:///{tmp_path / 'consensus.db'}"
    (tmp_path / "blob").mkdir()
    client = PersistClient.open(blob, cons, PersistConfig.for_tests())
    shard = ShardId.new()
    _, reader = client.open(shard, KEY, VAL)
    listen = reader.listen(0)
    n = 60
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, blob, cons, str(shard), str(n)],
        stdout=subprocess.PIPE,
        text=True,
    )
    # follow the writer while it runs
    seen: Counter = Counter()
    per_time: dict[int, Counter] = {}
    snap0 = reader.snapshot(0, timeout_s=60)
    for r in snap0.to_pylist():
        seen[(r["k"], r["v"])] += r["diff"]
    per_time[0] = +seen
    while listen.frontier.time is not None and listen.frontier.time < n:
        for e in listen.next(5.0):
            if isinstance(e, ListenUpdates):
                for r in e.table.sort_by("ts").to_pylist():
                    seen[(r["k"], r["v"])] += r["diff"]
            else:
                assert e.upper.time is not None
                per_time[e.upper.time - 1] = +Counter(seen)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0
    log = json.loads(out)
    # at every time the listener reported progress for, it held exactly the writer's collection
    for t, acc in per_time.items():
        assert acc == _accumulate(log, t), f"mismatch at time {t}"
    # and snapshots at every time agree with the writer's own record
    for t in range(0, n, 7):
        snap = Counter()
        for r in reader.snapshot(t).to_pylist():
            assert r["ts"] == t
            snap[(r["k"], r["v"])] += r["diff"]
        assert +snap == _accumulate(log, t)
