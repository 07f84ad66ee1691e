"""Loading an input as a polars ``LazyFrame`` that streams the collection in bounded memory.

The LazyFrame is a polars IO source (``polars.io.plugins.register_io_source``) over the
collection's streaming snapshot (``CollectionReader.snapshot_batches``): nothing is read
when it is built; each time it is collected (or sunk) it opens a read handle, streams
the snapshot as of the input's time within the I/O manager's ``read_memory_budget``, and
hands polars one DataFrame per record batch, so a streaming query
(``collect(engine="streaming")``, ``sink_parquet``) over a collection many times the
budget never holds it whole.

Pushed down: polars' projection becomes the read's ``columns=``, and the input's
partition filter the read's ``filter=`` (parts that can't hold the partitions' rows are
not fetched); polars' own row predicate and row limit are applied to each batch as it
arrives (they are not pushed into persist's part pruning). Rows come back as many times
as their multiplicity, like every other input type.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any

import pyarrow as pa

from dagster_project.io_manager.partitions import PartitionSelection
from dagster_project.io_manager.write_modes import expand
from persist_lib.shard.codec import Schemas
from persist_lib.storage.reader import CollectionReader


def lazy_frame(
    open_reader: Callable[[], AbstractContextManager[CollectionReader]], schemas: Schemas, as_of: int, *,
    filter: Any, sel: PartitionSelection | None, keep: Sequence[str] | None, memory_budget: int | None,
    where: str,
) -> Any:
    """A ``polars.LazyFrame`` of the collection at ``as_of`` (its columns ``keep``, all
    when None; cut to ``sel``'s partitions), read only when it is collected."""
    import polars as pl
    from polars.io.plugins import register_io_source

    fields = {f.name: f for f in [*schemas.key, *schemas.val]}
    names = list(keep) if keep is not None else list(fields)
    schema = pl.from_arrow(pa.schema([fields[n] for n in names]).empty_table()).schema  # type: ignore[union-attr]
    part_cols = list(sel.columns.values()) if sel is not None else []

    def source(
        with_columns: list[str] | None, predicate: Any, n_rows: int | None, batch_size: int | None
    ) -> Iterator[Any]:
        wanted = names if with_columns is None else [c for c in names if c in with_columns]
        read = list(dict.fromkeys([*wanted, *part_cols]))
        left = n_rows
        if left == 0:
            return
        with open_reader() as r, r.snapshot_batches(
            as_of, memory_budget=memory_budget, columns=read, filter=filter
        ) as stream:
            for batch in stream:
                t = expand(pa.Table.from_batches([batch]))
                if sel is not None:
                    t = t.filter(sel.mask(t, where))
                df = pl.from_arrow(t.select(wanted))
                assert isinstance(df, pl.DataFrame)
                if predicate is not None:
                    df = df.filter(predicate)
                if left is not None:
                    df = df.head(left)
                    left -= df.height
                if df.height:
                    yield df
                if left == 0:
                    return

    return register_io_source(source, schema=schema)
