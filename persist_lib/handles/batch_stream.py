"""Iterators that hold a reader's seqno hold while they are open.

A streaming read (``snapshot_batches``, ``updates_between_batches``, a listen's large
range) fetches parts lazily, long after the call that planned it returned; until it
is done the parts it may still fetch must not be garbage collected. ``HeldIterator``
ties that hold to the iterator's life, ``BatchStream`` is the record-batch stream a
user gets from the streaming reads.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

import pyarrow as pa

from persist_lib.shard.memory_plan import MergeStats

T = TypeVar("T")


def _close_source(source: Iterator[Any], release: Callable[[], None]) -> None:
    try:
        close = getattr(source, "close", None)
        if close is not None:
            close()
    finally:
        release()


class HeldIterator(Generic[T]):
    """An iterator that holds something (a reader's seqno hold) while it is open.

    What it holds is released exactly once: when the iterator is exhausted, raises,
    is closed (``close()``, or leaving a ``with`` block) or is garbage collected.
    """

    def __init__(self, source: Iterator[T], release: Callable[[], None]) -> None:
        self._source = source
        # The finalizer references the source and the release callback, never self.
        self._finalizer = weakref.finalize(self, _close_source, source, release)

    def __iter__(self) -> HeldIterator[T]:
        return self

    def __next__(self) -> T:
        if not self._finalizer.alive:
            raise StopIteration
        try:
            return next(self._source)
        except BaseException:  # exhausted (StopIteration) or failed: release now
            self.close()
            raise

    def close(self) -> None:
        """Stops the iteration and releases what it holds (idempotent)."""
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def __enter__(self) -> HeldIterator[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class BatchStream(HeldIterator[pa.RecordBatch]):
    """Record batches of a streaming read (key fields, value fields, ``ts``, ``diff``).

    Iterate it (or ``read_all()``); close it (or use ``with``) when stopping early. It
    holds its reader's seqno hold until then, so the parts it reads can't be garbage
    collected under it. ``stats`` fills in as it is read (runs, passes, rows, the most
    the merge held at once; ``passes == 0``: the parts were small and read whole).
    """

    def __init__(
        self,
        source: Iterator[pa.RecordBatch],
        schema: pa.Schema,
        release: Callable[[], None],
        stats: MergeStats | None = None,
    ) -> None:
        super().__init__(source, release)
        self.schema = schema
        self.stats = stats if stats is not None else MergeStats()

    def __enter__(self) -> BatchStream:
        return self

    def read_all(self) -> pa.Table:
        """The rest of the stream as one table (then closed)."""
        with self:
            return pa.Table.from_batches(list(self), schema=self.schema)

