"""The event log of a history: one JSON-lines file per actor incarnation, merged after.

Each client operation writes an ``invoke`` record before it starts and a ``complete``
record when it returns, with an outcome in Jepsen's vocabulary:

- ``ok``: it happened (a write is committed, a read returned this data);
- ``fail``: it definitely did not happen (``UpperMismatch``, ``Determinate``, usage errors);
- ``info``: unknown (``Indeterminate``, an unexpected error, or the actor was killed
  before it completed: an invoke without a complete is read back as ``info``).

Records are written with one ``write`` per line on an ``O_APPEND`` descriptor, so a
``kill -9`` can at worst leave a torn last line, which ``load_events`` skips.
Times: ``mono`` is ``time.monotonic()`` (system-wide on Linux, so comparable across the
processes of one machine: the real-time order check uses it) and ``wall_ms`` is
``time.time()`` in ms (comparable with the walltimes recorded in shard state).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

OK = "ok"
FAIL = "fail"
INFO = "info"
OUTCOMES = (OK, FAIL, INFO)


class EventLog:
    """Appends JSON records to one file (thread-safe; safe against ``kill -9``)."""

    def __init__(self, path: str | os.PathLike[str], actor: str, incarnation: int) -> None:
        self.path = str(path)
        self.actor = actor
        self.incarnation = incarnation
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._lock = threading.Lock()
        self._next = 0

    def _write(self, rec: dict[str, Any]) -> None:
        line = (json.dumps(rec, separators=(",", ":"), default=str) + "\n").encode()
        with self._lock:
            os.write(self._fd, line)

    def new_op_id(self) -> str:
        with self._lock:
            self._next += 1
            return f"{self.actor}.{self.incarnation}.{self._next}"

    def invoke(self, op: str, args: dict[str, Any] | None = None, op_id: str | None = None) -> str:
        """Logs the start of ``op``; returns its id (pass it to ``complete``)."""
        oid = op_id or self.new_op_id()
        self._write(
            {
                "type": "invoke",
                "id": oid,
                "op": op,
                "actor": self.actor,
                "inc": self.incarnation,
                "pid": os.getpid(),
                "args": args or {},
                "mono": time.monotonic(),
                "wall_ms": time.time() * 1000.0,
            }
        )
        return oid

    def complete(
        self,
        op_id: str,
        outcome: str,
        result: Any = None,
        error: str | None = None,
        error_type: str | None = None,
        **extra: Any,
    ) -> None:
        assert outcome in OUTCOMES, outcome
        rec: dict[str, Any] = {
            "type": "complete",
            "id": op_id,
            "outcome": outcome,
            "result": result,
            "mono": time.monotonic(),
            "wall_ms": time.time() * 1000.0,
        }
        if error is not None:
            rec["error"] = error[:2000]
            rec["error_type"] = error_type
        rec.update(extra)
        self._write(rec)

    def note(self, kind: str, **data: Any) -> None:
        """A free-form record (fault counters, outage windows, deletes...)."""
        self._write(
            {
                "type": kind,
                "actor": self.actor,
                "inc": self.incarnation,
                "pid": os.getpid(),
                "mono": time.monotonic(),
                "wall_ms": time.time() * 1000.0,
                **data,
            }
        )

    def close(self) -> None:
        try:
            os.close(self._fd)
        except OSError:
            pass


@dataclass
class Op:
    """One operation of the merged history."""

    id: str
    op: str
    actor: str
    inc: int
    args: dict[str, Any]
    invoke_mono: float
    invoke_wall_ms: float
    outcome: str = INFO  # an invoke without a complete is indeterminate
    result: Any = None
    error: str | None = None
    error_type: str | None = None
    complete_mono: float | None = None
    complete_wall_ms: float | None = None
    completed: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def process(self) -> str:
        return f"{self.actor}.{self.inc}"


@dataclass
class History:
    """Every actor's events merged: operations (by invoke time) and other records."""

    ops: list[Op]
    records: list[dict[str, Any]]
    torn_lines: int = 0

    def by_kind(self, kind: str) -> list[dict[str, Any]]:
        return [r for r in self.records if r.get("type") == kind]

    def ops_of(self, *names: str) -> list[Op]:
        return [o for o in self.ops if o.op in names]


def _lines(path: Path) -> Iterator[tuple[dict[str, Any] | None, bool]]:
    with open(path, "rb") as f:
        data = f.read()
    for raw in data.split(b"\n"):
        if not raw.strip():
            continue
        try:
            yield json.loads(raw), False
        except ValueError:
            yield None, True  # a line torn by kill -9


def load_events(log_dir: str | os.PathLike[str]) -> History:
    """Merges every ``*.jsonl`` file under ``log_dir`` into one ``History``."""
    ops: dict[str, Op] = {}
    records: list[dict[str, Any]] = []
    torn = 0
    for path in sorted(Path(log_dir).glob("*.jsonl")):
        for rec, bad in _lines(path):
            if bad or rec is None:
                torn += 1
                continue
            t = rec.get("type")
            if t == "invoke":
                ops[rec["id"]] = Op(
                    id=rec["id"],
                    op=rec["op"],
                    actor=rec["actor"],
                    inc=int(rec["inc"]),
                    args=rec.get("args") or {},
                    invoke_mono=float(rec["mono"]),
                    invoke_wall_ms=float(rec["wall_ms"]),
                )
            elif t == "complete":
                o = ops.get(rec["id"])
                if o is None:
                    continue
                o.outcome = rec["outcome"]
                o.result = rec.get("result")
                o.error = rec.get("error")
                o.error_type = rec.get("error_type")
                o.complete_mono = float(rec["mono"])
                o.complete_wall_ms = float(rec["wall_ms"])
                o.completed = True
                o.extra = {
                    k: v
                    for k, v in rec.items()
                    if k not in ("type", "id", "outcome", "result", "error", "error_type", "mono", "wall_ms")
                }
            else:
                records.append(rec)
    return History(sorted(ops.values(), key=lambda o: o.invoke_mono), records, torn)
