"""Migrating a part decoded under an earlier schema version to the current one.

Every part records the fingerprint of the schemas it was written under (in its Parquet
footer, ``parts.META_SCHEMAS``); the shard's schema registry (``Schemas.history``, kept
in shard state) maps each earlier version's fingerprint back to its schemas. A read
decodes the part under the version it was written with, then turns the decoded update
table into the reader's layout here: fields added since come back null, widened fields
are cast (lossless and order-preserving: ``shard.schema_compat``), dropped fields are
left out. A part of the reader's own version costs nothing extra.

Dropping a value field can make rows equal that were not (they differed only in the
dropped field) and breaks the ``(k, v, t)`` order of a sorted part, so such a part is
sorted and consolidated again after the migration (one sort of the part; compaction
rewrites old parts under the current version, after which no read pays it).
"""

from __future__ import annotations

import re

import pyarrow as pa

from persist_lib.errors import CorruptionError, StaleSchema
from persist_lib.shard.codec import D_COL, KEY_PREFIX, T_COL, VAL_PREFIX, Schemas, internal_schema
from persist_lib.shard.consolidate import consolidate


def writing_schemas(reader: Schemas, fingerprint: bytes | None, *, shard: str, key: str) -> Schemas:
    """The version (``reader`` or one of its earlier versions) a part with footer
    fingerprint ``fingerprint`` was written under; ``StaleSchema`` when ``reader`` does
    not know it (the part is of a later version than the handle was opened with)."""
    if fingerprint is None or not _FINGERPRINT.fullmatch(fingerprint):
        raise CorruptionError(
            f"shard {shard}: part {key}: its footer names no valid schemas fingerprint "
            f"({fingerprint!r:.80}); the blob was altered or truncated; nothing was returned. "
            "Stop and investigate the blob store (do not retry blindly)"
        )
    fp = fingerprint.decode("ascii")
    found = reader.for_fingerprint(fp)
    if found is not None:
        return found
    raise StaleSchema(
        f"shard {shard}: part {key} was written under schemas (fingerprint {fp[:12]}...) that are "
        f"not among the versions this handle knows (it was opened with version {reader.version}: "
        f"{reader.describe()}): the shard's schemas evolved after the handle was opened (or the "
        "part is not one this shard's writers made). Reopen the handle with the current schemas "
        "(`persist schema show`); nothing was returned",
        current_version=None,
    )


_FINGERPRINT = re.compile(rb"[0-9a-f]{64}")


def needs_migration(written: Schemas, reader: Schemas) -> bool:
    return written is not reader and written.fingerprint() != reader.fingerprint()


def migrate(table: pa.Table, written: Schemas, reader: Schemas) -> pa.Table:
    """``table`` (internal layout of ``written``) in the internal layout of ``reader``."""
    if not needs_migration(written, reader):
        return table
    n = table.num_rows
    target = internal_schema(reader)
    have = set(table.column_names)
    cols: list[pa.ChunkedArray] = []
    for f in target:
        if f.name in have:
            col = table.column(f.name)
            if not col.type.equals(f.type):
                col = col.cast(f.type, safe=True)
            cols.append(col)
        else:
            cols.append(pa.chunked_array([pa.nulls(n, f.type)], type=f.type))
    out = pa.Table.from_arrays(cols, schema=target)
    kept = {VAL_PREFIX + f for f in reader.val_names}
    dropped = any(
        c.startswith(VAL_PREFIX) and c not in kept
        for c in table.column_names
        if c not in (T_COL, D_COL) and not c.startswith(KEY_PREFIX)
    )
    return consolidate(out) if dropped and n else out
