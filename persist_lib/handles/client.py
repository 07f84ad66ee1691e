"""``PersistClient``: opens shards on a location and hands out read/write handles.

One client holds one Blob and one Consensus (wrapped in retries with backoff up to a
deadline). Handles of every client in a process share one cached state per shard.
A background thread heartbeats live handles every lease/4 (configurable); it survives
any error of a single heartbeat (logged, retried next tick), and it watches its own
loop: should the loop ever end by an exception (a BaseException such as an interrupt
included), the thread logs it and runs the loop again, so the handles already open
keep their leases without waiting for a new handle to be opened. A client keeps at
most ``config.max_cached_shards`` shard machines (least recently used first out;
handles keep their own), so a long-lived process that inspects many shards stays
bounded.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pyarrow as pa

from persist_lib.config import PersistConfig
from persist_lib.config_rules import config_of
from persist_lib.errors import (
    InvalidConfig,
    InvalidUsage,
    LeaseExpired,
    SchemaMismatch,
    ShardTombstoned,
)
from persist_lib.handles.one_shot import ONE_SHOT_READER, OneShotSnapshot
from persist_lib.handles.read import ReadHandle
from persist_lib.handles.schema_evolve import evolve_shard_schemas, retry_fresh
from persist_lib.handles.since import SinceHandle
from persist_lib.handles.write import WriteHandle
from persist_lib.ids import CriticalReaderId, ReaderId, ShardId, WriterId
from persist_lib.location.base import Blob, Consensus
from persist_lib.location.retry import RetryingBlob, RetryingConsensus, RetryPolicy
from persist_lib.location.uri import SensitiveUrl, open_blob, open_consensus
from persist_lib.shard import transitions as tr
from persist_lib.shard.codec import Schemas
from persist_lib.shard.context import Lease
from persist_lib.shard.machine import Machine, MachineMetrics, describe_state
from persist_lib.shard.metrics import PersistMetrics, serve_if_configured
from persist_lib.shard.schema_registry import EvolveResult, with_history

log = logging.getLogger(__name__)

ShardLike = ShardId | str


def default_home() -> Path:
    return Path(os.environ.get("PERSIST_HOME") or ".persist").resolve()


def default_uris(home: str | os.PathLike[str] | None = None) -> tuple[str, str]:
    """The embedded default location: ``$PERSIST_HOME`` (else ``./.persist``), unless
    ``PERSIST_BLOB_URI`` / ``PERSIST_CONSENSUS_URI`` select real backends."""
    h = Path(home).resolve() if home is not None else default_home()
    blob = os.environ.get("PERSIST_BLOB_URI") or f"file://{h / 'blob'}"
    consensus = os.environ.get("PERSIST_CONSENSUS_URI") or f"sqlite:///{h / 'consensus.db'}"
    return blob, consensus


def persist_config_of(config: object) -> PersistConfig:
    """``config`` when it is a ``PersistConfig``, the defaults for None; anything else (a
    dict of settings, a path, ``False``) is an ``InvalidConfig``, not silently replaced
    by the defaults."""
    return config_of(
        config, PersistConfig, what="PersistClient config", error=InvalidConfig,
        hint="fix: pass a PersistConfig (e.g. PersistConfig(read_memory_budget=...)), or None for the defaults",
    )


class _OpenDescriptor:
    """``PersistClient.open(blob_uri, consensus_uri)`` on the class opens a location;
    ``client.open(shard, key_schema, val_schema)`` on an instance opens a shard."""

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        if obj is None:
            return objtype._open_location
        return obj._open_shard


class PersistClient:
    """Entry point of the library: ``PersistClient.open(blob_uri, consensus_uri)``.

    It is the ``ShardContext`` (``persist_lib.shard.context``) the shard machinery runs
    with: the compactor, part writers and maintenance runs take it as such."""

    open = _OpenDescriptor()

    def __init__(
        self,
        blob: Blob,
        consensus: Consensus,
        config: PersistConfig | None = None,
        *,
        blob_uri: str = "",
        consensus_uri: str = "",
    ) -> None:
        self.config = persist_config_of(config)
        policy = RetryPolicy(deadline_s=self.config.retry_deadline_s)
        # Per-shard counters (persist_lib.shard.metrics); None: metrics off, nothing counted.
        self.metrics: PersistMetrics | None = PersistMetrics() if self.config.metrics else None
        self.raw_blob = blob
        self.raw_consensus = consensus
        self.blob: Blob = RetryingBlob(blob, policy, self.metrics)
        self.consensus: Consensus = RetryingConsensus(consensus, policy)
        self.blob_uri = blob_uri
        self.consensus_uri = consensus_uri
        self._handles: weakref.WeakSet[Any] = weakref.WeakSet()
        self._hb_thread: threading.Thread | None = None
        self._hb_stop = threading.Event()
        self._lock = threading.Lock()
        self._machines: OrderedDict[str, Machine] = OrderedDict()
        self.heartbeat_failures = 0  # heartbeats that raised (each logged)
        self.heartbeat_loop_restarts = 0  # times the heartbeat loop died and was rerun
        self._uploads: ThreadPoolExecutor | None = None
        if self.metrics is not None:
            serve_if_configured(self.config)  # the HTTP endpoint, if asked for (once)

    # ----- construction ---------------------------------------------------------------

    @classmethod
    def _open_location(
        cls, blob_uri: str, consensus_uri: str, config: PersistConfig | None = None
    ) -> PersistClient:
        """``PersistClient.open(blob_uri, consensus_uri)``: a client on a location."""
        config = persist_config_of(config)  # before the location is opened (or created)
        return cls(
            open_blob(blob_uri),
            open_consensus(consensus_uri),
            config,
            blob_uri=blob_uri,
            consensus_uri=consensus_uri,
        )

    @classmethod
    def open_existing(
        cls, blob_uri: str, consensus_uri: str, config: PersistConfig | None = None
    ) -> PersistClient:
        """Like ``open``, for tools that only read: a local location that does not exist
        is a ``LocationNotFound`` (nothing is created); see ``persist_lib.location.check``."""
        from persist_lib.location.check import require_existing_location

        require_existing_location(blob_uri, consensus_uri)
        return cls._open_location(blob_uri, consensus_uri, config)

    @classmethod
    def default(
        cls, home: str | os.PathLike[str] | None = None, config: PersistConfig | None = None
    ) -> PersistClient:
        """The embedded default: file blob + SQLite consensus under ``$PERSIST_HOME``."""
        config = persist_config_of(config)  # before a directory is made
        blob, consensus = default_uris(home)
        if blob.startswith("file://"):
            Path(blob[len("file://") :]).mkdir(parents=True, exist_ok=True)
        return cls._open_location(blob, consensus, config)

    def upload_executor(self) -> ThreadPoolExecutor:
        """One long-lived pool for part encoding/uploads (a pool per commit costs ~10%)."""
        with self._lock:
            if self._uploads is None:
                self._uploads = ThreadPoolExecutor(
                    max_workers=max(2, 2 * self.config.max_inflight_uploads),
                    thread_name_prefix="persist-upload",
                )
            return self._uploads

    def close(self) -> None:
        self._hb_stop.set()
        hb = self._hb_thread
        if hb is not None and hb is not threading.current_thread():
            # A heartbeat in flight finishes before the location is closed under it.
            hb.join(timeout=HEARTBEAT_JOIN_S)
        if self._uploads is not None:
            self._uploads.shutdown(wait=True)
            self._uploads = None
        bg = self.__dict__.pop("_bg_compactor", None)
        if bg is not None:
            bg.close()
        with self._lock:
            machines = list(self._machines.values())
        for m in machines:  # a background rollup still uses blob and consensus
            m.wait_background()
        self.blob.close()
        self.consensus.close()
        if self.metrics is not None:
            self.metrics.close()  # its counts go on in the process's totals

    def __enter__(self) -> PersistClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"PersistClient(blob={SensitiveUrl(self.blob_uri)!s}, "
            f"consensus={SensitiveUrl(self.consensus_uri)!s})"
        )

    # ----- handles --------------------------------------------------------------------

    def machine(self, shard: ShardLike) -> Machine:
        sid = str(ShardId.parse(shard))
        evicted: list[Machine] = []
        with self._lock:
            m = self._machines.get(sid)
            if m is None:
                mm = self.metrics.machine_metrics(sid) if self.metrics else MachineMetrics()
                m = self._machines[sid] = Machine(sid, self.blob, self.consensus, self.config, mm)
                attach = self.config.compaction_enabled
                limit = max(1, self.config.max_cached_shards)
                while len(self._machines) > limit:
                    _, old = self._machines.popitem(last=False)
                    evicted.append(old)
            else:
                self._machines.move_to_end(sid)
                attach = False
        for old in evicted:  # handles keep theirs; a background rollup finishes on its own
            old.wait_background(0.0)
        if attach:
            self.background_compactor().attach(m)
        return m

    def _open_shard(
        self,
        shard: ShardLike,
        key_schema: pa.Schema,
        val_schema: pa.Schema,
        *,
        purpose: str = "",
    ) -> tuple[WriteHandle, ReadHandle]:
        """Opens (creating it if new) ``shard``: a writer and a leased reader, in one transition."""
        schemas = Schemas.create(key_schema, val_schema)
        m = self.machine(shard)
        wid, rid = str(WriterId.new()), str(ReaderId.new())
        self._register(m, schemas, wid, rid, purpose)
        schemas = with_history(m.cached(), schemas)  # with the versions old parts need
        w = WriteHandle(self, m, wid, schemas, purpose)
        r = ReadHandle(self, m, rid, schemas, purpose)
        self._track(w)
        self._track(r)
        return w, r

    def open_writer(
        self, shard: ShardLike, key_schema: pa.Schema, val_schema: pa.Schema, *, purpose: str = ""
    ) -> WriteHandle:
        schemas = Schemas.create(key_schema, val_schema)
        m = self.machine(shard)
        wid = str(WriterId.new())
        self._register(m, schemas, wid, None, purpose)
        schemas = with_history(m.cached(), schemas)
        w = WriteHandle(self, m, wid, schemas, purpose)
        self._track(w)
        return w

    def open_leased_reader(
        self, shard: ShardLike, key_schema: pa.Schema, val_schema: pa.Schema, *, purpose: str = ""
    ) -> ReadHandle:
        schemas = Schemas.create(key_schema, val_schema)
        m = self.machine(shard)
        rid = str(ReaderId.new())
        self._register(m, schemas, None, rid, purpose)
        schemas = with_history(m.cached(), schemas)
        r = ReadHandle(self, m, rid, schemas, purpose)
        self._track(r)
        return r

    def snapshot(
        self,
        shard: ShardLike,
        key_schema: pa.Schema,
        val_schema: pa.Schema,
        as_of: int,
        timeout_s: float | None = None,
        *,
        memory_budget: int | None = None,
        columns: Sequence[str] | None = None,
        filter: Any = None,
    ) -> pa.Table:
        """One snapshot of an existing shard as of ``as_of``, without registering a reader.

        The same rows as ``open_leased_reader(...).snapshot(as_of, ...)`` followed by
        ``expire()``, without their two consensus writes: nothing is written, so a read
        of an old time by a new client costs the state load and the parts
        (``handles.one_shot`` argues why it can't return wrong rows). ``as_of`` before
        the shard's since, or the since passing it while the read runs and the parts it
        needed being collected, is ``SincePassed`` (nothing returned): hold the since
        with a leased reader to read old times reliably under compaction and GC.
        A shard that does not exist is an ``InvalidUsage`` (this never creates one);
        schemas other than the recorded ones a ``SchemaMismatch``.
        """
        schemas = Schemas.create(key_schema, val_schema)
        m = self.machine(shard)
        s = m.cached()
        if not s.exists:
            s = m.fetch_latest()
        if not s.exists:
            raise InvalidUsage(
                f"shard {m.shard_id} does not exist at {self!r}; a snapshot never creates one "
                "(open it with a writer first, or check the shard id and the location)"
            )
        if s.tombstone:
            raise ShardTombstoned(
                f"shard {m.shard_id} was finalized and is a tombstone: it can't be read"
            )
        try:
            tr.check_schemas(s, schemas)
        except SchemaMismatch:  # the cached state may predate an evolution elsewhere
            s = m.fetch_latest()
            tr.check_schemas(s, schemas)
        schemas = with_history(s, schemas)
        reader = OneShotSnapshot(self, m, ONE_SHOT_READER, schemas, "one-shot snapshot")
        return reader.read(
            as_of, timeout_s, memory_budget=memory_budget, columns=columns, filter=filter
        )

    def open_critical_since(
        self,
        shard: ShardLike,
        key_schema: pa.Schema,
        val_schema: pa.Schema,
        *,
        reader_id: str | None = None,
        initial_opaque: str = "",
        purpose: str = "",
    ) -> SinceHandle:
        """A since handle that never expires, fenced by an opaque token.

        Pass the same ``reader_id`` to re-open an existing one (e.g. after a restart).
        """
        schemas = Schemas.create(key_schema, val_schema)
        rid = str(CriticalReaderId(reader_id)) if reader_id else str(CriticalReaderId.new())
        m = self.machine(shard)
        retry_fresh(
            m,
            lambda: m.apply(
                "register_critical_reader",
                lambda s, now: tr.register_critical_reader(
                    s, now, schemas=schemas, reader_id=rid, initial_opaque=initial_opaque,
                    purpose=purpose,
                ),
            ),
        )
        return SinceHandle(m, rid, schemas)

    def compare_and_evolve_schema(
        self,
        shard: ShardLike,
        expected: tuple[pa.Schema, pa.Schema],
        new: tuple[pa.Schema, pa.Schema],
    ) -> EvolveResult:
        """Evolves the shard's (key, value) schemas from ``expected`` to ``new`` in one
        compare-and-set: the compatibility check and the change commit together
        (docs/architecture.md, "Schema evolution"). ``MISMATCH`` (nothing changed) when
        the shard's schemas are not ``expected``; ``IncompatibleSchemaChange`` when
        ``new`` can't be an in-place change. Handles opened before it keep their version:
        writes through them are refused (``StaleSchema``); reopen them."""
        return evolve_shard_schemas(
            self.machine(shard), Schemas.create(*expected), Schemas.create(*new)
        )

    def _register(
        self, m: Machine, schemas: Schemas, wid: str | None, rid: str | None, purpose: str
    ) -> None:
        cfg = self.config
        retry_fresh(
            m,
            lambda: m.apply(
                "register",
                lambda s, now: tr.register(
                    s, now, schemas=schemas, writer_id=wid, writer_lease_ms=cfg.writer_lease_ms,
                    reader_id=rid, reader_lease_ms=cfg.reader_lease_ms, purpose=purpose,
                ),
            ),
        )

    # ----- inspection and maintenance --------------------------------------------------

    def list_shards(self) -> list[str]:
        return sorted(k for k in self.consensus.list_keys() if _is_shard_id(k))

    def inspect(self, shard: ShardLike) -> dict[str, Any]:
        """The shard's state as JSON: seqno, since, upper, batches, readers, writers, rollups."""
        m = self.machine(shard)
        s = m.fetch_latest()
        if not s.exists:
            raise InvalidUsage(f"shard {m.shard_id} does not exist at {self!r}")
        return describe_state(s)

    def expire_leases(self, shard: ShardLike | None = None, now: int | None = None) -> dict[str, Any]:
        """Expires lapsed readers and writers on one shard or every shard.

        ``now`` (ms since the epoch) defaults to this client's clock. Returns what was
        expired per shard.
        """
        shards = [str(ShardId.parse(shard))] if shard is not None else self.list_shards()
        out: dict[str, Any] = {}
        for sid in shards:
            m = self.machine(sid)
            res, _ = m.apply(
                "expire_leases",
                lambda s, n: tr.expire_leases(s, now if now is not None else n),
            )
            if res.readers or res.writers:
                out[sid] = {"readers": list(res.readers), "writers": list(res.writers)}
                if self.metrics is not None:
                    self.metrics.leases_expired(sid, len(res.readers), len(res.writers))
        return out

    # ----- heartbeats -----------------------------------------------------------------

    def _track(self, handle: Any) -> None:
        handle.last_heartbeat_monotonic = time.monotonic()
        self._handles.add(handle)
        self.ensure_heartbeats()

    def track_lease(self, lease: Lease) -> None:
        """Heartbeats ``lease`` (anything with ``heartbeat()``, ``lease_ms`` and
        ``last_heartbeat_monotonic``, e.g. a ``PartWriter``) with the handles
        (``ShardContext.track_lease``)."""
        self._track(lease)

    def forget_lease(self, lease: Lease) -> None:
        """Stops heartbeating ``lease`` (``ShardContext.forget_lease``)."""
        self._forget_handle(lease)

    def ensure_heartbeats(self) -> None:
        """Starts the heartbeat thread (or a new one, should it have ended anyway)."""
        if not self.config.background_heartbeats or self._hb_stop.is_set():
            return
        t = self._hb_thread
        if t is not None and t.is_alive():
            return
        with self._lock:
            t = self._hb_thread
            if t is None or not t.is_alive():
                if t is not None:
                    log.error("persist heartbeat thread had died; restarting it")
                self._hb_thread = threading.Thread(
                    target=self._heartbeat_thread, name="persist-heartbeat", daemon=True
                )
                self._hb_thread.start()

    def _forget_handle(self, handle: Any) -> None:
        self._handles.discard(handle)

    def _lease_ms(self, h: Any) -> int:
        lease = getattr(h, "lease_ms", None)
        if isinstance(lease, int):
            return lease
        return self.config.writer_lease_ms if isinstance(h, WriteHandle) else self.config.reader_lease_ms

    def _heartbeat_thread(self) -> None:
        """The heartbeat thread, and the watchdog of its loop: whatever ends the loop
        (BaseExceptions included: nothing else in this thread would handle them), it is
        logged and the loop runs again after a tick, until the client is closed."""
        while not self._hb_stop.is_set():
            try:
                self._heartbeat_loop()
            except BaseException as e:  # noqa: BLE001 - the thread must outlive its loop
                self.heartbeat_loop_restarts += 1
                log.error("persist heartbeat loop died (%r); restarting it", e, exc_info=True)
                self._hb_stop.wait(self.config.heartbeat_tick_s)

    def _heartbeat_loop(self) -> None:
        while not self._hb_stop.wait(self.config.heartbeat_tick_s):
            try:
                self.heartbeat_due()
            except Exception:  # never let the thread die: every lease depends on it
                log.exception("persist heartbeat loop failed; continuing")

    def heartbeat_due(self) -> int:
        """Heartbeats every tracked handle whose last heartbeat is older than lease/4.

        A failure is logged (ERROR once half the lease has passed without a successful
        heartbeat) and retried at the next tick; ``LeaseExpired`` stops tracking the
        handle. Returns the number of failures.
        """
        failures = 0
        for h in list(self._handles):
            lease_ms = self._lease_ms(h)
            since = time.monotonic() - h.last_heartbeat_monotonic
            if since < lease_ms / 4000.0:
                continue
            try:
                h.heartbeat()
                h.last_heartbeat_monotonic = time.monotonic()
            except LeaseExpired:
                self._handles.discard(h)
            except Exception as e:
                failures += 1
                self.heartbeat_failures += 1
                level = logging.ERROR if since >= lease_ms / 2000.0 else logging.WARNING
                log.log(level, "heartbeat of %r failed (%.0f s since the last one; lease %.0f s): %r",
                        h, since, lease_ms / 1000.0, e)
        return failures

    # ----- maintenance (persist_lib.handles.maintenance) --------------------------------------

    def compact(self, shard: ShardLike, **kwargs: Any) -> dict[str, Any]:
        """Runs the shard's pending merges now (see ``persist_lib.handles.maintenance.compact``:
        ``retry_quarantined``, ``raise_on_failure``, ``max_rounds``)."""
        from persist_lib.handles import maintenance

        return maintenance.compact(self, shard, **kwargs)

    def gc(self, shard: ShardLike) -> dict[str, Any]:
        """One idempotent garbage-collection run (see ``persist_lib.handles.maintenance.gc``)."""
        from persist_lib.handles import maintenance

        return maintenance.gc(self, shard)

    def unreferenced_blobs(
        self,
        shard: ShardLike,
        older_than_ms: int | None = None,
        *,
        delete: bool = False,
        quiescent: bool = False,
    ) -> list[dict[str, Any]]:
        """Leaked blobs of ``shard`` (see ``maintenance.unreferenced_blobs``)."""
        from persist_lib.handles import maintenance

        return maintenance.unreferenced_blobs(
            self, shard, older_than_ms, delete=delete, quiescent=quiescent
        )

    def finalize(self, shard: ShardLike) -> dict[str, Any]:
        """Deletes a shard whose since and upper are empty, leaving a tombstone."""
        from persist_lib.handles import maintenance

        return maintenance.finalize(self, shard)

    def background_compactor(self) -> Any:
        """This client's in-process compaction pool (created on first use)."""
        from persist_lib.handles.maintenance import BackgroundCompactor

        with _BG_LOCK:
            bg = self.__dict__.get("_bg_compactor")
            if bg is None:
                bg = self.__dict__["_bg_compactor"] = BackgroundCompactor(self)
            return bg


_BG_LOCK = threading.Lock()  # creates a client's background compactor once
#: How long ``close`` waits for a heartbeat in flight.
HEARTBEAT_JOIN_S = 5.0


def _is_shard_id(k: str) -> bool:
    try:
        ShardId.parse(k)
        return True
    except InvalidUsage:
        return False
