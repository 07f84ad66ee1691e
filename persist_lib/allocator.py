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

**Freed pages kept for the next bulk write** (``keep_freed_pages``, issue 28). A bulk
write's sort works on numpy arrays of a few MiB per key range (packed keys, orders,
run starts, sums), which numpy takes from glibc malloc. With glibc's default, adaptive
thresholds such blocks are mmapped or trimmed off the heap when freed and every next
write faults them in again: measured on the 2-core KVM box, ~19k minor page faults
and 30-45 ms of system CPU per 1M-row ``compare_and_append`` (raw ``pq.write_table``:
~400 faults), about a quarter of the writer's CPU. Fixing glibc's thresholds
(``mallopt``: blocks below ``MMAP_THRESHOLD_BYTES`` from the heap, up to
``TRIM_THRESHOLD_BYTES`` of free heap top kept per arena) cut that to ~4-5k faults
and ~10-14 ms, with the same peak RSS. Unlike the pool choice this can be set at run
time, so the first bulk chunk of a process (``batch_builder``) sets it, once; it is
left alone when the operator set glibc's malloc thresholds (``MALLOC_MMAP_THRESHOLD_``,
``MALLOC_TRIM_THRESHOLD_``, ``GLIBC_TUNABLES``) or ``PERSIST_KEEP_FREED_PAGES=0``. The
cost: a process keeps up to ``TRIM_THRESHOLD_BYTES`` of freed memory per glibc arena
(two in persist's own processes) instead of returning it at once.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys

from persist_lib.config_rules import env_choice

log = logging.getLogger(__name__)

_M_ARENA_MAX = -8  # glibc's mallopt parameter numbers
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
ARENAS = 2
# ``keep_freed_pages``: blocks below this come from the heap (glibc's own adaptive
# threshold never goes above it either) ...
MMAP_THRESHOLD_BYTES = 32 << 20
# ... and up to this much free memory at the top of a heap stays with the process.
TRIM_THRESHOLD_BYTES = 64 << 20
_OPERATOR_KNOBS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")
_kept: bool | None = None  # keep_freed_pages' answer, once asked


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


def _libc() -> ctypes.CDLL | None:
    try:
        name = ctypes.util.find_library("c")
        libc = ctypes.CDLL(name) if name else None
    except OSError:  # not glibc
        return None
    return libc if libc is not None and hasattr(libc, "mallopt") else None


def keep_freed_pages() -> bool:
    """Sets glibc's malloc thresholds so that the few-MiB blocks of a bulk write's sort
    are reused by the next write instead of being returned and faulted in again (module
    docstring); once per process. Returns whether they are set (False: not glibc, or
    the operator chose: ``PERSIST_KEEP_FREED_PAGES=0`` or glibc's own knobs set)."""
    global _kept
    if _kept is not None:
        return _kept
    _kept = False
    if env_choice("PERSIST_KEEP_FREED_PAGES", ("0", "1"), "1") == "0":
        return False
    if any(k in os.environ for k in _OPERATOR_KNOBS) or "glibc.malloc.mmap" in os.environ.get(
        "GLIBC_TUNABLES", ""
    ) or "glibc.malloc.trim" in os.environ.get("GLIBC_TUNABLES", ""):
        log.debug("glibc malloc thresholds set by the operator: left alone")
        return False
    libc = _libc()
    if libc is None:
        return False
    # (setting either turns glibc's adaptive thresholds off: set both)
    _kept = bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )
    return _kept
