"""A Kafka reader's prefetching: ``consume()`` on a thread ahead of the reader, each
batch converted in two stages (split on the consuming thread, decoded on two decoding
threads), handed over in consume order (``_Prefetcher``); and the pause of Python's
cyclic garbage collector around a batch's ``Message`` objects that consuming and
converting take (``_gc_paused``, ``_gc_hold``/``_gc_release``, ``_consume``).

Moved out of the reader as it was (issue 26, with the fix that takes a batch's hold on
the collector only once its conversion returned).
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:  # pragma: no cover
    from persist_lib.ingest.kafka.messages import _Batch, _Fetched
    from persist_lib.ingest.kafka.split import _Split

log = logging.getLogger(__name__)

_BATCH = 20_000  # messages per ``consume()`` call of a prefetcher (at most)
_B = TypeVar("_B")  # what a ``_consume`` conversion makes of a batch

_gc_lock = threading.Lock()
_gc_depth = 0
_gc_was_enabled = False


def _gc_hold() -> None:
    """Python's cyclic garbage collector off until the matching ``_gc_release`` (holds
    nest, across threads; the state the first one found is restored by the last one)."""
    global _gc_depth, _gc_was_enabled
    with _gc_lock:
        if _gc_depth == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_depth += 1


def _gc_release() -> None:
    global _gc_depth
    with _gc_lock:
        _gc_depth = max(0, _gc_depth - 1)  # (>= 0: a forked child starts again from 0)
        if _gc_depth == 0 and _gc_was_enabled:
            gc.enable()


def _gc_reset_in_child() -> None:
    """After ``fork``: the threads holding the collector paused did not survive, so their
    releases will never come; the child starts unheld, with the collector as it was."""
    global _gc_lock, _gc_depth
    _gc_lock = threading.Lock()
    if _gc_depth > 0:
        _gc_depth = 0
        if _gc_was_enabled:
            gc.enable()


os.register_at_fork(after_in_child=_gc_reset_in_child)


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the block (nested and concurrent uses
    nest; the state the first one found is restored by the last one).

    Why: ``consume()`` creates one GC-tracked ``Message`` per message, so building a
    batch of 20,000 triggers dozens of collections that walk the batch again and again,
    though a ``Message`` can't be part of a reference cycle. With the batch converted
    (decoded, or pulled into lists) and dropped inside the block, its messages are never
    walked at all. Collections are only postponed (allocations still count), and the
    block never waits for the broker (``_consume``): it lasts as long as converting one
    batch."""
    _gc_hold()
    try:
        yield
    finally:
        _gc_release()


def _consume(
    consumer: Any, n: int, timeout: float, convert: Callable[[list[Any]], _B],
    io: AbstractContextManager[Any] | None = None, hold: bool = False,
) -> tuple[int, _B]:
    """Up to ``n`` messages and events from ``consumer`` as (how many, ``convert``-ed
    batch): what is queued already, consumed and converted with the garbage collector
    paused; if nothing is, waits up to ``timeout`` for some (the collector on: it is never
    paused while waiting). ``io``: held around the consumer calls (and the conversion).
    ``hold``: a converted batch comes with the collector still paused (``_gc_hold``) for
    a stage that still reads its ``Message`` objects; that stage calls ``_gc_release``.
    Nothing consumed: (0, ``convert([])``), never held."""
    lock = io if io is not None else nullcontext()
    with lock, _gc_paused():
        msgs = consumer.consume(n, 0)
        if msgs:
            size, batch = len(msgs), convert(msgs)
            del msgs  # (the Message objects go before the collector is back)
            if hold:
                _gc_hold()  # (only once ``convert`` returned: see below)
            return size, batch
    if timeout <= 0:
        return 0, convert([])
    with lock:
        msgs = consumer.consume(n, timeout)
        if not msgs:
            return 0, convert([])
        with _gc_paused():
            size, batch = len(msgs), convert(msgs)
            del msgs
            # The hold is taken after ``convert`` returned, never before: a conversion
            # that raises must leave no hold behind -- nobody would release it, and the
            # collector would stay off for the whole process.
            if hold:
                _gc_hold()
            return size, batch


class _Slot:
    """One consumed batch in a prefetcher's queue: decoded (``batch``) or failing
    (``error``) once ``done``."""

    __slots__ = ("size", "at", "batch", "error", "done")

    def __init__(self, size: int, at: float) -> None:
        self.size, self.at = size, at
        self.batch: _Batch = ([], [])
        self.error: BaseException | None = None
        self.done = False


class _Prefetcher:
    """Calls ``consume()`` on a thread, ahead of the reader, and converts each batch in
    two stages, holding at most ``limit`` messages: the consuming thread splits a batch
    by partition (``split``: the fields every message needs, read off the ``Message``
    objects), and one of ``_DECODERS`` decoding threads decodes it (``decode``: mostly
    pyarrow's JSON parser, which releases the GIL). So consuming, decoding (two batches
    at once) and the ingestion's appending overlap. Batches come out in the order
    ``consume`` returned them, whichever decoding finished first, so the reader sees
    exactly what it would have fetched itself.

    Why two stages on three threads: the one prefetch thread that consumed and decoded
    (sessions 8-9) was the critical path of an ingestion (~1.1 s of CPU per 1M messages:
    consume + split ~0.45 s, decoding ~0.65 s). Measured on 1M JSON messages (A/B in one
    process, medians of 6, docs/ingestion.md section 9): one decoding thread 1.35 s, two
    1.23 s.

    The garbage collector stays paused from a batch's ``consume`` until its decoding
    dropped its ``Message`` objects (``_consume(hold=True)``, see ``_gc_paused``): at most
    ``_MAX_PENDING`` batches wait for or are in decoding, and about every
    ``_GC_WINDOW_S`` the consuming thread lets the decoding finish them all before it
    consumes again, so collections still run while messages stream in. (The pause is
    process-wide: several readers streaming in one process at once only leave a window
    when all of their decodings are drained together.)"""

    _MAX_PENDING = 4
    _GC_WINDOW_S = 0.25
    _DECODERS = 2

    def __init__(
        self, consumer: Any, limit: int, where: str, split: Callable[[list[Any]], _Split],
        decode: Callable[[_Split], _Batch],
    ) -> None:
        self._consumer = consumer
        self._split = split
        self._decode = decode
        self._limit = max(1, limit)
        self._batches: deque[_Slot] = deque()  # consumed, in order; decoded when ``done``
        self._pending: deque[tuple[_Slot, _Split]] = deque()  # waiting for a decoding thread
        self._undecoded = 0  # batches consumed and not decoded yet (pending or decoding)
        self._held = 0
        self._cv = threading.Condition()
        self._io = threading.Lock()  # held around every call on the consumer
        self._waiting = 0  # reader-thread calls waiting for the consumer
        self._stop = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"kafka-prefetch {where}", daemon=True)
        self._decoders = [
            threading.Thread(target=self._run_decode, name=f"kafka-decode{i} {where}", daemon=True)
            for i in range(self._DECODERS)
        ]
        self._thread.start()
        for t in self._decoders:
            t.start()

    def _run(self) -> None:
        try:
            window = time.monotonic()
            while True:
                with self._cv:
                    while (
                        self._held >= self._limit or self._waiting or self._undecoded >= self._MAX_PENDING
                    ) and not self._stop:
                        self._cv.wait(0.1)
                    if self._stop:
                        return
                    if time.monotonic() - window > self._GC_WINDOW_S:
                        while self._undecoded and not self._stop:  # (decoding lets go of the collector)
                            self._cv.wait(0.1)
                    if not self._undecoded:
                        window = time.monotonic()
                    n = max(1, min(_BATCH, self._limit - self._held))
                size, sp = _consume(self._consumer, n, 0.05, self._split, self._io, hold=True)
                if size:
                    slot = _Slot(size, time.monotonic())
                    with self._cv:
                        if self._stop:  # (closed meanwhile: nobody decodes it)
                            del sp
                            _gc_release()
                            return
                        self._batches.append(slot)
                        self._pending.append((slot, sp))
                        self._undecoded += 1
                        self._held += size
                        self._cv.notify_all()
                    del sp
        except BaseException as e:  # noqa: BLE001 - handed to the reader's thread
            with self._cv:
                self._error = e
                self._cv.notify_all()

    def _run_decode(self) -> None:
        while True:
            with self._cv:
                while not self._pending and not self._stop:
                    self._cv.wait(0.1)
                if self._stop:
                    return  # (``close`` lets go of what is pending)
                slot, sp = self._pending.popleft()
            try:
                try:
                    slot.batch = self._decode(sp)
                except BaseException as e:  # noqa: BLE001 - handed to the reader's thread
                    slot.error = e
                del sp  # (the last reference to the Message objects)
            finally:
                _gc_release()  # (the hold ``_consume`` took for this batch)
            with self._cv:
                slot.done = True
                self._undecoded -= 1
                self._cv.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """The consumer for a call from the reader's thread (librdkafka calls on one
        consumer from two threads at once can hang: a cached watermark read did)."""
        with self._cv:
            self._waiting += 1
        try:
            with self._io:
                yield
        finally:
            with self._cv:
                self._waiting -= 1
                self._cv.notify_all()

    def take(self, max_n: int, timeout: float) -> list[_Fetched]:
        """Up to about ``max_n`` messages (whole batches), waiting up to ``timeout`` for one."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while not (self._batches and self._batches[0].done):
                if not self._batches and self._error is not None:
                    raise self._error  # (after every batch consumed before it)
                left = deadline - time.monotonic()
                if left <= 0:
                    return []
                self._cv.wait(left)
            out: list[_Fetched] = []
            got = 0
            while self._batches and self._batches[0].done and got < max_n:
                slot = self._batches[0]
                if slot.error is not None:
                    if out:
                        break  # (the batches before it first)
                    raise slot.error
                self._batches.popleft()
                out.append((slot.batch, slot.at))
                got += slot.size
                self._held -= slot.size
            self._cv.notify_all()
            return out

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(30)
        for t in self._decoders:
            t.join(30)
        if any(t.is_alive() for t in self._decoders):
            log.warning("a Kafka decoding thread did not stop within 30 s (a batch's decoding hangs)")
        with self._cv:
            # never decoded (a decoding thread takes a batch only while not stopped, under
            # the lock): their holds on the collector go with them
            while self._pending:
                self._pending.popleft()
                _gc_release()
