"""``persist sql`` gives the general path's snapshot on random histories (issue 28).

Whatever scan a query takes - DuckDB over verified part copies (``sql.direct_scan``), the
parallel per-part scan with its boundary folding (``sql.parallel_scan``) or the streaming
read - its rows must be ``ReadHandle.snapshot``'s: each ``(key, value)`` once with its
summed diff, none with a zero diff. The histories here have retractions that cancel,
multiplicities above one, the same record at several times, keys shared by two batches,
null key and value fields, floats with ``-0.0`` and NaN, and strings beyond ASCII; the
shard is read as written, compacted with its history and compacted without it.
"""

# ruff: noqa: S608 - queries over our own shard ids
from __future__ import annotations

import math
import random
import uuid
from typing import Any

import pyarrow as pa
import pytest

from persist_lib import PersistClient, PersistConfig, ShardId
from persist_lib.handles.read import ReadHandle
from persist_lib.sql.engine import SqlSession
from persist_lib.sql.parallel_scan import ScanHolds, parallel_snapshot

pytest.importorskip("duckdb")

VAL = pa.schema([("s", pa.string()), ("f", pa.float64())])
# The parallel and direct scans need an integer first key field; a float first key field
# with nulls takes the streaming read.
KEYS = {
    "int_first": pa.schema([("id", pa.int64()), ("x", pa.float64())]),
    "float_first": pa.schema([("x", pa.float64()), ("id", pa.int64())]),
}
FLOATS = [0.0, -0.0, 1.5, -2.25, math.nan, None]
STRINGS = ["a", "b", "é", "日本", "", None]
BATCHES = 5


def _client() -> PersistClient:
    name = uuid.uuid4().hex
    return PersistClient.open(f"mem://{name}", f"mem://{name}", PersistConfig.for_tests(inline_threshold=0))


def _batch(rng: random.Random, i: int, key: pa.Schema) -> pa.Table:
    """Batch ``i``: ids in ``[10i, 10i + 10]`` (a neighbour shares each endpoint), times
    ``3i..3i+2``, diffs with multiplicities and retractions, some cancelling later."""
    rows: list[tuple[int | None, float | None, str | None, float | None, int, int]] = []
    for _ in range(60):
        if rng.random() < 0.25:
            ident: int | None = rng.choice([10 * i, 10 * i + 10])
        else:
            ident = rng.randint(10 * i, 10 * i + 10)
        x, s, f = rng.choice(FLOATS), rng.choice(STRINGS), rng.choice(FLOATS)
        t, d = 3 * i + rng.randint(0, 2), rng.choice([1, 1, 2, 3, -1])
        rows.append((ident, x, s, f, t, d))
        if rng.random() < 0.3:
            rows.append((ident, x, s, f, min(t + 1, 3 * i + 2), -d))  # cancels it from then on
    cols = {
        "id": pa.array([r[0] for r in rows], pa.int64()),
        "x": pa.array([r[1] for r in rows], pa.float64()),
        "s": pa.array([r[2] for r in rows], pa.string()),
        "f": pa.array([r[3] for r in rows], pa.float64()),
    }
    return pa.table({
        **{n: cols[n] for n in key.names}, "s": cols["s"], "f": cols["f"],
        "ts": pa.array([r[4] for r in rows], pa.int64()), "diff": pa.array([r[5] for r in rows], pa.int64()),
    })


def _canon(v: Any) -> Any:
    """A value both sides agree on exactly: floats by ``repr`` (``-0.0`` and NaN kept)."""
    return repr(v) if isinstance(v, float) else v


def _sorted(rows: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    return sorted((tuple(_canon(v) for v in r) for r in rows), key=repr)


def _expected(r: ReadHandle, as_of: int, names: list[str]) -> list[tuple[Any, ...]]:
    t = r.snapshot(as_of)
    assert all(d != 0 for d in t.column("diff").to_pylist())
    return _sorted([tuple(row[n] for n in names) for row in t.to_pylist()])


def _scan(r: ReadHandle, s: SqlSession, sid: ShardId, as_of: int) -> str:
    """Which scan the session's query takes: "direct", "parallel" or "stream"."""
    plan = "\n".join(str(row[1]) for row in s.sql(f"EXPLAIN SELECT * FROM {sid}").fetchall()).upper()
    if "READ_PARQUET" in plan or "PARQUET_SCAN" in plan:
        return "direct"
    stream = parallel_snapshot(r, ScanHolds(r), as_of, memory_budget=None, timeout_s=None, filter=None, columns=None)
    if stream is None:
        return "stream"
    stream.close()
    return "parallel"


def _check(
    client: PersistClient, sid: ShardId, r: ReadHandle, as_of: int, names: list[str], scans: set[str]
) -> None:
    """The session's rows and aggregate equal the snapshot's, with direct reads on and off;
    records the scans taken in ``scans``."""
    want = _expected(r, as_of, names)
    cols = ", ".join(f'"{n}"' for n in names)
    for direct in (True, False):
        with SqlSession(client, as_of=as_of, direct_reads=direct) as s:
            scans.add(_scan(r, s, sid, as_of))
            got = _sorted(s.sql(f"SELECT {cols} FROM {sid}").fetchall())
            assert got == want, (as_of, direct)
            # An aggregate over every column weighted by the diff, as the benchmark runs it.
            agg = s.sql(f"SELECT count(*), sum(diff), sum(length(s) * diff), sum(id * diff) FROM {sid}").fetchall()
            assert agg[0][:2] == (len(want), sum(w[-1] for w in want)), (as_of, direct)


@pytest.mark.parametrize("layout", sorted(KEYS))
@pytest.mark.parametrize("seed", [11, 12])
def test_sql_equals_the_snapshot_on_random_histories(seed: int, layout: str) -> None:
    key = KEYS[layout]
    rng = random.Random(seed)
    client = _client()
    sid = ShardId.new()
    w, r = client.open(sid, key, VAL)
    for i in range(BATCHES):
        w.compare_and_append(_batch(rng, i, key), 3 * i, 3 * i + 3)
    w.expire()
    names = [*key.names, *VAL.names, "ts", "diff"]
    last = 3 * BATCHES - 1
    scans: set[str] = set()
    for as_of in (2, 7, last):
        _check(client, sid, r, as_of, names, scans)  # as written
    client.compact(sid)
    for as_of in (2, 7, last):
        _check(client, sid, r, as_of, names, scans)  # one sorted run, history kept (since 0)
    r.downgrade_since(last)
    client.compact(sid)
    _check(client, sid, r, last, names, scans)  # no history: every record at one time
    # Every scan the layout allows was compared (a scan no longer taken would go untested).
    assert scans == ({"direct", "parallel", "stream"} if layout == "int_first" else {"stream"}), scans
    r.expire()
    client.close()


def _disjoint_batch(rng: random.Random, i: int) -> pa.Table:
    """Batch ``i``: distinct ids in ``[10i, 10i + 9]`` (no id in two batches, none twice
    in one) at times ``3i..3i+2`` with multiplicities: parts the direct view may read
    as they are when no time is after the as-of."""
    ids = sorted(rng.sample(range(10 * i, 10 * i + 10), 8))
    return pa.table({
        "id": pa.array(ids, pa.int64()),
        "x": pa.array([rng.choice(FLOATS) for _ in ids], pa.float64()),
        "s": pa.array([rng.choice(STRINGS) for _ in ids], pa.string()),
        "f": pa.array([rng.choice(FLOATS) for _ in ids], pa.float64()),
        "ts": pa.array([3 * i + rng.randint(0, 2) for _ in ids], pa.int64()),
        "diff": pa.array([rng.choice([1, 2, 3]) for _ in ids], pa.int64()),
    })


@pytest.mark.parametrize("seed", [21, 22])
def test_sql_equals_the_snapshot_on_key_disjoint_parts(seed: int) -> None:
    """Key-disjoint parts, each record once: read directly when every time is at or
    before the as-of, else the rows after it are cut by the stream."""
    key = KEYS["int_first"]
    rng = random.Random(seed)
    client = _client()
    sid = ShardId.new()
    w, r = client.open(sid, key, VAL)
    for i in range(BATCHES):
        w.compare_and_append(_disjoint_batch(rng, i), 3 * i, 3 * i + 3)
    w.expire()
    scans: set[str] = set()
    for as_of in (4, 8, 3 * BATCHES - 1):
        _check(client, sid, r, as_of, [*key.names, *VAL.names, "ts", "diff"], scans)
    assert "direct" in scans and "parallel" in scans, scans
    r.expire()
    client.close()
