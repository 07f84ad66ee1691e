"""The ingestion driver: the source ingestion recipe (docs/design.md section 11, seed 001).

On start (and whenever it has to re-synchronize):

1. ``t`` = the minimum upper over every output and state shard;
2. the state (upsert: current value per key) is rehydrated as of ``t - 1``;
3. the source is reopened at the frontier the remap shard bound at ``t - 1``;
4. from ``t`` on, every binding read back from the remap shard is applied in time
   order: the messages with addresses in ``[F(b-1), F(b))`` are decoded, passed through
   the envelope, and the resulting output/state/error/raw updates are appended at time
   ``b`` with *verified definite appends* (a range another instance already committed is
   compared, and a difference raises ``NeedsNewRendition``); every output of a flush
   (data, errors, raw, state) is appended as ONE transaction of the location's txn log
   (``atomic_append.py``), so no reader sees a binding's data without its errors;
5. when the remap has no more bindings, the driver reads ahead (at most
   ``max_records_per_binding`` records: the binding's extent depends only on the
   source's contents, not on timing) and proposes the next binding at
   ``max(clock(), remap upper)`` with ``compare_and_append``. Win or lose, it then uses
   the binding it reads back: a loser drops what it read ahead and replays the winner's.

Two instances, or a restarted one, therefore write identical updates; the clock is
injected (``clock``) so tests can make two runs mint identical bindings.

``run_once`` ingests what is available and returns a summary dict (what a Dagster run
calls); ``run`` keeps ingesting (``stop`` event / ``max_duration_s``), advancing the
upper with the clock even when no data arrives.
"""

from __future__ import annotations

import functools
import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from persist_lib.config import system_clock_ms
from persist_lib.ingest.addresses import Frontier, Note, frontier_text
from persist_lib.ingest.atomic_append import append_atomically
from persist_lib.ingest.decode import (
    RAW_KEY,
    RAW_VAL,
    DecodeSpec,
    ErrorRecord,
    errors_table,
)
from persist_lib.ingest.envelope import Envelope, make_envelope
from persist_lib.ingest.errors import (
    IngestConfigError,
    IngestInvariantError,
    SourceDataGone,
    SourceUnavailable,
)
from persist_lib.ingest.ingest_config import IngestConfig, ingest_config_of
from persist_lib.ingest.outputs import Output, OutputFactory, ShardOutputs, shard_id_for, txns_of
from persist_lib.ingest.progress import IngestProgress, ProgressCallback
from persist_lib.ingest.remap import Binding, RemapShard
from persist_lib.ingest.source import Chunk, Source, SourceReader
from persist_lib.txn.txns import Txns

if TYPE_CHECKING:  # pragma: no cover
    from persist_lib.handles.client import PersistClient

log = logging.getLogger(__name__)

_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_.\-]{0,95}")

Clock = Callable[[], int]
Transform = Callable[[pa.Table], pa.Table]


@dataclass
class _Stats:
    records: int = 0
    bytes: int = 0
    errors: int = 0
    updates: int = 0
    bindings_minted: int = 0
    bindings_adopted: int = 0
    bindings_applied: int = 0
    time_advances: int = 0
    lost_races: int = 0
    resyncs: int = 0
    late_files: list[str] = field(default_factory=list)


class _Acc:
    """Updates accumulated per output role until the next append."""

    def __init__(self) -> None:
        self.tables: dict[str, list[pa.Table]] = {}
        self.records = 0

    def add(self, role: str, t: pa.Table | None) -> None:
        if t is not None and t.num_rows:
            self.tables.setdefault(role, []).append(t)
            self.records += t.num_rows

    def take(self, role: str, empty: pa.Table) -> pa.Table:
        ts = self.tables.pop(role, [])
        if not ts:
            return empty
        return pa.concat_tables([t.cast(empty.schema) if not t.schema.equals(empty.schema) else t for t in ts])


def _empty_user(key: pa.Schema, val: pa.Schema) -> pa.Table:
    return pa.schema(list(key) + list(val) + [pa.field("ts", pa.int64()), pa.field("diff", pa.int64())]).empty_table()


class Ingestion:
    """An ingestion pipeline: source -> decode -> envelope -> definite outputs.

    ``name`` identifies the ingestion: every instance with the same name (and the same
    persist location) shares the remap shard and the outputs. ``outputs`` defaults to
    plain persist shards named after ``name``; pass ``StorageOutputs`` to write STORAGE
    collections.
    """

    def __init__(
        self,
        client: PersistClient,
        name: str,
        source: Source,
        key_schema: pa.Schema,
        val_schema: pa.Schema,
        *,
        envelope: str | Envelope = "append_only",
        delete_field: str | None = None,
        outputs: OutputFactory | None = None,
        config: IngestConfig | None = None,
        clock: Clock | None = None,
        progress: ProgressCallback | None = None,
        transform: Transform | None = None,
    ) -> None:
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise IngestConfigError(
                f"ingestion name {name!r} is not valid: use 1-96 characters, a letter first, then "
                "letters, digits, '_', '-' or '.'"
            )
        self.client = client
        self.name = name
        self.source = source
        self.config = ingest_config_of(config)
        self.spec = DecodeSpec(key_schema, val_schema, delete_field=delete_field, keep_raw=self.config.keep_raw)
        self.envelope = envelope if isinstance(envelope, Envelope) else make_envelope(envelope, self.spec)
        self.outputs_factory = outputs or ShardOutputs(client, name)
        self.clock: Clock = clock or system_clock_ms
        self.progress = progress
        self.transform = transform
        self._outs: dict[str, Output] = {}
        self._txns: Txns | None = None  # the outputs' transactions (opened with them)
        self._own_txns = False
        self._remap: RemapShard | None = None
        self._reader: SourceReader | None = None
        self._pending: list[Chunk] = []
        self._t = 0
        self._resumed_at: int | None = None
        self._stats = _Stats()
        self._started = 0.0
        self._empties: dict[str, pa.Table] = {}
        self._last_heartbeat = time.monotonic()
        self._since_done: int | None = None  # the since this instance last downgraded the shards to
        # (time, frontier) of every binding this instance applied, in order: the bindings
        # it read back from the remap shard (tests compare instances with it).
        self.applied: list[tuple[int, Frontier]] = []

    # ----- set-up -----------------------------------------------------------------------

    def roles(self) -> list[str]:
        r = ["data", "errors"]
        if self.config.keep_raw:
            r.append("raw")
        if self.envelope.needs_state:
            r.append("state")
        return r

    def _schemas_for(self, role: str) -> tuple[pa.Schema, pa.Schema]:
        from persist_lib.ingest.decode import ERRORS_KEY, ERRORS_VAL

        if role in ("data", "state"):
            return self.spec.key_schema, self.spec.val_schema
        if role == "errors":
            return ERRORS_KEY, ERRORS_VAL
        if role == "raw":
            return RAW_KEY, RAW_VAL
        raise IngestConfigError(f"unknown output role {role!r}")

    def _open(self) -> None:
        if self._remap is not None:
            return
        attach = getattr(self.source, "attach", None)
        if callable(attach):
            attach(self.client, self.name, self.spec)
        bind_envelope = getattr(self.source, "bind_envelope", None)
        if callable(bind_envelope):  # a source whose decoding depends on it (Kafka tombstones)
            bind_envelope(self.envelope.kind)
        self.source.check()
        self.source.prepare()
        for role in self.roles():
            k, v = self._schemas_for(role)
            out = self.outputs_factory.open(role, k, v)
            if self.config.unsorted_min_bytes is not None and hasattr(out, "unsorted_min_bytes"):
                out.unsorted_min_bytes = self.config.unsorted_min_bytes
            self._outs[role] = out
            self._empties[role] = _empty_user(k, v)
        txns = txns_of(self.outputs_factory)
        if txns is None:
            txns, self._own_txns = Txns(self.client), True
        self._txns = txns
        txns.register(self._output_shards())
        self._remap = RemapShard(
            self.client, shard_id_for(self.name, "remap"), self.source.initial_frontier(),
            label=f"{self.name}/remap",
        )
        self._resync()

    def close(self) -> None:
        """Releases the handles (leases) of this instance."""
        if self._reader is not None:
            self._reader.close()
            self._reader = None
        for o in self._outs.values():
            o.close()
        self._outs.clear()
        if self._txns is not None and self._own_txns:
            self._txns.close()
        self._txns = None
        if self._remap is not None:
            self._remap.close()
            self._remap = None
        self.source.close()

    def __enter__(self) -> Ingestion:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def remap(self) -> RemapShard:
        if self._remap is None:
            raise IngestInvariantError("the ingestion is not open")
        return self._remap

    @property
    def reader(self) -> SourceReader:
        if self._reader is None:
            raise IngestInvariantError("the ingestion is not open")
        return self._reader

    def _resync(self) -> None:
        """Steps 1-3 of the recipe: t = min upper; rehydrate at t-1; reopen the source."""
        uppers = self._uppers()
        for role, o in self._data_last():
            # A predecessor killed after its commit CAS left the collections' metadata
            # uppers behind their shards: catch them up (a no-op for plain shards).
            o.committed(uppers[role])
        t = min(uppers.values())
        remap = self.remap
        remap.load(t - 1 if t > 0 else None)
        if t > remap.upper:
            raise IngestInvariantError(
                f"ingestion {self.name}: outputs are complete up to {t} but the remap shard only up "
                f"to {remap.upper} (uppers: {uppers}); outputs are only written for bound times, so "
                "something else wrote them"
            )
        base = max(t - 1, 0)
        frontier = remap.frontier_at(base)
        notes = remap.notes_upto(base)
        state = None
        if self.envelope.needs_state and t > 0:
            state = self._outs["state"].snapshot(t - 1)
        self.envelope.rehydrate(state)
        if self._reader is not None:
            self._reader.close()
        self._reader = self.source.open_reader(frontier, notes)
        self._pending = []
        self._t = t
        if self._resumed_at is None:
            self._resumed_at = t  # (run_once/run reset it per run; subclasses may not)
        log.info("ingestion %s resumes at %d from %s", self.name, t, frontier_text(frontier))

    def _uppers(self) -> dict[str, int]:
        """Each output's upper, with every committed transaction applied first."""
        if self._txns is not None:
            self._txns.ensure_applied(self._output_shards())
        return {role: o.upper() for role, o in self._outs.items()}

    def _data_last(self) -> list[tuple[str, Output]]:
        """The outputs with data last: their metadata uppers (what bounds a collection
        reader) advance errors, raw and state first, so a reader that sees a binding's
        data finds its errors."""
        return sorted(self._outs.items(), key=lambda kv: kv[0] == "data")

    def _output_shards(self) -> list[str]:
        return [t.shard_id for o in self._outs.values() for t in o.shard_outputs()]

    def _reopen_reader(self) -> None:
        base = max(self._t - 1, 0)
        if self._reader is not None:
            self._reader.close()
        self._reader = self.source.open_reader(self.remap.frontier_at(base), self.remap.notes_upto(base))
        self._pending = []

    # ----- applying bindings (step 4) ---------------------------------------------------

    def _catch_up(self) -> None:
        remap = self.remap
        acc = _Acc()
        for b in remap.bindings_between(self._t, remap.upper):
            self.reader.add_notes(b.notes)
            chunks = self._take_upto(b.frontier)
            self._apply(b, chunks, acc)
            if acc.records >= self.config.max_append_records:
                self._flush(acc, b.time + 1)
        self._flush(acc, remap.upper)

    def _take_upto(self, target: Frontier) -> list[Chunk]:
        """The messages before ``target``: pending chunks first, then the reader."""
        out: list[Chunk] = []
        keep: list[Chunk] = []
        for c in self._pending:
            bound = target.get(c.partition)
            if bound is None:
                keep.append(c)
                continue
            if tuple(c.end) <= tuple(bound):
                out.append(c)
            elif tuple(c.start) < tuple(bound):
                head, tail = c.split(tuple(bound))
                if head is not None:
                    out.append(head)
                if tail is not None:
                    keep.append(tail)
            else:
                keep.append(c)
        self._pending = keep
        reader = self.reader
        deadline = time.monotonic() + self.config.replay_timeout_s
        delay = 0.05
        for p, bound in target.items():
            if any(c.partition == p for c in keep):
                continue  # the reader is already past the bound for p
            while tuple(reader.position.get(p, ())) < tuple(bound):
                before = reader.position.get(p)
                got = reader.read({p: bound}, self.config.read_chunk_records)
                out.extend(got)
                if got or reader.position.get(p) != before:
                    delay = 0.05
                    continue
                if time.monotonic() > deadline:
                    raise SourceUnavailable(
                        f"ingestion {self.name}: the source does not serve partition {p!r} up to "
                        f"{list(bound)} (bound in the remap shard), stuck at {list(before or ())} after "
                        f"{self.config.replay_timeout_s}s"
                    )
                time.sleep(delay)
                delay = min(delay * 2, 1.0)
        return out

    def _apply(self, b: Binding, chunks: list[Chunk], acc: _Acc) -> None:
        spec = self.spec
        # Partition order, then address order: how an instance happened to read the
        # partitions of a multi-partition source (Kafka) must not change the result.
        chunks = sorted(chunks, key=lambda c: (c.partition, tuple(c.start)))
        decs = [c.decode(spec) for c in chunks]
        tables = [d.rows for d in decs if d.num_rows]
        rows = pa.concat_tables(tables) if tables else spec.rows_schema().empty_table()
        if self.transform is not None:
            rows = self._transform(rows)
        out_ups, state_ups = self.envelope.apply(rows, b.time)
        errors: list[ErrorRecord] = [e for d in decs for e in d.errors]
        for n in b.notes:
            err = n.get("error")
            if isinstance(err, dict):
                errors.append(
                    ErrorRecord(str(err["partition"]), tuple(err["address"]), str(err["kind"]), str(err["reason"]))
                )
                if n.get("kind") == "late_file":
                    self._stats.late_files.append(str(n.get("file")))
        acc.add("data", out_ups)
        acc.add("state", state_ups if "state" in self._outs else None)
        if errors:
            acc.add("errors", errors_table(errors, b.time))
        if "raw" in self._outs:
            raws = [d.raw for d in decs if d.raw is not None and d.raw.num_rows]
            if raws:
                raw = pa.concat_tables(raws)
                n = raw.num_rows
                raw = raw.append_column("ts", pa.array(np.full(n, b.time, dtype=np.int64)))
                raw = raw.append_column("diff", pa.array(np.ones(n, dtype=np.int64)))
                acc.add("raw", raw)
        st = self._stats
        st.records += sum(c.num_records - c.num_blank for c in chunks)  # blank lines: no record
        st.bytes += sum(c.nbytes for c in chunks)
        st.errors += len(errors)
        st.updates += out_ups.num_rows
        st.bindings_applied += 1
        self.applied.append((b.time, dict(b.frontier)))

    def _transform(self, rows: pa.Table) -> pa.Table:
        assert self.transform is not None
        out = self.transform(rows)
        if not isinstance(out, pa.Table) or not out.schema.equals(rows.schema):
            raise IngestConfigError(
                f"ingestion {self.name}: the transform must return a table with the same schema "
                f"({rows.schema.names}), got {getattr(out, 'schema', type(out).__name__)}"
            )
        return out

    def _flush(self, acc: _Acc, upper: int) -> None:
        if upper <= self._t:
            return
        lower = self._t
        tables = {role: acc.take(role, self._empties[role]) for role in self._outs}
        if self._txns is None:
            raise IngestInvariantError("the ingestion is not open")
        pieces = [p for role, o in self._outs.items() for p in o.shard_pieces(tables[role])]
        append_atomically(self._txns, list(pieces), lower, upper)  # one transaction
        for _, o in self._data_last():
            o.committed(upper)
        acc.records = 0
        self._t = upper
        remap = self.remap
        remap.forget_before(self._t)
        durable = remap.frontier_at(self._t - 1)
        try:
            self.source.release(durable)
        except SourceUnavailable as e:
            log.warning("ingestion %s: releasing the source up to %s failed: %s", self.name, frontier_text(durable), e)
        w = self.config.since_window_ms
        if w is not None:
            since = self._t - 1 - w
            # In steps of 1/64 of the window, not at every flush: each downgrade is a
            # consensus write per shard, and a since that lags by a step only keeps a little
            # more history readable.
            if since > 0 and (self._since_done is None or since >= self._since_done + max(1, w // 64)):
                for o in self._outs.values():
                    o.downgrade_since(since)
                remap.downgrade_since(since)
                self._since_done = since
        self._heartbeat()
        self._report(done=False)

    def _heartbeat(self, every_s: float = 60.0) -> None:
        """Keeps the leases alive on clients without background heartbeats
        (``PersistConfig(background_heartbeats=False)``; the CLI heartbeats in the background)."""
        if self.client.config.background_heartbeats:
            return
        now = time.monotonic()
        if now - self._last_heartbeat < every_s:
            return
        self._last_heartbeat = now
        for o in self._outs.values():
            o.heartbeat()
        self.remap.heartbeat()

    # ----- minting (step 5) -------------------------------------------------------------

    def _now_tick(self) -> int:
        now = int(self.clock())
        i = self.config.timestamp_interval_ms
        return now - now % i

    def _mint(self, *, advance_time: bool) -> str:
        """Reads ahead and proposes the next binding: 'data', 'advance', 'lost' or 'idle'."""
        remap = self.remap
        reader = self.reader
        cur = remap.frontier
        limit = self.config.max_records_per_binding
        chunks = list(self._pending)
        have = sum(c.num_records for c in chunks)
        while have < limit:
            got = reader.read(None, limit - have)
            if not got:
                break
            chunks.extend(got)
            have += sum(c.num_records for c in got)
        take: list[Chunk] = []
        rest: list[Chunk] = []
        left = limit
        for c in chunks:
            if rest or left <= 0:
                rest.append(c)  # after exactly `limit` records: the next binding's
                continue
            if c.num_records > left:
                head, tail = c.take(left)
                take.append(head)
                left = 0
                if tail is not None:
                    rest.append(tail)
            else:
                take.append(c)
                left -= c.num_records
        new = dict(cur)
        for c in take:
            if tuple(c.end) > tuple(new.get(c.partition, ())):
                new[c.partition] = tuple(c.end)
        notes: list[Note] = [n for c in take for n in c.notes]
        observe = getattr(reader, "observe", None)
        if callable(observe):
            notes.extend(observe())
        tick = self._now_tick()
        # New data or notes need a binding now; a frontier that moved past nothing (a CDC
        # source's WAL position when no transaction touched the table) rides along with
        # the next time advance instead, or an idle source would mint forever.
        has_new = bool(notes) or any(c.num_records for c in take)
        if not has_new:
            self._pending = chunks
            if advance_time and tick >= max(remap.upper, 1):
                ok = remap.mint(tick, new, [])
                remap.sync()
                if ok:
                    self._stats.time_advances += 1
                    return "advance"
                self._stats.lost_races += 1
                self._reopen_reader()
                return "lost"
            return "idle"
        t_new = max(tick, remap.upper, 1)
        ok = remap.mint(t_new, new, notes)
        before = remap.upper
        new_bindings = remap.sync()
        if ok:
            self._pending = take + rest
            self._stats.bindings_minted += 1
            self._stats.bindings_adopted += sum(1 for b in new_bindings if b.time != t_new)
            return "data"
        self._stats.lost_races += 1
        self._stats.bindings_adopted += len(new_bindings)
        log.info("ingestion %s: lost the race to mint at %d (remap upper %d -> %d); adopting", self.name, t_new, before, remap.upper)
        self._reopen_reader()
        return "lost"

    # ----- running --------------------------------------------------------------------

    def _guarded(self, step: Callable[[], Any]) -> Any:
        """Runs a step; on SourceDataGone, resyncs if another instance made it moot."""
        try:
            return step()
        except SourceDataGone:
            uppers = list(self._uppers().values())
            if min(uppers) > self._t:
                self._stats.resyncs += 1
                self._resync()
                return None
            raise

    def _begin(self) -> None:
        """Per-run bookkeeping: the summary describes this run only."""
        self._started = time.monotonic()
        self._stats = _Stats()
        self.applied = []
        self._open()
        self._resumed_at = self._t
        begin_run = getattr(self._reader, "begin_run", None)
        if callable(begin_run):  # (a reader may keep observations of the source's end)
            begin_run()

    def run_once(self, *, max_records: int | None = None) -> dict[str, Any]:
        """Ingests what the source has now, then returns the summary dict.

        Also advances the upper to the clock once (when it is ahead), so the outputs
        show they are complete up to "now". ``max_records`` stops early (the next run
        continues where this one stopped).
        """
        self._begin()
        advanced = False
        while True:
            self._guarded(self._catch_up)
            if max_records is not None and self._stats.records >= max_records:
                break
            r = self._guarded(functools.partial(self._mint, advance_time=not advanced))
            if r == "advance":
                advanced = True
            elif r == "idle":
                break
        self._guarded(self._catch_up)
        self._report(done=True)
        return self.summary(mode="once")

    def run(
        self,
        *,
        stop: threading.Event | None = None,
        max_duration_s: float | None = None,
    ) -> dict[str, Any]:
        """Keeps ingesting until ``stop`` is set or ``max_duration_s`` passes; returns the summary."""
        self._begin()
        deadline = None if max_duration_s is None else time.monotonic() + max_duration_s
        stop = stop or threading.Event()
        while not stop.is_set() and (deadline is None or time.monotonic() < deadline):
            self._guarded(self._catch_up)
            r = self._guarded(lambda: self._mint(advance_time=True))
            if r in ("idle", "advance", None):
                wait = self.config.poll_interval_s
                if deadline is not None:
                    wait = max(0.0, min(wait, deadline - time.monotonic()))
                # wakes early when another instance mints
                self.remap.sync(timeout_s=wait)
                self._heartbeat()
        self._guarded(self._catch_up)
        self._report(done=True)
        return self.summary(mode="continuous")

    # ----- reporting --------------------------------------------------------------------

    def _progress(self, done: bool) -> IngestProgress:
        st = self._stats
        lag_bytes = None
        if self._reader is not None:
            try:
                lag_bytes = self._reader.lag().bytes_behind
            except SourceUnavailable:
                lag_bytes = None
        frontier = self.remap.frontier_at(max(self._t - 1, 0)) if self._remap is not None else {}
        now = int(self.clock())
        return IngestProgress(
            name=self.name,
            records=st.records,
            bytes=st.bytes,
            errors=st.errors,
            bindings=st.bindings_applied,
            upper=self._t,
            frontier={p: list(a) for p, a in frontier.items()},
            lag_bytes=lag_bytes,
            lag_ms=max(0, now - (self._t - 1)) if self._t > 0 else None,
            total_bytes=(st.bytes + lag_bytes) if lag_bytes is not None else None,
            elapsed_s=time.monotonic() - self._started if self._started else 0.0,
            done=done,
        )

    def _report(self, done: bool) -> None:
        if self.progress is None:
            return
        try:
            self.progress(self._progress(done))
        except Exception as e:  # noqa: BLE001 - a broken display never stops ingestion
            log.warning("progress callback failed: %s", e)

    def summary(self, mode: str) -> dict[str, Any]:
        """The run summary (see docs/ingestion.md for every key)."""
        p = self._progress(done=True)
        st = self._stats
        outs = {role: o.describe() for role, o in self._outs.items()}
        written = sum(o.stats.written for o in self._outs.values())
        verified = sum(o.stats.verified for o in self._outs.values())
        return {
            "name": self.name,
            "mode": mode,
            "source": self.source.describe(),
            "envelope": self.envelope.kind,
            "resumed_at": self._resumed_at,
            "upper": self._t,
            "remap_upper": self.remap.upper if self._remap is not None else None,
            "frontier": p.frontier,
            "records": st.records,
            "bytes": st.bytes,
            "updates": st.updates,
            "errors": st.errors,
            "late_files": list(st.late_files),
            "bindings_minted": st.bindings_minted,
            "bindings_adopted": st.bindings_adopted,
            "bindings_applied": st.bindings_applied,
            "time_advances": st.time_advances,
            "lost_races": st.lost_races,
            "resyncs": st.resyncs,
            "appends_written": written,
            "appends_verified": verified,
            "lag_bytes": p.lag_bytes,
            "lag_ms": p.lag_ms,
            "duration_s": round(p.elapsed_s, 3),
            "records_per_s": round(p.records_per_s, 1),
            "mb_per_s": round(p.mb_per_s, 3),
            "outputs": outs,
            "remap_shard": self.remap.shard_id if self._remap is not None else None,
        }


def run_once(
    client: PersistClient,
    name: str,
    source: Source,
    key_schema: pa.Schema,
    val_schema: pa.Schema,
    **kwargs: Any,
) -> dict[str, Any]:
    """Convenience: one ``Ingestion(...).run_once()`` with its handles released afterwards."""
    max_records = kwargs.pop("max_records", None)
    with Ingestion(client, name, source, key_schema, val_schema, **kwargs) as ing:
        return ing.run_once(max_records=max_records)
