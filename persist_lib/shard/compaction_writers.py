"""Long-lived part writers of a background compactor: one registration for many merges.

A merge that rewrites data uploads its output under a registered part writer
(``part_writers``), which alone keeps the leaked-blob sweeper away from output not yet
linked. Registering a fresh writer per merge costs a consensus write (a durable SQLite
or Postgres commit) per merge, on top of the merge's own ``apply_merge_res``; under a
burst of small appends those writes queue with the writer's commits. A background
compactor therefore keeps *one* registered writer per shard (and per writer kind: a
time-layered output needs a ``cml-`` id, a one-run output a ``cmp-`` id, ``runs``) and
uploads every merge's output under it; ``apply_merge_res`` links the output without
releasing the registration.

Why this is as safe as a writer per merge (the crash story):

* part keys stay unique (``{shard}/{writer}/p{uuid}``), and every merge's output is
  linked only by that merge's own ``apply_merge_res``, which still refuses parts whose
  writer is not registered in the state it runs against;
* the registration is heartbeated through the context's heartbeat thread like any
  handle's lease, and released by ``close``. If the process dies, the heartbeats stop,
  lease expiry unregisters the writer, and the parts of a merge that was in flight
  become sweepable exactly as those of a per-merge writer did;
* a merge that ends in any way other than "applied" (not applied, an error, an
  outcome unknown) *retires* the shared writer: it is released at once, as the
  per-merge writer was, so output it may have left behind becomes sweepable without
  waiting for ``close``, and the next merge registers a fresh id. A concurrent merge
  still using the retired id then gets ``NOT_APPLIED_WRITER_EXPIRED`` and deletes its
  output: wasted work, never a dangling reference.

What it costs: one entry in ``state.writers`` per shard and kind while the compactor
runs, and a heartbeat write per lease/4 for it.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

from persist_lib.errors import LeaseExpired, ShardTombstoned
from persist_lib.shard.part_writers import PartWriter
from persist_lib.shard.runs import is_layered_writer, new_compactor_writer_id

if TYPE_CHECKING:  # pragma: no cover
    from persist_lib.shard.context import ShardContext
    from persist_lib.shard.machine import Machine

log = logging.getLogger(__name__)


class SharedPartWriter(PartWriter):
    """A ``PartWriter`` that outlives one merge: when a heartbeat finds it unregistered
    (its lease was expired by someone, or the shard was finalized), it counts as
    released, so the next merge registers a fresh writer instead of merging under a
    dead one, and the heartbeat thread stops tracking it."""

    def heartbeat(self) -> None:
        try:
            super().heartbeat()
        except (LeaseExpired, ShardTombstoned) as e:
            self.mark_released()
            raise LeaseExpired(str(e)) from e


class CompactionWriters:
    """The registered part writers a compactor shares between its merges (module
    docstring). Thread-safe; ``close`` releases every registration it holds."""

    def __init__(self, context: ShardContext | None = None) -> None:
        self._context = context
        self._lock = threading.Lock()
        self._writers: dict[tuple[str, bool], SharedPartWriter] = {}
        self.registered = 0
        self.retired = 0
        self._closed = False

    def acquire(self, machine: Machine, *, layered: bool) -> SharedPartWriter:
        """The shard's live writer of this kind, registered now if there is none."""
        key = (machine.shard_id, layered)
        with self._lock:
            pw = self._writers.get(key)
            if pw is not None and not pw.released and pw.machine is machine:
                return pw
            # Registering under the lock: at most one registration per shard and kind
            # (it happens once per shard, or after a retirement).
            new = SharedPartWriter.register(
                machine, purpose="compaction", context=self._context,
                writer_id=new_compactor_writer_id(layered=layered),
            )
            assert isinstance(new, SharedPartWriter)
            self.registered += 1
            if not self._closed:
                self._writers[key] = new
            return new

    def retire(self, pw: PartWriter) -> None:
        """Releases ``pw`` (best effort, ``PartWriter.release``) and forgets it, so the
        next merge registers a fresh writer."""
        with self._lock:
            key = (pw.shard_id, _layered(pw))
            if self._writers.get(key) is pw:
                del self._writers[key]
            if not pw.released:
                self.retired += 1
        pw.release()

    def close(self) -> None:
        """Releases every registration (the compactor's merges have ended)."""
        with self._lock:
            self._closed = True
            writers = list(self._writers.values())
            self._writers.clear()
        for pw in writers:
            try:
                pw.release()
            except Exception as e:  # noqa: BLE001 - closing must go on; the lease lapses
                log.warning("releasing %r failed (its lease will lapse): %s", pw, e)


def _layered(pw: PartWriter) -> bool:
    return is_layered_writer(pw.writer_id)
