"""Frontiers over u64 times (``persist_lib.frontier``): the order, the boundaries of a
valid time, and the JSON form state is stored in."""

from __future__ import annotations

import re

import pytest

from persist_lib.errors import InvalidUsage
from persist_lib.frontier import MAX_TIME, Antichain, as_frontier, check_time


def test_check_time_accepts_exactly_the_u63_range() -> None:
    assert check_time(0) == 0 and check_time(MAX_TIME) == MAX_TIME == (1 << 63) - 1
    for bad in (-1, MAX_TIME + 1):
        with pytest.raises(InvalidUsage, match=r"as_of must be in \[0, 2\^63\), got"):
            check_time(bad, "as_of")
    for bad in (True, 1.0, "1", None):
        with pytest.raises(InvalidUsage, match=r"as_of must be an int in \[0, 2\^63\)"):
            check_time(bad, "as_of")


def test_order_and_equality() -> None:
    empty, zero, five = Antichain(), Antichain([0]), Antichain([5])
    assert Antichain([7, 5, 9]) == five and Antichain.minimum() == zero and Antichain.empty() == empty
    assert zero < five < empty and not empty < empty and max(zero, empty) == empty
    assert five == 5 and five != 6 and empty != 0 and (five == True) is False  # noqa: E712
    assert five != "5" and five.__eq__("5") is NotImplemented and five.__lt__(5) is NotImplemented
    assert hash(five) == hash(Antichain([5])) and hash(five) != hash(empty)
    assert five.less_equal(5) and not five.less_equal(4) and not empty.less_equal(MAX_TIME)
    assert five.less_than(6) and not five.less_than(5) and not empty.less_than(MAX_TIME)
    assert (five.elements, empty.elements, five.time, empty.time) == ([5], [], 5, None)
    assert (str(five), str(empty), repr(five), repr(empty)) == ("[5]", "[]", "Antichain([5])", "Antichain([])")
    assert Antichain.of(None) == empty and Antichain.of(3) == Antichain([3])
    assert empty.is_empty() and not zero.is_empty()


def test_json_round_trip_and_validation() -> None:
    for a in (Antichain(), Antichain([0]), Antichain([MAX_TIME])):
        assert Antichain.from_json(a.to_json()) == a
    assert Antichain([4]).to_json() == 4 and Antichain().to_json() is None
    assert Antichain.from_json(7).time == 7 and Antichain.from_json(None).is_empty()
    for bad, got in ((-1, "-1"), (MAX_TIME + 1, str(MAX_TIME + 1)), (True, "True"), (1.5, "1.5"), ("3", "'3'")):
        with pytest.raises(InvalidUsage, match=rf"^frontier element must .*, got {re.escape(got)}( |$)"):
            Antichain.from_json(bad)  # type: ignore[arg-type]


def test_as_frontier() -> None:
    f = Antichain([3])
    assert as_frontier(f) is f
    assert as_frontier(3) == f and as_frontier([3, 8]) == f and as_frontier(()) == Antichain()
    with pytest.raises(InvalidUsage, match="upper must be an Antichain or an int time, got True"):
        as_frontier(True, "upper")
    with pytest.raises(InvalidUsage, match=r"upper must be an Antichain or an int time, got '3' \(str\)"):
        as_frontier("3", "upper")  # type: ignore[arg-type]
    with pytest.raises(InvalidUsage, match="upper must be in"):
        as_frontier(-2, "upper")
