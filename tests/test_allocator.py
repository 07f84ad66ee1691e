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
