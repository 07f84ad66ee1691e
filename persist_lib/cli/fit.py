"""Text tables that fit the screen: column widths cut down to a line width, long cells
elided with ``…``.

A table is laid out at its natural widths; if the line is longer than ``line_width()``
(120 columns, or the terminal's width when it is wider), the widest text columns are
narrowed, one at a time, down to ``MIN_WIDTH``; cells longer than their column end in
``…``. Numbers are never cut. ``--json`` prints every value whole.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Sequence

#: The width a table is fitted to when the terminal is not wider (or not a terminal).
DEFAULT_WIDTH = 120
#: A text column is never narrowed below this.
MIN_WIDTH = 12
GAP = 2  # spaces between columns
#: The environment variable that sets the width (0: never cut).
WIDTH_ENV = "PERSIST_TABLE_WIDTH"

_warned: set[str] = set()  # bad values of $PERSIST_TABLE_WIDTH already warned about


def line_width() -> int:
    """120, or the terminal's width when stdout is a wider terminal; ``PERSIST_TABLE_WIDTH``
    overrides both (0: never cut). A value that is not a whole number >= 0 is only a
    cosmetic mistake: one warning line on stderr (per value and process) names the
    variable, and the width is what it would be without it."""
    env = os.environ.get(WIDTH_ENV, "").strip()
    if env.isascii() and env.isdigit():
        return int(env) or 10**9
    if env and env not in _warned:
        _warned.add(env)
        print(
            f"persist: warning: ignoring {WIDTH_ENV}={env!r}: it must be a whole number of columns "
            f"(0: never cut long cells); fix: set e.g. {WIDTH_ENV}=160, or unset it",
            file=sys.stderr,
        )
    cols = shutil.get_terminal_size((DEFAULT_WIDTH, 24)).columns if os.isatty(1) else 0
    return max(DEFAULT_WIDTH, cols)


def fit_widths(widths: Sequence[int], cuttable: Sequence[bool], limit: int | None = None) -> list[int]:
    """``widths`` narrowed so the line (with ``GAP`` between columns) is at most ``limit``
    wide, cutting the widest cuttable column first; as narrow as ``MIN_WIDTH`` allows."""
    limit = line_width() if limit is None else limit
    out = list(widths)
    while True:
        total = sum(out) + GAP * max(0, len(out) - 1)
        if total <= limit:
            return out
        candidates = [i for i, w in enumerate(out) if cuttable[i] and w > MIN_WIDTH]
        if not candidates:
            return out
        i = max(candidates, key=lambda j: out[j])
        others = [out[j] for j in candidates if j != i]
        # down to the next widest column (so wide columns shrink together), or what is needed
        target = max(MIN_WIDTH, out[i] - (total - limit), max(others, default=MIN_WIDTH) - 1)
        out[i] = min(out[i] - 1, target) if target < out[i] else out[i] - 1


def elide(text: str, width: int) -> str:
    """``text`` cut to ``width`` characters, ending in ``…`` when cut."""
    return text if len(text) <= width else text[: max(0, width - 1)] + "…"
