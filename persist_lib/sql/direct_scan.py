"""A snapshot whose parts already *are* the snapshot, read by DuckDB's own Parquet
reader from verified copies of the parts (issue 28).

The general SQL scan (``parallel_scan`` / ``ReadHandle.snapshot_batches``) decodes every
part with pyarrow, forwards its times, consolidates it and streams the batches into
DuckDB through Python. When no consolidation is needed, DuckDB can decode the parts
itself, on all its threads, with its own projection and filter pushdown. That holds
when, decided from state alone:

- every part is sorted (so consolidated: no two rows share ``(k, v, t)``, no zero diff)
  and every time is at or before the as-of (times are only forwarded, no row is cut);
- the parts are key-disjoint: their recorded ranges of an integer first key field
  (``shard.stats``) don't meet, so no record sits in two parts
  (``handles.split_overlap.disjoint_overlaps`` with no shared endpoint);
- every key and value field has a plain type (signed integers, floats, bool, strings,
  binary), which DuckDB reads from Parquet as the type it gives the Arrow stream;
- the parts fit ``DIRECT_MAX_BYTES`` (their encoded size: the copies take that much
  room in the session's scratch directory);

and then, per part, on the scan pool (``copy_verified``): its bytes have the recorded
size and SHA-256 (else ``CorruptionError``: no view is made, nothing returned), its
footer has the persist layout and the reader's own schemas (a part written under an
earlier schema version needs migration: the general path reads it), and, for a part
holding several times, its first key field strictly increases (no ``(key, value)`` at
two times, which would need consolidating). Then the *verified bytes* are written to
a file in the session's private directory (``dest``): DuckDB reads those copies, never
the blob, so what it decodes is what was verified, whatever happens to the blob
later. Anything else falls back to the general path.

The view is ``SELECT k.<key fields>, v.<value fields>, <as_of> AS ts, d AS diff FROM
read_parquet([...copies])``. Strings are not re-validated as UTF-8 by persist on this
path: a part carrying column statistics was written after the write-time UTF-8 check
(every part without them fails the key-disjointness test above and takes the general
path, which checks); DuckDB also refuses invalid UTF-8 in a Parquet string column.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from persist_lib.errors import CorruptionError
from persist_lib.handles.read import ReadHandle
from persist_lib.handles.split_overlap import disjoint_overlaps
from persist_lib.location.base import Blob
from persist_lib.shard.batch_meta import PartMeta
from persist_lib.shard.codec import D_COL, DIFF, TS, Schemas
from persist_lib.shard.direct_parts import first_key_increases, plain_type
from persist_lib.shard.part_fetch import check_part_metadata, fetch_part_bytes
from persist_lib.shard.parts import parquet_form, verify_part_bytes
from persist_lib.shard.predicate import Predicate
from persist_lib.sql.parallel_scan import ScanHolds, scan_pool, scan_workers

# Encoded bytes of parts a session copies for one direct view, at most.
DIRECT_MAX_BYTES = 4 << 30


def planned_parts(parts: Sequence[PartMeta], schemas: Schemas, as_of: int) -> list[PartMeta] | None:
    """The parts in key order when the state-side conditions of the module docstring
    hold, else None."""
    if not parts or sum(p.size for p in parts) > DIRECT_MAX_BYTES:
        return None
    if not all(plain_type(f.type) for f in (*schemas.key, *schemas.val)):
        return None
    if any(not p.sorted or p.tmax > as_of for p in parts):
        return None
    planned = disjoint_overlaps(parts, schemas)
    if planned is None or any(o.los or o.nulls for o in planned[1]):
        return None  # overlapping ranges, a key value two parts share, or no statistics
    return planned[0]


class NeedsMerge(Exception):
    """A part the direct view can't serve as it is (an earlier schema version, or one
    ``(key, value)`` at two times): the caller falls back to the general scan."""


def _copy_one(blob: Blob, part: PartMeta, schemas: Schemas, shard: str, path: Path) -> None:
    """Fetches ``part``, verifies it and writes its verified bytes to ``path``."""
    data = fetch_part_bytes(blob, part, shard, purpose="persist sql")
    verify_part_bytes(data, expected_sha256=part.sha256, expected_size=part.size, shard=shard, key=part.location)
    data = parquet_form(data, shard, part.location)  # an inline IPC part: as Parquet for DuckDB
    try:
        pf = pq.ParquetFile(pa.BufferReader(data), pre_buffer=False)
        rows = pf.metadata.num_rows
    except Exception as e:  # noqa: BLE001 - verified bytes that don't decode are corrupt
        raise CorruptionError(
            f"shard {shard}: part {part.location}: cannot read its Parquet footer ({type(e).__name__}: {e}); "
            "the blob was altered or truncated; nothing was returned"
        ) from e
    written = check_part_metadata(pf, schemas, shard, part.location)
    if rows != part.count:
        raise CorruptionError(
            f"shard {shard}: part {part.location}: {rows} rows in its footer, {part.count} recorded in state; "
            "nothing was returned"
        )
    if written.fingerprint() != schemas.fingerprint():
        raise NeedsMerge(part.location)
    if part.tmin < part.tmax and not first_key_increases(pf):
        raise NeedsMerge(part.location)
    with open(path, "xb") as f:  # a fresh name in a private directory
        f.write(data)


def copy_verified(
    blob: Blob, parts: Sequence[PartMeta], schemas: Schemas, shard: str, dest: Path
) -> list[str] | None:
    """Copies of ``parts``, each verified (module docstring), written under ``dest``
    (a new directory); None (and nothing left in ``dest``) when a part needs the
    general path. A ``CorruptionError`` (a part's bytes or footer) leaves nothing behind
    either."""
    dest.mkdir(mode=0o700)
    paths = [dest / f"part-{i:06d}.parquet" for i in range(len(parts))]
    pool = scan_pool()
    # Parts holding several times first (the ones that may need merging), a few in flight:
    # a shard that needs the general path is told after a part or two, not after copying all.
    todo = deque(sorted(range(len(parts)), key=lambda i: parts[i].tmin == parts[i].tmax))
    window = 2 * scan_workers()
    started: list[Future[None]] = []
    running: deque[Future[None]] = deque()
    ok = False
    try:
        while todo or running:
            while todo and len(running) < window:
                i = todo.popleft()
                running.append(pool.submit(_copy_one, blob, parts[i], schemas, shard, paths[i]))
                started.append(running[-1])
            running.popleft().result()
        ok = True
        return [str(p) for p in paths]
    except NeedsMerge:
        return None
    finally:
        if not ok:
            for f in started:
                f.cancel()
            for f in started:
                if not f.cancelled():
                    f.exception()  # wait: no write may land after the clean-up
            for p in paths:
                p.unlink(missing_ok=True)
            dest.rmdir()


def direct_relation(con: Any, schemas: Schemas, paths: Sequence[str], as_of: int) -> Any:
    """The relation of a direct view on ``con``: the user layout (key fields, value
    fields, ``ts``, ``diff``) over the copies, built with DuckDB's expression API (no
    SQL text assembled from names or paths)."""
    import duckdb
    from duckdb.sqltypes import BIGINT

    def field(struct: str, name: str) -> Any:
        return duckdb.FunctionExpression(
            "struct_extract", duckdb.ColumnExpression(struct), duckdb.ConstantExpression(name)
        ).alias(name)

    cols = [field("k", f.name) for f in schemas.key] + [field("v", f.name) for f in schemas.val]
    cols += [
        duckdb.ConstantExpression(int(as_of)).cast(BIGINT).alias(TS),
        duckdb.ColumnExpression(D_COL).alias(DIFF),
    ]
    return con.read_parquet(list(paths)).select(*cols)


def direct_paths(
    reader: ReadHandle, holds: ScanHolds, as_of: int, timeout_s: float | None, dest: Path,
    filter: Predicate | None = None,
) -> list[str] | None:
    """The verified copies (written under ``dest``, in key order) of the parts of
    ``reader``'s snapshot at ``as_of``, for a direct view (``direct_relation``), or None
    when the general scan is needed. ``filter``:
    parts its statistics rule out are left out (the query applies the filter itself).
    The parts are held (``holds``) only while they are copied."""
    holds.begin()
    try:
        splits = reader.snapshot_splits(as_of, 1, timeout_s, filter=filter)
        parts = [p for s in splits for p in s.parts]
        ordered = planned_parts(parts, reader.schemas, as_of)
        if ordered is None:
            return None
        paths = copy_verified(reader.client.blob, ordered, reader.schemas, reader.shard_id, dest)
        return paths
    finally:
        holds.end()
