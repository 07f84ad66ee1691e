"""The encoding of small inline parts: an Arrow IPC stream instead of Parquet.

A part small enough to live inline in shard state (a small commit: ~10 KB for 1,000
rows) costs ~0.3 ms of CPU to write as Parquet, most of it the writer's fixed setup
(column writers, page and footer metadata), against ~0.03 ms as a zstd-compressed Arrow
IPC stream of the same bytes' size. An inline part is therefore written as an IPC
stream of the same stored table a Parquet part holds (columns ``k``/``v`` structs,
``t``, ``d``; the same schema metadata: ``persist.format`` and the schemas'
fingerprint), so decoding it goes through the same checks and conversions.

The format tag is in the bytes themselves, which the part's SHA-256 covers: an IPC
stream starts with the continuation marker ``0xFFFFFFFF``, a Parquet file with
``PAR1``. Parts written before (Parquet, inline or not) keep reading as they are.
An inline IPC part never leaves state as IPC: moving it to blob (inline backpressure)
re-encodes it as Parquet (``parts.blob_form``), so every blob part stays a Parquet file
that Spark and DuckDB can read directly.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.ipc as ipc

# The first four bytes of an Arrow IPC stream (the continuation marker of its first
# message); no Parquet file starts with them (Parquet starts with ``PAR1``).
IPC_MAGIC = b"\xff\xff\xff\xff"

_WRITE_OPTIONS = ipc.IpcWriteOptions(compression="zstd")


def is_ipc_part(data: bytes | memoryview) -> bool:
    """Whether a part's (verified) bytes are an inline IPC part rather than Parquet."""
    return bytes(data[:4]) == IPC_MAGIC


def write_ipc_part(stored: pa.Table) -> bytes:
    """``stored`` (a part's stored table, with its schema metadata) as IPC stream bytes."""
    sink = pa.BufferOutputStream()
    with ipc.new_stream(sink, stored.schema, options=_WRITE_OPTIONS) as w:
        w.write_table(stored)
    return sink.getvalue().to_pybytes()


def read_ipc_part(data: bytes) -> pa.Table:
    """The stored table of IPC part bytes (raises on anything that is not a whole stream)."""
    with ipc.open_stream(pa.py_buffer(data)) as r:
        return r.read_all()
