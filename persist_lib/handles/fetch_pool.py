"""The process-wide thread pools that reads fetch and decode parts on.

A read used to start a ``ThreadPoolExecutor`` of ``fetch_parallelism`` threads for
itself and join it at the end. For a cold read of a small shard that start was a
visible share of the read (starting four threads on a loaded machine takes
milliseconds, and a new client pays it on every read). Reads now share one pool per
``fetch_parallelism`` value for the whole process, started on first use (and afresh in
a forked child, ``shard.thread_pools.SharedPool``).

Sharing is safe because nothing that runs on these threads waits on the same pool:
a task fetches, verifies and decodes one part and filters it; the read that submitted
the tasks waits for them on its own thread. Concurrent reads queue behind each other's
parts, which bounds the process's fetch threads instead of multiplying them.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from persist_lib.shard.thread_pools import SharedPool

_POOLS: dict[int, SharedPool] = {}
_LOCK = threading.Lock()


def fetch_pool(workers: int) -> ThreadPoolExecutor:
    """The shared pool of ``workers`` threads (``PersistConfig.fetch_parallelism``)."""
    with _LOCK:
        pool = _POOLS.get(workers)
        if pool is None:
            pool = _POOLS[workers] = SharedPool(workers, f"persist-read-fetch-{workers}")
    return pool.get()
