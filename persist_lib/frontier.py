"""Frontiers over totally ordered u64 times.

Because our times are totally ordered, an antichain holds at most one element:
``Antichain([t])`` means "every time >= t" and ``Antichain([])`` (empty) means "no
time at all" (a closed upper, a released since). The empty frontier is the top of
the frontier order: it is beyond every time.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import total_ordering

from persist_lib.error_base import InvalidUsage

MIN_TIME = 0
MAX_TIME = (1 << 63) - 1


def check_time(t: object, what: str = "time") -> int:
    """Validates that ``t`` is a non-negative 64-bit integer time and returns it."""
    if isinstance(t, bool) or not isinstance(t, int):
        raise InvalidUsage(f"{what} must be an int in [0, 2^63), got {t!r} ({type(t).__name__})")
    if t < MIN_TIME or t > MAX_TIME:
        raise InvalidUsage(f"{what} must be in [0, 2^63), got {t}")
    return t


@total_ordering
class Antichain:
    """A frontier of totally ordered times: empty, or a single lower bound."""

    __slots__ = ("_t",)

    def __init__(self, elements: Iterable[int] = ()) -> None:
        elems = [check_time(e, "frontier element") for e in elements]
        # For a total order the antichain of a set of times is its minimum.
        self._t: int | None = min(elems) if elems else None

    @classmethod
    def of(cls, t: int | None) -> Antichain:
        """``Antichain([t])``, or the empty antichain for ``None``."""
        return cls() if t is None else cls([t])

    @classmethod
    def empty(cls) -> Antichain:
        return cls()

    @classmethod
    def minimum(cls) -> Antichain:
        return cls([MIN_TIME])

    @property
    def elements(self) -> list[int]:
        return [] if self._t is None else [self._t]

    @property
    def time(self) -> int | None:
        """The single element, or ``None`` when the frontier is empty."""
        return self._t

    def is_empty(self) -> bool:
        return self._t is None

    def less_equal(self, t: int) -> bool:
        """True iff time ``t`` is at or beyond this frontier (``t`` is "not yet complete")."""
        return self._t is not None and self._t <= t

    def less_than(self, t: int) -> bool:
        return self._t is not None and self._t < t

    def _key(self) -> float | int:
        return float("inf") if self._t is None else self._t

    def __eq__(self, other: object) -> bool:
        if isinstance(other, int) and not isinstance(other, bool):
            return self._t == other
        if not isinstance(other, Antichain):
            return NotImplemented
        return self._t == other._t

    def __lt__(self, other: object) -> bool:
        if not isinstance(other, Antichain):
            return NotImplemented
        return self._key() < other._key()

    def __hash__(self) -> int:
        return hash(("Antichain", self._t))

    def __repr__(self) -> str:
        return f"Antichain({self.elements})"

    def __str__(self) -> str:
        return "[]" if self._t is None else f"[{self._t}]"

    def to_json(self) -> int | None:
        return self._t

    @classmethod
    def from_json(cls, v: int | None) -> Antichain:
        """Decodes ``to_json``'s form (state decoding calls this hundreds of times per
        open: a direct check instead of ``Antichain([v])``'s generic path)."""
        if v is not None and (
            type(v) is not int or v < MIN_TIME or v > MAX_TIME  # noqa: E721 - bool is not a time
        ):
            check_time(v, "frontier element")  # raises with the usual message
        out = object.__new__(cls)
        out._t = v
        return out


FrontierLike = Antichain | int | list | tuple


def as_frontier(v: FrontierLike | None, what: str = "frontier") -> Antichain:
    """Accepts an ``Antichain``, a plain ``int`` (shorthand for ``Antichain([t])``) or a list."""
    if isinstance(v, Antichain):
        return v
    if isinstance(v, bool):
        raise InvalidUsage(f"{what} must be an Antichain or an int time, got {v!r}")
    if isinstance(v, int):
        return Antichain([check_time(v, what)])
    if isinstance(v, list | tuple):
        return Antichain(v)
    raise InvalidUsage(f"{what} must be an Antichain or an int time, got {v!r} ({type(v).__name__})")
