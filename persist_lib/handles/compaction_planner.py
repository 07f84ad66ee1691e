"""When the background compactor plans merges: off the commit path, and not in pairs
under a burst of commits.

**Off the commit path.** A commit only *pokes* the planner (``PlannerThread.poke``: a
dict store and a notify); the spine's planning (``spine.compaction_requests``, the GC
check) runs on the planner's own thread, against the latest cached state. It thus
overlaps the writer's next consensus write instead of lengthening every commit, and
pokes that arrive while it is busy are coalesced into one plan of the newest state.

**Burst deferral.** Under a burst of small appends the spine asks for a merge of the two
newest batches at nearly every other commit (a binary counter). Each such merge reads
and rewrites a few thousand updates, fsyncs its output, and takes two consensus writes
(part-writer registration, then the merge itself) that queue behind, and slow, the
writer's own commits, and its CPU competes with the writer's. While commits keep
arriving, a *small* merge is therefore held back: the next commit re-derives it with one
more input, so the tail is merged ``max_fanin`` batches at a time instead of two at a
time (fewer merges, each update rewritten fewer times).

Bounds, so the trace never grows without limit and a burst's tail is never left
unmerged:

* only ``"merge"`` requests (the level rule) of fewer than ``max_fanin`` batches and at
  most ``max_updates`` updates are held back; a request reaching either bound runs at
  once, so at most ``max_fanin - 1`` batches per held-back request wait;
* every hold arms a per-shard timer: once no commit (no new hold) came for ``quiet_s``,
  the shard is planned again with nothing held back (``settle``). ``wait_idle`` counts a
  pending poke or an armed timer as work, so "idle" still means "fully compacted".

Nothing here does I/O or touches shard state: it only decides *when* a merge the spine
asked for is queued.
"""

from __future__ import annotations

import logging
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


@dataclass
class _Due:
    at: float  # time.monotonic()
    target: Any
    settle: bool


class PlannerThread:
    """One thread running ``plan(target, settle)`` for a client's shards.

    ``poke(key, target)`` asks for a plan now (``settle=False``); pokes for one key that
    arrive before the plan starts are coalesced. ``arm(key, target, quiet_s)`` (re)starts
    ``key``'s quiet period: when it passes without another ``arm``, ``plan(target,
    settle=True)`` runs; a pending poke is never pushed back by an ``arm``. ``notify``
    runs after each plan (the compactor wakes its ``wait_idle`` waiters). The thread is
    started on first use.
    """

    def __init__(
        self,
        plan: Callable[[Any, bool], None],
        notify: Callable[[], None],
        name: str = "persist-compaction-planner",
    ) -> None:
        self._plan = plan
        self._notify = notify
        self._name = name
        self._cond = threading.Condition()
        self._due: dict[str, _Due] = {}
        self._running = 0
        self._closed = False
        self._thread: threading.Thread | None = None

    def poke(self, key: str, target: Any) -> None:
        self._put(key, _Due(0.0, target, settle=False))

    def arm(self, key: str, target: Any, quiet_s: float) -> None:
        self._put(key, _Due(time.monotonic() + quiet_s, target, settle=True))

    def _put(self, key: str, due: _Due) -> None:
        with self._cond:
            if self._closed:
                return
            cur = self._due.get(key)
            if cur is not None and not cur.settle and due.settle:
                return  # a plan is already pending: it re-arms the timer if still needed
            self._due[key] = due
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def idle(self) -> bool:
        """Nothing pending and no plan running."""
        with self._cond:
            return not self._due and self._running == 0

    def _next(self) -> tuple[str, _Due] | None:
        """Waits for the next due entry and takes it; None once closed."""
        with self._cond:
            while not self._closed:
                if not self._due:
                    self._cond.wait()
                    continue
                key, due = min(self._due.items(), key=lambda kv: kv[1].at)
                wait_s = due.at - time.monotonic()
                if wait_s <= 0:
                    del self._due[key]
                    self._running += 1
                    return key, due
                self._cond.wait(wait_s)
            return None

    def _loop(self) -> None:
        while (item := self._next()) is not None:
            key, due = item
            try:
                self._plan(due.target, due.settle)
            except Exception as e:  # noqa: BLE001 - maintenance must never kill the planner
                log.warning("planning background compaction for %s failed: %s", key, e)
            finally:
                with self._cond:
                    self._running -= 1
                self._notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._due.clear()
            self._cond.notify_all()
            t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join()
