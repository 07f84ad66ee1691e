"""``readable_since``: the earliest time a collection reader can read (issue 30 item 2)."""

from __future__ import annotations

from typing import Any

import pytest

from persist_lib.storage.readable import readable_since

TIMELINE = [{"at": 0, "to": "r0"}, {"at": 5, "to": "r1"}]


def rs(since: int | None, status: str) -> dict[str, Any]:
    return {"since": None if since is None else [since], "status": status}


@pytest.mark.parametrize(
    ("meta", "r0", "r1", "expected"),
    [
        (6, rs(None, "dropped"), rs(0, "active"), 6),  # compacted past the handover
        (0, rs(0, "retired"), rs(0, "active"), 0),  # a reader holds r0: all history
        (0, rs(3, "retired"), rs(0, "active"), 3),  # r0 compacted to 3
        (0, rs(0, "dropped"), rs(0, "active"), 5),  # r0 gone: only r1's segment
        (0, rs(7, "retired"), rs(0, "active"), 5),  # r0 compacted past its segment
        (0, rs(0, "retired"), rs(8, "active"), 8),  # r1 compacted past the handover
        (9, rs(0, "retired"), rs(0, "active"), 9),  # the metadata since wins
    ],
)
def test_readable_since(meta: int, r0: dict[str, Any], r1: dict[str, Any], expected: int) -> None:
    assert readable_since([meta], TIMELINE, {"r0": r0, "r1": r1}) == expected


def test_nothing_readable() -> None:
    assert readable_since([0], [], {}) is None  # no rendition active yet
    assert readable_since([], TIMELINE, {"r0": rs(0, "retired"), "r1": rs(0, "active")}) is None
    assert readable_since([0], TIMELINE[:1], {"r0": rs(None, "active")}) is None
