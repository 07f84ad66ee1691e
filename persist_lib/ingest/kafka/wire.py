"""What crosses the socket between a Kafka reader process and the ingestion: messages
pickled with protocol 5 and out-of-band buffers (no copy into the pickle); a decoded
run of one partition (``_Decoded``) as ``_Shipped`` (rows and raw records as Arrow IPC
streams, offsets and value sizes as numpy arrays); consumer events as ``_Event`` (a
``Message`` does not pickle). ``ship`` and ``unship`` convert a batch each way.

Below both sides (``reader_process``, the ingestion's; ``reader_child``, the child's):
the classes pickle under this module's name in both processes."""

from __future__ import annotations

import pickle
import struct
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from persist_lib.ingest.errors import IngestInvariantError
from persist_lib.ingest.kafka.messages import _Batch, _Decoded, _Msgs

if TYPE_CHECKING:  # pragma: no cover
    from persist_lib.ingest.decode import DecodeSpec, ErrorRecord

_HEAD = struct.Struct("<I")  # out-of-band buffers following a message's pickle


@dataclass
class _Event:
    """An error/event message of a consumed batch, across the process boundary (a
    ``Message`` does not pickle): what ``KafkaReader._on_error`` reads off it."""

    code: int
    reason: str
    fatal: bool
    part: int | None
    off: int | None

    @classmethod
    def of(cls, m: Any) -> _Event:
        err = m.error()
        return cls(int(err.code()), str(err.str()), bool(err.fatal()), m.partition(), m.offset())

    def error(self) -> Any:
        from confluent_kafka import KafkaError

        return KafkaError(self.code, self.reason, fatal=self.fatal)

    def partition(self) -> int | None:
        return self.part

    def offset(self) -> int | None:
        return self.off


@dataclass
class _Shipped:
    """A ``_Decoded`` run of one partition as shipped: rows (and raw) as Arrow IPC."""

    offs: np.ndarray
    vlen: np.ndarray
    rows: pa.Buffer
    errors: list[ErrorRecord]
    raw: pa.Buffer | None


def _ipc(t: pa.Table) -> pa.Buffer:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, t.schema) as w:
        w.write_table(t)
    return sink.getvalue()


def _unipc(b: pa.Buffer) -> pa.Table:
    return pa.ipc.open_stream(b).read_all()


def _send(conn: Connection, obj: Any) -> None:
    bufs: list[pickle.PickleBuffer] = []
    head = pickle.dumps(obj, protocol=5, buffer_callback=bufs.append)
    conn.send_bytes(_HEAD.pack(len(bufs)) + head)
    for b in bufs:
        conn.send_bytes(b.raw())


def _recv(conn: Connection) -> Any:
    head = conn.recv_bytes()
    (n,) = _HEAD.unpack_from(head)
    bufs = [conn.recv_bytes() for _ in range(n)]
    return pickle.loads(memoryview(head)[_HEAD.size:], buffers=bufs)



def ship(batch: _Batch) -> tuple[list[_Event], list[tuple[int, Any]]]:
    """A converted batch as shipped (see the module docstring)."""
    events, groups = batch
    out: list[tuple[int, Any]] = []
    for p, g in groups:
        if isinstance(g, _Decoded):
            out.append((p, _Shipped(
                np.asarray(g.offs, dtype=np.int64), np.asarray(g.vlen, dtype=np.int64), _ipc(g.rows), g.errors,
                None if g.raw is None else _ipc(g.raw),
            )))
        else:
            out.append((p, g))  # (materialized lists: a reader with no schema attached)
    return [_Event.of(m) for m in events], out


def unship(batch: tuple[list[_Event], list[tuple[int, Any]]], spec: DecodeSpec | None, where: str) -> _Batch:
    """A shipped batch as the reader holds it (``_Decoded`` runs rebuilt with ``spec``)."""
    events, groups = batch
    out: list[tuple[int, _Decoded | _Msgs]] = []
    for p, g in groups:
        if isinstance(g, _Shipped):
            if spec is None:
                raise IngestInvariantError(f"{where}: the reader process decoded without a schema")
            raw = None if g.raw is None else _unipc(g.raw)
            out.append((p, _Decoded(g.offs.tolist(), _unipc(g.rows), g.errors, raw, g.vlen.tolist(), spec)))
        else:
            out.append((p, g))
    return list(events), out
