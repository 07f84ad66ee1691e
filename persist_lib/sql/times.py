"""Times of SQL time travel: parsing (ints, ISO 8601 strings) and display.

A time is an int (ingested data: milliseconds since the epoch) or an ISO 8601
timestamp (no offset means UTC); ``format_time`` shows epoch-millisecond times with
their UTC timestamp, and ``range_text`` a table's readable range in error messages.
"""

from __future__ import annotations

import datetime as dt
import re

from persist_lib.errors import InvalidUsage
from persist_lib.frontier import Antichain, check_time

TimeLike = int | str

#: Times at or above this are shown as UTC timestamps too (ms since the epoch, >= 1973).
_EPOCH_MS_FROM = 10**11
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)


def parse_time(value: object, what: str = "time") -> int:
    """A time from an int, a string of digits, or an ISO 8601 timestamp (milliseconds
    since the epoch; a timestamp without an offset is UTC)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return check_time(value, what)
    if isinstance(value, dt.datetime):
        d = value if value.tzinfo else value.replace(tzinfo=dt.UTC)
        return check_time((d - _EPOCH) // dt.timedelta(milliseconds=1), what)
    if isinstance(value, str):
        text = value.strip()
        if re.fullmatch(r"\d+", text):
            return check_time(int(text), what)
        try:
            d = dt.datetime.fromisoformat(text)
        except ValueError:
            pass
        else:
            return parse_time(d, what)
    raise InvalidUsage(
        f"{what} {value!r} is not a time: give an integer (ingested times are milliseconds "
        "since the epoch, e.g. 1714564800000) or an ISO 8601 timestamp (e.g. "
        "'2024-05-01T12:00:00Z'; without an offset it is UTC)"
    )


def format_time(t: int | None) -> str:
    """``1714564800000 (2024-05-01T12:00:00Z)``; small times (not epoch ms) as is."""
    if t is None:
        return "(none: closed)"
    if t >= _EPOCH_MS_FROM:
        try:
            d = dt.datetime.fromtimestamp(t / 1000, dt.UTC)
        except (OverflowError, ValueError, OSError):
            return str(t)
        iso = d.strftime("%Y-%m-%dT%H:%M:%S")
        if t % 1000:
            iso += f".{t % 1000:03d}"
        return f"{t} ({iso}Z)"
    return str(t)


def range_text(since: Antichain, upper: Antichain) -> str:
    if upper.time is not None and since.time is not None and upper.time <= since.time:
        return f"none yet (since {format_time(since.time)}, upper {format_time(upper.time)})"
    hi = "no end (closed)" if upper.time is None else format_time(upper.time)
    return f"[{format_time(since.time)}, {hi})"
