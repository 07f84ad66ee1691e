"""Registered part writers: what keeps the leaked-blob sweeper away from writes in flight.

Parts are uploaded *before* the compare-and-set that links them, so for a while every
part of a write in flight is referenced by no state at all, exactly like a leaked
one. A grace period on the blob's age cannot tell the two apart safely: a write or a
Spark job may run longer than any grace, and the sweeper judges age by its own clock
against the store's mtime/LastModified, which may be skewed. So the guard is made of
consensus state instead, with no clock involved:

* every part key is ``{shard}/{writer}/p{uuid}``, and ``writer`` is registered in the
  shard state (``state.writers``) *before* the part is uploaded: a write handle's own
  id, or a part writer registered here for a compactor or a Spark job;
* every transition that links parts (``compare_and_append``, ``apply_merge_res``)
  refuses parts whose writer is not registered in the state it runs against;
* the sweeper lists the blobs first, then reads the state, and never deletes a part
  whose writer is registered in that state.

If the sweeper deletes part P of writer W, W was not registered in a state read after
P was listed, hence after P was uploaded, hence after W registered: W had been
unregistered (its lease expired, or it was released), and an unregistered writer is
never registered again (ids are fresh UUIDs), so P can never be linked afterwards.
Rollups get the same guarantee from their seqno (``transitions.ROLLUP_LINK_WINDOW``).

A ``PartWriter`` registered with a ``ShardContext`` (a ``PersistClient``) heartbeats
through the context's heartbeat thread like any handle, so a long compaction or Spark
job keeps its registration; a crashed one lapses and its
parts become sweepable once lease expiry unregisters it.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from persist_lib.errors import ExternalError, LeaseExpired
from persist_lib.ids import WriterId
from persist_lib.shard import maintenance_transitions as mt
from persist_lib.shard import transitions as tr

if TYPE_CHECKING:  # pragma: no cover
    from persist_lib.shard.context import ShardContext
    from persist_lib.shard.machine import Machine

log = logging.getLogger(__name__)


class PartWriter:
    """A writer id registered on one shard for uploading parts that a later transition
    links (``apply_merge_res``, or a ``compare_and_append`` by a write handle)."""

    def __init__(
        self, machine: Machine, writer_id: str, lease_ms: int, purpose: str,
        context: ShardContext | None = None,
    ) -> None:
        self.machine = machine
        self.writer_id = writer_id
        self.lease_ms = lease_ms
        self.purpose = purpose
        self.released = False
        self.last_heartbeat_monotonic = time.monotonic()
        self._context = context

    @classmethod
    def register(
        cls,
        machine: Machine,
        *,
        purpose: str,
        context: ShardContext | None = None,
        writer_id: str | None = None,
        lease_ms: int | None = None,
    ) -> PartWriter:
        """Registers a fresh writer id on ``machine``'s shard (one state change); with a
        ``context`` (e.g. a ``PersistClient``), its heartbeat thread keeps the lease alive
        until ``release``."""
        wid = writer_id or str(WriterId.new())
        lease = lease_ms if lease_ms is not None else machine.config.writer_lease_ms
        machine.apply(
            "register_part_writer",
            lambda s, now: tr.register_part_writer(
                s, now, writer_id=wid, lease_ms=lease, purpose=purpose
            ),
        )
        pw = cls(machine, wid, lease, purpose, context)
        if context is not None:
            context.track_lease(pw)
        return pw

    @property
    def shard_id(self) -> str:
        return self.machine.shard_id

    def heartbeat(self) -> None:
        if self.released:
            raise LeaseExpired(f"shard {self.shard_id}: part writer {self.writer_id} was released")
        self.machine.apply(
            "heartbeat_writer",
            lambda s, now: tr.heartbeat_writer(s, now, writer_id=self.writer_id),
        )

    def release(self) -> None:
        """Unregisters the writer (best effort: lease expiry does it otherwise). Parts it
        wrote that nothing linked become sweepable."""
        if self.released:
            return
        self.mark_released()
        try:
            self.machine.apply(
                "release_part_writer",
                lambda s, now: mt.release_part_writer(s, now, writer_id=self.writer_id),
            )
        except ExternalError as e:
            log.warning(
                "shard %s: releasing part writer %s failed (its lease will lapse): %s",
                self.shard_id, self.writer_id, e,
            )

    def mark_released(self) -> None:
        """The registration was released by another transition (``apply_merge_res``)."""
        self.released = True
        if self._context is not None:
            self._context.forget_lease(self)

    def __repr__(self) -> str:
        return f"PartWriter(shard={self.shard_id}, writer={self.writer_id}, purpose={self.purpose!r})"
