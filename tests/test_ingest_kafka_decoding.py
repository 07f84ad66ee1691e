"""Kafka decoding without a broker (confluent-kafka ``Message`` objects built by hand):
however the messages are chunked -- decoded one by one, as one bulk chunk, or decoded
as fetched in random consume batches and then cut at random binding bounds (what the
reader does since it decodes on the prefetch thread) -- the rows, the error records
(kind, partition, offset, reason, raw) and the raw records are the same. Bad messages
inside a bulk JSON chunk get the error they get alone, and the good ones around them
decode as they would alone."""

from __future__ import annotations

import gc
import json
import random
import shutil
import threading
import time
from collections.abc import Callable
from typing import Any, cast

import numpy as np
import pyarrow as pa
import pytest

confluent_kafka = pytest.importorskip("confluent_kafka")

from persist_lib.ingest.decode import DecodeSpec, ErrorRecord, decode_json_lines  # noqa: E402
from persist_lib.ingest.kafka import KafkaSource  # noqa: E402
from persist_lib.ingest.kafka import messages as messages_mod  # noqa: E402
from persist_lib.ingest.kafka import prefetch as prefetch_mod  # noqa: E402
from persist_lib.ingest.kafka import split as split_mod  # noqa: E402
from persist_lib.ingest.kafka.messages import _Decoded, _Msgs  # noqa: E402
from persist_lib.ingest.kafka.prefetch import _gc_paused, _Prefetcher  # noqa: E402
from persist_lib.ingest.kafka.split import _split, decode_split, split_batch  # noqa: E402

Message = confluent_kafka.Message
KafkaError = confluent_kafka.KafkaError

# append-only: the key is where the message came from; metadata columns
AKEY = pa.schema([("kafka_partition", pa.int64()), ("kafka_offset", pa.int64())])
AVAL = pa.schema([
    ("id", pa.int64()), ("name", pa.string()), ("qty", pa.float64()),
    ("kafka_timestamp", pa.int64()), ("kafka_headers", pa.string()),
])
# upsert: a scalar JSON key, tombstones
UKEY = pa.schema([("id", pa.int64())])
UVAL = pa.schema([("name", pa.string()), ("qty", pa.float64())])

BAD_VALUES = [
    b'{"id": 1, "name": ',  # invalid JSON
    b"[1, 2, 3]",  # not an object
    b'{"id": "seven", "name": "x"}',  # type mismatch
    b'{"name": "no id", "qty": 2}',  # fine for append-only (the key is the address)
    b"\xff\xfe",  # not UTF-8
    b'{"id": 5,\n "name": "two\\nlines", "qty": 1}',  # a value spanning lines (the slow path)
    b'{"id": 6, "name": "cr", "qty": 2}\r',
    b'{"id": 9223372036854775808, "name": "too big"}',  # int64 overflow
]


def _value(rng: random.Random, i: int, tombstones: bool) -> bytes | None:
    r = rng.random()
    if tombstones and r < 0.1:
        return None
    if r < 0.25:
        return rng.choice(BAD_VALUES)
    return json.dumps({"id": i, "name": f"n{i}", "qty": rng.randrange(100) / 4}).encode()


def _messages(seed: int, n: int, *, upsert: bool, partitions: int = 3) -> list[Any]:
    """Messages in the order a consumer could return them: runs of one partition,
    offsets ascending per partition, with end-of-partition events in between."""
    rng = random.Random(seed)
    nxt = [rng.randrange(0, 50) for _ in range(partitions)]
    out: list[Any] = []
    while len(out) < n:
        p = rng.randrange(partitions)
        for _ in range(rng.randrange(1, 40)):
            o = nxt[p]
            nxt[p] += 1 if rng.random() < 0.9 else rng.randrange(2, 5)  # (offset gaps: markers)
            if upsert:
                k = rng.choice([str(rng.randrange(20)).encode(), str(rng.randrange(20)).encode(), b"{oops", None])
            else:
                k = None if rng.random() < 0.5 else f"k{o}".encode()
            ts = (1, 1_700_000_000_000 + o) if rng.random() < 0.9 else (0, -1)
            hdrs = None if rng.random() < 0.7 else [("h", b"v"), ("bin", b"\xff")]
            out.append(Message(topic="t", partition=p, offset=o, key=k, value=_value(rng, o, upsert),
                               headers=hdrs, timestamp=ts))
        if rng.random() < 0.2:
            out.append(Message(topic="t", partition=p, offset=nxt[p], error=KafkaError(KafkaError._PARTITION_EOF)))
    return out


def _source(upsert: bool) -> tuple[KafkaSource, DecodeSpec]:
    if upsert:
        src = KafkaSource("localhost:1", "t", key_format="json")
        spec = DecodeSpec(UKEY, UVAL, keep_raw=True)
        src.attach(None, "dec", spec)  # type: ignore[arg-type]
        src.bind_envelope("upsert")
    else:
        src = KafkaSource("localhost:1", "t", include="partition,offset,timestamp,headers")
        spec = DecodeSpec(AKEY, AVAL, keep_raw=True)
        src.attach(None, "dec", spec)  # type: ignore[arg-type]
        src.bind_envelope("append_only")
    return src, spec


def _by_partition(msgs: list[Any]) -> dict[int, list[Any]]:
    out: dict[int, list[Any]] = {}
    for m in msgs:
        if m.error() is None:
            out.setdefault(m.partition(), []).append(m)
    return out


def _plain(ms: list[Any]) -> _Msgs:
    """The messages as lists (the rebuild's form): the reference decoding's input."""
    ts = [m.timestamp()[1] if m.timestamp()[0] else None for m in ms]
    return _Msgs(None, [m.offset() for m in ms], [m.value() for m in ms],
                 keys=[m.key() for m in ms], ts=ts, hdrs=[m.headers() for m in ms])


def _result(rows: list[pa.Table], errors: list[ErrorRecord], raws: list[pa.Table | None]) -> tuple[Any, ...]:
    t = [r for r in rows if r.num_rows]
    raw = [r for r in raws if r is not None and r.num_rows]
    return (
        pa.concat_tables(t).to_pylist() if t else [],
        [(e.partition, tuple(e.address), e.kind, e.reason, e.raw) for e in errors],
        pa.concat_tables(raw).to_pylist() if raw else [],
    )


@pytest.mark.parametrize("upsert", [False, True], ids=["append_only", "upsert"])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_any_chunking_and_decoding_at_fetch_time_give_the_same_result(upsert: bool, seed: int) -> None:
    src, spec = _source(upsert)
    msgs = _messages(seed, 600, upsert=upsert)
    rng = random.Random(seed * 7)
    # decoded as the reader does: random consume batches, split, decoded per run, buffered
    buf: dict[int, _Decoded] = {}
    i = 0
    events = 0
    while i < len(msgs):
        j = min(len(msgs), i + rng.randrange(1, 120))
        ev, groups = _split(msgs[i:j])
        events += len(ev)
        for p, m in groups:
            d = _Decoded.of(src, str(p), m, spec)
            if p in buf:
                buf[p].extend(d)
            else:
                buf[p] = d
        i = j
    assert events == sum(1 for m in msgs if m.error() is not None)
    for p, ms in _by_partition(msgs).items():
        plain = _plain(ms)
        whole = src.decode_messages(str(p), plain, spec)  # one bulk chunk
        alone = [src.decode_messages(str(p), plain.slice(k, k + 1), spec) for k in range(len(ms))]
        ref = _result([whole.rows], whole.errors, [whole.raw])
        assert _result([d.rows for d in alone], [e for d in alone for e in d.errors], [d.raw for d in alone]) == ref
        assert ref[1], "some messages must be bad"
        # cut at random bounds (bindings), each piece decoded on its own
        held = buf[p]
        assert held.offs == plain.offs and held.nbytes == plain.nbytes
        cuts = sorted(rng.sample(range(1, len(ms)), 6))
        pieces = [held.slice(a, b) for a, b in zip([0, *cuts], [*cuts, len(ms)], strict=True)]
        decs = [x.decode(src, str(p), spec) for x in pieces]
        assert _result([d.rows for d in decs], [e for d in decs for e in d.errors], [d.raw for d in decs]) == ref
        assert sum(x.nbytes for x in pieces) == plain.nbytes
        # the lazily read keys/timestamps/headers (off the Message objects) are the same
        lazy = _split(ms)[1]
        assert len(lazy) == 1
        lz = lazy[0][1]
        assert lz.msgs is not None
        assert [lz.key_at(k) for k in range(len(ms))] == plain.keys
        assert [lz.ts_at(k) for k in range(len(ms))] == plain.ts
        assert lz.materialize().hdrs == plain.hdrs and lz.msgs is None
        d = src.decode_messages(str(p), _split(ms)[1][0][1], spec)
        assert _result([d.rows], d.errors, [d.raw]) == ref


def test_split_cuts_runs_at_partition_changes_and_refetched_offsets() -> None:
    def m(p: int, o: int) -> Any:
        return Message(topic="t", partition=p, offset=o, value=b"{}", timestamp=(0, -1))

    eof = Message(topic="t", partition=1, offset=3, error=KafkaError(KafkaError._PARTITION_EOF))
    batch = [m(0, 5), m(0, 6), m(1, 1), eof, m(1, 2), m(0, 7), m(0, 3), m(0, 4), m(0, 8)]
    events, groups = _split(batch)
    assert [e.offset() for e in events] == [3]
    assert [(p, g.offs) for p, g in groups] == [(0, [5, 6]), (1, [1, 2]), (0, [7]), (0, [3, 4, 8])]
    held = groups[0][1].materialize()
    for _, g in groups[2:]:
        held.extend(g)  # a re-fetch after a reconnect: what was held already is dropped
    assert held.offs == [5, 6, 7, 8]
    assert _split([]) == ([], [])


def test_bulk_json_with_bad_lines_decodes_like_line_by_line() -> None:
    spec = DecodeSpec(UKEY, UVAL)
    rng = random.Random(5)
    lines = [
        rng.choice([b'{"id": 1, "name": ', b"[1]", b'{"id": "x"}', b'{"id": 2, "qty": "many"}'])
        if rng.random() < 0.2 else json.dumps({"id": i, "name": f"n{i}", "qty": i / 2}).encode()
        for i in range(300)
    ]
    bulk, bad = decode_json_lines(spec, lines, joined=b"\n".join(lines))
    again, bad2 = decode_json_lines(spec, lines)
    assert bulk.equals(again) and bad == bad2 and bad
    rows: list[dict[str, Any]] = []
    alone_bad = []
    for i, line in enumerate(lines):
        t, b = decode_json_lines(spec, [line])
        rows += t.to_pylist()
        alone_bad += [(i, k, r) for _, k, r in b]
    assert bulk.to_pylist() == rows and bad == alone_bad


def test_gc_pause_nests_and_restores_what_it_found() -> None:
    assert gc.isenabled()
    with _gc_paused():
        assert not gc.isenabled()
        with _gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with _gc_paused():
            pass
        assert not gc.isenabled()  # (it was off: it stays off)
    finally:
        gc.enable()


def test_the_reader_never_waits_a_second_for_a_refill() -> None:
    """librdkafka's default fetch.queue.backoff.ms (1 s) paused fetching whenever the
    local queue had been full once; ``run_once`` took the pause for the end of the topic."""
    conf = KafkaSource("localhost:1", "t")._consumer_conf()
    assert int(conf["fetch.queue.backoff.ms"]) * 1000 < KafkaSource("localhost:1", "t").poll_s * 1e6


class _Batches:
    """A consumer stand-in for the prefetcher's own logic: ``consume`` hands out fixed
    batches of hand-built messages in order, then nothing (the broker path is tested
    against the real broker in test_ingest_kafka.py)."""

    def __init__(self, batches: list[list[Any]]) -> None:
        self.batches = list(batches)
        self.calls = 0

    def consume(self, n: int, timeout: float) -> list[Any]:
        self.calls += 1
        if not self.batches:
            if timeout > 0:
                time.sleep(min(timeout, 0.01))
            return []
        b = self.batches[0]
        if len(b) > n:  # (what consume does: at most n; the rest stays queued)
            self.batches[0] = b[n:]
            return b[:n]
        return self.batches.pop(0)


def _drain(pf: _Prefetcher, total: int, timeout: float = 10.0) -> list[Any]:
    out: list[Any] = []
    got = 0
    deadline = time.monotonic() + timeout
    while got < total:
        assert time.monotonic() < deadline, f"only {got} of {total} messages came out"
        for (events, groups), _at in pf.take(10**9, 0.2):
            out.append((events, groups))
            got += len(events) + sum(len(m) for _, m in groups)
    return out


@pytest.mark.parametrize("seed", [1, 2])
def test_prefetcher_hands_batches_over_in_consume_order_whichever_decoding_ends_first(seed: int) -> None:
    """Two decoding threads finish batches out of order (a random delay per batch): the
    reader still gets them in the order ``consume`` returned them, and every message's
    decoding equals decoding its partition's messages at once."""
    src, spec = _source(False)
    msgs = _messages(seed, 900, upsert=False)
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(msgs)), 25))
    batches = [msgs[a:b] for a, b in zip([0, *cuts], [*cuts, len(msgs)], strict=True)]
    delays = {i: rng.choice([0.0, 0.0, 0.02, 0.05]) for i in range(len(batches))}
    order: list[int] = []
    lock = threading.Lock()
    seq = iter(range(len(batches)))

    def split(ms: list[Any]) -> Any:
        i = next(seq)
        return (i, split_batch(src, ms))

    def decode(sp: Any) -> Any:
        i, inner = sp
        time.sleep(delays[i])
        with lock:
            order.append(i)
        return decode_split(src, inner)

    pf = _Prefetcher(_Batches(batches), 10**6, "test", split, decode)  # type: ignore[arg-type]
    try:
        assert pf._DECODERS >= 2
        out = _drain(pf, len(msgs))
    finally:
        pf.close()
    assert order != sorted(order), "decoding never finished out of order: the test shows nothing"
    got: dict[int, list[_Decoded]] = {}
    events = []
    for ev, groups in out:
        events += ev
        for p, d in groups:
            got.setdefault(p, []).append(d)
    assert [(m.partition(), m.offset()) for m in events] == [
        (m.partition(), m.offset()) for m in msgs if m.error() is not None
    ]
    for p, ms in _by_partition(msgs).items():
        ds = got[p]
        assert [o for d in ds for o in d.offs] == [m.offset() for m in ms]  # (in order, once)
        whole = src.decode_messages(str(p), _plain(ms), spec)
        decs = [d.decode(src, str(p), spec) for d in ds]
        assert _result([d.rows for d in decs], [e for d in decs for e in d.errors], [d.raw for d in decs]) == (
            _result([whole.rows], whole.errors, [whole.raw])
        )
    assert gc.isenabled() and prefetch_mod._gc_depth == 0


def test_a_failing_decoding_comes_after_the_batches_before_it_and_stays() -> None:
    src, _spec = _source(False)
    msgs = [m for m in _messages(5, 300, upsert=False) if m.error() is None]
    batches = [msgs[i : i + 50] for i in range(0, len(msgs), 50)]
    seq = iter(range(len(batches)))

    def split(ms: list[Any]) -> Any:
        return (next(seq), split_batch(src, ms))

    def decode(sp: Any) -> Any:
        i, inner = sp
        if i == 2:
            raise ValueError("decoding batch 2 failed")
        time.sleep(0.03 if i < 2 else 0.0)  # (the later batches finish first)
        return decode_split(src, inner)

    pf = _Prefetcher(_Batches(batches), 10**6, "test", split, decode)  # type: ignore[arg-type]
    try:
        first = _drain(pf, 100)
        assert [o for _, g in first for _, d in g for o in d.offs] == [m.offset() for m in msgs[:100]]
        for _ in range(2):  # (sticky: the reader can't skip past it)
            with pytest.raises(ValueError, match="batch 2"):
                pf.take(10**9, 1.0)
    finally:
        pf.close()
    assert gc.isenabled() and prefetch_mod._gc_depth == 0


def test_the_collector_is_paused_while_messages_wait_for_decoding_and_back_after_close() -> None:
    """``Message`` objects are never walked by a collection: the collector is off from a
    batch's consume until its decoding let go of them; closing with batches still
    waiting gives the pause back."""
    src, _spec = _source(False)
    msgs = [m for m in _messages(7, 200, upsert=False) if m.error() is None]
    release = threading.Event()
    started = threading.Event()

    def decode(sp: Any) -> Any:
        started.set()
        release.wait(10)
        return decode_split(src, sp)

    split: Callable[[list[Any]], Any] = lambda ms: split_batch(src, ms)  # noqa: E731
    assert gc.isenabled()
    pf = _Prefetcher(_Batches([msgs[:100], msgs[100:]]), 10**6, "test", split, decode)
    try:
        assert started.wait(5)
        assert not gc.isenabled()  # (a batch is in decoding, one more waits)
        release.set()
        _drain(pf, len(msgs))
        deadline = time.monotonic() + 5
        while not gc.isenabled() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert gc.isenabled()  # (everything decoded and taken: nothing holds the pause)
    finally:
        release.set()
        pf.close()
    assert gc.isenabled() and prefetch_mod._gc_depth == 0
    # closed while batches wait for decoding
    release.clear()
    started.clear()
    pf = _Prefetcher(_Batches([msgs[:50], msgs[50:100], msgs[100:150]]), 10**6, "test", split, decode)
    assert started.wait(5)
    deadline = time.monotonic() + 5
    while pf._undecoded < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not gc.isenabled()
    threading.Timer(0.2, release.set).start()  # (the decoding in progress ends; close drops the rest)
    pf.close()
    assert gc.isenabled() and prefetch_mod._gc_depth == 0



class _Late:
    """A consumer stand-in whose batch arrives while ``consume`` waits: nothing for a
    zero timeout (the local queue is empty), the batch once it is asked to wait."""

    def __init__(self, batch: list[Any]) -> None:
        self.batch = batch

    def consume(self, n: int, timeout: float) -> list[Any]:
        if timeout <= 0 or not self.batch:
            return []
        b, self.batch = self.batch, []
        return b


def test_a_conversion_that_raises_leaves_the_collector_on() -> None:
    """A batch's conversion raising (in ``_consume``, queued or waited for; on the
    prefetch thread, where the error reaches the reader) must not leave a hold on the
    collector behind: nobody would release it and the process would run without cyclic
    garbage collection from then on."""
    msgs = [Message(topic="t", partition=0, offset=o, value=b"{}") for o in range(5)]

    def convert(ms: list[Any]) -> Any:
        if not ms:
            return ([], [])
        raise ValueError("converting the batch failed")

    try:
        for consumer in (_Batches([msgs]), _Late(msgs)):
            with pytest.raises(ValueError, match="converting the batch failed"):
                prefetch_mod._consume(consumer, 10, 0.5, convert, hold=True)
            assert gc.isenabled() and prefetch_mod._gc_depth == 0, type(consumer).__name__
        pf = _Prefetcher(_Late(msgs), 10**6, "test", convert, lambda sp: sp)
        try:
            with pytest.raises(ValueError, match="converting the batch failed"):
                pf.take(10**9, 5.0)
        finally:
            pf.close()
        assert gc.isenabled() and prefetch_mod._gc_depth == 0
    finally:  # (a leaked hold must not turn the collector off for the tests after this one)
        if prefetch_mod._gc_depth:
            prefetch_mod._gc_depth = 0
            gc.enable()


@pytest.mark.parametrize("decoded", [False, True], ids=["messages", "decoded"])
def test_a_refetch_into_an_empty_buffer_keeps_only_offsets_at_or_past_the_position(decoded: bool) -> None:
    """``_buffer`` (the reader's ``_poll``): offsets 0..9 buffered and cut (the buffer
    empty, the position 10), then a re-fetch of 5..14 arrives: only 10..14 are buffered;
    a later re-fetch into the non-empty buffer adds only what is past its last offset."""
    src, spec = _source(False)

    def fetched(offs: range) -> Any:
        ms = [Message(topic="t", partition=0, offset=o, value=json.dumps({"id": o}).encode(), timestamp=(0, -1)) for o in offs]
        sp = split_batch(src, ms)
        groups = decode_split(src, sp)[1] if decoded else sp[1]
        assert len(groups) == 1
        return groups[0][1]

    buf: dict[int, Any] = {}
    assert messages_mod._buffer(buf, 0, 0, fetched(range(10))) == 10
    buf[0] = buf[0].slice(10, 10)  # (what ``_cut`` leaves: everything was cut)
    assert messages_mod._buffer(buf, 0, 10, fetched(range(5, 15))) == 5
    assert buf[0].offs == list(range(10, 15))
    assert messages_mod._buffer(buf, 0, 10, fetched(range(12, 17))) == 2
    assert buf[0].offs == list(range(10, 17))
    d = buf[0].decode(src, "0", spec)
    assert [r["kafka_offset"] for r in d.rows.to_pylist()] == list(range(10, 17))
    assert messages_mod._buffer(buf, 0, 10, fetched(range(3, 9))) == 0 and buf[0].offs == list(range(10, 17))

def _native_module() -> Any:
    try:
        from persist_lib.ingest.kafka import _split as native  # type: ignore[attr-defined]
    except ImportError:
        if shutil.which("cc") or shutil.which("gcc"):
            pytest.fail("persist_lib.ingest.kafka._split is not built though a C compiler is here: pip install -e .")
        pytest.skip("no C compiler: the native split is not built")
    return native


def _python_split(msgs: list[Any]) -> tuple[list[Any], list[tuple[int, _Msgs]]]:
    saved = split_mod._native
    split_mod._native = False
    try:
        return _split(msgs)
    finally:
        split_mod._native = saved


def test_the_reader_splits_with_the_native_extension(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the extension is built, the reader's ``_split`` binds it (from its place in
    the package, ``persist_lib.ingest.kafka._split``) and takes the C path -- a clean run
    comes with its values joined, which only the C path does; ``PERSIST_KAFKA_NATIVE=0``
    keeps the Python path."""
    native = _native_module()
    msgs = [Message(topic="t", partition=0, offset=o, value=b"{}") for o in range(3)]
    monkeypatch.setattr(split_mod, "_native", None)  # (bound again, as in a fresh process)
    monkeypatch.delenv("PERSIST_KAFKA_NATIVE", raising=False)
    (_, m), = _split(msgs)[1]
    assert split_mod._native is native
    assert m.joined == b"{}\n{}\n{}" and m.offs == [0, 1, 2]
    monkeypatch.setattr(split_mod, "_native", None)
    monkeypatch.setenv("PERSIST_KAFKA_NATIVE", "0")
    (_, m), = _split(msgs)[1]
    assert split_mod._native is False and m.joined is None and m.offs == [0, 1, 2]


@pytest.mark.parametrize("seed", range(4))
def test_native_split_gives_what_the_python_split_gives(seed: int) -> None:
    """The C split (``kafka._split``) against the Python one on random batches: the same
    runs (partition changes, re-fetched offsets), offsets, values, Message objects; the
    values joined exactly when no value is a tombstone or holds a line break; events and
    anything but ``Message`` objects go to the Python path."""
    native = _native_module()
    assert native.bind(Message)
    rng = random.Random(seed)
    msgs = [m for m in _messages(seed, 700, upsert=seed % 2 == 1) if m.error() is None]
    # re-fetched offsets, empty values, values with line breaks
    extra = [Message(topic="t", partition=0, offset=o, value=v) for o, v in [(3, b""), (2, b"a\rb"), (2, b"{}")]]
    msgs[100:100] = extra
    for k in range(16):
        i = rng.randrange(len(msgs))
        batch = msgs[i : i + rng.randrange(1, 200)]
        runs = native.split(batch)
        assert runs is not None
        ev, groups = _python_split(batch)
        assert ev == []
        assert [(p, m.offs, m.vals) for p, m in groups] == [(r[0], r[3], r[4]) for r in runs]
        assert [batch[r[1] : r[2]] for r in runs] == [m.msgs for _, m in groups]
        for r, (_, m) in zip(runs, groups, strict=True):
            clean = None not in m.vals and not any(b"\n" in v or b"\r" in v for v in m.vals if v is not None)
            assert r[5] == (b"\n".join(cast(list[bytes], m.vals)) if clean else None)
            assert np.frombuffer(r[6], dtype=np.int64).tolist() == [0 if v is None else len(v) for v in m.vals]
        if k % 4:
            continue
        # what the reader gets through _split either way decodes the same
        src, spec = _source(seed % 2 == 1)
        nat = _split(batch)[1]
        assert all(m.joined is not None or r[5] is None for (_, m), r in zip(nat, runs, strict=True))
        for (p, a), (_, b) in zip(nat, groups, strict=True):
            da, db = src.decode_messages(str(p), a, spec), src.decode_messages(str(p), b, spec)
            assert _result([da.rows], da.errors, [da.raw]) == _result([db.rows], db.errors, [db.raw])
            assert _Decoded.of(src, str(p), a, spec).vlen == _Decoded.of(src, str(p), b, spec).vlen
    eof = Message(topic="t", partition=1, offset=3, error=KafkaError(KafkaError._PARTITION_EOF))
    assert native.split(msgs[:5] + [eof]) is None  # (events: the Python path)
    assert native.split([*msgs[:3], "not a message"]) is None
    assert native.split([]) == []
