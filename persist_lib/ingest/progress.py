"""Progress reporting for long ingests: a callback protocol plus two ready-made sinks.

The driver calls ``callback(progress)`` after every durable append (and once at the
end with ``done=True``). ``IngestProgress`` is plain data: the CLI renders it as a
progress bar (``ProgressBar``), Dagster turns ``as_metadata()`` into asset metadata.
Callbacks must be quick and must not raise (exceptions are logged and ignored: a
broken progress display never stops an ingestion).
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass, field
from typing import IO, Any, Protocol


@dataclass
class IngestProgress:
    """A snapshot of an ingestion run's progress."""

    name: str
    records: int = 0  # messages processed by this run (decoded rows + error records)
    bytes: int = 0  # input bytes processed by this run
    errors: int = 0  # error records written by this run
    bindings: int = 0  # bindings applied by this run (minted here or adopted)
    upper: int = 0  # every output is complete for times before this
    frontier: dict[str, list[Any]] = field(default_factory=dict)
    lag_bytes: int | None = None  # input not yet ingested (estimate), when the source knows
    lag_ms: int | None = None  # wall clock minus the last bound time
    total_bytes: int | None = None  # bytes + lag_bytes when both known: for a percentage
    elapsed_s: float = 0.0
    done: bool = False

    @property
    def records_per_s(self) -> float:
        return self.records / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def mb_per_s(self) -> float:
        return self.bytes / 1e6 / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def fraction(self) -> float | None:
        if not self.total_bytes:
            return None
        return min(1.0, self.bytes / self.total_bytes)

    def as_metadata(self) -> dict[str, Any]:
        """Flat JSON-able dict (Dagster metadata, logs)."""
        d = asdict(self)
        d["records_per_s"] = round(self.records_per_s, 1)
        d["mb_per_s"] = round(self.mb_per_s, 3)
        return d


class ProgressCallback(Protocol):
    def __call__(self, progress: IngestProgress, /) -> None: ...


class ProgressBar:
    """Renders progress on a terminal line: ``[#####-----] 52% 520,000 rec 45.1 MB 41k rec/s``."""

    def __init__(self, stream: IO[str] | None = None, width: int = 30, min_interval_s: float = 0.2) -> None:
        self.stream = stream or sys.stderr
        self.width = width
        self.min_interval_s = min_interval_s
        self._last = 0.0

    def __call__(self, p: IngestProgress) -> None:
        now = time.monotonic()
        if not p.done and now - self._last < self.min_interval_s:
            return
        self._last = now
        frac = p.fraction
        if frac is None:
            bar = "[" + ("=" * self.width if p.done else "?" * self.width) + "]"
            pct = " done" if p.done else ""
        else:
            filled = int(frac * self.width)
            bar = "[" + "#" * filled + "-" * (self.width - filled) + "]"
            pct = f" {frac * 100:5.1f}%"
        lag = f" lag {p.lag_bytes / 1e6:.1f} MB" if p.lag_bytes is not None else ""
        line = (
            f"\r{p.name}: {bar}{pct} {p.records:,} rec {p.bytes / 1e6:.1f} MB "
            f"{p.records_per_s:,.0f} rec/s {p.errors:,} err upper {p.upper}{lag}"
        )
        self.stream.write(line)
        if p.done:
            self.stream.write("\n")
        self.stream.flush()


class ProgressLog:
    """Collects every progress event (tests, Dagster: the last one becomes metadata)."""

    def __init__(self) -> None:
        self.events: list[IngestProgress] = []

    def __call__(self, p: IngestProgress) -> None:
        self.events.append(p)

    @property
    def last(self) -> IngestProgress | None:
        return self.events[-1] if self.events else None
