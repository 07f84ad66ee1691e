"""Helpers shared by the Spark test modules (locations, clients, comparisons)."""

from __future__ import annotations

from typing import Any


def file_location(tmp_path: Any, tag: str = "loc") -> tuple[str, str]:
    """A fresh ``file://`` blob + SQLite consensus under ``tmp_path`` (executors see it)."""
    blob = tmp_path / f"blob-{tag}"
    blob.mkdir(parents=True, exist_ok=True)
    return f"file://{blob}", f"sqlite:///{tmp_path / f'consensus-{tag}.db'}"


def open_client(loc: tuple[str, str], **config: Any) -> Any:
    """A client with test settings; no rollups unless asked (so a CAS is one seqno)."""
    from persist_lib import PersistClient, PersistConfig

    config.setdefault("rollup_interval", 10**9)
    return PersistClient.open(loc[0], loc[1], PersistConfig.for_tests(**config))


def table_counter(table: Any) -> Any:
    """A user-layout Arrow table as a Counter of (key..., value..., ts) -> summed diff."""
    from collections import Counter

    cols = [c for c in table.column_names if c != "diff"]
    c: Counter[tuple[Any, ...]] = Counter()
    rows = table.to_pydict()
    for i, d in enumerate(rows["diff"]):
        c[tuple(_hashable(rows[n][i]) for n in cols)] += d
    return Counter({k: v for k, v in c.items() if v != 0})


def _hashable(v: Any) -> Any:
    if isinstance(v, dict):
        return tuple(sorted((k, _hashable(x)) for k, x in v.items()))
    if isinstance(v, list):
        return tuple(_hashable(x) for x in v)
    if isinstance(v, bytearray):
        return bytes(v)
    return v


def df_counter(df: Any) -> Any:
    """A Spark DataFrame (user layout) as ``table_counter`` of its Arrow form."""
    return table_counter(df.toArrow())


def sorted_hashes(df: Any) -> Any:
    """The sorted 64-bit hashes of every row of ``df`` (a numpy array): two DataFrames
    hold the same multiset of rows iff these are equal (up to hash collisions), and
    comparing them moves 8 bytes per row instead of shuffling the rows."""
    import numpy as np
    from pyspark.sql import functions as F

    h = df.select(F.xxhash64(*[F.col(c) for c in df.columns]).alias("h")).toArrow()
    return np.sort(h.column("h").to_numpy())
