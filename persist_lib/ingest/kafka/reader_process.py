"""The Kafka reader process: consuming and decoding on another core than the ingestion.

Why: a reader's prefetch thread (``prefetch._Prefetcher``) and the ingestion's own thread
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
- over a socket pair (``wire``); a receiver thread in the ingestion process reads it
  continuously (``recv`` releases the GIL) and queues the batches.

This module is the ingestion process's side (``ReaderProcess``); the child's is
``reader_child``.

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
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from persist_lib.ingest.errors import SourceUnavailable
from persist_lib.ingest.kafka.wire import _recv, _send, unship

if TYPE_CHECKING:  # pragma: no cover
    from persist_lib.ingest.kafka.messages import _Batch, _Fetched
    from persist_lib.ingest.kafka.topic import KafkaTopic

log = logging.getLogger(__name__)

_STOP_WAIT_S = 10.0
# The child's code (``reader_child``), imported by ``-c`` rather than run with ``-m``: run as
# ``__main__``, the module would be a second copy beside the one the package imports.
_CHILD = "import sys; from persist_lib.ingest.kafka.reader_child import main; sys.exit(main(sys.argv[1:]))"


def _project_root() -> str:
    import persist_lib

    return str(Path(persist_lib.__file__).resolve().parent.parent)


class ReaderProcess:
    """The ingestion-process side: the ``_Prefetcher`` interface (``take``, ``exclusive``,
    ``close``) over a spawned child, plus ``assign`` (the child's consumer fetches) and
    ``high_watermarks`` (its cached ones, for ``lag``)."""

    def __init__(self, src: KafkaTopic, limit: int, where: str) -> None:
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
                    b = unship(batch, self._spec, self._where)
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

