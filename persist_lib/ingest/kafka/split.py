"""Splitting a consumed batch by partition, and converting it: ``_split`` cuts a
``consume()`` batch into runs of one partition with ascending offsets (``_Msgs``), in C
when the optional extension ``_split`` (``_split.c``, built by setup.py) is there, in
Python otherwise; ``split_batch`` and ``decode_split`` are the two stages of
``convert_batch`` (split on the consuming thread, decoded on a decoding thread, see
``prefetch``)."""

from __future__ import annotations

import importlib
import logging
import operator
from itertools import compress, repeat
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from persist_lib.config_rules import env_choice
from persist_lib.ingest.decode import DecodeSpec
from persist_lib.ingest.kafka.messages import _Batch, _Decoded, _Held, _Msgs

if TYPE_CHECKING:  # pragma: no cover
    from persist_lib.ingest.kafka.topic import KafkaTopic

log = logging.getLogger(__name__)


def _split(msgs: list[Any]) -> tuple[list[Any], list[tuple[int, _Msgs]]]:
    """One ``consume()`` batch -> (its error/event messages in order, [(partition, its
    messages)] for each run of one partition with ascending offsets, in the order
    consumed). One ``map`` over the batch per field (C calls, no Python frame per
    message); keys, timestamps and headers are left on the messages (``_Msgs``)."""
    if not msgs:
        return [], []
    from confluent_kafka import Message

    runs = _native_split(msgs)
    if runs is not None:
        return [], [
            (p, _Msgs(msgs[i:j], offs, vals, joined=joined, vlen=np.frombuffer(lens, dtype=np.int64).tolist()))
            for p, i, j, offs, vals, joined, lens in runs
        ]
    errs = list(map(Message.error, msgs))
    events: list[Any] = []
    if any(errs):  # (a KafkaError is truthy; its __eq__ rejects None, so no errs.count(None))
        events = list(compress(msgs, errs))
        msgs = list(compress(msgs, map(operator.is_, errs, repeat(None))))
        if not msgs:
            return events, []
    parts: list[int] = list(map(Message.partition, msgs))  # type: ignore[arg-type]
    offs: list[int] = list(map(Message.offset, msgs))  # type: ignore[arg-type]
    vals: list[bytes | None] = list(map(Message.value, msgs))
    n = len(parts)
    p = np.array(parts, dtype=np.int64)
    o = np.array(offs, dtype=np.int64)
    # runs of one partition, cut where the offsets don't ascend (a re-fetch after a reconnect)
    cuts = (np.flatnonzero((p[1:] != p[:-1]) | (o[1:] <= o[:-1])) + 1).tolist()
    if not cuts:
        return events, [(parts[0], _Msgs(msgs, offs, vals))]
    return events, [
        (parts[i], _Msgs(msgs[i:j], offs[i:j], vals[i:j]))
        for i, j in zip([0, *cuts], [*cuts, n], strict=True)
    ]


_native: Any = None  # persist_lib.ingest.kafka._split once bound; False: not available


def _native_split(msgs: list[Any]) -> list[tuple[int, int, int, list[int], list[bytes | None], bytes | None, bytes]] | None:
    """``_split``'s work (and decoding's join of the values) in one C pass when the
    optional extension ``_split`` is built (see its source): None when it is not,
    or when the batch holds an event (then the Python path). ``PERSIST_KAFKA_NATIVE=0``
    turns it off."""
    global _native
    if _native is None:
        _native = False
        if env_choice("PERSIST_KAFKA_NATIVE", ("0", "1"), "1") != "0":
            try:
                from confluent_kafka import Message

                # (by name: an optional extension, maybe not built -- and not the package)
                native = importlib.import_module("persist_lib.ingest.kafka._split")
                if native.bind(Message):
                    _native = native
            except ImportError:
                log.info("persist_lib.ingest.kafka._split is not built: Kafka batches are split in Python")
    if _native is False:
        return None
    return cast(Any, _native).split(msgs)


def _split_materialized(msgs: list[Any]) -> _Batch:
    """``_split`` with keys, timestamps and headers read off (the messages let go)."""
    events, groups = _split(msgs)
    return events, [(p, m.materialize()) for p, m in groups]


_Split = tuple[list[Any], list[tuple[int, _Held]], DecodeSpec | None]  # a batch split, not decoded yet


def split_batch(src: KafkaTopic, msgs: list[Any]) -> _Split:
    """The first stage of ``convert_batch``: the batch split by partition (``_split``),
    with the schema to decode it with (None: no ingestion attached one -- the messages
    are pulled into lists, nothing is left to decode)."""
    events, groups = _split(msgs)
    spec = src._spec
    if spec is None:
        return events, [(p, m.materialize()) for p, m in groups], None
    return events, list(groups), spec


def decode_split(src: KafkaTopic, sp: _Split) -> _Batch:
    """The second stage of ``convert_batch``: each partition's messages decoded
    (``_Decoded``); their ``Message`` objects are let go."""
    events, groups, spec = sp
    if spec is None:
        return events, groups
    return events, [(p, _Decoded.of(src, str(p), cast(_Msgs, m), spec)) for p, m in groups]


def convert_batch(src: KafkaTopic, msgs: list[Any]) -> _Batch:
    """A consumed batch, each partition's messages decoded right away (``_Decoded``),
    or -- when no ingestion attached its schema -- held as lists for later. What a
    reader's reader process (``reader_child``) and a reader without prefetching run; the
    prefetcher runs its two stages on two threads."""
    return decode_split(src, split_batch(src, msgs))
