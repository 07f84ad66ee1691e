"""Process-wide thread pools, made on first use and made afresh in a forked child.

A pool per merge or per part costs more than a small merge or part itself, so work that
runs in the background of a write (output uploads, part statistics) shares one pool per
purpose for the whole process. A forked child has none of its parent's threads: it gets a
new pool when it first asks for one.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any


class SharedPool:
    """One lazily created ``ThreadPoolExecutor`` for the process."""

    def __init__(self, max_workers: int, name: str) -> None:
        self._max_workers = max_workers
        self._name = name
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        os.register_at_fork(after_in_child=self._forget)

    def get(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=self._max_workers, thread_name_prefix=self._name)
            return self._pool

    def _forget(self) -> None:
        self._pool = None
        self._lock = threading.Lock()  # (a lock held by a parent's thread stays held in the child)


def cancel_and_wait(futures: Iterable[Future[Any]]) -> None:
    """Cancels ``futures`` and waits for those already running (their errors dropped):
    what they read must outlive the threads reading it."""
    fs = list(futures)
    for f in fs:
        f.cancel()
    for f in fs:
        if not f.cancelled():
            f.exception()
