"""Decoding ``kafka`` raw records again (a rebuild from the raw collection,
``ingest.rebuild``): each record carries its key, value, timestamp, headers and the
decoding settings it was read with (``decoding.KafkaDecoding._raw``), so it decodes
exactly as the source did."""

from __future__ import annotations

import base64
import json
from collections.abc import Sequence

import pyarrow as pa

from persist_lib.ingest.decode import DecodeSpec
from persist_lib.ingest.kafka.messages import _Msgs
from persist_lib.ingest.kafka.topic import KafkaTopic


def decode_kafka_raw(
    spec: DecodeSpec, envelope: str, partitions: Sequence[str], offsets: Sequence[int], raws: Sequence[bytes]
) -> tuple[pa.Table, list[tuple[int, str, str]]]:
    """Decodes raw ``kafka`` records (in partition, offset order) as the source did:
    rows, and ``(index, kind, reason)`` of the bad ones (``rebuild.decode_raw``)."""
    docs = [json.loads(r) for r in raws]
    out: list[pa.Table] = []
    bad: list[tuple[int, str, str]] = []
    i = 0
    while i < len(docs):
        j = i
        while j < len(docs) and partitions[j] == partitions[i] and docs[j]["decoding"] == docs[i]["decoding"]:
            j += 1
        d = docs[i]["decoding"]
        src = KafkaTopic(
            "rebuild:0", d["topic"], key_format=d["key_format"], value_format=d["value_format"],
            key_field=d["key_field"], value_field=d["value_field"], include=d["include"],
        )
        src.bind_envelope(envelope)

        def b64(x: str | None) -> bytes | None:
            return None if x is None else base64.b64decode(x)

        m = _Msgs(
            None,
            list(offsets[i:j]),
            [b64(x["value"]) for x in docs[i:j]],
            keys=[b64(x["key"]) for x in docs[i:j]],
            ts=[x["timestamp"] for x in docs[i:j]],
            hdrs=[None if x["headers"] is None else [(k, b64(v)) for k, v in x["headers"]] for x in docs[i:j]],
        )
        dec = src.decode_messages(partitions[i], m, spec)
        out.append(dec.rows)
        where = {(e.partition, e.address[0]): e for e in dec.errors}
        for k in range(i, j):
            e = where.get((partitions[k], offsets[k]))
            if e is not None:
                bad.append((k, e.kind, e.reason))
        i = j
    rows = pa.concat_tables(out) if out else spec.rows_schema().empty_table()
    return rows, bad
