"""PersistIOManager against the Delta Lake I/O manager path: materialize + load of a
1M-row asset (``python -m bench.io_manager [--rows N] [--root DIR]``).

Both sides run inside Dagster (``dg.materialize`` of an upstream asset returning a
``pyarrow.Table`` and a downstream asset loading it), in this one process, on the same
data and disk:

- persist: ``PersistIOManager`` on the embedded default (file blob + SQLite consensus),
  a new 1-shard collection: the write is one compare-and-append (the diff against the
  empty collection), the load a snapshot as of the recorded time;
- Delta: a minimal I/O manager doing what ``dagster-deltalake``'s does for pyarrow,
  ``write_deltalake(path, table, mode="overwrite")`` and
  ``DeltaTable(path).to_pyarrow_table()``.

Reported: seconds inside ``handle_output`` and ``load_input`` of each (Dagster's own run
overhead is left out: it is the same for both), then a second materialization that
changes 1% of the rows (persist writes only the difference, Delta rewrites the table),
and the ratios persist / Delta, in wall-clock seconds and in CPU seconds of the process
(every thread; less moved by other load on a shared machine than the wall clock). One
run, no repetitions: a rough figure.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import dagster as dg
import numpy as np
import pyarrow as pa

from dagster_project.io_manager import PersistIOManager
from dagster_project.io_manager.manager import PersistIOManagerImpl
from dagster_project.resources import PersistResource

TIMES: dict[str, float] = {}


def data(rows: int, version: int) -> pa.Table:
    rng = np.random.default_rng(7)
    amount = rng.random(rows) * 1000
    if version:
        amount[: rows // 100] += version
    return pa.table(
        {
            "id": pa.array(np.arange(rows, dtype=np.int64)),
            "customer": pa.array([f"c{i % 50_000}" for i in range(rows)]),
            "amount": pa.array(amount),
            "status": pa.array(np.array(["new", "paid", "shipped", "cancelled"])[np.arange(rows) % 4]),
        }
    )


class _Timed:
    def __init__(self, side: str) -> None:
        self.side = side

    def time(self, what: str, fn: Any, *args: Any) -> Any:
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn(*args)
        TIMES[f"{self.side}_{what}"] = time.perf_counter() - t0
        TIMES[f"{self.side}_{what}_cpu"] = time.process_time() - c0
        return out


class TimedPersist(PersistIOManager):
    def create_io_manager(self, context: dg.InitResourceContext) -> Any:
        impl: PersistIOManagerImpl = super().create_io_manager(context)
        t = _Timed("persist")
        handle, load = impl.handle_output, impl.load_input
        impl.handle_output = lambda c, o: t.time("write", handle, c, o)  # type: ignore[method-assign,assignment]
        impl.load_input = lambda c: t.time("load", load, c)  # type: ignore[method-assign,assignment]
        return impl


class DeltaIOManager(dg.ConfigurableIOManager):
    """What dagster-deltalake's pyarrow handler does, minus its config surface."""

    root: str

    def _path(self, key: dg.AssetKey) -> str:
        return str(Path(self.root) / "/".join(key.path))

    def handle_output(self, context: dg.OutputContext, obj: pa.Table) -> None:
        from deltalake import write_deltalake

        _Timed("delta").time("write", lambda: write_deltalake(self._path(context.asset_key), obj, mode="overwrite"))

    def load_input(self, context: dg.InputContext) -> pa.Table:
        from deltalake import DeltaTable

        return _Timed("delta").time("load", lambda: DeltaTable(self._path(context.asset_key)).to_pyarrow_table())


def run(rows: int, root: Path) -> dict[str, Any]:
    holder: dict[str, pa.Table] = {}

    @dg.asset(metadata={"persist/key": ["id"]})
    def orders() -> pa.Table:
        return holder["t"]

    @dg.asset(io_manager_key="mem")
    def count(orders: pa.Table) -> int:
        return orders.num_rows

    out: dict[str, Any] = {"rows": rows}
    persist = PersistResource(home=str(root / "persist"))
    managers = {
        "persist": TimedPersist(persist=persist),
        "delta": DeltaIOManager(root=str(root / "delta")),
    }
    (root / "dagster").mkdir(parents=True, exist_ok=True)
    with dg.instance_for_test(temp_dir=str(root / "dagster")) as instance:
        for version, label in ((0, "first"), (1, "1pct_changed")):
            holder["t"] = data(rows, version)
            for side, io in managers.items():
                res = dg.materialize(
                    [orders, count], resources={"io_manager": io, "mem": dg.InMemoryIOManager()}, instance=instance
                )
                assert res.success and res.output_for_node("count") == rows
                out[f"{label}_{side}_write_s"] = round(TIMES[f"{side}_write"], 3)
                out[f"{label}_{side}_load_s"] = round(TIMES[f"{side}_load"], 3)
                out[f"{label}_{side}_write_cpu_s"] = round(TIMES[f"{side}_write_cpu"], 3)
                out[f"{label}_{side}_load_cpu_s"] = round(TIMES[f"{side}_load_cpu"], 3)
            for what in ("write", "load"):
                out[f"{label}_{what}_ratio"] = round(out[f"{label}_persist_{what}_s"] / out[f"{label}_delta_{what}_s"], 2)
                out[f"{label}_{what}_cpu_ratio"] = round(
                    out[f"{label}_persist_{what}_cpu_s"] / out[f"{label}_delta_{what}_cpu_s"], 2
                )
    persist.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--root", default=None, help="a directory on the disk to measure (default: a temp dir)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=args.root) as d:
        print(json.dumps(run(args.rows, Path(d)), indent=2))


if __name__ == "__main__":
    main()
