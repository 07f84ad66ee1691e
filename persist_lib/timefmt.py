"""Times for people: which times are wall-clock times, and how to show and parse them.

A persist time is a plain non-negative integer. Ingested collections use milliseconds
since the Unix epoch; tests and hand-made shards use small logical times (0, 1, 2...).
Nothing in a shard says which, so displays use one rule, the same everywhere (the
``persist`` CLI, Dagster metadata): a time in ``[EPOCH_MS_MIN, EPOCH_MS_MAX)`` (from
1973-03-03 to 5138-11-16) is shown as an ISO-8601 UTC timestamp beside the integer;
anything smaller is a logical time and shown as the integer alone.

Fields that are always wall-clock milliseconds (heartbeats, ``walltime_ms``, failure
times) are shown as timestamps whatever their value (``iso_utc``).
"""

from __future__ import annotations

import datetime as dt
import re

#: The smallest time taken for milliseconds since the epoch (1973-03-03T09:46:40Z).
EPOCH_MS_MIN = 10**11
#: The first time no longer taken for one (5138-11-16).
EPOCH_MS_MAX = 10**14

_UTC = dt.UTC
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=_UTC)


def is_epoch_ms(t: object) -> bool:
    """Whether ``t`` is displayed as a time in ms since the epoch (see the module doc)."""
    return isinstance(t, int) and not isinstance(t, bool) and EPOCH_MS_MIN <= t < EPOCH_MS_MAX


def iso_utc(ms: int) -> str:
    """``1767225600123`` -> ``"2026-01-01T00:00:00.123Z"`` (milliseconds kept when nonzero)."""
    d = _EPOCH + dt.timedelta(milliseconds=ms)  # exact (no float rounding)
    text = d.isoformat(timespec="milliseconds" if ms % 1000 else "seconds")
    return text.replace("+00:00", "Z")


def time_text(t: int | None) -> str:
    """A time for a table cell: ``"5"``, or ``"1767225600123 (2026-01-01T00:00:00.123Z)"``."""
    if t is None:
        return "-"
    return f"{t} ({iso_utc(t)})" if is_epoch_ms(t) else str(t)


def short_time_text(t: int | None) -> str:
    """A time where space is short: ``"5"``, or ``"2026-01-01T00:00:00.123Z"`` alone for an
    epoch-ms time (``--json`` keeps the integer)."""
    if t is None:
        return "-"
    return iso_utc(t) if is_epoch_ms(t) else str(t)


def short_frontier_text(elements: list[int] | tuple[int, ...] | None) -> str:
    """``frontier_text`` with ``short_time_text``: ``"closed"``, ``"-"``, ``"5"``, or the
    timestamp alone."""
    if elements is None:
        return "-"
    if not elements:
        return "closed"
    return ", ".join(short_time_text(int(e)) for e in elements)


def frontier_text(elements: list[int] | tuple[int, ...] | None) -> str:
    """A frontier for people: ``[5]`` -> ``"5"``, ``[]`` -> ``"closed"`` (the empty
    frontier: no more times), ``None`` -> ``"-"``; epoch-ms times with their timestamp."""
    if elements is None:
        return "-"
    if not elements:
        return "closed"
    return ", ".join(time_text(int(e)) for e in elements)


def epoch_seconds(elements: list[int] | tuple[int, ...] | None) -> float | None:
    """A one-time frontier of epoch milliseconds as UNIX seconds (else None)."""
    if elements is not None and len(elements) == 1 and is_epoch_ms(int(elements[0])):
        return int(elements[0]) / 1000.0
    return None


_INT = re.compile(r"[+-]?\d+")


def parse_time(text: str) -> int:
    """A time given on a command line: an integer (a persist time, e.g. ``1767225600000``
    or ``5``), or an ISO-8601 timestamp (``2026-01-01T00:00:00Z``, ``2026-01-01 12:30``,
    ``2026-01-01``; without a zone it is UTC), converted to ms since the epoch."""
    s = text.strip()
    if _INT.fullmatch(s):
        t = int(s)
        if t < 0:
            raise ValueError(f"time {text!r} is negative; persist times are >= 0")
        return t
    iso = s[:-1] + "+00:00" if s.endswith(("Z", "z")) else s
    try:
        d = dt.datetime.fromisoformat(iso)
    except ValueError:
        raise ValueError(
            f"time {text!r} is neither an integer nor an ISO-8601 timestamp (e.g. 1767225600000, "
            "2026-01-01T00:00:00Z, 2026-01-01 12:30:00+02:00, 2026-01-01)"
        ) from None
    if d.tzinfo is None:
        d = d.replace(tzinfo=_UTC)
    ms = round(d.timestamp() * 1000)
    if ms < 0:
        raise ValueError(f"time {text!r} is before the epoch; persist times are >= 0")
    return ms
