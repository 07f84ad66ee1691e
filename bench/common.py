"""Shared pieces of the side-by-side benchmarks (``python -m bench``).

Every benchmark measures persist and its anchor (delta-rs, pyiceberg, raw Parquet, a raw
fsync'd loop...) back to back, in one process run, on the same data and the same disk,
and reports *ratios*: the machine is shared and noisy, so an absolute figure means
little without the anchor measured next to it.

A benchmark module exposes ``run(ctx: Ctx) -> dict`` returning
``{"rows": [Row-as-dict, ...], "detail": {...}}``; ``bench.report`` renders the rows.
"""

from __future__ import annotations

import contextlib
import gc
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

REPO = Path(__file__).resolve().parent.parent

KEY_SCHEMA = pa.schema([("key", pa.int64())])
VAL_SCHEMA = pa.schema([("value", pa.string())])


# ----- data ---------------------------------------------------------------------------------


def update_batch(n: int, t: int, seed: int, *, time_col: str = "ts") -> pa.Table:
    """``n`` updates at time ``t`` as in research/peers.md section 4: key int64 (random in
    [0, 1e7)), value ``"val_<key>"``, time int64, diff int64 (= 1)."""
    rng = np.random.default_rng(seed)
    keys = pa.array(rng.integers(0, 10_000_000, n, dtype=np.int64))
    vals = pc.binary_join_element_wise("val_", pc.cast(keys, pa.string()), "")
    return pa.table(
        {
            "key": keys,
            "value": vals,
            time_col: pa.array(np.full(n, t, dtype=np.int64)),
            "diff": pa.array(np.ones(n, dtype=np.int64)),
        }
    )


def du(path: str | os.PathLike[str]) -> int:
    tot = 0
    for d, _, fs in os.walk(path):
        for f in fs:
            with contextlib.suppress(OSError):
                tot += os.path.getsize(os.path.join(d, f))
    return tot


# ----- statistics ---------------------------------------------------------------------------


def pct(xs: list[float], p: float) -> float:
    """Nearest-rank percentile (as in the peers script)."""
    s = sorted(xs)
    k = max(0, min(len(s) - 1, int(round(p / 100.0 * (len(s) - 1)))))
    return s[k]


def drift(lat: list[float], p: float = 95) -> float:
    """pP of the last 10% of the samples / pP of the first 10%."""
    k = max(1, len(lat) // 10)
    first, last = pct(lat[:k], p), pct(lat[-k:], p)
    return round(last / first, 2) if first > 0 else float("inf")


def lat_summary(lat: list[float]) -> dict[str, Any]:
    """Latencies in seconds -> ops/s (over the sum of latencies), p50/p95/p99/max in ms,
    drift (p95 of last 10% / p95 of first 10%) and the p50 drift."""
    return {
        "n": len(lat),
        "ops_per_s": round(len(lat) / sum(lat), 1) if lat else 0.0,
        "p50_ms": round(pct(lat, 50) * 1e3, 2),
        "p95_ms": round(pct(lat, 95) * 1e3, 2),
        "p99_ms": round(pct(lat, 99) * 1e3, 2),
        "max_ms": round(max(lat) * 1e3, 2),
        "mean_ms": round(statistics.mean(lat) * 1e3, 2),
        "drift_p95": drift(lat, 95),
        "drift_p50": drift(lat, 50),
        "decile_p50_ms": _deciles(lat, 50),
        "decile_p95_ms": _deciles(lat, 95),
    }


def _deciles(lat: list[float], p: float) -> list[float]:
    """pP (ms) of each tenth of the samples, in order: the shape behind the drift figure."""
    k = max(1, len(lat) // 10)
    return [round(pct(lat[i : i + k], p) * 1e3, 1) for i in range(0, k * 10, k) if lat[i : i + k]]


def median_time(fn: Callable[[], Any], reps: int) -> tuple[float, Any]:
    """Median wall time (s) of ``reps`` calls of ``fn`` and the last result."""
    ts: list[float] = []
    out: Any = None
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts), out


# ----- rows of the report ---------------------------------------------------------------------


@dataclass
class Row:
    """One line of the report: persist's figure next to its anchor, measured in the same run.

    ``ratio`` is persist / anchor (None when there is no anchor); ``goal`` is a string
    such as ``">= 2.0x"`` (on the ratio) or ``"<= 50 ms"`` (on the value), and ``met``
    says whether it holds (None when the row has no goal).
    """

    bench: str
    metric: str
    persist: float | None
    unit: str
    anchor_name: str = ""
    anchor: float | None = None
    ratio: float | None = None
    goal: str = ""
    met: bool | None = None
    note: str = ""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return round(a / b, 3)


def row(
    bench: str,
    metric: str,
    persist: float | None,
    unit: str,
    anchor_name: str = "",
    anchor: float | None = None,
    *,
    goal_ratio: tuple[str, float] | None = None,
    goal_value: tuple[str, float] | None = None,
    note: str = "",
) -> dict[str, Any]:
    """A report row; ``goal_ratio=(">=", 2.0)`` checks persist/anchor, ``goal_value=("<=",
    50)`` checks persist's value itself."""
    r = ratio(persist, anchor)
    goal, met = "", None
    if goal_ratio is not None:
        op, th = goal_ratio
        goal = f"{op} {th:g}x"
        met = None if r is None else _cmp(r, op, th)
    elif goal_value is not None:
        op, th = goal_value
        goal = f"{op} {th:g} {unit}"
        met = None if persist is None else _cmp(persist, op, th)
    out = Row(bench, metric, persist, unit, anchor_name, anchor, r, goal, met, note).to_json()
    out["load"] = load_1min()
    return out


def load_1min() -> float | None:
    """The machine's 1-minute load average now (printed beside each figure)."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def _cmp(x: float, op: str, th: float) -> bool:
    return x >= th if op == ">=" else x <= th


# ----- the run context ---------------------------------------------------------------------------


@dataclass
class Ctx:
    """What a benchmark gets: its mode, a scratch directory on the local disk, shared
    servers (started lazily, stopped at the end) and artefacts other benchmarks left."""

    mode: str  # "quick" | "full"
    root: Path
    profile_dir: Path | None = None
    shared: dict[str, Any] = field(default_factory=dict)
    _pg: Any = None
    _moto: Any = None
    _cleanups: list[Callable[[], None]] = field(default_factory=list)

    @property
    def quick(self) -> bool:
        return self.mode == "quick"

    def pick(self, quick: Any, full: Any) -> Any:
        return quick if self.quick else full

    def dir(self, name: str) -> Path:
        d = self.root / name
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        return d

    # -- servers -------------------------------------------------------------------

    def pg(self) -> Any:
        """A throwaway Postgres (``tests/support/pg_server.py``; as the ``postgres`` user
        when run as root), shared by every benchmark of the run."""
        if self._pg is None:
            if str(REPO) not in sys.path:
                sys.path.insert(0, str(REPO))
            from tests.support.pg_server import PgServer

            self._pg = PgServer.start()
            self._cleanups.append(self._pg.stop)
        return self._pg

    def moto(self) -> Any:
        """The moto S3 server over HTTP on 127.0.0.1 (``tests/support/moto_server.py``)."""
        if self._moto is None:
            if str(REPO) not in sys.path:
                sys.path.insert(0, str(REPO))
            from tests.support.moto_server import MotoS3

            self._moto = MotoS3().start()
            self._cleanups.append(self._moto.stop)
        return self._moto

    def close(self) -> None:
        while self._cleanups:
            fn = self._cleanups.pop()
            with contextlib.suppress(Exception):
                fn()

    # -- profiling ------------------------------------------------------------------

    @contextlib.contextmanager
    def profile(self, name: str) -> Iterator[None]:
        """With ``--profile DIR``: profiles the block into ``DIR/name.txt`` (top frames).

        Uses py-spy when it is installed (it samples *every* thread: batch building and
        compaction run in pools), else pyinstrument (main thread only). Otherwise a no-op.
        """
        if self.profile_dir is None:
            yield
            return
        self.profile_dir.mkdir(parents=True, exist_ok=True)
        spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
        if os.access(spy, os.X_OK):
            raw = self.profile_dir / f"{name}.raw"
            proc = subprocess.Popen(
                [
                    spy,
                    "record",
                    "--pid",
                    str(os.getpid()),
                    "--rate",
                    "250",
                    "--format",
                    "raw",
                    "--output",
                    str(raw),
                    "--nonblocking",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            time.sleep(0.5)  # let it attach
            try:
                yield
            finally:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                if raw.exists():
                    (self.profile_dir / f"{name}.txt").write_text(summarize_raw_profile(raw))
            return
        from pyinstrument import Profiler

        prof = Profiler(interval=0.0005, async_mode="disabled")
        prof.start()
        try:
            yield
        finally:
            prof.stop()
            (self.profile_dir / f"{name}.txt").write_text(
                prof.output_text(unicode=False, color=False, show_all=False)
            )


def _frame_name(f: str) -> str:
    """``func (path/to/file.py:123)`` -> ``func (file path relative to the repo/site-packages)``."""
    f = re.sub(r":\d+\)$", ")", f)
    f = re.sub(r"\(.*/site-packages/", "(", f)
    f = re.sub(r"\(.*/lib/python3\.\d+/", "(", f)
    return f.replace(f"({REPO}/", "(")


def summarize_raw_profile(path: Path, top: int = 40) -> str:
    """Inclusive and self time per frame of a py-spy ``raw`` (collapsed stacks) file,
    over busy samples of every thread (idle threads are not sampled)."""
    incl: dict[str, int] = {}
    self_: dict[str, int] = {}
    total = 0
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        stack, _, count = line.rpartition(" ")
        n = int(count)
        frames = [_frame_name(f) for f in stack.split(";")]
        total += n
        for f in set(frames):
            incl[f] = incl.get(f, 0) + n
        self_[frames[-1]] = self_.get(frames[-1], 0) + n
    if total == 0:
        return "no samples\n"
    out = [f"py-spy, every thread, {total} busy samples at 250 Hz", "", "inclusive:"]
    skip = (
        "_bootstrap",
        "Thread.run",
        "_worker (",
        "_WorkItem.run",
        "<module>",
        "run_module",
        "_run_code",
        "_run_module_as_main",
        "main (bench/__main__",
    )
    for f, n in sorted(incl.items(), key=lambda kv: -kv[1]):
        if any(s in f for s in skip):
            continue
        out.append(f"{100 * n / total:5.1f}%  {f}")
        if len(out) >= top + 3:
            break
    out += ["", "self:"]
    for f, n in sorted(self_.items(), key=lambda kv: -kv[1])[:20]:
        out.append(f"{100 * n / total:5.1f}%  {f}")
    return "\n".join(out) + "\n"


# ----- persist helpers ------------------------------------------------------------------------


def compaction_available() -> bool:
    """Whether the library has in-process background compaction (issue: compaction)."""
    from persist_lib.config import PersistConfig
    from persist_lib.handles.client import PersistClient

    return (
        hasattr(PersistClient, "compact")
        and "compaction_enabled" in PersistConfig.__dataclass_fields__
    )


def warm_imports() -> None:
    """Imports what each side loads lazily on its first use (polars: persist's sorts and
    merges; deltalake) before anything is timed: a one-time cost of a process (~0.25 s
    for polars), not a throughput, which otherwise lands in whichever figure runs first."""
    import deltalake  # noqa: F401
    import polars  # noqa: F401


def persist_config(**overrides: Any) -> Any:
    """The default config, minus the heartbeat thread (leases are 15 min / 1 h: no
    heartbeat would fire during a benchmark anyway)."""
    from persist_lib.config import PersistConfig

    cfg = PersistConfig(background_heartbeats=False)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def file_location(d: Path) -> tuple[str, str]:
    """The embedded default's URIs in ``d``: file blob + SQLite consensus."""
    (d / "blob").mkdir(parents=True, exist_ok=True)
    return f"file://{d / 'blob'}", f"sqlite:///{d / 'consensus.db'}"


def persist_file_client(d: Path, *, fsync: bool = True, **cfg: Any) -> Any:
    """A client on file blob + SQLite consensus in ``d``. ``fsync=False`` turns off the
    blob's fsyncs and uses SQLite ``synchronous=NORMAL``: the durability delta-rs has on
    a local disk (it never fsyncs), for an apples-to-apples comparison."""
    from persist_lib.handles.client import PersistClient

    blob_uri, cons_uri = file_location(d)
    if fsync:
        return PersistClient.open(blob_uri, cons_uri, persist_config(**cfg))
    from persist_lib.location.file_blob import FileBlob
    from persist_lib.location.sqlite_consensus import SqliteConsensus

    return PersistClient(
        FileBlob(d / "blob", fsync=False),
        SqliteConsensus(d / "consensus.db", synchronous="NORMAL"),
        persist_config(**cfg),
        blob_uri=blob_uri,
        consensus_uri=cons_uri + "?synchronous=NORMAL",
    )


def wait_compaction_idle(client: Any, timeout_s: float = 120.0) -> float:
    """Waits for the client's background compactor to drain; returns the seconds waited."""
    bg = client.__dict__.get("_bg_compactor")
    if bg is None:
        return 0.0
    t0 = time.perf_counter()
    bg.wait_idle(timeout_s)
    return time.perf_counter() - t0


def compactor_stats(client: Any) -> dict[str, Any]:
    bg = client.__dict__.get("_bg_compactor")
    return bg.stats() if bg is not None else {}


def fresh_process_state() -> None:
    """Forgets persist's per-process state cache and collects garbage between phases."""
    from persist_lib.shard.machine import clear_state_cache

    clear_state_cache()
    gc.collect()


def tmp_root(base: str | None = None) -> Path:
    return Path(tempfile.mkdtemp(prefix="persist-bench-", dir=base))
