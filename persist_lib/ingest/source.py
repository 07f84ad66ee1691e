"""The source protocol: partitions of ordered, replayable addresses (docs/design.md section 11).

A *source* is split into partitions; within a partition every message has an
*address* (a tuple of ints/strings compared as a Python tuple: ``(file, row)`` for a
landing zone, ``(commit_lsn,)`` for Postgres CDC) and messages come in address order.
A *frontier* maps each partition to the first address not yet covered. Reading from
any recorded frontier yields the same messages again, which is what lets a restarted
or a second instance reproduce the same output.

Readers return messages in *chunks* (a run of consecutive messages of one partition).
A chunk can be split at an address (to apply a binding minted by someone else) or
after a number of records (to mint a binding of a deterministic size). A chunk may
carry *notes*: non-deterministic observations (a file turned out unreadable, a late
file appeared, a file was completed with N rows) that must be recorded in the remap
shard together with the binding that covers the chunk, so every instance decides the
same way. Addresses, frontiers and notes themselves (and their canonical encodings) are
in ``addresses``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from persist_lib.ingest.addresses import Address, Frontier, Note

if TYPE_CHECKING:  # pragma: no cover
    from persist_lib.ingest.decode import Decoded, DecodeSpec


@dataclass
class Lag:
    """How far a reader is behind its source (for progress and Dagster metadata)."""

    bytes_behind: int | None = None
    records_behind: int | None = None
    detail: dict[str, Any] = field(default_factory=dict)


class Chunk(ABC):
    """Consecutive messages of one partition: addresses in ``[start, end)``."""

    partition: str
    start: Address
    end: Address
    num_records: int  # messages (addresses) in [start, end): bindings are cut by these
    nbytes: int
    notes: tuple[Note, ...]
    #: of ``num_records``, the addresses that hold no record (a blank JSON or CSV line):
    #: they take part in addressing and binding extents but are not counted as records
    num_blank: int = 0

    @abstractmethod
    def split(self, at: Address) -> tuple[Chunk | None, Chunk | None]:
        """(messages with address < ``at``, the rest); either side may be ``None``."""

    @abstractmethod
    def take(self, n: int) -> tuple[Chunk, Chunk | None]:
        """The shortest prefix with at least ``n`` records ending at a message boundary."""

    @abstractmethod
    def decode(self, spec: DecodeSpec) -> Decoded:
        """Schema-checked decoding: typed rows (in address order) and error records."""


@runtime_checkable
class SourceReader(Protocol):
    """Reads one source from a frontier onwards."""

    @property
    def position(self) -> Frontier:
        """The first address (per partition) not yet returned."""
        ...

    def read(self, upto: Frontier | None, max_records: int) -> list[Chunk]:
        """The next chunks from ``position``.

        With ``upto`` (replaying a binding) only messages before ``upto`` are returned
        and anything unexpected (an unreadable file) raises ``SourceUnavailable``:
        what the binding covers was decided already. Without ``upto`` (reading ahead to
        mint a binding) about ``max_records`` records are returned and non-deterministic
        observations become notes on the chunks. ``[]`` means nothing more right now.
        """
        ...

    def add_notes(self, notes: Iterable[Note]) -> None:
        """Notes read back from the remap shard (decisions every instance must follow)."""
        ...

    def lag(self) -> Lag: ...

    def close(self) -> None: ...


@runtime_checkable
class Source(Protocol):
    """A replayable source of messages (see the module docstring)."""

    kind: str

    def describe(self) -> dict[str, Any]:
        """JSON description for summaries and errors (no secrets)."""
        ...

    def partitions(self) -> tuple[str, ...]: ...

    def initial_frontier(self) -> Frontier: ...

    def check(self) -> None:
        """Validates the configuration; raises ``IngestConfigError`` naming the fix."""
        ...

    def prepare(self) -> None:
        """One-time set-up before reading (create slots, snapshot); idempotent."""
        ...

    def open_reader(self, frontier: Frontier, notes: list[Note]) -> SourceReader: ...

    def release(self, frontier: Frontier) -> None:
        """Everything before ``frontier`` is durably ingested: the source may drop it."""
        ...

    def close(self) -> None: ...
