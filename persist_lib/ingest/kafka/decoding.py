"""Decoding Kafka messages into the schema's rows (row-wise, so any chunking decodes
identically): key and value as ``json`` (an object's fields; a scalar JSON key fills a
single key field), ``text`` (UTF-8) or ``bytes`` into one field; ``include`` adds message
metadata (partition, offset, timestamp, headers, topic) as columns; with the upsert
envelope a null value (a tombstone) deletes its key. Also the raw record a message is
kept as (``_raw``, read back by ``raw.decode_kafka_raw``).

``KafkaDecoding`` is mixed into ``topic.KafkaTopic``, whose settings it reads."""

from __future__ import annotations

import base64
import dataclasses
import json
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from persist_lib.ingest.decode import (
    Decoded,
    DecodeSpec,
    ErrorRecord,
    cast_rowwise,
    decode_json_lines,
    merge_good_and_bad,
    raw_table,
)
from persist_lib.ingest.errors import IngestConfigError
from persist_lib.ingest.kafka.messages import _Msgs

_TOMBSTONE = "__kafka_tombstone"


class KafkaDecoding:
    """The decoding of a topic's messages (see the module docstring), from the topic's
    settings (``topic.KafkaTopic`` declares them as dataclass fields)."""

    topic: str
    key_format: str
    value_format: str
    key_field: str | None
    value_field: str | None
    _meta: dict[str, str]  # include: {column: metadata kind}
    _envelope: str

    if TYPE_CHECKING:  # pragma: no cover

        def _where(self) -> str: ...

    def _plan(self, spec: DecodeSpec) -> tuple[list[pa.Field], list[pa.Field], str | None, str | None]:
        """(fields from a JSON key, fields from a JSON value, text/bytes key field, value field)."""
        names = set(spec.key_names) | set(spec.val_names)
        for col in self._meta:
            if col not in names:
                raise IngestConfigError(
                    f"{self._where()}: include names column {col!r} ({self._meta[col]}) but the schema has "
                    f"no such field; add it (e.g. --value {col}:int64) or drop it from include"
                )
        key_fields = [pa.field(f.name, f.type, True) for f in spec.key_schema if f.name not in self._meta]
        val_fields = [pa.field(f.name, f.type, True) for f in spec.val_schema if f.name not in self._meta]
        kfield: str | None = None
        vfield: str | None = None
        from_key: list[pa.Field] = []
        if self.key_format == "json":
            from_key = key_fields
        elif self.key_format in ("text", "bytes"):
            kfield = self.key_field or (key_fields[0].name if len(key_fields) == 1 else None)
            if kfield is None or kfield not in names:
                raise IngestConfigError(
                    f"{self._where()}: key_format={self.key_format!r} needs key_field naming the field the "
                    f"key goes to (key fields: {[f.name for f in key_fields]})"
                )
            from_key = []
        if self.key_format in ("json", "text", "bytes"):
            from_val = val_fields if self.key_format == "json" else [f for f in key_fields + val_fields if f.name != kfield]
        else:
            from_val = key_fields + val_fields
        if self.value_format in ("text", "bytes"):
            cands = [f.name for f in from_val]
            vfield = self.value_field or (cands[0] if len(cands) == 1 else None)
            if vfield is None or vfield not in names:
                raise IngestConfigError(
                    f"{self._where()}: value_format={self.value_format!r} fills one field: pass value_field "
                    f"(candidates: {cands})"
                )
            missing = [n for n in cands if n != vfield]
            if missing:
                raise IngestConfigError(
                    f"{self._where()}: with value_format={self.value_format!r} fields {missing} get no data; "
                    "drop them, include them as metadata, or use value_format='json'"
                )
            from_val = []
        return from_key, from_val, kfield, vfield

    def decode_messages(self, partition: str, m: _Msgs, spec: DecodeSpec) -> Decoded:
        n = len(m)
        inp = spec.input_schema()
        from_key, from_val, kfield, vfield = self._plan(spec)
        bad: dict[int, tuple[str, str]] = {}
        cols: dict[str, pa.Array] = {}
        vals_all = m.vals
        tomb = (
            np.fromiter((v is None for v in vals_all), dtype=bool, count=n)
            if None in vals_all  # (a C-level scan: most chunks hold no tombstone)
            else np.zeros(n, dtype=bool)
        )
        upsert = self._envelope == "upsert"
        if from_val or vfield is not None:
            idx = np.flatnonzero(~tomb)
            # (in idx order; with no tombstone the values are all bytes)
            vals = [v for v in vals_all if v is not None] if len(idx) < n else cast(list[bytes], vals_all)
            self._fill(spec, "value", self.value_format, vals, idx, n, from_val, vfield, cols, bad, m.joined)
        if self.key_format != "none":
            keys_all = m.keys
            if None in keys_all:
                kidx = np.array([i for i, k in enumerate(keys_all) if k is not None], dtype=np.int64)
                keys = [k for k in keys_all if k is not None]
            else:
                kidx, keys = np.arange(n, dtype=np.int64), cast(list[bytes], keys_all)
            self._fill(spec, "key", self.key_format, keys, kidx, n, from_key, kfield, cols, bad)
        for col, kind in self._meta.items():
            cols[col] = self._metadata(kind, partition, m, inp.field(col).type)
        arrays = [cols.get(f.name, pa.nulls(n, f.type)) for f in inp]
        table = pa.Table.from_arrays(arrays, schema=inp)
        dspec = spec
        if upsert:
            table = table.append_column(_TOMBSTONE, pa.array(tomb, pa.bool_()))
            dspec = dataclasses.replace(spec, delete_field=_TOMBSTONE)
        badl = [(i, k, r) for i, (k, r) in sorted(bad.items())]
        if badl:
            mask = np.ones(n, dtype=bool)
            mask[[i for i, _, _ in badl]] = False
            table = table.filter(pa.array(mask))
        rows, allbad = merge_good_and_bad(dspec, n, table, badl)
        offs = m.offs
        errors = [ErrorRecord(partition, (offs[i],), kind, reason, self._raw(m, i)) for i, kind, reason in allbad]
        raw = None
        if spec.keep_raw:
            raw = raw_table(partition, [(o,) for o in offs], "kafka", [self._raw(m, i) for i in range(n)])
        return Decoded(rows, errors, raw)

    def _fill(
        self, spec: DecodeSpec, what: str, fmt: str, data: list[bytes], idx: Any, n: int,
        fields: list[pa.Field], single: str | None, cols: dict[str, pa.Array], bad: dict[int, tuple[str, str]],
        clean_joined: bytes | None = None,
    ) -> None:
        """Decodes keys or values (present at positions ``idx`` of ``n``) into ``cols``.
        ``clean_joined``: ``b"\n".join(data)``, known to hold no line break inside a
        value (the native split checked)."""
        pos = np.full(n, -1, dtype=np.int64)  # position -> row of the decoded table (-1: null)
        if fmt == "json":
            if not fields:
                return
            lines: list[bytes] = data
            pre_bad: dict[int, tuple[str, str]] = {}
            scalar_key = what == "key" and len(fields) == 1
            clean = clean_joined is not None and not scalar_key
            joined: bytes | None = clean_joined if clean else b"\n".join(data)
            assert joined is not None
            if not clean and (scalar_key or b"\r" in joined or joined.count(b"\n") != len(data) - 1):
                joined = None
                lines = []  # the slow path: a record spans lines, or scalar keys to wrap
                for j, b in enumerate(data):
                    if scalar_key and not b.lstrip().startswith(b"{"):
                        b = b'{"' + fields[0].name.encode() + b'":' + b + b"}"  # a scalar JSON key
                    if b"\n" in b or b"\r" in b:
                        try:
                            b = json.dumps(json.loads(b), separators=(",", ":")).encode()
                        except UnicodeDecodeError as e:
                            pre_bad[j] = ("invalid_utf8", f"the message {what} is not valid UTF-8: {e}")
                            b = b"\x00"
                        except ValueError as e:
                            pre_bad[j] = ("invalid_json", f"the message {what} is not valid JSON: {e}")
                            b = b"\x00"
                        except RecursionError:
                            pre_bad[j] = ("invalid_json", f"the message {what} is not valid JSON: nested too deeply")
                            b = b"\x00"
                    lines.append(b)
            table, jbad = decode_json_lines(spec, lines, schema=pa.schema(fields), joined=joined)
            badj = {i: (k, r) for i, k, r in jbad}
            badj.update(pre_bad)
            if not badj and len(lines) == n:  # (every message has one, and every one decoded)
                for f in fields:
                    cols[f.name] = table.column(f.name).combine_chunks() if n else pa.nulls(0, f.type)
                return
            good = [j for j in range(len(lines)) if j not in badj]
            for j, (k, r) in badj.items():
                bad.setdefault(int(idx[j]), (k, f"message {what}: {r}"))
            pos[np.asarray(idx, dtype=np.int64)[good]] = np.arange(len(good))
            sel = pa.array(pos, pa.int64(), mask=pos < 0)
            for f in fields:
                cols[f.name] = table.column(f.name).combine_chunks().take(sel) if table.num_rows else pa.nulls(n, f.type)
            return
        assert single is not None
        target = spec.input_schema().field(single).type
        arr = pa.array(data, pa.binary())
        if fmt == "text":
            arr, errs = cast_rowwise(arr, pa.string())
            for j, msg in errs.items():
                bad.setdefault(int(idx[j]), ("invalid_utf8", f"message {what} is not valid UTF-8 text: {msg}"))
        if not arr.type.equals(target):
            arr, errs = cast_rowwise(arr, target)
            for j, msg in errs.items():
                bad.setdefault(int(idx[j]), ("type_mismatch", f"message {what}: field {single!r}: cannot convert to {target}: {msg}"))
        pos[np.asarray(idx, dtype=np.int64)] = np.arange(len(data))
        cols[single] = arr.take(pa.array(pos, pa.int64(), mask=pos < 0)) if len(data) else pa.nulls(n, target)

    def _metadata(self, kind: str, partition: str, m: _Msgs, t: pa.DataType) -> pa.Array:
        n = len(m)
        if kind == "partition":
            arr: pa.Array = pa.array(np.full(n, int(partition), dtype=np.int64))
        elif kind == "offset":
            arr = pa.array(m.offs, pa.int64())
        elif kind == "topic":
            arr = pa.array([self.topic] * n, pa.string())
        elif kind == "timestamp":
            arr = pa.array(m.ts, pa.int64())
            if pa.types.is_timestamp(t):
                arr = arr.cast(pa.timestamp("ms", tz="UTC")).cast(t)
        else:  # headers: JSON [[key, value], ...] with UTF-8 text values (else base64: "b64:...")
            arr = pa.array([_headers_json(h) for h in m.hdrs], pa.string())
        return arr if arr.type.equals(t) else pc.cast(arr, t)

    def decoding(self) -> dict[str, Any]:
        """How messages are decoded (kept with each raw record, for rebuilds)."""
        return {
            "topic": self.topic, "key_format": self.key_format, "value_format": self.value_format,
            "key_field": self.key_field, "value_field": self.value_field, "include": dict(self._meta),
        }

    def _raw(self, m: _Msgs, i: int) -> bytes:
        """The message as the raw collection keeps it: key, value and header values in
        base64, the timestamp, and the decoding settings (``decode_kafka_raw``)."""
        k, v, h = m.key_at(i), m.vals[i], m.hdrs_at(i)
        return json.dumps(
            {
                "key": None if k is None else base64.b64encode(k).decode(),
                "value": None if v is None else base64.b64encode(v).decode(),
                "timestamp": m.ts_at(i),
                "headers": None if h is None else [[hk, None if hv is None else base64.b64encode(hv).decode()] for hk, hv in h],
                "decoding": self.decoding(),
            },
            separators=(",", ":"),
        ).encode()


def _headers_json(h: Any) -> str | None:
    if not h:
        return None if h is None else "[]"
    out = []
    for k, v in h:
        if v is None:
            out.append([k, None])
            continue
        try:
            out.append([k, v.decode("utf-8")])
        except UnicodeDecodeError:
            out.append([k, "b64:" + base64.b64encode(v).decode()])
    return json.dumps(out, separators=(",", ":"), ensure_ascii=False)
