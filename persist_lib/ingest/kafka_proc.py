"""The Kafka reader process: consuming and decoding on another core than the ingestion.

Why: a reader's prefetch thread (``kafka_prefetch._Prefetcher``) and the ingestion's own thread
both need the GIL for most of their work (confluent-kafka builds a Python ``Message``
per message, splitting and decoding orchestrate Arrow from Python, reclocking and
appends are Python), so on one interpreter they barely overlap. A spawned child process
(not forked: it starts clean, with no copy of the parent's threads, locks or librdkafka
handles) runs exactly what the prefetch thread runs -- ``_consume`` + ``convert_batch``
-- with its own consumer, and ships each converted batch to the ingestion process:

- the rows (and, with ``keep_raw``, the raw records) of each partition's run of messages
  as an Arrow IPC stream, the offsets and value sizes as numpy arrays (pickle protocol 5
  with out-of-band buffers: no copy into the pickle), the error records and the
  consumer's events (end of partition, errors: ``_Event``, rebuilt as ``KafkaError``)
  pickled;
- over a socket pair; a receiver thread in the ingestion process reads it continuously
  (``recv`` releases the GIL) and queues the batches.

Semantics are the prefetch thread's: batches arrive in the order ``consume`` returned
them, the reader (``KafkaReader``, in the ingestion process) keeps every decision --
bindings, positions, typed errors from the events -- and tells the child which
partitions to read from which offsets (``assign``, applied before its next
``consume``). Memory is bounded the same way: the child consumes only while fewer than
``limit`` messages it sent have not been taken by the reader (``took`` credits).

Lifetime: the child exits when the reader closes (``stop``), when the socket reaches EOF
(the ingestion process died, even by ``kill -9``: the kernel closes its end), and when
its parent process is gone (a watchdog thread polls ``os.getppid()``: covers a parent
that forked and died while a fork holds the socket). A child that dies or fails makes
``take`` raise ``SourceUnavailable`` (its exit status, or its error) in the ingestion
process: the ingestion stops, and a restarted one resumes at the durable frontier.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from persist_lib.ingest.errors import IngestInvariantError, SourceUnavailable

if TYPE_CHECKING:  # pragma: no cover
    from persist_lib.ingest.decode import ErrorRecord
    from persist_lib.ingest.kafka import KafkaSource, _Batch, _Fetched

log = logging.getLogger(__name__)

_HEAD = struct.Struct("<I")  # out-of-band buffers following a message's pickle
_STOP_WAIT_S = 10.0
# (not ``-m persist_lib.ingest.kafka_proc``: its classes must pickle under this module's name)
_CHILD = "import sys; from persist_lib.ingest.kafka_proc import main; sys.exit(main(sys.argv[1:]))"


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


def _project_root() -> str:
    import persist_lib

    return str(Path(persist_lib.__file__).resolve().parent.parent)


class ReaderProcess:
    """The ingestion-process side: the ``_Prefetcher`` interface (``take``, ``exclusive``,
    ``close``) over a spawned child, plus ``assign`` (the child's consumer fetches) and
    ``high_watermarks`` (its cached ones, for ``lag``)."""

    def __init__(self, src: KafkaSource, limit: int, where: str) -> None:
        self._where = where
        self._spec = src._spec
        self._limit = max(1, limit)
        self._batches: deque[tuple[int, _Batch, float]] = deque()  # (messages and events, batch, consumed at)
        self._held = 0
        self._cv = threading.Condition()
        self._send_lock = threading.Lock()
        self._error: BaseException | None = None
        self._closing = False
        self._high: dict[int, int] = {}
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        root = _project_root()
        env["PYTHONPATH"] = os.pathsep.join([root, *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]])
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", _CHILD, str(theirs.fileno()), str(os.getpid())],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, env=env,
                close_fds=True,
            )
        except OSError as e:
            ours.close()
            raise SourceUnavailable(f"{where}: could not start the Kafka reader process: {e}") from None
        finally:
            theirs.close()
        self.pid = self._proc.pid
        self._conn = Connection(ours.detach())
        settings = src.settings()
        self._post(("init", settings, src._name, src._spec, src._envelope, self._limit))
        self._thread = threading.Thread(target=self._run, name=f"kafka-reader-process {where}", daemon=True)
        self._thread.start()

    def _post(self, msg: Any) -> None:
        with self._send_lock:
            try:
                _send(self._conn, msg)
            except OSError:
                pass  # (a dead child: the receiver thread reports it)

    def _run(self) -> None:
        try:
            while True:
                msg = _recv(self._conn)
                kind = msg[0]
                if kind == "batch":
                    _, size, batch, high, at = msg
                    b = self._unpack(batch)
                    with self._cv:
                        self._high.update(high)
                        self._batches.append((size, b, at))
                        self._held += size
                        self._cv.notify_all()
                elif kind == "error":
                    with self._cv:
                        self._error = self._child_error(msg[1], msg[2])
                        self._cv.notify_all()
                    return
        except (EOFError, OSError):
            pass
        except BaseException as e:  # noqa: BLE001 - handed to the reader's thread
            with self._cv:
                self._error = e
                self._cv.notify_all()
            self._proc.kill()  # (nothing reads its batches any more)
            return
        if self._closing:
            return
        try:
            rc: int | None = self._proc.wait(2.0)
        except subprocess.TimeoutExpired:
            rc = None
        how = (
            "is gone with its socket closed" if rc is None
            else f"was killed by signal {signal.Signals(-rc).name}" if rc < 0
            else f"exited with status {rc}"
        )
        with self._cv:
            self._error = SourceUnavailable(
                f"{self._where}: the Kafka reader process (pid {self.pid}) {how} while the ingestion "
                "was reading; nothing was decided from what it had not delivered: restart the ingestion "
                "(it resumes at the durable frontier)"
            )
            self._cv.notify_all()

    def _child_error(self, pickled: bytes | None, text: str) -> BaseException:
        if pickled is not None:
            try:
                e = pickle.loads(pickled)
                if isinstance(e, BaseException):
                    return e
            except Exception:  # noqa: BLE001, S110 - fall back to the text
                pass
        return SourceUnavailable(f"{self._where}: the Kafka reader process (pid {self.pid}) failed: {text}")

    def _unpack(self, batch: tuple[list[_Event], list[tuple[int, Any]]]) -> _Batch:
        from persist_lib.ingest.kafka import _Decoded, _Msgs

        events, groups = batch
        out: list[tuple[int, _Decoded | _Msgs]] = []
        for p, g in groups:
            if isinstance(g, _Shipped):
                if self._spec is None:
                    raise IngestInvariantError(f"{self._where}: the reader process decoded without a schema")
                raw = None if g.raw is None else _unipc(g.raw)
                out.append((p, _Decoded(g.offs.tolist(), _unipc(g.rows), g.errors, raw, g.vlen.tolist(), self._spec)))
            else:
                out.append((p, g))
        return list(events), out

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """(The reader's own consumer is not shared with the child: nothing to exclude.)"""
        yield

    def assign(self, parts: list[tuple[int, int]]) -> None:
        """The child's consumer reads ``(partition, offset)``s too (before its next consume)."""
        self._post(("assign", parts))

    def high_watermarks(self) -> dict[int, int]:
        with self._cv:
            return dict(self._high)

    def take(self, max_n: int, timeout: float) -> list[_Fetched]:
        """Up to about ``max_n`` messages (whole batches), waiting up to ``timeout`` for one."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while not self._batches and self._error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return []
                self._cv.wait(left)
            if not self._batches and self._error is not None:
                raise self._error
            out: list[_Fetched] = []
            got = 0
            while self._batches and got < max_n:
                size, b, at = self._batches.popleft()
                out.append((b, at))  # (time.monotonic: one clock for every process)
                got += size
                self._held -= size
        if got:
            self._post(("took", got))
        return out

    def close(self) -> None:
        self._closing = True
        self._post(("stop",))
        try:
            # (while the receiver thread drains the socket, the child gets to read "stop")
            self._proc.wait(_STOP_WAIT_S if self._thread.is_alive() else 0.5)
        except subprocess.TimeoutExpired:
            log.warning("%s: the Kafka reader process (pid %d) did not stop; killing it", self._where, self.pid)
            self._proc.kill()
            self._proc.wait()
        self._thread.join(_STOP_WAIT_S)
        self._conn.close()


# ----- the child --------------------------------------------------------------------------


def _watch_parent(ppid: int) -> None:
    """Exits this process as soon as the parent is gone (re-parented)."""

    def run() -> None:
        while True:
            if os.getppid() != ppid:
                os._exit(3)
            time.sleep(0.2)

    threading.Thread(target=run, name="parent-watchdog", daemon=True).start()


def _ship(batch: _Batch) -> tuple[list[_Event], list[tuple[int, Any]]]:
    from persist_lib.ingest.kafka import _Decoded

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


def _serve(conn: Connection) -> None:
    """The child's loop: control messages (assignments before the next consume), then a
    ``consume`` + ``convert_batch`` -- what the prefetch thread does -- and the batch
    shipped, while fewer than ``limit`` messages wait in the ingestion process."""
    import gc

    from confluent_kafka import TopicPartition

    from persist_lib.ingest.kafka import KafkaSource, convert_batch
    from persist_lib.ingest.kafka_prefetch import _consume

    msg = _recv(conn)
    if msg[0] != "init":
        raise IngestInvariantError(f"the Kafka reader process expected init, got {msg[0]!r}")
    _, settings, name, spec, envelope, limit = msg
    src = KafkaSource(**settings)
    src.attach(None, name, spec)  # type: ignore[arg-type]  # (no client: it only reads)
    src.bind_envelope(envelope)
    gc.freeze()  # (what the imports left: never walked by a collection again)
    consumer = src.new_consumer()
    topic = src.topic
    outstanding = 0  # messages (and events) shipped and not yet taken by the reader

    def convert(msgs: list[Any]) -> _Batch:
        return convert_batch(src, msgs)

    try:
        while True:
            while True:
                full = outstanding >= limit
                if not conn.poll(0.1 if full else 0.0):
                    if full:
                        continue
                    break
                m = _recv(conn)
                if m[0] == "assign":
                    consumer.incremental_assign([TopicPartition(topic, p, o) for p, o in m[1]])
                elif m[0] == "took":
                    outstanding -= int(m[1])
                elif m[0] == "stop":
                    return
            size, batch = _consume(consumer, max(1, min(20_000, limit - outstanding)), 0.05, convert)
            if not size:
                continue
            at = time.monotonic()
            high: dict[int, int] = {}  # (cached: the last fetch responses' high watermarks)
            for p, _ in batch[1]:
                if p not in high:
                    _, hi = consumer.get_watermark_offsets(TopicPartition(topic, p), cached=True)
                    if hi is not None and hi >= 0:
                        high[p] = int(hi)
            _send(conn, ("batch", size, _ship(batch), high, at))
            outstanding += size
    finally:
        consumer.close()


class _NoPandas:
    """An import hook refusing pandas. Why: pyarrow's pandas shim imports pandas on the
    first ``pa.array``/``to_numpy`` call of a process if it can (~0.2 s of CPU per reader
    process); this process never converts from or to pandas, and pyarrow without pandas
    converts numpy and Arrow data exactly the same way."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name == "pandas" or name.startswith("pandas."):
            raise ImportError("the Kafka reader process does not use pandas")
        return None


def main(argv: list[str]) -> int:
    """``python -c _CHILD FD PARENT_PID``: serves one reader."""
    if "pandas" not in sys.modules:
        sys.meta_path.insert(0, _NoPandas())
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (Ctrl-C is the ingestion's to handle: it stops us)
    fd, ppid = int(argv[0]), int(argv[1])
    _watch_parent(ppid)
    conn = Connection(fd)
    try:
        _serve(conn)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return 0  # the ingestion process went away
    except BaseException as e:  # noqa: BLE001 - reported to the ingestion process
        import traceback

        text = f"{type(e).__name__}: {e}"
        pickled: bytes | None = None
        try:
            data = pickle.dumps(e)
            pickle.loads(data)  # (librdkafka's exceptions don't round-trip)
            pickled = data
        except Exception:  # noqa: BLE001, S110 - sent as text instead
            pass
        try:
            _send(conn, ("error", pickled, text))
        except OSError:
            pass
        traceback.print_exc(file=sys.stderr)
        return 1
    finally:
        conn.close()
    return 0

