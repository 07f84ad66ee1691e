"""Stable key-hash routing of records to the shards of a rendition.

The route of a key must never change (a rendition's shard count is static and every
writer — in-process or a Spark executor — must agree), so it is computed from the
key's *values*, not from Python's randomized ``hash``: integers/temporal/bool values
are mixed with splitmix64, floats by their IEEE bits, strings/binaries/decimals by a
BLAKE2b digest of their bytes (only the distinct values are hashed in Python), and
nested values by a digest of a canonical JSON rendering. Columns are combined in key
order. Nulls hash to a fixed constant.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from persist_lib.shard.codec import CheckedUpdates

Rows = TypeVar("Rows", pa.Table, CheckedUpdates)

_NULL = np.uint64(0x9E3779B97F4A7C15)
_MASK = (1 << 64) - 1


def _splitmix(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = x.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def _digest(b: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(b, digest_size=8).digest(), "little")


def _canonical(v: Any) -> bytes:
    return json.dumps(v, sort_keys=True, default=str, separators=(",", ":")).encode()


def _hash_column(col: pa.ChunkedArray | pa.Array) -> np.ndarray:
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    n = len(arr)
    t = arr.type
    valid = np.ones(n, dtype=bool) if arr.null_count == 0 else ~np.asarray(arr.is_null())
    if pa.types.is_integer(t) or pa.types.is_boolean(t) or pa.types.is_temporal(t):
        if pa.types.is_temporal(t):  # its integer storage (Arrow casts no date32 to int64)
            arr = arr.view(pa.int32() if t.bit_width == 32 else pa.int64())
        as_int = pc.cast(arr, pa.int64(), safe=False)
        vals = np.asarray(as_int.fill_null(0), dtype=np.int64).view(np.uint64)
        h = _splitmix(vals)
    elif pa.types.is_floating(t):
        f = np.asarray(pc.cast(arr, pa.float64()).fill_null(0.0), dtype=np.float64)
        f = np.where(f == 0.0, 0.0, f)  # -0.0 and 0.0 route together
        h = _splitmix(f.view(np.uint64))
    elif pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t) or pa.types.is_decimal(t):
        src = pc.cast(arr, pa.string()) if pa.types.is_decimal(t) else arr
        enc = pc.dictionary_encode(src)
        uniq = enc.dictionary.to_pylist()
        table = np.array(
            [_digest(u.encode() if isinstance(u, str) else bytes(u)) for u in uniq], dtype=np.uint64
        )
        idx = np.asarray(enc.indices.fill_null(0), dtype=np.int64)
        h = table[idx] if len(table) else np.zeros(n, dtype=np.uint64)
    else:
        h = np.array([_digest(_canonical(v)) for v in arr.to_pylist()], dtype=np.uint64)
    return np.where(valid, h, _NULL)


def key_hashes(table: pa.Table, key_names: list[str]) -> np.ndarray:
    """A stable 64-bit hash per row of the key columns (``uint64`` array)."""
    h = np.zeros(table.num_rows, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for name in key_names:
            h = _splitmix(h * np.uint64(31) ^ _hash_column(table[name]))
    return h


def route(table: pa.Table, key_names: list[str], num_shards: int) -> np.ndarray:
    """The shard index (``0..num_shards-1``) of every row."""
    if num_shards == 1:
        return np.zeros(table.num_rows, dtype=np.int64)
    return (key_hashes(table, key_names) % np.uint64(num_shards)).astype(np.int64)


def split_by_shard(table: Rows, key_names: list[str], num_shards: int) -> list[Rows]:
    """``table`` split into one table per shard (rows keep their relative order).
    ``CheckedUpdates`` split into ``CheckedUpdates``: the pieces need no second check."""
    if num_shards == 1:
        return [table]
    idx = route(table.table if isinstance(table, CheckedUpdates) else table, key_names, num_shards)
    order = np.argsort(idx, kind="stable")
    counts = np.bincount(idx, minlength=num_shards)
    sorted_t = table.take(pa.array(order))
    out, start = [], 0
    for c in counts:
        out.append(sorted_t.slice(start, int(c)))
        start += int(c)
    return out
