"""Addresses, frontiers and notes: the vocabulary every source, the remap shard and the
decoding share.

An *address* is a tuple of ints/strings compared as a Python tuple (``(file, row)`` for
a landing zone, ``(commit_lsn,)`` for Postgres CDC, ``(offset,)`` for Kafka); a
*frontier* maps each partition to the first address not yet covered; a *note* is a
non-deterministic observation recorded with a binding (see ``source``). They live
below both the source protocol (``source``) and the decoding (``decode``: error and
raw records are keyed by address), so neither imports the other.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

Address = tuple[Any, ...]
Frontier = dict[str, Address]
Note = dict[str, Any]


def encode_address(a: Sequence[Any]) -> str:
    """Canonical JSON text of an address (the remap/errors/raw key column)."""
    return json.dumps(list(a), separators=(",", ":"), ensure_ascii=False)


def decode_address(s: str) -> Address:
    v = json.loads(s)
    return tuple(v) if isinstance(v, list) else (v,)


def encode_note(n: Note) -> str:
    """Canonical JSON text of a note (sorted keys, so equal notes encode equally)."""
    return json.dumps(n, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def frontier_covers(f: Frontier, g: Frontier) -> bool:
    """True iff ``f`` is at or beyond ``g`` in every partition of ``g``."""
    return all(p in f and tuple(f[p]) >= tuple(a) for p, a in g.items())


def frontier_text(f: Frontier) -> str:
    return ", ".join(f"{p}: {encode_address(a)}" for p, a in sorted(f.items())) or "(none)"
