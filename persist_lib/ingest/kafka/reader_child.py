"""The Kafka reader process's own side (``reader_process`` starts it with ``python -c``):
reads its settings from the socket, builds the same source, and runs ``consume`` +
``convert_batch`` -- what the prefetch thread runs -- shipping each converted batch
(``wire``) while fewer than ``limit`` messages it sent wait in the ingestion process.
Exits on ``stop``, on the socket's end and when its parent process is gone."""

from __future__ import annotations

import os
import pickle
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from persist_lib.ingest.errors import IngestInvariantError
from persist_lib.ingest.kafka.messages import _Batch
from persist_lib.ingest.kafka.prefetch import _consume
from persist_lib.ingest.kafka.source import KafkaSource
from persist_lib.ingest.kafka.split import convert_batch
from persist_lib.ingest.kafka.wire import _recv, _send, ship


def _watch_parent(ppid: int) -> None:
    """Exits this process as soon as the parent is gone (re-parented)."""

    def run() -> None:
        while True:
            if os.getppid() != ppid:
                os._exit(3)
            time.sleep(0.2)

    threading.Thread(target=run, name="parent-watchdog", daemon=True).start()


def _serve(conn: Connection) -> None:
    """The child's loop: control messages (assignments before the next consume), then a
    ``consume`` + ``convert_batch`` -- what the prefetch thread does -- and the batch
    shipped, while fewer than ``limit`` messages wait in the ingestion process."""
    import gc

    from confluent_kafka import TopicPartition

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
            _send(conn, ("batch", size, ship(batch), high, at))
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

