"""Threads whose failures fail the test.

An ``assert`` (or any exception) inside a ``threading.Thread`` only prints a warning and
ends that thread: the test goes on and passes with one racer fewer. ``run_threads``
starts every function on its own thread (released together through a barrier), joins
them all, and re-raises the first exception any of them raised; a thread still alive
after ``timeout_s`` is a failure too.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any


class ThreadFailed(AssertionError):
    """A worker thread raised (its exception is the ``__cause__``) or hung."""


def run_threads(fns: Sequence[Callable[[], Any]], *, timeout_s: float = 120.0) -> list[Any]:
    """Runs ``fns`` concurrently (released together); returns their results in order."""
    barrier = threading.Barrier(len(fns))
    results: list[Any] = [None] * len(fns)
    errors: list[tuple[int, BaseException]] = []
    lock = threading.Lock()

    def body(i: int, fn: Callable[[], Any]) -> None:
        try:
            barrier.wait(timeout_s)
            results[i] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            with lock:
                errors.append((i, e))
            barrier.abort()

    threads = [threading.Thread(target=body, args=(i, fn), daemon=True) for i, fn in enumerate(fns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    hung = [i for i, t in enumerate(threads) if t.is_alive()]
    if errors:
        # A BrokenBarrierError is a consequence of another thread's failure: report the cause.
        errors.sort(key=lambda e: isinstance(e[1], threading.BrokenBarrierError))
        i, e = errors[0]
        raise ThreadFailed(f"thread {i} of {len(fns)} raised {type(e).__name__}: {e}") from e
    if hung:
        raise ThreadFailed(f"threads {hung} of {len(fns)} still running after {timeout_s}s")
    return results
