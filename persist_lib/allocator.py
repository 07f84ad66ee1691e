"""The allocator persist's memory budgets are kept under, and why.

Reads and compaction bound what they *hold* (``MergeStats``, ``read_memory_budget``,
``compaction_memory_budget``); a process's RSS also counts pages an allocator keeps
after they were freed. ``python -m bench.compaction --only memory`` compacts a shard
under a budget in a fresh process and compares peak RSS above the post-warm-up baseline
with the budget. Measured on the 2-core dev box (quick mode, 16 MiB budget, session 5):
pyarrow's default pool on Linux, mimalloc, peaked at 1.42-1.62x the budget; the system
allocator (glibc malloc, at most two arenas) at 0.90-0.97x, with compaction times
within noise of mimalloc's.

Both settings are read once: Arrow picks its default pool when it is first asked for
one (``ARROW_DEFAULT_MEMORY_POOL``), and ``pyarrow.set_memory_pool`` later changes only
the pool pyarrow's Python calls pass down: Arrow's C++ (Parquet decoding, kernels) keeps
allocating from the default one. Switching at run time was measured *worse* (2.35-2.67x:
two allocators keep pages). So the choice must be made before pyarrow is imported.

persist's own processes make it: the ``persist`` CLI (``persist_lib/cli/main.py``) and the
Dagster code location (``dagster_project/__init__.py``: the code server and every run
process) call :func:`configure_bounded_allocator` before anything imports pyarrow. It
leaves an operator's choice alone (``ARROW_DEFAULT_MEMORY_POOL`` or
``MALLOC_ARENA_MAX`` already set) and exports both settings, so subprocesses (Spark's
local workers, ingestion workers) inherit them. The library never does it on import; in
a program of your own, start Python with ``ARROW_DEFAULT_MEMORY_POOL=system
MALLOC_ARENA_MAX=2`` or call it before importing pyarrow.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys

log = logging.getLogger(__name__)

_M_ARENA_MAX = -8  # glibc's mallopt parameter number
ARENAS = 2


def configure_bounded_allocator() -> bool:
    """Chooses the system allocator for Arrow (and at most ``ARENAS`` glibc arenas),
    unless the operator chose; returns whether Arrow will use what this set.

    Must run before pyarrow is imported (see the module docstring); afterwards it
    changes nothing and returns False.
    """
    if "pyarrow" in sys.modules:
        log.debug("pyarrow is already imported: its default memory pool stays as it is")
        return False
    if "MALLOC_ARENA_MAX" not in os.environ:
        os.environ["MALLOC_ARENA_MAX"] = str(ARENAS)  # for subprocesses
        try:  # this process read the environment at its first malloc: tell glibc now
            name = ctypes.util.find_library("c")
            libc = ctypes.CDLL(name) if name else None
            if libc is not None and hasattr(libc, "mallopt"):
                libc.mallopt(_M_ARENA_MAX, ARENAS)
        except OSError:  # not glibc: nothing to cap
            pass
    os.environ.setdefault("ARROW_DEFAULT_MEMORY_POOL", "system")
    return True
