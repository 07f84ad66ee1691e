"""Envelopes: how decoded records become updates of the output collection.

- ``AppendOnly``: every record is inserted (diff +1) at its time; no state.
- ``Upsert``: the output holds the latest value per key. A record for a key retracts
  the key's previous value and inserts the new one; a delete retracts it. The state is
  the current value per key, kept in a *state shard* (the recipe's "state"): on
  restart it is rehydrated as of ``t - 1`` and then evolves deterministically, so the
  retractions a restarted or second instance computes equal the committed ones.

Within one time the records of a key apply in address order; only the net change per
key is written (so a transaction that updates a row twice shows only its result).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import numpy as np
import pyarrow as pa

from persist_lib.ingest.decode import DELETE_COL, TRUNCATE_COL, UNCHANGED_COL, DecodeSpec
from persist_lib.ingest.errors import IngestConfigError, IngestInvariantError


class Envelope(ABC):
    kind: str = ""
    needs_state: bool = False

    def __init__(self, spec: DecodeSpec) -> None:
        self.spec = spec

    @abstractmethod
    def rehydrate(self, state: pa.Table | None) -> None:
        """Loads the state (user layout snapshot as of ``t - 1``; None: empty)."""

    @abstractmethod
    def apply(self, rows: pa.Table, t: int) -> tuple[pa.Table, pa.Table | None]:
        """(output updates, state updates) at time ``t`` for ``rows`` in address order."""

    def describe(self) -> dict[str, Any]:
        return {"envelope": self.kind}


def _updates(spec: DecodeSpec, keys: list[tuple[Any, ...]], vals: list[tuple[Any, ...]], diffs: list[int], t: int) -> pa.Table:
    cols: dict[str, pa.Array] = {}
    for i, f in enumerate(spec.key_schema):
        cols[f.name] = pa.array([k[i] for k in keys], f.type)
    for i, f in enumerate(spec.val_schema):
        cols[f.name] = pa.array([v[i] for v in vals], f.type)
    cols["ts"] = pa.array([t] * len(keys), pa.int64())
    cols["diff"] = pa.array(diffs, pa.int64())
    return pa.table(cols)


def empty_updates(spec: DecodeSpec) -> pa.Table:
    return _updates(spec, [], [], [], 0)


class AppendOnly(Envelope):
    kind = "append_only"
    needs_state = False

    def __init__(self, spec: DecodeSpec) -> None:
        super().__init__(spec)
        if spec.delete_field is not None:
            raise IngestConfigError(
                f"delete_field={spec.delete_field!r} only makes sense with the upsert envelope: "
                "an append-only collection never deletes; use envelope='upsert' or drop it"
            )

    def rehydrate(self, state: pa.Table | None) -> None:
        return None

    def apply(self, rows: pa.Table, t: int) -> tuple[pa.Table, pa.Table | None]:
        n = rows.num_rows
        names = self.spec.key_names + self.spec.val_names
        out = rows.select(names)
        out = out.append_column("ts", pa.array(np.full(n, t, dtype=np.int64)))
        out = out.append_column("diff", pa.array(np.ones(n, dtype=np.int64)))
        return out, None


class Upsert(Envelope):
    kind = "upsert"
    needs_state = True

    def __init__(self, spec: DecodeSpec) -> None:
        super().__init__(spec)
        self.state: dict[tuple[Any, ...], tuple[Any, ...]] = {}

    def rehydrate(self, state: pa.Table | None) -> None:
        self.state = {}
        if state is None or state.num_rows == 0:
            return
        keys = _tuples(state, self.spec.key_names)
        vals = _tuples(state, self.spec.val_names)
        diffs = state.column("diff").to_pylist()
        for k, v, d in zip(keys, vals, diffs, strict=True):
            if d != 1 or k in self.state:
                raise IngestInvariantError(
                    f"the upsert state holds key {k!r} with multiplicity {d} (or twice); the state "
                    "shard was written by something other than this pipeline: rebuild it in a new "
                    "rendition"
                )
            self.state[k] = v

    def apply(self, rows: pa.Table, t: int) -> tuple[pa.Table, pa.Table | None]:
        spec = self.spec
        keys = _tuples(rows, spec.key_names)
        vals = _tuples(rows, spec.val_names)
        deletes = rows.column(DELETE_COL).to_pylist() if rows.num_rows else []
        unchanged: list[Any] = (
            rows.column(UNCHANGED_COL).to_pylist()
            if UNCHANGED_COL in rows.column_names
            else [None] * rows.num_rows
        )
        truncs: list[Any] = (
            rows.column(TRUNCATE_COL).to_pylist()
            if TRUNCATE_COL in rows.column_names
            else [False] * rows.num_rows
        )
        vnames = spec.val_names
        latest: dict[tuple[Any, ...], tuple[Any, ...] | None] = {}
        for k, v, dele, unch, trunc in zip(keys, vals, deletes, unchanged, truncs, strict=True):
            if trunc:  # every key present so far goes
                for sk in self.state:
                    latest[sk] = None
                for lk in latest:
                    latest[lk] = None
                continue
            if dele:
                latest[k] = None
                continue
            if unch:
                prev = latest[k] if k in latest else self.state.get(k)
                if prev is not None:
                    keep = set(unch)
                    v = tuple(prev[i] if vnames[i] in keep else v[i] for i in range(len(v)))
            latest[k] = v
        out_k: list[tuple[Any, ...]] = []
        out_v: list[tuple[Any, ...]] = []
        out_d: list[int] = []
        for k, new in latest.items():
            old = self.state.get(k)
            if old == new:
                continue
            if old is not None:
                out_k.append(k)
                out_v.append(old)
                out_d.append(-1)
            if new is not None:
                out_k.append(k)
                out_v.append(new)
                out_d.append(1)
                self.state[k] = new
            else:
                del self.state[k]
        ups = _updates(spec, out_k, out_v, out_d, t)
        return ups, ups


def _tuples(table: pa.Table, names: list[str]) -> list[tuple[Any, ...]]:
    if table.num_rows == 0:
        return []
    if not names:
        return [()] * table.num_rows
    cols = [table.column(n).to_pylist() for n in names]
    return list(zip(*cols, strict=True))


def make_envelope(kind: str, spec: DecodeSpec) -> Envelope:
    if kind in ("append_only", "append", "none"):
        return AppendOnly(spec)
    if kind == "upsert":
        return Upsert(spec)
    raise IngestConfigError(f"unknown envelope {kind!r}: use 'append_only' or 'upsert'")
