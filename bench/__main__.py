"""Side-by-side benchmarks of persist against delta-rs, pyiceberg and the machine's limits.

Run: ``.venv/bin/python -m bench [--quick|--full] [--only NAME ...] [--out bench/out/results.json]
[--root DIR] [--profile DIR] [--keep]``.

Every benchmark measures persist and its anchor back to back in this one process run,
on the same data and the same disk (a temp dir on the local disk), and reports ratios;
the JSON goes to ``--out`` and a markdown table to stdout. See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import shutil
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from bench.common import Ctx, tmp_root
from bench.repeat import combine, unstable
from bench.report import render

# (name, module) in run order; ``--only`` takes names or module names.
BENCHMARKS: list[tuple[str, str]] = [
    ("small_appends", "bench.small_appends"),
    ("bulk_append", "bench.bulk_append"),
    ("compaction", "bench.compaction_vs_delta"),
    ("open", "bench.open_vs_delta"),
    ("time_travel", "bench.time_travel"),
    ("snapshot_read", "bench.snapshot_read"),
    ("pushdown", "bench.pushdown"),
    ("write_amplification", "bench.write_amplification"),
    ("consensus_cas", "bench.consensus_cas"),
    ("s3_pg_latency", "bench.s3_pg_latency"),
    ("listen_latency", "bench.listen_latency"),
]

# Run only when named with ``--only`` (not part of ``make bench``).
OPTIONAL: list[tuple[str, str]] = [("scaling", "bench.scaling"), ("stats_cost", "bench.stats_cost")]


def _select(only: list[str] | None) -> list[tuple[str, str]]:
    if not only:
        return BENCHMARKS
    wanted = set(only)
    every = BENCHMARKS + OPTIONAL
    picked = [(n, m) for n, m in every if n in wanted or m.split(".")[-1] in wanted]
    known = {n for n, _ in every} | {m.split(".")[-1] for _, m in every}
    unknown = wanted - known
    if unknown:
        raise SystemExit(f"unknown benchmark(s) {sorted(unknown)}; choose from {sorted(known)}")
    return picked


def _versions() -> dict[str, str]:
    out: dict[str, str] = {}
    for mod in ("pyarrow", "deltalake", "pyiceberg", "psycopg"):
        try:
            out[mod] = importlib.import_module(mod).__version__
        except Exception:  # noqa: BLE001
            out[mod] = "missing"
    return out


def _git() -> str:
    """HEAD and whether persist_lib has uncommitted changes (others edit concurrently)."""
    import subprocess

    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "persist_lib"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        return head + (" + uncommitted persist_lib changes" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "?"


def _loadavg() -> str:
    try:
        return "/".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "?"


def _run_one(modname: str, ctx: Ctx) -> dict[str, Any]:
    try:
        res: dict[str, Any] = importlib.import_module(modname).run(ctx)
    except Exception as e:  # noqa: BLE001 - one failing benchmark must not sink the run
        traceback.print_exc()
        res = {"error": f"{type(e).__name__}: {e}", "rows": []}
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--quick", action="store_const", dest="mode", const="quick")
    g.add_argument("--full", action="store_const", dest="mode", const="full")
    ap.add_argument("--only", nargs="+", metavar="NAME", help="run only these benchmarks")
    ap.add_argument("--out", type=Path, default=Path("bench/out/results.json"))
    ap.add_argument("--root", default=None, help="scratch directory parent (default: system temp)")
    ap.add_argument(
        "--profile",
        type=Path,
        default=None,
        metavar="DIR",
        help="pyinstrument the persist side of each benchmark into DIR",
    )
    ap.add_argument("--keep", action="store_true", help="keep the scratch directory")
    ap.add_argument(
        "--runs", type=int, default=2, help="runs of each benchmark at least (default 2)"
    )
    ap.add_argument(
        "--max-runs",
        type=int,
        default=4,
        help="runs at most, while an anchor varies by more than --tolerance (default 4)",
    )
    ap.add_argument(
        "--tolerance",
        type=float,
        default=0.2,
        help="an anchor spread (max/min - 1) above this repeats the benchmark (default 0.2)",
    )
    a = ap.parse_args(argv)
    mode = a.mode or "quick"
    selected = _select(a.only)

    root = tmp_root(a.root)
    ctx = Ctx(mode=mode, root=root, profile_dir=a.profile)
    meta: dict[str, Any] = {
        "mode": mode,
        "runs": f"{a.runs}..{a.max_runs} (repeated while an anchor varies by more than {a.tolerance:.0%})",
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "loadavg_start": _loadavg(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "root": str(root),
        "git": _git(),
        **_versions(),
    }
    results: dict[str, Any] = {"meta": meta, "benchmarks": {}}
    t_all = time.perf_counter()
    try:
        for name, modname in selected:
            t0 = time.perf_counter()
            runs: list[dict[str, Any]] = []
            while True:
                print(f"[bench] {name} run {len(runs) + 1} ...", file=sys.stderr, flush=True)
                runs.append(_run_one(modname, ctx))
                if "error" in runs[-1] or len(runs) >= a.max_runs:
                    break
                if len(runs) >= a.runs:
                    noisy = unstable(runs, a.tolerance)
                    if not noisy:
                        break
                    print(f"[bench] {name}: anchors varied: {'; '.join(noisy)}", file=sys.stderr)
            res = combine(runs, a.tolerance)
            res["seconds"] = round(time.perf_counter() - t0, 1)
            results["benchmarks"][name] = res
            print(f"[bench] {name} done in {res['seconds']} s", file=sys.stderr, flush=True)
    finally:
        ctx.close()
        meta["seconds"] = round(time.perf_counter() - t_all, 1)
        meta["loadavg_end"] = _loadavg()
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(results, indent=1, default=str))
        if not a.keep:
            shutil.rmtree(root, ignore_errors=True)
    print(render(results))
    print(f"\n(JSON: {a.out})")
    return 1 if any("error" in r for r in results["benchmarks"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
