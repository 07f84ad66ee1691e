"""The client and location stack every actor of a history builds.

A ``PersistClient`` on the history's location through the audit wrappers
(``testing.audit``), under seeded fault injection (``UnreliableBlob`` /
``UnreliableConsensus`` with a ``PartitioningHandle``) and optional interrupts.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from persist_lib.testing.history import EventLog
from persist_lib.testing.history_config import TINY_TIME_LAYERS, HistoryConfig


@dataclass
class Location:
    """A client plus the wrappers a history needs to look at."""

    client: Any
    handle: Any  # UnreliableHandle (None when fault-free)
    audit_blob: Any
    audit_consensus: Any
    raw_consensus: Any


def build_location(
    cfg: HistoryConfig,
    log: EventLog | None,
    archive_name: str,
    *,
    faults: bool,
    seed: int,
    now_ms: Callable[[], int] | None = None,
    interrupts: Any = None,
) -> Location:
    """A ``PersistClient`` on the history's location: audit wrappers under fault injection."""
    from persist_lib.config import PersistConfig
    from persist_lib.handles.client import PersistClient
    from persist_lib.location.file_blob import FileBlob
    from persist_lib.location.unreliable import FaultRates, UnreliableBlob, UnreliableConsensus
    from persist_lib.testing import planted
    from persist_lib.testing.audit import AuditBlob, AuditConsensus
    from persist_lib.testing.faults import PartitioningHandle

    raw_cons = planted.open_consensus(cfg.consensus_uri, cfg.planted)
    audit_cons = AuditConsensus(raw_cons, os.path.join(cfg.archive_dir, archive_name), log)
    audit_blob = AuditBlob(FileBlob(cfg.blob_dir), FileBlob(cfg.graveyard_dir), raw_cons, log)
    config = PersistConfig.for_tests(
        retry_deadline_s=cfg.retry_deadline_s,
        snapshot_timeout_s=2.0,
        reader_lease_ms=cfg.reader_lease_ms,
        writer_lease_ms=cfg.writer_lease_ms,
        background_heartbeats=True,
        inline_threshold=cfg.inline_threshold,
        inline_max_total=cfg.inline_max_total,
        rollup_interval=cfg.rollup_interval,
        unsorted_min_bytes=cfg.unsorted_min_bytes,
        compaction_in_memory=cfg.compaction_in_memory,
        **(TINY_TIME_LAYERS if cfg.tiny_time_layers else {}),
        compaction_enabled=cfg.background_compaction,
        listen_poll_max_s=0.2,
        rng=random.Random(seed),
    )
    if now_ms is not None:
        config.now_ms = now_ms
    handle = None
    blob: Any = audit_blob
    cons: Any = audit_cons
    if faults:
        base = FaultRates.from_unreliability(cfg.unreliability)
        rates = FaultRates(
            determinate=base.determinate,
            applied_then_timeout=base.applied_then_timeout,
            timeout_only=base.timeout_only,
            stall=cfg.stall_rate,
        )
        handle = PartitioningHandle(
            seed,
            rates,
            stall_s=cfg.stall_s,
            partition_after_timeout=cfg.partition_after_timeout,
            partition_s=cfg.outage_s,
        )
        blob = UnreliableBlob(audit_blob, handle)
        cons = UnreliableConsensus(audit_cons, handle)
    if interrupts is not None:
        from persist_lib.testing.hooks import InterruptingBlob, InterruptingConsensus

        blob = InterruptingBlob(blob, interrupts)
        cons = InterruptingConsensus(cons, interrupts)
    client = PersistClient(
        blob, cons, config, blob_uri=f"file://{cfg.blob_dir}", consensus_uri=cfg.consensus_uri
    )
    return Location(client, handle, audit_blob, audit_cons, raw_cons)
