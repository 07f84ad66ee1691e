"""Parts: exact round trips of every supported type, verification and corruption."""

from __future__ import annotations

import datetime
import decimal
import hashlib
import re
import uuid
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from persist_lib.errors import (
    BlobNotFound,
    CorruptionError,
    InvalidBlobKey,
    InvalidUsage,
    StaleSchema,
)
from persist_lib.location.mem import MemBlob
from persist_lib.shard.batch_meta import PartMeta
from persist_lib.shard.codec import Schemas, internal_schema, normalize_updates
from persist_lib.shard.consolidate import consolidate
from persist_lib.shard.parts import (
    BLOB_KEY_RE,
    decode_part,
    encode_part,
    fetch_part,
    part_blob_key,
    part_meta_for,
)

UTC = datetime.UTC
D = decimal.Decimal

# (type, three values: the last is always None)
SAMPLES: dict[str, tuple[pa.DataType, list[Any]]] = {
    "i8": (pa.int8(), [-128, 127, None]),
    "i16": (pa.int16(), [-5, 32767, None]),
    "i32": (pa.int32(), [-(2**31), 7, None]),
    "i64": (pa.int64(), [-(2**63), 2**63 - 1, None]),
    "u8": (pa.uint8(), [0, 255, None]),
    "u16": (pa.uint16(), [1, 65535, None]),
    "u32": (pa.uint32(), [2**32 - 1, 0, None]),
    "u64": (pa.uint64(), [2**64 - 1, 0, None]),
    "f16": (pa.float16(), [1.5, -0.0, None]),
    "f32": (pa.float32(), [1.25, float("inf"), None]),
    "f64": (pa.float64(), [-1e300, 0.1, None]),
    "dec128": (pa.decimal128(12, 3), [D("123456789.123"), D("-0.001"), None]),
    "dec256": (pa.decimal256(60, 10), [D("1" * 50 + ".0123456789"), D("-1"), None]),
    "s": (pa.string(), ["héllo", "", None]),
    "ls": (pa.large_string(), ["x" * 1000, "\x00", None]),
    "b": (pa.binary(), [b"\x00\xff", b"", None]),
    "lb": (pa.large_binary(), [b"abc", b"\x01" * 100, None]),
    "fsb": (pa.binary(3), [b"abc", b"\x00\x00\x00", None]),
    "bool": (pa.bool_(), [True, False, None]),
    "d32": (pa.date32(), [datetime.date(1, 1, 1), datetime.date(2024, 2, 29), None]),
    "d64": (pa.date64(), [datetime.date(1970, 1, 1), datetime.date(9999, 12, 31), None]),
    "ts_s": (
        pa.timestamp("s"),
        [datetime.datetime(2020, 1, 1, 1, 2, 3), datetime.datetime(1900, 1, 1), None],
    ),
    "ts_ms_tz": (
        pa.timestamp("ms", tz="Europe/Berlin"),
        [
            datetime.datetime(2021, 6, 1, 12, tzinfo=UTC),
            datetime.datetime(1970, 1, 1, tzinfo=UTC),
            None,
        ],
    ),
    "ts_us_tz": (
        pa.timestamp("us", tz="+05:30"),
        [
            datetime.datetime(2021, 6, 1, 12, 0, 0, 1, tzinfo=UTC),
            datetime.datetime(2000, 1, 1, tzinfo=UTC),
            None,
        ],
    ),
    "ts_ns_tz": (pa.timestamp("ns", tz="UTC"), [1_700_000_000_123_456_789, -1, None]),
    "t32s": (pa.time32("s"), [datetime.time(23, 59, 59), datetime.time(0), None]),
    "t32ms": (pa.time32("ms"), [datetime.time(1, 2, 3, 4000), datetime.time(0), None]),
    "t64us": (pa.time64("us"), [datetime.time(1, 2, 3, 4), datetime.time(0), None]),
    "t64ns": (pa.time64("ns"), [86_399_999_999_999, 1, None]),
    "dur_s": (pa.duration("s"), [datetime.timedelta(days=-3), datetime.timedelta(0), None]),
    "dur_ns": (pa.duration("ns"), [123, -456, None]),
    "struct": (
        pa.struct(
            [
                pa.field("a", pa.int64(), nullable=False),
                ("b", pa.string()),
                ("c", pa.struct([("x", pa.date64())])),
            ]
        ),
        [
            {"a": 1, "b": None, "c": {"x": datetime.date(2000, 1, 1)}},
            {"a": 2, "b": "z", "c": None},
            None,
        ],
    ),
    "list": (pa.list_(pa.int32()), [[1, None, 3], [], None]),
    "list_nn": (pa.list_(pa.field("item", pa.string(), nullable=False)), [["a", "b"], [], None]),
    "large_list": (
        pa.large_list(pa.timestamp("us", tz="UTC")),
        [[datetime.datetime(2020, 1, 1, tzinfo=UTC)], [None], None],
    ),
    "fsl": (pa.list_(pa.float64(), 2), [[1.0, 2.0], [None, -0.0], None]),
    "list_struct": (
        pa.list_(pa.struct([("k", pa.string()), ("v", pa.list_(pa.decimal128(5, 2)))])),
        [[{"k": "a", "v": [D("1.25")]}, None], [{"k": None, "v": None}], None],
    ),
}


def _table_for(schemas: Schemas, cols: dict[str, list[Any]], n: int) -> pa.Table:
    arrays = []
    for f in internal_schema(schemas):
        if f.name in ("t", "d"):
            arrays.append(pa.array(list(range(n)) if f.name == "t" else [1] * n, pa.int64()))
        else:
            arrays.append(pa.array(cols[f.name.split(".", 1)[1]], f.type))
    return pa.Table.from_arrays(arrays, schema=internal_schema(schemas))


def _encode(table: pa.Table, schemas: Schemas) -> tuple[bytes, PartMeta]:
    data = encode_part(table, schemas)
    return data, part_meta_for(data, table, "s1/w1/p1", inline=False)


def _decode(data: bytes, schemas: Schemas, meta: PartMeta) -> pa.Table:
    return decode_part(
        data,
        schemas,
        expected_sha256=meta.sha256,
        expected_size=meta.size,
        shard="s1",
        key="s1/w1/p1",
    )


def test_every_supported_type_round_trips_exactly() -> None:
    names = list(SAMPLES)
    half = len(names) // 2
    key = pa.schema([(n, SAMPLES[n][0]) for n in names[:half]])
    val = pa.schema([(n, SAMPLES[n][0]) for n in names[half:]])
    schemas = Schemas.create(key, val)
    table = _table_for(schemas, {n: v for n, (_, v) in SAMPLES.items()}, 3)
    data, meta = _encode(table, schemas)
    back = _decode(data, schemas, meta)
    assert back.schema == internal_schema(schemas)
    for f in back.schema:
        assert str(back.schema.field(f.name).type) == str(f.type)
    assert back.to_pylist() == table.to_pylist()
    assert back.equals(table)


@pytest.mark.parametrize("name", list(SAMPLES))
def test_each_type_as_the_only_key_with_unit_value(name: str) -> None:
    t, values = SAMPLES[name]
    schemas = Schemas.create(pa.schema([("x", t)]), pa.schema([]))
    table = consolidate(_table_for(schemas, {"x": values}, 3))
    data, meta = _encode(table, schemas)
    back = _decode(data, schemas, meta)
    assert back.column_names == ["k.x", "t", "d"]
    assert back.to_pylist() == table.to_pylist()
    # The Parquet file has no `v` column for the unit value, and carries our metadata.
    import pyarrow.parquet as pq

    md = pq.read_metadata(pa.BufferReader(data))
    assert md.schema.to_arrow_schema().names == ["k", "t", "d"]
    kv = md.metadata
    assert (
        kv[b"persist.format"] == b"1" and kv[b"persist.schemas"] == schemas.fingerprint().encode()
    )


def test_date64_with_milliseconds_is_exact() -> None:
    schemas = Schemas.create(pa.schema([("d", pa.date64())]))
    table = pa.table(
        {"k.d": pa.array([1, 86_400_001], pa.date64()), "t": [0, 0], "d": [1, 1]}
    ).cast(internal_schema(schemas))
    data, meta = _encode(table, schemas)
    assert _decode(data, schemas, meta).equals(table)


KEY = pa.schema([("id", pa.int64()), ("name", pa.string())])
VAL = pa.schema([("amount", pa.float64())])
S = Schemas.create(KEY, VAL)


def _small_part() -> tuple[pa.Table, bytes, PartMeta]:
    t = consolidate(
        normalize_updates(
            [(((i, f"n{i % 7}"), (i / 3,)), i % 5, 1 + i % 3) for i in range(200)], S, shard="s1"
        )
    )
    data, meta = _encode(t, S)
    return t, data, meta


def test_part_meta() -> None:
    t, data, meta = _small_part()
    assert meta.size == len(data) and meta.count == 200
    assert meta.sha256 == hashlib.sha256(data).hexdigest()
    assert (meta.tmin, meta.tmax) == (0, 4)
    inline = part_meta_for(data, t, None, inline=True)
    assert inline.key is None and inline.inline == data and inline.location == "<inline>"
    with pytest.raises(InvalidUsage):
        part_meta_for(data, t, None, inline=False)
    with pytest.raises(InvalidUsage):
        part_meta_for(data, t.slice(0, 0), "a/b", inline=False)


_PART = _small_part()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_any_single_bit_flip_is_detected(data: st.DataObject) -> None:
    _, raw, meta = _PART
    pos = data.draw(st.integers(0, len(raw) - 1))
    bit = data.draw(st.integers(0, 7))
    bad = bytearray(raw)
    bad[pos] ^= 1 << bit
    with pytest.raises(
        CorruptionError, match=r"shard s1: part s1/w1/p1: checksum mismatch.*nothing was returned"
    ):
        _decode(bytes(bad), S, meta)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_any_truncation_is_detected(data: st.DataObject) -> None:
    _, raw, meta = _PART
    n = data.draw(st.integers(0, len(raw) - 1))
    with pytest.raises(
        CorruptionError, match=r"size mismatch: expected \d+ bytes, got \d+.*altered or truncated"
    ):
        _decode(raw[:n], S, meta)
    # Without a recorded size the checksum still catches it.
    with pytest.raises(CorruptionError, match="checksum mismatch"):
        decode_part(
            raw[:n], S, expected_sha256=meta.sha256, expected_size=None, shard="s1", key="k"
        )


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_undecodable_bytes_with_matching_checksum_raise_corruption(data: st.DataObject) -> None:
    # E.g. a writer bug, or a blob replaced together with its metadata: decoding must
    # still fail cleanly with CorruptionError, never with a raw pyarrow error.
    _, raw, _ = _PART
    pos = data.draw(st.integers(0, len(raw) - 1))
    bad = bytearray(raw)
    bad[pos] ^= data.draw(st.integers(1, 255))
    bad_bytes = bytes(bad)
    digest = hashlib.sha256(bad_bytes).hexdigest()
    try:
        out = decode_part(
            bad_bytes, S, expected_sha256=digest, expected_size=len(bad_bytes), shard="s1", key="k"
        )
    except CorruptionError as e:
        assert "nothing was returned" in str(e)
    except StaleSchema as e:
        # A flip inside the footer's schemas fingerprint that leaves it well-formed: a
        # part of schemas this reader does not know, which is what a part of a later
        # schema version looks like (``shard.migrate``); refused as cleanly.
        assert "nothing was returned" in str(e)
    else:
        # Parquet has no checksum of its own: a flip in a value may decode. It must
        # then at least be a well-formed update table.
        assert out.schema == internal_schema(S)


def test_decode_rejects_garbage_and_foreign_parts() -> None:
    garbage = b"not a parquet file"
    with pytest.raises(CorruptionError, match="cannot decode Parquet"):
        decode_part(
            garbage,
            S,
            expected_sha256=hashlib.sha256(garbage).hexdigest(),
            expected_size=None,
            shard="s1",
            key="k",
        )
    t, raw, meta = _PART
    other = Schemas.create(KEY, pa.schema([("amount", pa.float32())]))
    # A part of schemas the reader doesn't know (neither its own nor an earlier version
    # of them): what a part of a later version looks like to a stale handle.
    with pytest.raises(StaleSchema, match="not among the versions this handle knows"):
        _decode(raw, other, meta)
    # A plain Parquet file (not written by us) is refused.
    import pyarrow.parquet as pq

    sink = pa.BufferOutputStream()
    pq.write_table(pa.table({"x": [1]}), sink)
    plain = sink.getvalue().to_pybytes()
    with pytest.raises(CorruptionError, match="unknown part format"):
        decode_part(
            plain,
            S,
            expected_sha256=hashlib.sha256(plain).hexdigest(),
            expected_size=None,
            shard="s1",
            key="k",
        )


def test_fetch_part_from_blob_and_inline() -> None:
    blob = MemBlob(f"parts-{uuid.uuid4().hex}")
    t, raw, meta = _PART
    key = part_blob_key("s1", "w1")
    blob.set(key, raw)
    meta = part_meta_for(raw, t, key, inline=False)
    assert fetch_part(blob, meta, S, "s1").equals(t)
    inline = part_meta_for(raw, t, None, inline=True)
    assert fetch_part(blob, inline, S, "s1").equals(t)
    blob.delete(key)
    with pytest.raises(BlobNotFound, match=rf"shard s1: part {re.escape(key)} is missing"):
        fetch_part(blob, meta, S, "s1")
    blob.set(key, raw[:-1] + bytes([raw[-1] ^ 1]))
    with pytest.raises(
        CorruptionError, match=rf"shard s1: part {re.escape(key)}: checksum mismatch"
    ):
        fetch_part(blob, meta, S, "s1")


def test_part_blob_key() -> None:
    a, b = part_blob_key("s1", "w-1"), part_blob_key("s1", "w-1")
    assert a != b and a.startswith("s1/w-1/p") and BLOB_KEY_RE.match(a)
    with pytest.raises(InvalidBlobKey):
        part_blob_key("s1", "../etc")
    with pytest.raises(InvalidBlobKey):
        part_blob_key("s 1", "w")


def test_encode_rejects_wrong_layout() -> None:
    with pytest.raises(InvalidUsage, match="expected an update table with 5 columns"):
        encode_part(pa.table({"x": [1]}), S)
