"""Client configuration, with the clock and the RNG injected (docs/design.md section 15)."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from persist_lib.config_rules import FIELD_RULES, CheckedConfig, problems
from persist_lib.errors import ConfigProblem

MiB = 1 << 20


def system_clock_ms() -> int:
    return int(time.time() * 1000)


@dataclass
class PersistConfig(CheckedConfig):
    """Tunables of a ``PersistClient``. Defaults follow docs/design.md and Materialize's persist.

    Every value is checked against its rule (``persist_lib.config_rules``: type, range,
    the rules between fields, ``$PERSIST_METRICS_PORT``) when the config is built, and
    again whenever a field is assigned afterwards (``cfg.x = ...``, ``setattr``): a bad
    value raises ``InvalidConfig`` (an ``InvalidUsage`` and a ``ValueError``) naming every
    bad setting, and the config keeps its old value. Checking on assignment, not only
    when a client is opened, is deliberate: tests, benchmarks and the reliability harness
    change fields after building a config, some after the client holds it; reads of a
    field (the hot paths) are plain attribute reads and cost nothing extra. To change
    fields that depend on each other (the heartbeat tick and the leases), use
    ``update(**changes)``, which checks the changes together. An unknown field name is
    an ``InvalidConfig`` too, not a silently ignored attribute.
    """

    # Writes.
    blob_target_size: int = 128 * MiB  # a part is flushed when its Arrow buffer reaches this
    max_inflight_uploads: int = 2
    # Parts of at most this many encoded bytes live inline in shard state instead of
    # in blob, wherever they are written (compaction output, batch builders, Spark);
    # 0 turns inlining off everywhere, appends included.
    inline_threshold: int = 4096
    # The same for the parts of a write handle's appends (``compare_and_append``,
    # ``append``, ``builder``), when ``inline_threshold`` > 0: a small commit is then one
    # consensus write, with no blob write, no fsync of a part and its directory, no S3
    # PUT, and equally durable. 16 KiB holds a 1,000-row part of narrow rows. Merges
    # write their output to blob above ``inline_threshold``, so inline appends leave
    # the state as soon as compaction merges them.
    inline_append_threshold: int = 16 * 1024
    # Bound on the inline bytes of a shard (what rollups and cold opens carry): an
    # append whose part would pass it writes the part to blob instead.
    inline_max_total: int = 1 * MiB
    # Parts of at least this many Arrow bytes are written unsorted (the compactor sorts
    # them); None: every part is sorted on write (batch_builder.py).
    unsorted_min_bytes: int | None = 8 * MiB
    # A write handle's chunk (one ``compare_and_append`` table, one builder ``add``) of at
    # least this many Arrow bytes is cut at sampled leading-key quantiles into sorted
    # parts of disjoint key ranges, each sorted on its own upload thread, so that a
    # snapshot reads them as one sorted run (batch_builder.py); None: such a chunk is cut
    # in row order (and its parts left unsorted past ``unsorted_min_bytes``).
    key_range_min_bytes: int | None = 4 * MiB
    # State.
    rollup_interval: int = 128  # write a rollup every ~this many seqnos
    rollup_in_background: bool = True  # off the committing writer's path (tests: inline)
    # Leases.
    reader_lease_ms: int = 15 * 60 * 1000
    writer_lease_ms: int = 60 * 60 * 1000
    background_heartbeats: bool = True
    heartbeat_tick_s: float = 1.0  # how often the heartbeat thread looks for due handles
    # Location retries.
    retry_deadline_s: float = 60.0
    # ``Machine.apply`` lets the threads of a process take turns on a shard (a lock held
    # from reading the state through the compare-and-set). A thread that waited this long
    # for its turn goes on without it (the CAS still arbitrates), so a CAS stuck on a dead
    # connection never holds up the shard's other changes and heartbeats for longer. The
    # stuck call itself is bounded by the consensus (Postgres: ``persist_op_timeout_s``).
    apply_lock_wait_s: float = 5.0
    # Reads.
    snapshot_timeout_s: float = 60.0
    fetch_parallelism: int = 4
    listen_poll_max_s: float = 1.0
    # Streaming reads (snapshot_batches, updates_between_batches, large listens) and the
    # in-memory snapshot's choice between decoding whole and streaming: their budget.
    read_memory_budget: int = 256 * MiB
    # Compaction (in-process, background). Filled in by the maintenance layer.
    compaction_enabled: bool = False
    # Per merge. Materialize's bound (1 GiB, at least 4x the part target size): a merge
    # whose inputs fit decoded runs in memory with one multi-threaded sort of all rows;
    # larger ones stream (in_memory_merge.py, kway_merge.py).
    compaction_memory_budget: int = 1024 * MiB
    # False: every merge streams, even one that fits in memory (the reliability harness
    # runs both ways).
    compaction_in_memory: bool = True
    # Retained history (times between the since and the upper) in a merge's output is
    # kept in up to this many time layers, one sorted run each, so that a read as of an
    # old time skips the later layers' parts (``shard.time_layers``); 1 = one run.
    # Layers of fewer than ``compaction_layer_min_rows`` updates are not split off.
    # No layers when the first would hold more than ``compaction_layer_max_first_share``
    # of the merge's updates: every read at the latest time merges the layers' runs.
    compaction_time_layers: int = 6
    compaction_layer_min_rows: int = 4096
    compaction_layer_max_first_share: float = 0.25
    # (k, v)-whole layers: each (k, v) goes whole into the layer of its oldest retained
    # update, the batch is marked (k, v)-disjoint and reads concatenate its layers
    # instead of merging them; max_first_share then does not apply. False: each update
    # in the layer of its own time (reads merge the layers).
    compaction_layer_kv_whole: bool = True
    # Background merge threads per client. One: merges then queue behind each other and
    # the spine plans N-way merges over what accumulated, instead of two threads
    # re-merging the tail concurrently; measured on 1,000-row appends (2 cores): ~35%
    # less CPU per commit, and the writer competes with one merge, not two
    # (docs/benchmarks.md, issue 14 session 8).
    compaction_workers: int = 1
    compaction_queue_max: int = 20  # queued merges per client; excess dropped (re-derived later)
    gc_in_background: bool = True  # with compaction_enabled: GC once garbage is deletable
    # A failed background merge (or GC) is retried after this, doubling up to the max;
    # a merge failing deterministically this many times is quarantined (maintenance.py).
    compaction_retry_backoff_s: float = 1.0
    compaction_retry_backoff_max_s: float = 300.0
    compaction_quarantine_after: int = 2
    # Leaked-blob sweeper: an extra guard on top of the registered-writer rule
    # (``persist_lib.shard.part_writers``): blobs younger than this are never reported.
    leak_grace_ms: int = 60 * 60 * 1000
    # Shard machines a client keeps (least recently used dropped first).
    max_cached_shards: int = 256
    # Metrics (persist_lib.shard.metrics): per-shard counters of commits, blob requests and
    # their S3 cost; off = no counting at all. ``metrics_port`` (else
    # $PERSIST_METRICS_PORT) serves them to Prometheus from this process.
    metrics: bool = True
    metrics_port: int | None = None
    # Injected clock (ms since the epoch) and RNG, so tests are deterministic.
    now_ms: Callable[[], int] = field(default=system_clock_ms)
    rng: random.Random = field(default_factory=random.Random)

    RULES = FIELD_RULES  # (the cross rules and the environment: ``_problems``)

    def _problems(self, values: Mapping[str, Any], changed: Iterable[str] | None) -> list[ConfigProblem]:
        return problems(values, self.defaults(), changed)

    @classmethod
    def for_tests(cls, **overrides: Any) -> PersistConfig:
        """Small parts and no background threads: what most tests want (``overrides``
        checked together with them)."""
        cls.unknown_fields(overrides)
        base: dict[str, Any] = {
            "blob_target_size": 1 * MiB,
            "background_heartbeats": False,
            "rollup_in_background": False,
            "retry_deadline_s": 10.0,
            "snapshot_timeout_s": 10.0,
        }
        return cls(**{**base, **overrides})


