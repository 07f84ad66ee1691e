"""Fetching, verifying and decoding parts for merges, and the decoded-part cache.

Every part a merge reads is verified (size and SHA-256 of the whole blob, then its
Parquet metadata: format version, schemas fingerprint, columns) before a byte of it is
decoded, and decoded whole into the internal layout. Small decoded parts are kept in a
process-wide cache keyed by their checksum (``DECODED_CACHE``): a merge's output is
often the next merge's input. The cache is consulted only *after* the fetched bytes
passed their checksum.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from persist_lib.errors import BlobNotFound, CorruptionError
from persist_lib.location.base import Blob
from persist_lib.shard.batch_meta import PartMeta
from persist_lib.shard.codec import D_COL, T_COL, Schemas, internal_schema
from persist_lib.shard.migrate import migrate, writing_schemas
from persist_lib.shard.parts import (
    FORMAT_VERSION,
    META_FORMAT,
    META_SCHEMAS,
    check_part_strings,
    verify_part_bytes,
)

MiB = 1 << 20


class _DecodedCache:
    """Decoded small parts by (SHA-256, schemas): a merge's output is often the next
    merge's input, and decoding a tiny Parquet file costs more than merging it. Only a
    lookup *after* the fetched bytes passed their checksum may use it."""

    def __init__(self, max_bytes: int = 16 * MiB, max_entry: int = 1 * MiB) -> None:
        self.max_bytes = max_bytes
        self.max_entry = max_entry
        self._d: OrderedDict[tuple[str, str], pa.Table] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0

    def get(self, sha: str, fp: str) -> pa.Table | None:
        with self._lock:
            t = self._d.get((sha, fp))
            if t is not None:
                self._d.move_to_end((sha, fp))
                self.hits += 1
            return t

    def put(self, sha: str, fp: str, t: pa.Table) -> None:
        n = t.nbytes
        if n > self.max_entry:
            return
        with self._lock:
            if (sha, fp) in self._d:
                return
            self._d[(sha, fp)] = t
            self._bytes += n
            while self._bytes > self.max_bytes and self._d:
                _, old = self._d.popitem(last=False)
                self._bytes -= old.nbytes


DECODED_CACHE = _DecodedCache()


def remember_written_part(sha256: str, schemas: Schemas, table: pa.Table) -> None:
    """Offers a part a writer just encoded (``table``: the rows it encoded, in the
    internal layout) to the decoded-part cache under its bytes' SHA-256: the process's
    next merge of a small part it wrote (in-process compaction of small commits) then
    skips decoding it, as later merges skip decoding earlier merges' small output. A
    lookup still fetches and verifies the bytes first, and a hit under that SHA-256 can
    only be the table those bytes were encoded from. Skipped when the table's buffers
    are larger than a cache entry (a slice of a large batch would keep all of it
    alive) or its schema is not exactly what decoding the part yields.

    The cache keeps a *copy*: the written table may share buffers with the caller's
    batch (Arrow arrays made zero-copy from numpy, sorted input cut into slices), and a
    caller may change those buffers once the append returned; a merge reading the
    cached table would then write the new values under the old bytes' checksum."""
    if table.get_total_buffer_size() > DECODED_CACHE.max_entry:
        return
    if not table.schema.equals(internal_schema(schemas), check_metadata=False):
        return
    if any(_has_dictionary(f.type) for f in table.schema):
        return  # a dictionary would stay shared through ``take``
    owned = table.take(pa.array(range(table.num_rows), pa.int64()))  # new buffers, same rows
    DECODED_CACHE.put(sha256, schemas.fingerprint(), owned)


def _has_dictionary(t: pa.DataType) -> bool:
    if pa.types.is_dictionary(t):
        return True
    return any(_has_dictionary(t.field(i).type) for i in range(t.num_fields))


def _missing_part(shard: str, key: str, purpose: str) -> BlobNotFound:
    if purpose == "compaction":
        return BlobNotFound(
            f"shard {shard}: compaction input part {key} is missing (it was garbage "
            "collected: the inputs were replaced meanwhile); the merge is abandoned"
        )
    return BlobNotFound(
        f"shard {shard}: part {key} is missing ({purpose}): it was deleted (garbage collected "
        "while still referenced?) or never written; re-read the shard state and retry"
    )


def fetch_part_bytes(blob: Blob, p: PartMeta, shard: str, purpose: str = "compaction") -> bytes:
    """A part's encoded bytes (inline or from blob), not yet verified."""
    if p.inline is not None:
        return p.inline
    if p.key is None:
        raise CorruptionError(f"shard {shard}: part metadata has neither a blob key nor inline bytes: {p}")
    got = blob.get(p.key)
    if got is None:
        raise _missing_part(shard, p.key, purpose)
    return got


def fetch_small_part(
    blob: Blob, p: PartMeta, schemas: Schemas, shard: str, purpose: str = "compaction"
) -> pa.Table:
    """``parts.fetch_part`` for small parts, with the decoded-part cache behind the
    checksum: the bytes are always fetched and verified first."""
    data = fetch_part_bytes(blob, p, shard, purpose)
    verify_part_bytes(data, expected_sha256=p.sha256, expected_size=p.size, shard=shard, key=p.location)
    fp = schemas.fingerprint()
    hit = DECODED_CACHE.get(p.sha256, fp)
    if hit is not None:
        return hit
    t = decode_whole(data, p, schemas, shard)
    DECODED_CACHE.put(p.sha256, fp, t)
    return t


def release_unused_memory() -> None:
    """Hands freed pages back to the OS (Arrow's mimalloc/jemalloc pools and glibc keep
    them otherwise, and RSS then grows well past what is live). Called once per part
    loaded: cheap next to decoding a part."""
    try:
        pa.default_memory_pool().release_unused()
    except Exception:  # noqa: BLE001 - best effort, older pyarrow
        pass
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _load_libc() -> Any:
    try:
        import ctypes
        import ctypes.util

        name = ctypes.util.find_library("c")
        lib = ctypes.CDLL(name) if name else None
        return lib if lib is not None and hasattr(lib, "malloc_trim") else None
    except OSError:
        return None


_LIBC = _load_libc()


def _corrupt(shard: str, key: str, what: str) -> CorruptionError:
    return CorruptionError(
        f"shard {shard}: part {key}: {what}; the blob was altered or truncated; nothing was "
        "returned. Stop and investigate the blob store (do not retry blindly)"
    )


def raw_to_internal(raw: pa.Table, schemas: Schemas, target: pa.Schema, shard: str, key: str) -> pa.Table:
    """Flattens a decoded Parquet slice (``k``/``v`` structs) into the internal layout
    (the same mapping ``parts.decode_part`` applies to a whole part)."""
    try:
        cols: list[pa.ChunkedArray] = list(raw.column("k").flatten())
        if len(schemas.val):
            cols += raw.column("v").flatten()
        cols += [raw.column(T_COL), raw.column(D_COL)]
        if len(cols) != len(target):
            raise ValueError(f"{len(cols)} fields, expected {len(target)}")
        out = []
        for col, f in zip(cols, target, strict=True):
            if str(col.type) != str(f.type):
                col = pc.cast(col, f.type, safe=True)
            out.append(col)
        table = pa.Table.from_arrays(out, schema=target)
    except Exception as e:
        raise _corrupt(shard, key, f"part does not match {schemas.describe()} ({e})") from e
    if table.column(T_COL).null_count or table.column(D_COL).null_count:
        raise _corrupt(shard, key, "null times or diffs")
    return table


def _open_verified(
    data: bytes, part: PartMeta, reader: Schemas, shard: str
) -> tuple[pq.ParquetFile, Schemas]:
    """Verifies a part's bytes (size and SHA-256) and its Parquet metadata, then opens
    it; also returns the schema version (``reader`` or an earlier one) it was written under."""
    key = part.location
    verify_part_bytes(data, expected_sha256=part.sha256, expected_size=part.size, shard=shard, key=key)
    try:
        pf = pq.ParquetFile(pa.BufferReader(data), pre_buffer=False)
    except Exception as e:
        raise _corrupt(shard, key, f"cannot decode Parquet ({type(e).__name__}: {e})") from e
    return pf, check_part_metadata(pf, reader, shard, key)


def check_part_metadata(pf: pq.ParquetFile, reader: Schemas, shard: str, key: str) -> Schemas:
    """Checks a verified part's Parquet metadata: format version, schemas, columns;
    returns the schema version (``reader`` or an earlier one) it was written under."""
    try:
        meta = pf.schema_arrow.metadata or {}
    except Exception as e:
        raise _corrupt(shard, key, f"cannot decode Parquet ({type(e).__name__}: {e})") from e
    if meta.get(META_FORMAT) != FORMAT_VERSION.encode():
        raise _corrupt(shard, key, f"unknown part format {meta.get(META_FORMAT)!r}")
    schemas = writing_schemas(reader, meta.get(META_SCHEMAS), shard=shard, key=key)
    expected_cols = ["k", "v", T_COL, D_COL] if len(schemas.val) else ["k", T_COL, D_COL]
    if pf.schema_arrow.names != expected_cols:
        raise _corrupt(shard, key, f"columns {pf.schema_arrow.names}, expected {expected_cols}")
    return schemas


def decode_whole(
    data: bytes, part: PartMeta, schemas: Schemas, shard: str, *, use_threads: bool = False
) -> pa.Table:
    """Verifies and decodes a whole (small) part into the internal layout.

    Same checks as ``parts.decode_part`` but through ``ParquetFile.read``, which costs
    ~0.3 ms for a tiny part against ~2 ms for ``pq.read_table`` (dataset machinery).
    ``use_threads``: decode columns in parallel (Arrow's pool), for a part decoded
    while nothing else is (a ~1 MB part: 1.7x faster).
    """
    pf, written = _open_verified(data, part, schemas, shard)
    try:
        raw = pf.read(use_threads=use_threads)
    except Exception as e:
        raise _corrupt(shard, part.location, f"cannot decode Parquet ({type(e).__name__}: {e})") from e
    table = raw_to_internal(raw, written, internal_schema(written), shard, part.location)
    check_part_strings(table, written, shard, part.location)  # (never merged into a new part)
    return migrate(table, written, schemas)  # an earlier version's part: to the reader's layout
