"""Repeated runs of one benchmark, and the rows that summarise them.

These machines are shared and noisy: a goal met because the anchor happened to run slow
is not met. So every benchmark runs at least ``min_runs`` times; when the anchor of any
of its rows varied by more than ``tolerance`` (max/min - 1) across the runs so far, the
whole benchmark runs again (persist and anchor back to back, as always), up to
``max_runs``. The reported row is the median over runs of persist's figure, of the
anchor's figure and of the per-run ratio (each ratio is still persist / anchor *of the
same run*); its goal is judged on the median ratio; it records the runs, the anchor's
spread and the load average of the runs (1-minute, at the time each row was measured).
"""

from __future__ import annotations

import statistics
from typing import Any

from bench.common import _cmp


def _key(r: dict[str, Any], i: int) -> tuple[str, str, str, int]:
    return (r["bench"], r["metric"], r.get("anchor_name") or "", i)


def _rows_by_key(res: dict[str, Any]) -> dict[tuple[str, str, str, int], dict[str, Any]]:
    """Rows of one run keyed by (bench, metric, anchor, occurrence) (metrics may repeat)."""
    seen: dict[tuple[str, str, str], int] = {}
    out: dict[tuple[str, str, str, int], dict[str, Any]] = {}
    for r in res.get("rows", []):
        k3 = (r["bench"], r["metric"], r.get("anchor_name") or "")
        i = seen.get(k3, 0)
        seen[k3] = i + 1
        out[_key(r, i)] = r
    return out


def spread(xs: list[float]) -> float | None:
    """max/min - 1 of positive figures (None when there are fewer than two)."""
    v = [x for x in xs if x is not None and x > 0]
    if len(v) < 2:
        return None
    return max(v) / min(v) - 1


def unstable(runs: list[dict[str, Any]], tolerance: float) -> list[str]:
    """Rows whose anchor varied by more than ``tolerance`` across ``runs``."""
    keyed = [_rows_by_key(r) for r in runs if "error" not in r]
    if len(keyed) < 2:
        return []
    out = []
    for k in keyed[0]:
        s = spread([kr[k].get("anchor") for kr in keyed if k in kr])
        if s is not None and s > tolerance:
            out.append(f"{k[0]}: {k[1]} vs {k[2]} ({100 * s:.0f}%)")
    return out


def combine(runs: list[dict[str, Any]], tolerance: float) -> dict[str, Any]:
    """One result from several runs of a benchmark (see the module docstring)."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return runs[-1]
    keyed = [_rows_by_key(r) for r in ok]
    rows: list[dict[str, Any]] = []
    for k, first in keyed[0].items():
        same = [kr[k] for kr in keyed if k in kr]
        row = dict(first)
        pv = [r["persist"] for r in same if r.get("persist") is not None]
        av = [r["anchor"] for r in same if r.get("anchor") is not None]
        rv = [r["ratio"] for r in same if r.get("ratio") is not None]
        row["persist"] = statistics.median(pv) if pv else None
        row["anchor"] = statistics.median(av) if av else None
        row["ratio"] = round(statistics.median(rv), 3) if rv else None
        row["runs"] = len(same)
        s = spread(av)
        row["anchor_spread"] = None if s is None else round(s, 3)
        row["anchor_stable"] = s is None or s <= tolerance
        loads = [r.get("load") for r in same if r.get("load") is not None]
        row["load"] = loads
        row["met"] = _judge(row)
        rows.append(row)
    out = dict(ok[-1])
    out["rows"] = rows
    out["runs"] = [r.get("detail") for r in runs]
    out.pop("detail", None)
    return out


def _judge(row: dict[str, Any]) -> bool | None:
    goal = row.get("goal") or ""
    if not goal:
        return None
    op, th_s = goal.split()[0], goal.split()[1]
    th = float(th_s.rstrip("x"))
    if th_s.endswith("x"):  # a goal on the ratio, else on persist's value
        return None if row["ratio"] is None else _cmp(row["ratio"], op, th)
    return None if row["persist"] is None else _cmp(row["persist"], op, th)
