"""Output of the ``persist`` command line for people: text tables, key/value blocks, a
progress bar on stderr.

Scripts use ``--json`` instead (the documents the library returns, unchanged); what is
here may change between versions. Times are shown with ``persist_lib.timefmt``: an
ISO-8601 UTC timestamp beside the integer when it is a time in ms since the epoch.
Tables fit 120 columns (``persist_lib.cli.fit``: long text cells end in ``…``).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import IO, Any

from persist_lib.cli.fit import elide, fit_widths, line_width
from persist_lib.cli.values import bytes_text
from persist_lib.timefmt import (
    frontier_text,
    iso_utc,
    short_frontier_text,
    short_time_text,
    time_text,
)

#: Keys whose integer values are always wall-clock milliseconds.
WALL_CLOCK_KEYS = frozenset(
    {
        "walltime_ms",
        "last_heartbeat_ms",
        "first_failure_ms",
        "last_failure_ms",
        "created_ms",
        "mtime_ms",
    }
)
#: Keys whose values are frontiers (lists of times) or times.
FRONTIER_KEYS = frozenset(
    {"since", "upper", "lower", "metadata_since", "metadata_upper", "most_recent_write_upper"}
)
TIME_KEYS = frozenset({"at", "retired_at", "as_of", "resumed_at", "ts", "handover_at", "remap_upper"})
#: Column keys of times and frontiers shown as the timestamp alone (narrow tables).
SHORT_TIME_KEYS = frozenset({"upper_short", "since_short", "retired_at_short"})


def cell(key: str, value: Any) -> str:
    """One value as table text, formatted by what its key says it is."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if key in WALL_CLOCK_KEYS and isinstance(value, int):
        return iso_utc(value)
    if key in FRONTIER_KEYS and isinstance(value, list | tuple):
        return frontier_text([int(v) for v in value])
    if key in (FRONTIER_KEYS | TIME_KEYS) and isinstance(value, int):
        return time_text(value)
    if key in SHORT_TIME_KEYS and isinstance(value, list | tuple):
        return short_frontier_text([int(v) for v in value])
    if key in SHORT_TIME_KEYS and isinstance(value, int):
        return short_time_text(value)
    if key == "bytes" and isinstance(value, int):
        return human_bytes(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.3f}".rstrip("0").rstrip(".")
    if isinstance(value, bytes | bytearray):
        return bytes_text(value)
    if isinstance(value, list | tuple):
        return ", ".join(cell(key, v) for v in value) if value else "-"
    if isinstance(value, dict):
        return ", ".join(f"{k}={cell(str(k), v)}" for k, v in value.items()) if value else "-"
    return str(value)


def human_bytes(n: int) -> str:
    """``1234567`` -> ``"1.2 MB (1,234,567)"``; small sizes as plain byte counts."""
    if n < 10_000:
        return f"{n:,} B"
    for unit, size in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n:,} B"  # pragma: no cover


def table(
    header: Sequence[str],
    rows: Iterable[Sequence[Any]],
    *,
    keys: Sequence[str] | None = None,
    width: int | None = None,
) -> str:
    """An aligned text table. Cells are formatted with ``cell`` by column key (``keys``,
    default the header); columns of numbers are right-aligned; the lines fit ``width``
    (default ``fit.line_width()``)."""
    keys = list(keys) if keys is not None else list(header)
    raw = [list(r) for r in rows]
    body = [[cell(k, v) for k, v in zip(keys, row, strict=False)] for row in raw]
    numeric = [
        bool(raw)
        and all(
            isinstance(r[i], int | float) and not isinstance(r[i], bool) and keys[i] not in _AS_TEXT
            for r in raw
            if i < len(r) and r[i] is not None
        )
        for i in range(len(header))
    ]
    widths = [max([len(h)] + [len(r[i]) for r in body if i < len(r)]) for i, h in enumerate(header)]
    widths = fit_widths(widths, [not n and k not in _AS_TEXT for n, k in zip(numeric, keys, strict=False)], width)

    def line(cells: Sequence[str]) -> str:
        out = [
            elide(c, widths[i]).rjust(widths[i]) if numeric[i] else elide(c, widths[i]).ljust(widths[i])
            for i, c in enumerate(cells)
        ]
        return "  ".join(out).rstrip()

    lines = [line(list(header)), "  ".join("-" * w for w in widths)]
    lines += [line(r) for r in body]
    return "\n".join(lines)


def nested_table(header: Sequence[str], rows: Iterable[Sequence[Any]], *, keys: Sequence[str] | None = None) -> str:
    """A ``table`` to be indented by two spaces under a heading: two columns narrower."""
    return table(header, rows, keys=keys, width=line_width() - 2)


def id_table(
    id_header: str,
    ids: Sequence[str],
    header: Sequence[str],
    rows: Iterable[Sequence[Any]],
    *,
    keys: Sequence[str] | None = None,
) -> str:
    """A table of rows named by long ids (shard ids): each id whole on its own line, its
    row below it indented by two spaces, so the table fits the line width without
    cutting an id."""
    lines = table(header, rows, keys=keys, width=line_width() - 2).splitlines()
    out = [id_header, *("  " + x for x in lines[:2])]
    for i, line in zip(ids, lines[2:], strict=True):
        out += [i, "  " + line]
    return "\n".join(out)


# Numeric columns shown as text (timestamps beside the integer read better left-aligned).
_AS_TEXT = FRONTIER_KEYS | TIME_KEYS | WALL_CLOCK_KEYS | SHORT_TIME_KEYS


def kv(pairs: Iterable[tuple[str, Any]] | Mapping[str, Any]) -> str:
    """``key: value`` lines, keys aligned, values formatted by key."""
    items = list(pairs.items()) if isinstance(pairs, Mapping) else list(pairs)
    if not items:
        return ""
    w = max(len(k) for k, _ in items)
    return "\n".join(f"{k.ljust(w)}  {cell(k, v)}" for k, v in items)


def render(doc: Any, width: int | None = None) -> str:
    """Any JSON document as text: a list of objects is a table, an object is key/value
    lines (nested lists of objects as tables below it), scalars as they are."""
    if isinstance(doc, list):
        if doc and all(isinstance(d, dict) for d in doc):
            header = list(dict.fromkeys(k for d in doc for k in d))
            return table(header, [[d.get(k) for k in header] for d in doc], width=width)
        return "\n".join(cell("", d) for d in doc) if doc else "(none)"
    if isinstance(doc, dict):
        if not doc:
            return "(none)"
        flat = [(k, v) for k, v in doc.items() if not _is_nested(v)]
        nested = [(k, v) for k, v in doc.items() if _is_nested(v)]
        parts = [kv(flat)] if flat else []
        for k, v in nested:
            if isinstance(v, dict):
                v = [{"": kk, **vv} if isinstance(vv, dict) else {"": kk, "value": vv} for kk, vv in v.items()]
            inner = (line_width() if width is None else width) - 2
            parts.append(f"\n{k}:\n" + _indent(render(v, inner)))
        return "\n".join(parts)
    return cell("", doc)


def _is_nested(v: Any) -> bool:
    if isinstance(v, list):
        return bool(v) and all(isinstance(x, dict) for x in v)
    if isinstance(v, dict):
        return bool(v) and all(isinstance(x, dict) for x in v.values())
    return False


def _indent(text: str, by: str = "  ") -> str:
    return "\n".join(by + line if line else line for line in text.splitlines())


class Progress:
    """A one-line progress bar on stderr: ``compact s1a2..: [######----] 3/5 merges``.

    Drawn only when ``enabled`` (default: the stream is a terminal), so pipes and logs
    get nothing. ``update`` is cheap (redraws at most every ``min_interval_s``); ``close``
    (or leaving a ``with`` block) draws the final state and ends the line.
    """

    def __init__(
        self,
        label: str,
        total: int | None = None,
        *,
        unit: str = "",
        stream: IO[str] | None = None,
        enabled: bool | None = None,
        width: int = 30,
        min_interval_s: float = 0.1,
    ) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = _isatty(self.stream) if enabled is None else enabled
        self.label = label
        self.total = total
        self.unit = unit
        self.done = 0
        self.note = ""
        self.width = width
        self.min_interval_s = min_interval_s
        self._last = 0.0
        self._drawn = False
        self._t0 = time.monotonic()

    def update(self, done: int, total: int | None = None, note: str = "") -> None:
        self.done = done
        if total is not None:
            self.total = total
        self.note = note
        now = time.monotonic()
        if now - self._last >= self.min_interval_s:
            self._last = now
            self._draw()

    def advance(self, n: int = 1, note: str = "") -> None:
        self.update(self.done + n, note=note)

    def _draw(self, final: bool = False) -> None:
        if not self.enabled:
            return
        total = self.total
        if total:
            frac = min(1.0, self.done / total)
            filled = int(frac * self.width)
            bar = "[" + "#" * filled + "-" * (self.width - filled) + "]"
            count = f" {self.done:,}/{total:,}"
        else:
            bar = "[" + ("=" * self.width if final else "." * self.width) + "]"
            count = f" {self.done:,}"
        unit = f" {self.unit}" if self.unit else ""
        note = f" {self.note}" if self.note else ""
        secs = f" {time.monotonic() - self._t0:.1f}s"
        self.stream.write(f"\r\x1b[2K{self.label}: {bar}{count}{unit}{secs}{note}")
        self.stream.flush()
        self._drawn = True

    def close(self) -> None:
        if self.enabled:
            self._draw(final=True)
            self.stream.write("\n")
            self.stream.flush()
            self.enabled = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _isatty(stream: IO[str]) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False
