"""Schema evolution at 1M rows (issue 27 item 3): what reading parts of earlier schema
versions costs against reading the same rows written under the current version.

Run: ``.venv/bin/python -m bench.schema_evolution [--rows N] [--shards S]``. Embedded
file location in a temp dir. A collection gets ``N`` rows under v1 ``(qty int32, price
float32)`` at time 0, ``--add`` ``note string`` (v2) and ``N/10`` rows at 1, ``qty`` and
``price`` widened to int64/float64 (v3) and ``N/10`` rows at 2; a second collection gets
the same rows written under v3 from the start ("native"). Measured, best of 3 each:
``snapshot(2)`` and a ``listen(0)`` to 3 of both (the evolved one migrates every
v1/v2 part as it decodes it), then the evolved collection's shards are compacted (its
parts rewritten under v3) and read again. Every read is checked: row counts, nulls where
a column did not exist, the sum of ``qty``. Both are then compacted and read again, and
finally ``price`` is dropped (v4) from the evolved one and it is read once more (a drop
makes each older part sort and consolidate again). It prints a table and a JSON line.
Standalone: not part of ``python -m bench``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

K = pa.schema([pa.field("id", pa.int64(), nullable=False)])
V1 = pa.schema([("qty", pa.int32()), ("price", pa.float32())])
V2 = pa.schema([("qty", pa.int32()), ("price", pa.float32()), ("note", pa.string())])
V3 = pa.schema([("qty", pa.int64()), ("price", pa.float64()), ("note", pa.string())])
V4 = pa.schema([("qty", pa.int64()), ("note", pa.string())])  # price dropped


def _rows(lo: int, n: int, t: int, note: bool, schema: pa.Schema) -> pa.Table:
    ids = np.arange(lo, lo + n, dtype=np.int64)
    cols: dict[str, Any] = {
        "id": ids,
        "qty": pa.array(ids % 1000, schema.field("qty").type),
        "price": pa.array((ids % 97).astype(np.float32) / 4, schema.field("price").type),
    }
    if "note" in schema.names:
        cols["note"] = pa.array([f"n{i % 50}" for i in ids] if note else [None] * n, pa.string())
    cols["ts"] = np.full(n, t, dtype=np.int64)
    cols["diff"] = np.ones(n, dtype=np.int64)
    return pa.table(cols)


def _best(fn: Any, reps: int = 3) -> tuple[float, Any]:
    best, out = float("inf"), None
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def _check(snap: pa.Table, n: int, extra: int) -> None:
    assert snap.num_rows == n + 2 * extra, snap.num_rows
    assert snap.schema.field("qty").type == pa.int64()
    assert "price" not in snap.schema.names or snap.schema.field("price").type == pa.float64()
    notes = snap.column("note")
    assert notes.null_count == n, notes.null_count  # v1 rows: no note
    want = int(sum(i % 1000 for i in range(n + 2 * extra)))
    assert pc.sum(snap.column("qty")).as_py() == want


def run(rows: int, shards: int) -> dict[str, Any]:
    from bench.common import persist_file_client
    from persist_lib.storage import StorageController

    extra = rows // 10
    out: dict[str, Any] = {"rows": rows, "shards": shards}
    with tempfile.TemporaryDirectory() as d:
        client = persist_file_client(Path(d), fsync=False, compaction_enabled=False)
        ctl = StorageController(client)
        ctl.create_collection("evolved", K, V1, num_shards=shards)
        ctl.create_collection("native", K, V3, num_shards=shards)
        w = ctl.open_writer("evolved")
        w.append(_rows(0, rows, 0, False, V1), 0, 1)
        w.expire()
        t0 = time.perf_counter()
        ctl.evolve_schema("evolved", K, V2)
        out["evolve_add_s"] = round(time.perf_counter() - t0, 3)
        w = ctl.open_writer("evolved")
        w.append(_rows(rows, extra, 1, True, V2), 1, 2)
        w.expire()
        t0 = time.perf_counter()
        ctl.evolve_schema("evolved", K, V3)
        out["evolve_widen_s"] = round(time.perf_counter() - t0, 3)
        w = ctl.open_writer("evolved")
        w.append(_rows(rows + extra, extra, 2, True, V3), 2, 3)
        w.expire()
        nw = ctl.open_writer("native")
        first = _rows(0, rows, 0, False, V3)
        nw.append(first, 0, 1)
        nw.append(_rows(rows, extra, 1, True, V3), 1, 2)
        nw.append(_rows(rows + extra, extra, 2, True, V3), 2, 3)
        nw.expire()
        for name in ("evolved", "native"):
            r = ctl.acquire_read_handle(name)
            r.snapshot(2)  # warm (state, handles)
            s, snap = _best(lambda r=r: r.snapshot(2))
            _check(snap, rows, extra)
            u, upd = _best(lambda r=r: r.listen(0).read_until(3))
            assert upd.num_rows == 2 * extra and upd.column("note").null_count == 0
            before = r.snapshot(0)
            assert before.num_rows == rows and before.column("note").null_count == rows
            out[f"{name}_snapshot_s"] = round(s, 3)
            out[f"{name}_listen_s"] = round(u, 3)
            r.expire()
        for name in ("evolved", "native"):
            t0 = time.perf_counter()
            for rend in ctl.describe(name)["renditions"].values():
                for sid in rend["shards"]:
                    client.compact(sid)
            out[f"{name}_compact_s"] = round(time.perf_counter() - t0, 3)
            r = ctl.acquire_read_handle(name)
            r.snapshot(2)
            s, snap = _best(lambda r=r: r.snapshot(2))
            _check(snap, rows, extra)
            out[f"{name}_after_compaction_snapshot_s"] = round(s, 3)
            r.expire()
        # A drop: every part of an earlier version is sorted and consolidated again.
        ctl.evolve_schema("evolved", K, V4)
        r = ctl.acquire_read_handle("evolved")
        r.snapshot(2)
        s, snap = _best(lambda: r.snapshot(2))
        _check(snap, rows, extra)
        out["after_drop_snapshot_s"] = round(s, 3)
        r.expire()
        ctl.close()
        client.close()
    out["migrated_over_native_snapshot"] = round(out["evolved_snapshot_s"] / out["native_snapshot_s"], 2)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--shards", type=int, default=2)
    a = p.parse_args()
    res = run(a.rows, a.shards)
    for k, v in res.items():
        print(f"{k:40} {v}")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
