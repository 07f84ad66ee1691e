"""Markdown table of a benchmark run (``bench/out/results.json``).

Run: ``.venv/bin/python -m bench.report [bench/out/results.json]``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def _fmt(x: Any) -> str:
    if x is None:
        return "—"
    if isinstance(x, bool):
        return str(x)
    if isinstance(x, int):
        return f"{x:,}"
    if isinstance(x, float):
        ax = abs(x)
        if ax >= 1000:
            return f"{x:,.0f}"
        if ax >= 100:
            return f"{x:.0f}"
        if ax >= 10:
            return f"{x:.1f}"
        if ax >= 1:
            return f"{x:.2f}"
        return f"{x:.3g}"
    return str(x)


def _met(m: bool | None) -> str:
    if m is None:
        return ""
    return "met" if m else "**NOT met**"


def _runs(r: dict[str, Any]) -> str:
    n = r.get("runs")
    if n is None:
        return ""
    sp = r.get("anchor_spread")
    if sp is None:
        return str(n)
    flag = "" if r.get("anchor_stable", True) else ", **unstable**"
    return f"{n} ({100 * sp:.0f}%{flag})"


def _load(x: Any) -> str:
    if x is None:
        return ""
    if isinstance(x, list):
        return " / ".join(f"{v:.1f}" for v in x)
    return f"{x:.1f}"


def render_rows(rows: list[dict[str, Any]]) -> str:
    out = [
        "| benchmark | metric | persist | anchor | anchor value | ratio persist/anchor | goal | met? "
        "| runs (anchor spread) | load avg 1 min |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        unit = r.get("unit", "")
        pv = f"{_fmt(r['persist'])} {unit}".strip()
        av = f"{_fmt(r['anchor'])} {unit}".strip() if r.get("anchor") is not None else "—"
        rr = f"{_fmt(r['ratio'])}x" if r.get("ratio") is not None else "—"
        metric = r["metric"] + (f" ({r['note']})" if r.get("note") else "")
        out.append(
            f"| {r['bench']} | {metric} | {pv} | {r.get('anchor_name') or '—'} | {av} | {rr} | "
            f"{r.get('goal') or ''} | {_met(r.get('met'))} | {_runs(r)} | {_load(r.get('load'))} |"
        )
    return "\n".join(out)


def render(results: dict[str, Any]) -> str:
    meta = results.get("meta", {})
    rows: list[dict[str, Any]] = []
    errors: list[str] = []
    for name, res in results.get("benchmarks", {}).items():
        if "error" in res:
            errors.append(f"- `{name}` failed: {res['error']}")
        rows.extend(res.get("rows", []))
    goals = [r for r in rows if r.get("met") is not None]
    met = sum(1 for r in goals if r["met"])
    shaky = sum(1 for r in goals if r["met"] and not r.get("anchor_stable", True))
    head = (
        f"Mode **{meta.get('mode', '?')}**, {meta.get('cpus', '?')} CPUs, load average "
        f"{meta.get('loadavg_start', '?')} at start / {meta.get('loadavg_end', '?')} at end, "
        f"{meta.get('seconds', '?')} s in total; deltalake {meta.get('deltalake', '?')}, pyiceberg "
        f"{meta.get('pyiceberg', '?')}, pyarrow {meta.get('pyarrow', '?')}, Python "
        f"{meta.get('python', '?')}; code at `{meta.get('git', '?')}`. "
        f"Goals met: **{met} / {len(goals)}**"
        + (f" ({shaky} of them with an anchor that stayed unstable over the runs)" if shaky else "")
        + "."
    )
    parts = [head, "", render_rows(rows)]
    if errors:
        parts += ["", "Errors:", *errors]
    return "\n".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("path", nargs="?", default="bench/out/results.json", type=Path)
    a = ap.parse_args()
    print(render(json.loads(a.path.read_text())))


if __name__ == "__main__":
    main()
