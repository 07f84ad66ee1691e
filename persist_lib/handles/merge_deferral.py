"""Burst deferral: the background compactor's small merges wait out a burst of commits.

Under a burst of small appends the spine asks for a merge of the two newest batches at
nearly every other commit (a binary counter). Each such merge reads and rewrites a few
thousand updates, fsyncs its output, and takes two consensus writes (part-writer
registration, then the merge itself) that queue behind, and slow, the writer's own
commits. While commits keep arriving, a *small* merge is therefore held back: the next
commit re-derives it with one more input, so the tail is merged ``max_fanin`` batches
at a time instead of two at a time (fewer merges, each update rewritten fewer times).

Bounds, so the trace never grows without limit and a burst's tail is never left
unmerged:

* only ``"merge"`` requests (the level rule) of fewer than ``max_fanin`` batches and at
  most ``max_updates`` updates are held back; a request reaching either bound runs at
  once, so at most ``max_fanin - 1`` batches per held-back request wait;
* every hold arms a per-shard timer: once no commit (no new hold) came for ``quiet_s``,
  the shard is offered again with nothing held back (``settle``). ``wait_idle`` counts
  an armed timer as work, so "idle" still means "fully compacted".

Nothing here does I/O or touches shard state: it only decides *when* a merge the spine
asked for is queued.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from persist_lib.shard.spine import CompactionRequest

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeferralPolicy:
    """Which merges wait out a burst (module docstring). ``max_fanin <= 2`` disables it."""

    quiet_s: float = 0.1
    max_fanin: int = 8
    max_updates: int = 65_536

    @property
    def enabled(self) -> bool:
        return self.max_fanin > 2 and self.quiet_s > 0

    def deferrable(self, req: CompactionRequest) -> bool:
        return (
            self.enabled
            and req.kind == "merge"
            and len(req.batch_ids) < self.max_fanin
            and req.num_updates <= self.max_updates
        )

    def split(
        self, reqs: list[CompactionRequest]
    ) -> tuple[list[CompactionRequest], list[CompactionRequest]]:
        """``(run_now, held_back)``."""
        now_: list[CompactionRequest] = []
        held: list[CompactionRequest] = []
        for r in reqs:
            (held if self.deferrable(r) else now_).append(r)
        return now_, held


class SettleTimer:
    """Per-shard debounce: ``arm(key, target, quiet_s)`` (re)starts ``key``'s quiet
    period; when it passes without another ``arm``, ``on_settle(target)`` runs on this
    timer's thread.
    One thread for all shards, started on first use; ``notify`` runs after each settle
    (the compactor wakes its ``wait_idle`` waiters).

    ``arm`` wakes the thread only when the new deadline is earlier than the one it
    sleeps until: under a burst every commit re-arms its shard with a *later* deadline,
    and waking the thread for each (to go back to sleep) handed it the GIL once per
    commit, in the middle of the writer's commit. The thread finds the moved deadline
    when its old one passes, and sleeps again."""

    def __init__(
        self,
        on_settle: Callable[[Any], None],
        notify: Callable[[], None],
        name: str = "persist-compaction-settle",
    ) -> None:
        self._on_settle = on_settle
        self._notify = notify
        self._name = name
        self._cond = threading.Condition()
        self._due: dict[str, tuple[float, Any]] = {}  # key -> (monotonic deadline, target)
        self._firing = 0
        self._closed = False
        # The deadline the thread sleeps until (inf: until notified), None when it is
        # not sleeping (it re-reads ``_due`` before it sleeps again).
        self._sleep_until: float | None = None
        self._thread: threading.Thread | None = None

    def arm(self, key: str, target: Any, quiet_s: float) -> None:
        with self._cond:
            if self._closed:
                return
            deadline = time.monotonic() + quiet_s
            self._due[key] = (deadline, target)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
            elif self._sleep_until is not None and deadline < self._sleep_until:
                self._cond.notify_all()

    def idle(self) -> bool:
        """Nothing armed and no settle running."""
        with self._cond:
            return not self._due and self._firing == 0

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._closed:
                    if not self._due:
                        self._sleep(math.inf)
                        continue
                    now = time.monotonic()
                    key, (deadline, target) = min(self._due.items(), key=lambda kv: kv[1][0])
                    if deadline <= now:
                        del self._due[key]
                        self._firing += 1
                        break
                    self._sleep(deadline)
                else:
                    return
            try:
                self._on_settle(target)
            except Exception as e:  # noqa: BLE001 - maintenance must never kill the timer
                log.warning("settling background compaction for %s failed: %s", key, e)
            finally:
                with self._cond:
                    self._firing -= 1
                self._notify()

    def _sleep(self, until: float) -> None:
        """Waits (holding ``_cond``) until ``until`` (monotonic; inf: until notified)."""
        self._sleep_until = until
        try:
            self._cond.wait(None if until == math.inf else max(0.0, until - time.monotonic()))
        finally:
            self._sleep_until = None

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._due.clear()
            self._cond.notify_all()
            t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join()
