"""Multi-threaded vector kernels for the data plane: sorting int64 keys and gathering
rows, through polars when it is installed, numpy/pyarrow otherwise.

Why polars: pyarrow's string ``take`` is slow. polars (Rust, its own thread pool) reads
Arrow buffers without copies and, measured on the 2-core dev box (docs/benchmarks.md,
"Issue 14 (session 8)"), gathers 5M strings (with the conversions in and out of Arrow)
in ~120 ms against ~330 ms for ``pa.Array.take``. Sorting int64 is numpy's: with
numpy 2's vectorized sort it beats polars 5x (issue 28; polars' sort was faster than
the numpy of issue 14).
Both functions return exactly what the numpy/pyarrow versions return (same values, same
types, same nulls): polars is only an engine, never part of a result's meaning. Set
``PERSIST_KERNELS=numpy`` to turn it off (tests run both).

**Importing polars** costs ~0.1-0.15 s of CPU, almost all of it holding the GIL. Code
that must not pay it inline (the background compactor's merges, which run beside a
writer's burst of commits) runs under ``no_polars_import()``: there polars is used only
if this process already imported it, else the numpy/pyarrow kernels run; ``warm()``
imports it at a moment of the caller's choosing (the compactor: once it is idle).
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import numpy as np
import pyarrow as pa

from persist_lib.config_rules import env_choice

_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def kernel_pool() -> ThreadPoolExecutor:
    """Two threads for kernels that split their input (the GIL is released inside)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="persist-kernel")
        return _POOL


# Below this many rows the conversions cost more than the kernels save.
MIN_POLARS_ROWS = 1 << 14
_POLARS: Any = None
_POLARS_CHECKED = False
# Set in a child forked after this process used polars: its thread pool did not survive
# the fork (polars may deadlock there), so the child uses the numpy kernels.
_FORKED_AFTER_USE = False


def _after_fork_in_child() -> None:
    global _POOL, _FORKED_AFTER_USE
    _POOL = None  # its threads did not survive the fork
    if _POLARS is not None:
        _FORKED_AFTER_USE = True


os.register_at_fork(after_in_child=_after_fork_in_child)

# Per thread: whether ``polars()`` may import polars (``no_polars_import``).
_IMPORT_POLICY = threading.local()


@contextmanager
def no_polars_import() -> Iterator[None]:
    """Within (on this thread): ``polars()`` returns polars only if the process has
    already imported it, and None otherwise, so that the exact numpy/pyarrow kernels run
    instead of an import that holds the GIL for ~0.1 s (module docstring)."""
    prev = getattr(_IMPORT_POLICY, "deferred", False)
    _IMPORT_POLICY.deferred = True
    try:
        yield
    finally:
        _IMPORT_POLICY.deferred = prev


def warm() -> bool:
    """Imports polars now, if it is used at all (``polars()``); whether it is loaded."""
    prev = getattr(_IMPORT_POLICY, "deferred", False)
    _IMPORT_POLICY.deferred = False
    try:
        return polars() is not None
    finally:
        _IMPORT_POLICY.deferred = prev


def polars() -> Any:
    """The polars module, or None (not installed, ``PERSIST_KERNELS=numpy``, a child
    forked after its parent used polars, or not imported yet under ``no_polars_import``)."""
    global _POLARS, _POLARS_CHECKED
    if _FORKED_AFTER_USE or env_choice("PERSIST_KERNELS", ("numpy", "auto"), "auto") == "numpy":
        return None
    if not _POLARS_CHECKED:
        if getattr(_IMPORT_POLICY, "deferred", False) and "polars" not in sys.modules:
            return None
        try:
            import polars as pl

            _POLARS = pl
        except Exception:  # not installed, or broken: the numpy kernels are exact too
            _POLARS = None
        _POLARS_CHECKED = True
    return _POLARS


def sort_int64(values: np.ndarray) -> np.ndarray:
    """``np.sort(values)`` for an int64 array (a new array; ``values`` is not changed).

    numpy itself, whatever the engine: since numpy 2.0 its sort of 64-bit integers is
    the vectorized x86-simd-sort (AVX2/AVX-512), measured 5x faster than polars' on the
    2-core box (1M random int64: 5 ms against 26 ms; 5M: 35 ms against 170 ms) and
    without polars' thread pool competing with the decode threads (issue 28)."""
    return np.sort(values)


def is_var_binary(t: pa.DataType) -> bool:
    """String or binary (either offset width): the types Arrow and polars both order by bytes."""
    return (
        pa.types.is_string(t)
        or pa.types.is_large_string(t)
        or pa.types.is_binary(t)
        or pa.types.is_large_binary(t)
    )


def _to_polars_view(pl: Any, col: pa.Array | pa.ChunkedArray) -> Any:
    """A string or binary column as a one-chunk polars Series. Through Arrow's view type:
    polars holds strings as views, and Arrow builds the views without copying the bytes,
    where polars' own conversion of offsets copies them (measured on 1M short strings:
    1.9 ms of CPU against 5.8 ms)."""
    view = pa.string_view() if pa.types.is_string(col.type) or pa.types.is_large_string(col.type) else pa.binary_view()
    s = pl.from_arrow(col.cast(view))
    assert isinstance(s, pl.Series)
    return s.rechunk() if s.n_chunks() > 1 else s  # a gather across chunks is several times slower


def _gathered(pl: Any, s: Any, idx: np.ndarray, n: int) -> pa.Array:
    """``s`` (``_to_polars_view``) at the positions ``idx`` as an Arrow view array (no
    conversion of the bytes out of polars: the caller's cast to its type builds them)."""
    positions = pl.Series(idx, dtype=pl.UInt32 if n < (1 << 32) else pl.UInt64)
    out: pa.Array = s.gather(positions).to_arrow(compat_level=pl.CompatLevel.newest())
    return out


def take_column(col: pa.Array | pa.ChunkedArray, idx: np.ndarray) -> pa.Array | pa.ChunkedArray:
    """``col.take(idx)``: strings and binaries through polars (same type and values)."""
    pl = polars()
    if pl is not None and len(idx) >= MIN_POLARS_ROWS and is_var_binary(col.type):
        try:
            out = _gathered(pl, _to_polars_view(pl, col), idx, len(col))
            return out.cast(col.type) if not out.type.equals(col.type) else out
        except (pa.ArrowInvalid, OverflowError):
            pass  # e.g. more than 2 GiB of strings for 32-bit offsets: Arrow copes
    return col.take(pa.array(idx))


def take_rows(table: pa.Table, idx: np.ndarray) -> pa.Table:
    """``table.take(idx)`` for an int64 index array, column by column (``take_column``)."""
    if len(idx) < MIN_POLARS_ROWS or polars() is None:
        return table.take(pa.array(idx))
    return RowSource(table).take(idx)


class RowSource:
    """A table to gather many row subsets from (e.g. a merge's output, slice by slice):
    each column is prepared once — one chunk, strings and binaries converted to polars —
    so that every ``take`` costs only the gather."""

    def __init__(self, table: pa.Table) -> None:
        self.table = table
        self._cols: list[Any] = [None] * table.num_columns

    def prepare(self, i: int) -> None:
        """Converts column ``i`` now (e.g. before threads share this source)."""
        self._column(i)

    def _column(self, i: int) -> Any:
        c = self._cols[i]
        if c is None:
            col = self.table.column(i)
            pl = polars()
            if pl is not None and is_var_binary(col.type) and len(col) >= MIN_POLARS_ROWS:
                c = _to_polars_view(pl, col)
            else:
                c = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
            self._cols[i] = c
        return c

    def take_column(self, i: int, idx: np.ndarray) -> pa.Array:
        """Column ``i`` at the rows ``idx`` (int64 positions), with its type."""
        c = self._column(i)
        if isinstance(c, (pa.Array, pa.ChunkedArray)):
            return c.take(pa.array(idx))
        out = _gathered(polars(), c, idx, len(self.table))
        typ = self.table.schema.field(i).type
        try:
            return out.cast(typ) if not out.type.equals(typ) else out
        except (pa.ArrowInvalid, OverflowError):  # too many bytes for 32-bit offsets
            return self.table.column(i).take(pa.array(idx)).combine_chunks()

    def take(self, idx: np.ndarray) -> pa.Table:
        """The rows ``idx`` (int64 positions), with the table's schema, one chunk each."""
        cols = [self.take_column(i, idx) for i in range(self.table.num_columns)]
        return pa.Table.from_arrays(cols, schema=self.table.schema)
