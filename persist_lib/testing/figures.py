"""The reliability figures: aggregated over many histories and checks, as a table + JSON.

``Figures`` accumulates ``HistoryResult``s per backend, planted-bug outcomes and the
property-test counts, and renders them (``table()``) in the order of
research/reliability.md section 8 (R3 stateful, R4 histories, R5 indeterminate
resolution, R6 GC safety, R7 crashes, R8 corruption, R9 liveness, R12 planted bugs).
Every violation kind is listed, with its count (0 is the target for correct code).
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from persist_lib.testing.checker import VIOLATION_KINDS
from persist_lib.testing.runner import HistoryResult
from persist_lib.testing.txn_checker import TXN_VIOLATION_KINDS
from persist_lib.testing.txn_history import TxnHistoryResult


@dataclass
class BackendFigures:
    histories: int = 0
    histories_failed: int = 0
    ops: int = 0
    ops_min: int | None = None
    outcomes: Counter[str] = field(default_factory=Counter)
    ops_by_kind: Counter[str] = field(default_factory=Counter)
    faults: Counter[str] = field(default_factory=Counter)
    outages: Counter[str] = field(default_factory=Counter)
    crashes: int = 0
    unexpected_restarts: int = 0
    hung: int = 0
    commits: int = 0
    seqnos: int = 0
    indeterminate_writes: int = 0
    indeterminate_committed: int = 0
    snapshots_checked: int = 0
    listen_progress_checked: int = 0
    versions_content_checked: int = 0
    deletes_audited: int = 0
    leaked_before_sweep: int = 0
    leaked_after_sweep: int = 0
    interrupted_ops: int = 0
    heartbeat_faults: int = 0
    sweeps: int = 0
    blobs_swept: int = 0
    long_writes: int = 0
    long_writes_ok: int = 0
    fresh_starts: int = 0
    violations: Counter[str] = field(default_factory=Counter)
    failed_seeds: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0

    def add(self, r: HistoryResult) -> None:
        s = r.report.stats
        self.histories += 1
        n = int(s.get("ops", 0))
        self.ops += n
        self.ops_min = n if self.ops_min is None else min(self.ops_min, n)
        self.outcomes.update({"ok": s.get("ops_ok", 0), "fail": s.get("ops_fail", 0), "info": s.get("ops_info", 0)})
        self.ops_by_kind.update(s.get("ops_by_kind", {}))
        self.faults.update(s.get("faults", {}))
        self.outages.update(s.get("outages", {}))
        self.crashes += r.crashes
        self.unexpected_restarts += r.restarts_unexpected
        self.hung += len(r.hung)
        for k in (
            "commits", "seqnos", "indeterminate_writes", "snapshots_checked",
            "listen_progress_checked", "versions_content_checked", "deletes_audited",
            "interrupted_ops", "heartbeat_faults", "sweeps", "blobs_swept", "long_writes",
            "long_writes_ok",
        ):
            setattr(self, k, getattr(self, k) + int(s.get(k, 0) or 0))
        self.indeterminate_committed += int(s.get("indeterminate_committed", 0))
        self.fresh_starts += int(s.get("fresh_start", 0))
        self.leaked_before_sweep += r.leaked_before_sweep
        self.leaked_after_sweep += r.leaked_after_sweep
        self.violations.update(r.report.by_kind())
        self.seconds += r.duration_s
        if not r.ok:
            self.histories_failed += 1
            self.failed_seeds.append(
                {"seed": r.cfg.seed, "dir": r.cfg.root, "violations": r.report.by_kind(),
                 "first": [str(v)[:300] for v in r.report.violations[:3]]}
            )

    def to_json(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        for k, v in d.items():
            if isinstance(v, Counter):
                d[k] = dict(v)
        d["violations"] = {k: self.violations.get(k, 0) for k in VIOLATION_KINDS}
        return d


@dataclass
class Figures:
    backends: dict[str, BackendFigures] = field(default_factory=dict)
    planted: dict[str, dict[str, Any]] = field(default_factory=dict)
    stateful: dict[str, Any] = field(default_factory=dict)
    corruption: dict[str, Any] = field(default_factory=dict)
    txn: dict[str, Counter[str]] = field(default_factory=dict)  # backend -> transactions-history counts
    started: float = field(default_factory=time.time)

    def add_txn_history(self, backend: str, r: TxnHistoryResult) -> None:
        """A transactions history (``txn_history``): its counts and violations."""
        c = self.txn.setdefault(backend, Counter())
        s = r.report.stats
        c["histories"] += 1
        c["histories_failed"] += 0 if r.ok else 1
        for k in ("ops", "ops_ok", "ops_fail", "ops_info", "txns_committed",
                  "txns_committed_multi_collection", "handovers"):
            c[k] += int(s.get(k) or 0)
        for k in ("snapshot", "listen_next"):
            c[f"reads_{k}"] += int((s.get("ops_by_kind") or {}).get(k, 0))
        for point, n in (s.get("kill_points") or {}).items():
            c[f"kill_{point}"] += n
        c["nemesis_kills"] += r.crashes
        for k, n in r.report.by_kind().items():
            c[f"violation_{k}"] += n

    def add_history(self, backend: str, r: HistoryResult) -> None:
        self.backends.setdefault(backend, BackendFigures()).add(r)

    def add_planted(self, name: str, check: str, caught: bool, detail: str = "", seconds: float = 0.0) -> None:
        e = self.planted.setdefault(name, {"checks": {}})
        e["checks"][check] = {"caught": caught, "detail": detail[:300], "seconds": round(seconds, 1)}
        e["caught"] = any(c["caught"] for c in e["checks"].values())

    def to_json(self) -> dict[str, Any]:
        return {
            "generated_at": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime()),
            "wall_seconds": round(time.time() - self.started, 1),
            "backends": {k: v.to_json() for k, v in self.backends.items()},
            "planted": self.planted,
            "planted_caught": sum(1 for p in self.planted.values() if p.get("caught")),
            "planted_total": len(self.planted),
            "stateful": self.stateful,
            "corruption": self.corruption,
            "transactions": {k: dict(v) for k, v in self.txn.items()},
        }

    def write_json(self, path: str | os.PathLike[str]) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.to_json(), indent=2, sort_keys=True) + "\n")

    def table(self) -> str:
        names = sorted(self.backends)
        cols = [self.backends[n] for n in names]
        w = max([22] + [len(n) + 2 for n in names])
        lines: list[str] = []

        def row(label: str, vals: list[Any]) -> None:
            lines.append(f"{label:<34}" + "".join(f"{str(v):>{w}}" for v in vals))

        lines.append("Reliability figures (persist_lib.testing)")
        row("", names)
        row("R4 histories", [c.histories for c in cols])
        row("   histories with violations", [c.histories_failed for c in cols])
        row("   operations (total)", [c.ops for c in cols])
        row("   operations (min per history)", [c.ops_min for c in cols])
        for o in ("ok", "fail", "info"):
            row(f"   outcome {o}", [c.outcomes.get(o, 0) for c in cols])
        row("   committed writes (seqno-ordered)", [c.commits for c in cols])
        row("   state versions replayed", [c.seqnos for c in cols])
        row("   snapshots checked vs model", [c.snapshots_checked for c in cols])
        row("   listen progress checked", [c.listen_progress_checked for c in cols])
        row("   trace contents checked", [c.versions_content_checked for c in cols])
        row("faults: per-call calls", [c.faults.get("calls", 0) for c in cols])
        for k in ("determinate", "applied_then_timeout", "timeout_only", "stall"):
            row(f"   {k}", [c.faults.get(k, 0) for c in cols])
        row("   outages (timeout/determinate)", [f"{c.outages.get('timeout_only', 0)}/{c.outages.get('determinate', 0)}" for c in cols])
        row(
            "   interrupts before/after effect",
            [f"{c.faults.get('interrupt_before', 0)}/{c.faults.get('interrupt_after', 0)}" for c in cols],
        )
        row("   ops ended by an interrupt", [c.interrupted_ops for c in cols])
        row("   heartbeat faults (unexpected)", [c.heartbeat_faults for c in cols])
        row("   sweeps, clock hours ahead", [c.sweeps for c in cols])
        row("      blobs they deleted", [c.blobs_swept for c in cols])
        row("   long writes (ok / all)", [f"{c.long_writes_ok}/{c.long_writes}" for c in cols])
        row("   fresh concurrent first opens", [c.fresh_starts for c in cols])
        row("R7 crashes (kill -9)", [c.crashes for c in cols])
        row("   leaked blobs before sweep", [c.leaked_before_sweep for c in cols])
        row("   leaked blobs after sweep", [c.leaked_after_sweep for c in cols])
        row("R5 indeterminate writes", [c.indeterminate_writes for c in cols])
        row("   ... of which committed (once)", [c.indeterminate_committed for c in cols])
        row("R6 blob deletes audited", [c.deletes_audited for c in cols])
        row("R9 hung actors / unexpected exits", [f"{c.hung}/{c.unexpected_restarts}" for c in cols])
        lines.append("violations by kind:")
        for k in VIOLATION_KINDS:
            row(f"   {k}", [c.violations.get(k, 0) for c in cols])
        row("   TOTAL", [sum(c.violations.values()) for c in cols])
        self._txn_table(lines)
        if self.stateful:
            lines.append(
                f"R3 stateful: {self.stateful.get('examples')} examples x <= {self.stateful.get('steps')} steps, "
                f"failures: {self.stateful.get('failures', 0)}"
            )
        if self.corruption:
            lines.append(
                f"R8 corruption: {self.corruption.get('examples')} random flips/truncations, "
                f"detected {self.corruption.get('detected')}, returned as data {self.corruption.get('returned', 0)}"
            )
        if self.planted:
            caught = sum(1 for p in self.planted.values() if p.get("caught"))
            lines.append(f"R12 planted bugs caught: {caught}/{len(self.planted)}")
            for name, p in sorted(self.planted.items()):
                checks = ", ".join(
                    f"{c}: {'caught' if v['caught'] else 'MISSED'} ({v['seconds']}s)" for c, v in sorted(p["checks"].items())
                )
                lines.append(f"   {name:<28} {checks}")
        for n, c in zip(names, cols, strict=True):
            for f in c.failed_seeds[:10]:
                lines.append(f"FAILED {n} seed {f['seed']}: {f['violations']} (kept in {f['dir']})")
        return "\n".join(lines)

    def _txn_table(self, lines: list[str]) -> None:
        if not self.txn:
            return
        names = sorted(self.txn)
        lines.append("transactions histories (txn_history)" + "".join(f"{n:>22}" for n in names))
        labels = [
            ("histories", "histories"), ("histories_failed", "   with violations"), ("ops", "   operations"),
            ("txns_committed", "   transactions in the collections"),
            ("txns_committed_multi_collection", "      ... over several collections"),
            ("handovers", "   handovers"), ("reads_snapshot", "   snapshots checked"),
            ("reads_listen_next", "   listen steps checked"), ("nemesis_kills", "   nemesis kill -9"),
        ] + [(f"kill_{p}", f"   kill -9 {p}") for p in ("after_commit_cas", "between_applies", "before_tidy_cas", "after_tidy_cas")]
        labels += [(f"violation_{k}", f"   {k}") for k in TXN_VIOLATION_KINDS]
        for key, label in labels:
            lines.append(f"{label:<38}" + "".join(f"{self.txn[n].get(key, 0):>22}" for n in names))
