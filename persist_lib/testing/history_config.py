"""The configuration of a reliability history and the data its writers write.

``HistoryConfig`` is everything one history needs (JSON-serializable: the runner passes
it to every actor process); the deterministic *definite* stream (``definite_records``)
is what every definite appender writes at a time, so the checker can recompute it.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

KEY_SCHEMA = pa.schema([("k", pa.string())])
VAL_SCHEMA = pa.schema([("v", pa.int64())])

Update = tuple[tuple[tuple[str], tuple[int]], int, int]


# The config of merges that keep retained history in time layers however small and
# uneven (``shard.time_layers``): the soak and the stateful model use it in half their runs.
TINY_TIME_LAYERS: dict[str, Any] = {"compaction_layer_min_rows": 1, "compaction_layer_max_first_share": 1.0}


@dataclass
class HistoryConfig:
    """Everything one history needs; JSON-serializable (it is passed to every actor)."""

    seed: int
    root: str
    consensus_uri: str
    shard_id: str
    target_ops: int = 300
    writers: int = 3
    readers: int = 2
    compactor: bool = True
    gc: bool = True
    expirer: bool = True
    unreliability: float = 0.05
    stall_rate: float = 0.01
    stall_s: float = 0.02
    outage_mean_interval_s: float = 5.0  # per actor: total outages start at random times
    outage_s: tuple[float, float] = (0.3, 1.5)
    partition_after_timeout: float = 0.2  # chance an injected timeout starts an outage
    crash_mean_interval_s: float = 1.5
    max_crashes: int = 6
    retry_deadline_s: float = 1.0
    reader_lease_ms: int = 2500
    writer_lease_ms: int = 4000
    inline_threshold: int = 4096
    inline_max_total: int = 1 << 20
    rollup_interval: int = 16
    background_compaction: bool = False
    time_limit_s: float = 120.0
    planted: list[str] = field(default_factory=list)
    # Issue 13's wider fault model (``actors`` module docstring).
    interrupt_rate: float = 0.0
    actor_clock_skew_ms: int = 0
    expirer_clock_ahead_ms: int = 0
    sweeper_clock_ahead_ms: int = 0
    sweep_rate: float = 0.0
    long_write_rate: float = 0.0
    long_write_pause_s: tuple[float, float] = (0.05, 0.5)
    heartbeat_fault_rate: float = 0.0
    fresh_start: bool = False
    # Parts of at least this many Arrow bytes are written unsorted (None: all sorted).
    unsorted_min_bytes: int | None = None
    # Merges that fit their budget run in memory (False: always the streaming merge).
    compaction_in_memory: bool = True
    # Merges keep retained history in time layers however small and uneven
    # (``shard.time_layers``: no minimum rows, no bound on the first layer's share).
    tiny_time_layers: bool = False
    # Writer steps that replay committed times with divergent updates through a
    # verified append (``actors`` module docstring).
    verified_append_rate: float = 0.0
    # Reader steps that downgrade the since forward and at once try a backward downgrade
    # (which must fail), on top of the reader's usual mix; the planted ``since_regress``
    # runs with it so one short history is enough to show the bug.
    since_probe_rate: float = 0.0

    @property
    def lease_slack_ms(self) -> float:
        """How early a lease may lapse in wall time: clocks ahead expire sooner, clocks
        behind record older heartbeats."""
        return 100.0 + self.expirer_clock_ahead_ms + self.actor_clock_skew_ms

    def __repr__(self) -> str:  # the consensus URI may hold a password
        from persist_lib.location.redaction import redacted_dataclass_repr

        return redacted_dataclass_repr(self)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, s: str) -> HistoryConfig:
        d = json.loads(s)
        d["outage_s"] = tuple(d["outage_s"])
        if "long_write_pause_s" in d:
            d["long_write_pause_s"] = tuple(d["long_write_pause_s"])
        return cls(**d)

    # Paths inside ``root``.
    @property
    def blob_dir(self) -> str:
        return os.path.join(self.root, "blob")

    @property
    def graveyard_dir(self) -> str:
        return os.path.join(self.root, "graveyard")

    @property
    def log_dir(self) -> str:
        return os.path.join(self.root, "logs")

    @property
    def archive_dir(self) -> str:
        return os.path.join(self.root, "archive")

    @property
    def stop_path(self) -> str:
        return os.path.join(self.root, "STOP")


def definite_records(seed: int, t: int) -> list[tuple[str, int]]:
    """The deterministic stream every definite appender writes at time ``t``."""
    rng = random.Random(f"definite/{seed}/{t}")
    return [(f"d/{t}/{j}", rng.randint(0, 999)) for j in range(rng.randint(0, 2))]


def definite_updates(seed: int, lo: int, hi: int) -> list[Update]:
    return [(((k,), (v,)), t, 1) for t in range(lo, hi) for k, v in definite_records(seed, t)]


def actor_seed(seed: int, actor: str, incarnation: int) -> int:
    return random.Random(f"{seed}/{actor}/{incarnation}").getrandbits(48)


def prepare_dirs(cfg: HistoryConfig) -> None:
    for d in (cfg.blob_dir, cfg.graveyard_dir, cfg.log_dir, cfg.archive_dir):
        Path(d).mkdir(parents=True, exist_ok=True)
