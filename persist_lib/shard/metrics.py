"""Prometheus metrics of persist, per shard: commits, CAS retries, blob requests and
their S3 cost, bytes and parts moved, compaction debt, listen lag, lease expiries.

**Counting.** Each ``PersistClient`` has a ``PersistMetrics`` (``client.metrics``;
``None`` with ``PersistConfig(metrics=False)``). Its hooks are plain integer
increments on the paths that already exist: the machine's CAS loop bumps its shard's
``MachineMetrics`` (commits by transition, attempts, mismatches, indeterminate
retries), ``RetryingBlob`` counts every blob request attempt by the shard its key
starts with (``{shard}/...``) with the bytes it moved, ``expire_leases`` counts what it
expired, and a listen is registered (weakly) for its lag. Nothing else runs until
something asks: the counters cost a few hundred nanoseconds per blob request or
commit, against the milliseconds those take.

**Exporting.** ``samples()`` gives every value of the process: the counters of every
live client plus those of closed ones (folded in when a client closes, so counters
never go down), and gauges read from the shard states this process has cached
(compaction debt, frontiers, batches, readers) and from its live listens (lag, after
fetching their shard's latest upper). ``registry()`` is a ``prometheus_client``
registry holding them; ``start_http_server(port)`` serves it, and a client starts it
by itself when ``PersistConfig.metrics_port`` or ``$PERSIST_METRICS_PORT`` is set
(``$PERSIST_METRICS_ADDR``, default 127.0.0.1, is the address; a port already taken
is logged, not fatal). ``persist metrics`` prints them. prometheus-client is optional
(``pip install persist-platform[metrics]``) and imported only to export.

**The S3 cost model** (``REQUEST_PRICE_USD``): AWS S3 Standard list prices, us-east-1:
PUT, COPY, POST and LIST requests $0.005 per 1,000, GET $0.0004 per 1,000, DELETE
free. Requests are counted as S3 bills them, whatever the backend: a value over 8 MiB
is a multipart upload (create, one request per 8 MiB part, complete), a listing is one
request per 1,000 keys returned (at least one). Not counted: parts stored inline in
shard state (no blob request at all), and requests made in other processes (Spark
executors write and read parts through their own blob clients).
"""

from __future__ import annotations

import logging
import math
import os
import threading
import weakref
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from persist_lib.shard.machine import MachineMetrics

if TYPE_CHECKING:  # pragma: no cover
    from persist_lib.config import PersistConfig

log = logging.getLogger(__name__)

# AWS S3 Standard list prices (us-east-1), USD.
S3_PUT_COPY_POST_LIST_USD_PER_1000 = 0.005
S3_GET_SELECT_USD_PER_1000 = 0.0004
S3_DELETE_USD = 0.0
#: USD per request, by operation.
REQUEST_PRICE_USD: Mapping[str, float] = {
    "put": S3_PUT_COPY_POST_LIST_USD_PER_1000 / 1000,
    "get": S3_GET_SELECT_USD_PER_1000 / 1000,
    "list": S3_PUT_COPY_POST_LIST_USD_PER_1000 / 1000,
    "delete": S3_DELETE_USD,
}
#: S3 returns at most this many keys per LIST request.
S3_LIST_PAGE_KEYS = 1000
#: persist's S3 blob writes values up to this in one PUT, larger ones in parts of it
#: (``location/s3_blob.py``: ``MULTIPART_PART_SIZE``).
S3_MULTIPART_PART_BYTES = 8 * 1024 * 1024

OPS = ("put", "get", "list", "delete")
PUT, GET, LIST, DELETE = range(4)


def put_requests(nbytes: int) -> int:
    """S3 requests to write a value of ``nbytes``: one PUT, or a multipart upload."""
    if nbytes <= S3_MULTIPART_PART_BYTES:
        return 1
    return 2 + math.ceil(nbytes / S3_MULTIPART_PART_BYTES)


def list_requests(nkeys: int) -> int:
    """S3 LIST requests to list ``nkeys`` keys (1,000 per page, at least one)."""
    return max(1, math.ceil(nkeys / S3_LIST_PAGE_KEYS))


def shard_of_key(key: str) -> str:
    """The shard a blob key (or listing prefix) belongs to: its first path segment."""
    return key.partition("/")[0] or "-"


class ShardMetrics:
    """One client's counters of one shard (plain ints)."""

    __slots__ = (
        "requests",
        "bytes_written",
        "bytes_read",
        "parts_written",
        "parts_read",
        "readers_expired",
        "writers_expired",
        "machine",
    )

    def __init__(self, machine: MachineMetrics | None = None) -> None:
        self.requests = [0, 0, 0, 0]  # by OPS
        self.bytes_written = 0
        self.bytes_read = 0
        self.parts_written = 0
        self.parts_read = 0
        self.readers_expired = 0
        self.writers_expired = 0
        self.machine = machine if machine is not None else MachineMetrics()

    def cost_usd(self) -> float:
        return sum(n * REQUEST_PRICE_USD[op] for op, n in zip(OPS, self.requests, strict=True))

    def add_into(self, out: ShardMetrics) -> None:
        for i, n in enumerate(self.requests):
            out.requests[i] += n
        out.bytes_written += self.bytes_written
        out.bytes_read += self.bytes_read
        out.parts_written += self.parts_written
        out.parts_read += self.parts_read
        out.readers_expired += self.readers_expired
        out.writers_expired += self.writers_expired
        m, o = self.machine, out.machine
        o.cas_attempts += m.cas_attempts
        o.cas_committed += m.cas_committed
        o.cas_mismatches += m.cas_mismatches
        o.indeterminate_retries += m.indeterminate_retries
        for name, n in list(m.committed_by.items()):
            o.committed_by[name] = o.committed_by.get(name, 0) + n


def _is_part(key: str) -> bool:
    return "/rollup/" not in key


class PersistMetrics:
    """The counters of one client, by shard. Thread-safe; cheap to bump."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._shards: dict[str, ShardMetrics] = {}
        # Folded into the process's totals when closed or collected (never twice).
        self._finalizer = weakref.finalize(self, _retire, self._shards)
        with _PROCESS_LOCK:
            _LIVE.add(self)

    def close(self) -> None:
        """Folds this client's counters into the process's totals (idempotent)."""
        self._finalizer()

    def shard(self, shard: str) -> ShardMetrics:
        sm = self._shards.get(shard)
        if sm is None:
            with self._lock:
                sm = self._shards.setdefault(shard, ShardMetrics())
        return sm

    def machine_metrics(self, shard: str) -> MachineMetrics:
        """The ``MachineMetrics`` a client's machine for ``shard`` counts into (kept
        across machine evictions)."""
        return self.shard(shard).machine

    # ----- hooks (RetryingBlob, PersistClient) ---------------------------------------

    def blob_request(self, op: int, key: str, n: int = 1) -> None:
        sm = self.shard(shard_of_key(key))
        with self._lock:
            sm.requests[op] += n

    def on_get(self, key: str) -> None:
        self.blob_request(GET, key)

    def on_put(self, key: str, nbytes: int) -> None:
        self.blob_request(PUT, key, put_requests(nbytes))

    def on_delete(self, key: str) -> None:
        self.blob_request(DELETE, key)

    def on_list(self, prefix: str, nkeys: int) -> None:
        self.blob_request(LIST, prefix, list_requests(nkeys))

    def blob_written(self, key: str, nbytes: int) -> None:
        sm = self.shard(shard_of_key(key))
        with self._lock:
            sm.bytes_written += nbytes
            if _is_part(key):
                sm.parts_written += 1

    def blob_read(self, key: str, nbytes: int) -> None:
        sm = self.shard(shard_of_key(key))
        with self._lock:
            sm.bytes_read += nbytes
            if _is_part(key):
                sm.parts_read += 1

    def leases_expired(self, shard: str, readers: int, writers: int) -> None:
        sm = self.shard(shard)
        with self._lock:
            sm.readers_expired += readers
            sm.writers_expired += writers

    # ----- reading ---------------------------------------------------------------------

    def by_shard(self) -> dict[str, ShardMetrics]:
        """A copy of this client's counters, by shard."""
        with self._lock:
            items = list(self._shards.items())
        out: dict[str, ShardMetrics] = {}
        for sid, sm in items:
            sm.add_into(out.setdefault(sid, ShardMetrics()))
        return out

    def totals(self) -> dict[str, float]:
        """This client's counters summed over shards: requests by operation, their
        cost, bytes and parts moved, commits."""
        return totals(self.by_shard().values())


def totals(shards: Iterable[ShardMetrics]) -> dict[str, float]:
    t = ShardMetrics()
    for sm in shards:
        sm.add_into(t)
    out: dict[str, float] = {op: float(n) for op, n in zip(OPS, t.requests, strict=True)}
    out.update(
        cost_usd=t.cost_usd(),
        bytes_written=float(t.bytes_written),
        bytes_read=float(t.bytes_read),
        parts_written=float(t.parts_written),
        parts_read=float(t.parts_read),
        commits=float(t.machine.cas_committed),
        cas_mismatches=float(t.machine.cas_mismatches),
    )
    return out


# ----- the process ----------------------------------------------------------------------

_PROCESS_LOCK = threading.RLock()  # re-entrant: a client's metrics may be retired by GC anywhere
_LIVE: weakref.WeakSet[PersistMetrics] = weakref.WeakSet()
_RETIRED: dict[str, ShardMetrics] = {}
# Live listens (weak), for their lag: listen -> its read handle.
_LISTENS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def _retire(shards: dict[str, ShardMetrics]) -> None:
    with _PROCESS_LOCK:
        for sid, sm in list(shards.items()):
            sm.add_into(_RETIRED.setdefault(sid, ShardMetrics()))


def track_listen(listen: Any, handle: Any) -> None:
    """Registers a live listen (weakly) so its lag is reported."""
    with _PROCESS_LOCK:
        _LISTENS[listen] = handle


def process_counters() -> dict[str, ShardMetrics]:
    """Every client's counters of this process (live and closed), by shard."""
    out: dict[str, ShardMetrics] = {}
    with _PROCESS_LOCK:  # a consistent cut: no client is retired half-way through
        for sid, sm in list(_RETIRED.items()):
            sm.add_into(out.setdefault(sid, ShardMetrics()))
        for m in list(_LIVE):
            if not m._finalizer.alive:
                continue  # closed: already in _RETIRED
            for sid, sm in m.by_shard().items():
                sm.add_into(out.setdefault(sid, ShardMetrics()))
    return out


@dataclass(frozen=True)
class Sample:
    """One value: a metric family's name, its labels and the value."""

    name: str
    labels: tuple[tuple[str, str], ...]
    value: float

    def label(self, key: str) -> str:
        return dict(self.labels).get(key, "")


#: name -> (type, help, label names). Counters are exposed with a ``_total`` suffix.
FAMILIES: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "persist_commits": ("counter", "State transitions committed (CAS won), by transition", ("shard", "transition")),
    "persist_cas_attempts": ("counter", "Consensus compare-and-set attempts", ("shard",)),
    "persist_cas_mismatches": ("counter", "CAS attempts that lost (the state had moved on)", ("shard",)),
    "persist_cas_retries": (
        "counter",
        "Transitions re-run after a lost or indeterminate CAS",
        ("shard",),
    ),
    "persist_blob_requests": (
        "counter",
        "Blob requests (attempts), counted as S3 bills them, by operation",
        ("shard", "op"),
    ),
    "persist_blob_request_cost_usd": (
        "counter",
        "Cost of the blob requests at AWS S3 Standard list prices (USD)",
        ("shard", "op"),
    ),
    "persist_blob_bytes_written": ("counter", "Bytes written to blob (parts and rollups)", ("shard",)),
    "persist_blob_bytes_read": ("counter", "Bytes read from blob (parts and rollups)", ("shard",)),
    "persist_parts_written": ("counter", "Parts written to blob (inline parts not included)", ("shard",)),
    "persist_parts_read": ("counter", "Parts read from blob", ("shard",)),
    "persist_lease_expiries": ("counter", "Leases expired by maintenance, by kind", ("shard", "kind")),
    "persist_compaction_debt": ("gauge", "Compaction debt (updates; 0 = nothing to do)", ("shard",)),
    "persist_shard_upper": ("gauge", "Shard upper (-1: closed)", ("shard",)),
    "persist_shard_since": ("gauge", "Shard since (-1: released)", ("shard",)),
    "persist_shard_seqno": ("gauge", "Shard state seqno", ("shard",)),
    "persist_shard_batches": ("gauge", "Batches in the shard's trace", ("shard",)),
    "persist_shard_updates": ("gauge", "Updates in the shard's trace", ("shard",)),
    "persist_shard_bytes": ("gauge", "Bytes of the shard's parts", ("shard",)),
    "persist_leased_readers": ("gauge", "Leased readers registered on the shard", ("shard",)),
    "persist_writers": ("gauge", "Writers registered on the shard", ("shard",)),
    "persist_listen_lag": (
        "gauge",
        "How far this process's most lagging listen is behind the shard upper (times; ms for ingested data)",
        ("shard",),
    ),
    "persist_listens": ("gauge", "Live listens of this process on the shard", ("shard",)),
}


def samples(include_state: bool = True) -> list[Sample]:
    """Every metric value of this process (counters; with ``include_state`` the gauges
    read from cached shard states and live listens too)."""
    out: list[Sample] = []

    def add(name: str, value: float, **labels: str) -> None:
        out.append(Sample(name, tuple(labels.items()), float(value)))

    for sid, sm in sorted(process_counters().items()):
        m = sm.machine
        for name, n in sorted(m.committed_by.items()):
            add("persist_commits", n, shard=sid, transition=name)
        if m.cas_attempts:
            add("persist_cas_attempts", m.cas_attempts, shard=sid)
            add("persist_cas_mismatches", m.cas_mismatches, shard=sid)
            add("persist_cas_retries", m.cas_mismatches + m.indeterminate_retries, shard=sid)
        if any(sm.requests):
            for op, n in zip(OPS, sm.requests, strict=True):
                add("persist_blob_requests", n, shard=sid, op=op)
                add("persist_blob_request_cost_usd", n * REQUEST_PRICE_USD[op], shard=sid, op=op)
            add("persist_blob_bytes_written", sm.bytes_written, shard=sid)
            add("persist_blob_bytes_read", sm.bytes_read, shard=sid)
            add("persist_parts_written", sm.parts_written, shard=sid)
            add("persist_parts_read", sm.parts_read, shard=sid)
        if sm.readers_expired or sm.writers_expired:
            add("persist_lease_expiries", sm.readers_expired, shard=sid, kind="reader")
            add("persist_lease_expiries", sm.writers_expired, shard=sid, kind="writer")
    if include_state:
        out += state_samples()
    return out


def state_samples() -> list[Sample]:
    """Gauges of every shard state this process has cached, and of its live listens."""
    from persist_lib.shard.machine import cached_states
    from persist_lib.shard.spine import compaction_debt

    out: list[Sample] = []
    latest: dict[str, Any] = {}  # one state per shard (several locations may cache one)
    for s in cached_states():
        if s.exists and (s.shard_id not in latest or s.seqno > latest[s.shard_id].seqno):
            latest[s.shard_id] = s
    for sid, s in sorted(latest.items()):
        trace = s.trace_batches()
        values = {
            "persist_compaction_debt": compaction_debt(s),
            "persist_shard_upper": -1 if s.upper.time is None else s.upper.time,
            "persist_shard_since": -1 if s.since.time is None else s.since.time,
            "persist_shard_seqno": s.seqno,
            "persist_shard_batches": len(trace),
            "persist_shard_updates": sum(b.len for _, b in trace),
            "persist_shard_bytes": sum(b.size for _, b in trace),
            "persist_leased_readers": len(s.leased_readers),
            "persist_writers": len(s.writers),
        }
        out += [Sample(n, (("shard", sid),), float(v)) for n, v in values.items()]
    lag: dict[str, int] = {}
    count: dict[str, int] = {}
    with _PROCESS_LOCK:
        listens = list(_LISTENS.items())
    for listen, handle in listens:
        sid = handle.shard_id
        count[sid] = count.get(sid, 0) + 1
        f = listen.frontier.time
        try:
            upper = handle._machine.fetch_latest().upper.time
        except Exception:  # noqa: BLE001 - a gauge: fall back to what is cached
            upper = handle.upper.time
        behind = 0 if f is None or upper is None else max(0, upper - f)
        lag[sid] = max(lag.get(sid, 0), behind)
    for sid in sorted(count):
        out.append(Sample("persist_listen_lag", (("shard", sid),), float(lag[sid])))
        out.append(Sample("persist_listens", (("shard", sid),), float(count[sid])))
    return out


# ----- prometheus_client ------------------------------------------------------------------


class _Collector:
    """A ``prometheus_client`` collector of ``samples()`` (read at each scrape)."""

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        by_name: dict[str, list[Sample]] = {}
        for s in samples():
            by_name.setdefault(s.name, []).append(s)
        for name, (kind, doc, labelnames) in FAMILIES.items():
            cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            fam = cls(name, doc, labels=list(labelnames))
            for s in by_name.get(name, []):
                fam.add_metric([s.label(k) for k in labelnames], s.value)
            yield fam

    def describe(self) -> Iterator[Any]:
        return iter(())


_REGISTRY: Any = None
_SERVER: tuple[Any, Any] | None = None
_SERVER_TRIED = False


def registry() -> Any:
    """The ``prometheus_client.CollectorRegistry`` holding persist's metrics."""
    global _REGISTRY
    with _PROCESS_LOCK:
        if _REGISTRY is None:
            from prometheus_client import CollectorRegistry

            r = CollectorRegistry(auto_describe=False)
            r.register(_Collector())
            _REGISTRY = r
        return _REGISTRY


def register(target: Any) -> None:
    """Adds persist's metrics to another registry (e.g. ``prometheus_client.REGISTRY``,
    for a process that serves its own metrics)."""
    target.register(_Collector())


def exposition() -> str:
    """The metrics in the Prometheus text format."""
    from prometheus_client import generate_latest

    return bytes(generate_latest(registry())).decode("utf-8")


def start_http_server(port: int, addr: str = "127.0.0.1") -> tuple[Any, Any]:
    """Serves ``registry()`` at ``http://addr:port/metrics`` from a daemon thread
    (``port=0``: any free port, see ``server.server_port``). Returns (server, thread)."""
    import prometheus_client

    return prometheus_client.start_http_server(port, addr=addr, registry=registry())


def serve_if_configured(config: PersistConfig) -> tuple[Any, Any] | None:
    """Starts the process's metrics endpoint once, if ``config.metrics_port`` or
    ``$PERSIST_METRICS_PORT`` asks for it. A failure (port taken, prometheus-client
    missing) is logged and the process goes on."""
    global _SERVER, _SERVER_TRIED
    port: int | str | None = config.metrics_port
    if port is None:
        port = os.environ.get("PERSIST_METRICS_PORT") or None
    if port is None or _SERVER_TRIED:
        return _SERVER
    with _PROCESS_LOCK:
        if _SERVER_TRIED:
            return _SERVER
        _SERVER_TRIED = True
    addr = os.environ.get("PERSIST_METRICS_ADDR") or "127.0.0.1"
    try:
        _SERVER = start_http_server(int(port), addr)
        log.info("persist metrics served at http://%s:%s/metrics", addr, _SERVER[0].server_port)
    except Exception as e:  # noqa: BLE001 - metrics must never stop the work
        log.warning("persist metrics: could not serve on %s:%s: %r", addr, port, e)
    return _SERVER


def http_server() -> tuple[Any, Any] | None:
    """The endpoint ``serve_if_configured`` started (None if none)."""
    return _SERVER


# ----- per-shard tables (``persist metrics``, Dagster) ------------------------------------------


#: Column -> (family, the label value that selects it or "" for the sum over labels).
COLUMNS: dict[str, tuple[str, str]] = {
    "upper": ("persist_shard_upper", ""),
    "since": ("persist_shard_since", ""),
    "batches": ("persist_shard_batches", ""),
    "bytes": ("persist_shard_bytes", ""),
    "debt": ("persist_compaction_debt", ""),
    "readers": ("persist_leased_readers", ""),
    "writers": ("persist_writers", ""),
    "listen_lag": ("persist_listen_lag", ""),
    "commits": ("persist_commits", ""),
    "cas_retries": ("persist_cas_retries", ""),
    "cas_mismatches": ("persist_cas_mismatches", ""),
    "put": ("persist_blob_requests", "put"),
    "get": ("persist_blob_requests", "get"),
    "list": ("persist_blob_requests", "list"),
    "delete": ("persist_blob_requests", "delete"),
    "cost_usd": ("persist_blob_request_cost_usd", ""),
    "bytes_written": ("persist_blob_bytes_written", ""),
    "bytes_read": ("persist_blob_bytes_read", ""),
    "parts_written": ("persist_parts_written", ""),
    "parts_read": ("persist_parts_read", ""),
    "lease_expiries": ("persist_lease_expiries", ""),
}


def by_shard(values: Iterable[Sample]) -> dict[str, dict[str, float]]:
    """``{shard: {column: value}}`` (``COLUMNS``) from samples (local or scraped)."""
    out: dict[str, dict[str, float]] = {}
    for col, (fam, sel) in COLUMNS.items():
        for s in values:
            if s.name != fam or (sel and sel not in dict(s.labels).values()):
                continue
            row = out.setdefault(s.label("shard") or "-", {})
            row[col] = row.get(col, 0.0) + s.value
    return out


def parse_exposition(text: str) -> list[Sample]:
    """Samples of persist's families from a Prometheus text exposition (a scrape)."""
    from prometheus_client.parser import text_string_to_metric_families

    out = []
    for fam in text_string_to_metric_families(text):
        if fam.name not in FAMILIES:
            continue
        for s in fam.samples:
            if s.name.endswith(("_created",)):
                continue
            out.append(Sample(fam.name, tuple(sorted(s.labels.items())), float(s.value)))
    return out
