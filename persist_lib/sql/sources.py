"""What a SQL session reads: tables opened for reading and re-scannable Arrow sources.

A ``Table`` is a collection or a shard with its reader; an ``ArrowSource`` is that
table as of a time (or its changes between two), and every scan of it (DuckDB,
polars, pyarrow) opens a fresh streaming read within the session's memory budget, so
relations and frames built on it can be evaluated again and give the same rows.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from persist_lib.errors import InvalidUsage
from persist_lib.frontier import Antichain
from persist_lib.handles.batch_stream import BatchStream
from persist_lib.handles.pushdown import ReadPushdown
from persist_lib.handles.read import ReadHandle
from persist_lib.shard.codec import Schemas, internal_schema, user_schema
from persist_lib.shard.predicate import Predicate
from persist_lib.sql.direct_scan import direct_paths
from persist_lib.sql.parallel_scan import ScanHolds, parallel_snapshot
from persist_lib.sql.times import format_time, range_text

if TYPE_CHECKING:  # pragma: no cover
    from persist_lib.storage import CollectionReader

class Table:
    """A collection or a shard opened for reading by a session (one leased reader, or a
    collection reader, expired by ``close``)."""

    def __init__(self, label: str, schemas: Schemas, reader: ReadHandle | CollectionReader) -> None:
        self.label = label  # "collection orders" / "shard s..."
        self.schemas = schemas
        self.schema = user_schema(schemas)
        self._reader = reader
        # Parallel scans of a shard (``parallel_scan``) share its reader's split holds.
        self._holds = ScanHolds(reader) if isinstance(reader, ReadHandle) else None

    @property
    def since(self) -> Antichain:
        return self._reader.since

    @property
    def upper(self) -> Antichain:
        """Every time before it is readable (read from consensus now)."""
        r = self._reader
        if isinstance(r, ReadHandle):
            return r._machine.fetch_latest().upper
        return r.upper

    def latest(self) -> int:
        """The latest readable time (``upper - 1``)."""
        since, upper = self.since, self.upper
        if upper.time is None:
            raise InvalidUsage(
                f"{self.label}: its upper is closed (no more writes); give an explicit time "
                f"(readable: from {format_time(since.time)})"
            )
        if upper.time == 0 or not since.less_equal(upper.time - 1):
            raise InvalidUsage(
                f"{self.label} has no readable time yet (readable times: {range_text(since, upper)}): "
                "nothing was written to it"
            )
        return upper.time - 1

    def snapshot_batches(
        self, as_of: int, *, memory_budget: int | None, timeout_s: float | None,
        filter: Predicate | None = None, columns: list[str] | None = None,
    ) -> BatchStream:
        r = self._reader
        if isinstance(r, ReadHandle) and self._holds is not None:
            stream = parallel_snapshot(
                r, self._holds, as_of, memory_budget=memory_budget, timeout_s=timeout_s, filter=filter,
                columns=columns,
            )
            if stream is not None:
                return stream
        return self._reader.snapshot_batches(
            as_of, memory_budget=memory_budget, timeout_s=timeout_s, filter=filter, columns=columns
        )

    def direct_paths(
        self, as_of: int, timeout_s: float | None, dest: Path, filter: Predicate | None = None
    ) -> list[str] | None:
        """The paths of verified copies, for a DuckDB view, of the parts (written
        under ``dest``) of a shard's snapshot at ``as_of`` that needs no consolidation
        (``direct_scan``; ``filter``: only the parts its statistics don't rule out);
        None for a collection or when the parts need the general scan."""
        r = self._reader
        if not isinstance(r, ReadHandle) or self._holds is None:
            return None
        return direct_paths(r, self._holds, as_of, timeout_s, dest, filter)

    def updates_between_batches(
        self, lower: int, upper: int, *, memory_budget: int | None, timeout_s: float | None,
        filter: Predicate | None = None, columns: list[str] | None = None,
    ) -> BatchStream:
        r = self._reader
        if isinstance(r, ReadHandle):
            return r.updates_between_batches(
                lower, upper, memory_budget=memory_budget, timeout_s=timeout_s, filter=filter, columns=columns
            )
        # A collection's changes (handovers included) are read whole, then filtered.
        stream = r.updates_between_batches(lower, upper, memory_budget=memory_budget, timeout_s=timeout_s)
        if filter is None and columns is None:
            return stream
        pd = ReadPushdown.plan(self.schemas, columns, filter, shard=self.label)

        def rows() -> Iterator[pa.RecordBatch]:
            with stream:
                for b in stream:
                    t = pa.Table.from_batches([b])
                    if pd.pred is not None:
                        t = t.filter(pd.pred.mask(pa.Table.from_arrays(t.columns, schema=internal_schema(self.schemas))))
                    yield from pd.project(t).to_batches()

        return BatchStream(rows(), pd.user_schema(), stream.close)

    def explain(self, e: Exception, what: str) -> Exception:
        """``e`` (an ``InvalidUsage`` or ``Timeout`` of a read) with the table, the
        time asked for and the readable range added; same type."""
        try:
            rng = range_text(self.since, self.upper)
        except Exception:  # noqa: BLE001 - the message is best effort
            rng = "unknown"
        msg = f"{self.label} {what}: {e} (readable times: {rng})"
        try:
            return type(e)(msg)
        except TypeError:
            return e

    def close(self) -> None:
        from persist_lib.errors import PersistError

        try:
            self._reader.expire()
        except PersistError:  # already expired (its lease lapsed) or the shard is gone
            pass


@dataclass(frozen=True)
class Scan:
    """What a source reads: a snapshot at ``as_of``, or the updates in ``[lower, upper)``."""

    as_of: int | None = None
    lower: int = 0
    upper: int = 0


class ArrowSource:
    """A re-scannable Arrow stream of a table as of a time (or of its changes).

    Every consumer that takes the Arrow PyCapsule stream interface (DuckDB, polars,
    pyarrow) can read it; each ``__arrow_c_stream__`` call (each scan) opens a new
    streaming read when its first batch is pulled and releases it when the scan ends.
    ``reader()`` is one such scan as a ``pyarrow.RecordBatchReader``.
    """

    def __init__(
        self, table: Table, scan: Scan, memory_budget: int | None, timeout_s: float | None,
        filter: Predicate | None = None,
    ) -> None:
        self.table = table
        self.scan = scan
        self.schema = table.schema
        self._budget = memory_budget
        self._timeout = timeout_s
        # Pushed down to every scan (``sql.pushdown``: a query's filter from DuckDB's
        # plan): parts its statistics rule out are not read. The rows DuckDB keeps are
        # the same either way (it filters above the scan too).
        self.filter = filter

    def with_filter(self, filter: Predicate) -> ArrowSource:
        """This source with ``filter`` pushed down to its reads."""
        return ArrowSource(self.table, self.scan, self._budget, self._timeout, filter)

    @property
    def description(self) -> str:
        s = self.scan
        if s.as_of is not None:
            return f"{self.table.label} as of {format_time(s.as_of)}"
        return f"{self.table.label} changes in [{format_time(s.lower)}, {format_time(s.upper)})"

    def open_stream(self, columns: list[str] | None = None) -> BatchStream:
        """One read of the source (``columns``: only those, with ``ts`` and ``diff``)."""
        s = self.scan
        if s.as_of is not None:
            return self.table.snapshot_batches(
                s.as_of, memory_budget=self._budget, timeout_s=self._timeout, filter=self.filter, columns=columns
            )
        return self.table.updates_between_batches(
            s.lower, s.upper, memory_budget=self._budget, timeout_s=self._timeout, filter=self.filter,
            columns=columns,
        )

    def batches(self) -> Iterator[pa.RecordBatch]:
        """One scan: opens the read on the first ``next``, releases it when exhausted,
        closed or collected."""
        with self.open_stream() as stream:
            yield from stream

    def reader(self) -> pa.RecordBatchReader:
        return pa.RecordBatchReader.from_batches(self.schema, self.batches())

    def __arrow_c_stream__(self, requested_schema: object | None = None) -> object:
        return self.reader().__arrow_c_stream__(requested_schema)

    def __arrow_c_schema__(self) -> object:
        return self.schema.__arrow_c_schema__()

    def read_all(self) -> pa.Table:
        """The whole scan as one table (materialized: for small results)."""
        return self.reader().read_all()

    def __repr__(self) -> str:
        return f"ArrowSource({self.description})"


def lazy_frame(src: ArrowSource) -> Any:
    import polars as pl
    from polars.io.plugins import register_io_source

    schema = pl.from_arrow(src.schema.empty_table()).schema  # type: ignore[union-attr]

    def io_source(
        with_columns: list[str] | None, predicate: Any, n_rows: int | None, batch_size: int | None
    ) -> Iterator[Any]:
        left = n_rows
        # The projection is pushed to the read (polars' predicate is applied here).
        names = set(src.schema.names)
        cols = None if with_columns is None or not set(with_columns) <= names else list(with_columns)
        with src.open_stream(cols) as stream:
            for b in stream:
                if left is not None and left <= 0:
                    return
                df = pl.from_arrow(b)
                assert isinstance(df, pl.DataFrame)
                if predicate is not None:
                    df = df.filter(predicate)
                if with_columns is not None:
                    df = df.select(with_columns)
                if left is not None:
                    df = df.head(left)
                    left -= df.height
                yield df

    return register_io_source(io_source, schema=schema)
