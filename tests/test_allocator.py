"""persist's own processes choose Arrow's allocator before pyarrow loads, so memory
budgets hold in RSS (persist_lib/allocator.py; measured by bench.compaction --only memory)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = "import pyarrow as pa, os; print(pa.default_memory_pool().backend_name, os.environ.get('MALLOC_ARENA_MAX'))"


def _run(code: str, **env: str) -> str:
    base = {k: v for k, v in os.environ.items() if k not in ("ARROW_DEFAULT_MEMORY_POOL", "MALLOC_ARENA_MAX")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**base, **env}, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("entry", ["persist_lib.cli.main", "dagster_project.definitions"])
def test_entry_points_choose_the_system_allocator_before_pyarrow_loads(entry: str) -> None:
    assert _run(f"import {entry}; {PROBE}") == "system 2"


def test_an_operators_choice_is_kept() -> None:
    assert _run(f"import persist_lib.cli.main; {PROBE}", ARROW_DEFAULT_MEMORY_POOL="mimalloc") == "mimalloc 2"
    assert _run(f"import persist_lib.cli.main; {PROBE}", MALLOC_ARENA_MAX="4") == "system 4"


def test_too_late_after_pyarrow_is_imported_and_says_so() -> None:
    code = (
        "import pyarrow as pa\n"
        "from persist_lib.allocator import configure_bounded_allocator\n"
        "print(configure_bounded_allocator(), pa.default_memory_pool().backend_name != 'system')"
    )
    assert _run(code) == "False True"


# ----- freed pages kept for the next bulk write (issue 28) --------------------------------

CHURN = """
import resource, threading, numpy as np
def churn():  # numpy blocks of a few MiB, as a bulk write's sort allocates them
    faults = []
    for i in range(8):
        f0 = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        a = np.ones(500_000 + (i % 3) * 10_000, dtype=np.int64)
        b = np.flatnonzero(a * 2)
        del a, b
        faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - f0)
    out.append(faults)
out = []
th = threading.Thread(target=churn)  # an upload thread's arena
th.start()
th.join()
churn()
print(KEPT, all(min(f[4:]) < f[0] // 10 for f in out))
"""

BULK_WRITE = """
import uuid
import numpy as np, pyarrow as pa, pyarrow.compute as pc
from persist_lib import PersistClient, PersistConfig, allocator
tag = uuid.uuid4().hex
client = PersistClient.open(f"mem://b-{tag}", f"mem://c-{tag}", PersistConfig())
w = client.open_writer(f"s{uuid.UUID(int=1)}", pa.schema([("key", pa.int64())]), pa.schema([("value", pa.string())]))
keys = pa.array(np.random.default_rng(0).integers(0, 10**7, 200_000))
table = pa.table({"key": keys, "value": pc.binary_join_element_wise("val_", pc.cast(keys, pa.string()), ""),
                  "ts": np.zeros(200_000, np.int64), "diff": np.ones(200_000, np.int64)})
assert table.nbytes >= PersistConfig().key_range_min_bytes  # a bulk chunk: key-range parts
w.compare_and_append(table, [0], [1])
assert client.inspect(w.shard_id)["num_updates"] > 0
client.close()
KEPT = allocator._kept
"""

_MALLOC_KNOBS = ("PERSIST_KEEP_FREED_PAGES", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "GLIBC_TUNABLES")


def _run_clean(code: str, **env: str) -> str:
    base = {k: v for k, v in os.environ.items() if k not in _MALLOC_KNOBS}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**base, **env}, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc")
def test_a_bulk_write_keeps_freed_pages_for_the_next_one() -> None:
    """After a process's first bulk chunk, blocks of a few MiB freed by one write are
    reused by the next instead of being faulted in again: later rounds of the churn
    fault less than a tenth of the first (glibc's default faults them in every time)."""
    assert _run_clean(BULK_WRITE + CHURN) == "True True"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc")
def test_an_operators_malloc_settings_are_kept() -> None:
    """``PERSIST_KEEP_FREED_PAGES=0`` or glibc's own thresholds set: persist changes
    nothing, and the churn faults its blocks in again every round."""
    assert _run_clean(BULK_WRITE + CHURN, PERSIST_KEEP_FREED_PAGES="0") == "False False"
    assert _run_clean(BULK_WRITE + "print(KEPT)", MALLOC_TRIM_THRESHOLD_="131072") == "False"
    assert _run_clean(BULK_WRITE + "print(KEPT)", GLIBC_TUNABLES="glibc.malloc.mmap_threshold=131072") == "False"
