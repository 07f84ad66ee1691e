"""A part's statistics read from its Parquet footer (``stats.footer_part_stats``) are the
statistics ``part_stats`` computes from its rows: over random parts of every column type
statistics cover (nulls, all-null columns, unicode, empty and long strings, values past
Parquet's statistics size limit, extreme unsigned integers, floats and timestamps, which
fall back to the rows), in one row group or many; and a bulk write records them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from persist_lib.shard import part_index
from persist_lib.shard.codec import Schemas, normalize_checked
from persist_lib.shard.parts import encode_part, fetch_part
from persist_lib.shard.stats import footer_part_stats, part_stats
from tests.test_spark_support import file_location, open_client

KEY = pa.schema([("a", pa.int64()), ("b", pa.string())])
VAL = pa.schema([
    ("u", pa.uint64()), ("i8", pa.int8()), ("flag", pa.bool_()), ("blob", pa.binary()),
    ("f", pa.float64()), ("at", pa.timestamp("us")), ("none", pa.int32()), ("ls", pa.large_string()),
])
SCHEMAS = Schemas(KEY, VAL)
WORDS = ["", "a", "zz", "é", "日本", "\U0001f600x", "x" * 64, "y" * 65, "w" * 5000, "val_1"]


def _masked(rng: np.random.Generator, values: list[object], p_null: float) -> list[object]:
    return [None if rng.random() < p_null else v for v in values]


def _table(rng: np.random.Generator, n: int) -> pa.Table:
    """``n`` random updates (user layout); each column has nulls at a random rate."""
    p = [0.0, 0.0, 0.3, 1.0][int(rng.integers(0, 4))]
    ints = rng.integers(-(10**6), 10**6, n)
    u = rng.choice(np.array([0, 1, 2**63, 2**64 - 1], dtype=np.uint64), n)
    words = list(rng.choice(np.array(WORDS, dtype=object), n))
    return pa.table({
        "a": pa.array(ints),
        "b": pa.array(_masked(rng, words, p), pa.string()),
        "u": pa.array(_masked(rng, [int(x) for x in u], p), pa.uint64()),
        "i8": pa.array(_masked(rng, [int(x) for x in rng.integers(-128, 128, n)], p), pa.int8()),
        "flag": pa.array(_masked(rng, [bool(x) for x in rng.integers(0, 2, n)], p), pa.bool_()),
        "blob": pa.array(_masked(rng, [bytes([int(x), 255 - int(x)]) for x in rng.integers(0, 256, n)], p), pa.binary()),
        "f": pa.array(_masked(rng, [float(x) for x in rng.normal(size=n)], p), pa.float64()),
        "at": pa.array(_masked(rng, [int(x) for x in rng.integers(0, 10**15, n)], p), pa.timestamp("us")),
        "none": pa.nulls(n, pa.int32()),
        "ls": pa.array(_masked(rng, [w[:70] for w in words], p), pa.large_string()),
        "ts": pa.array(rng.integers(0, 50, n)),
        "diff": pa.array(rng.integers(-2, 3, n)),
    })


@pytest.mark.parametrize("seed", range(24))
def test_footer_statistics_equal_the_rows(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(part_index, "INDEXED_ROW_GROUP_ROWS", 64)  # many row groups, few rows
    rng = np.random.default_rng(seed)
    n = int(rng.choice([1, 2, 63, 64, 65, 300, 1000]))
    table = normalize_checked(_table(rng, n), SCHEMAS, shard="s").table
    for indexed in (True, False):
        data = encode_part(table, SCHEMAS, indexed=indexed)
        md = pq.read_metadata(pa.BufferReader(data))
        assert footer_part_stats(table, SCHEMAS, md) == part_stats(table, SCHEMAS)


def test_a_value_past_parquets_statistics_limit_is_bounded_by_the_rows() -> None:
    """Parquet keeps no min/max for a row group holding a string of more than 4 KiB: its
    column's bounds come from the rows (here none: longer than state keeps), never from
    the other groups alone."""
    n = 40
    names = ["m"] * n
    names[-1] = "z" * 5000  # the maximum, in the last group only
    table = normalize_checked(
        pa.table({"a": list(range(n)), "b": names, "ts": [0] * n, "diff": [1] * n}),
        Schemas(KEY, pa.schema([])), shard="s",
    ).table
    schemas = Schemas(KEY, pa.schema([]))
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, row_group_size=10, write_statistics=True)
    md = pq.read_metadata(pa.BufferReader(sink.getvalue()))
    assert not md.row_group(3).column(1).statistics.has_min_max
    got = dict((c, (lo, hi, nulls)) for c, lo, hi, nulls in footer_part_stats(table, schemas, md))
    assert "k.b" not in got  # "m" from three groups would be a lie
    assert footer_part_stats(table, schemas, md) == part_stats(table, schemas)


def test_a_bulk_write_records_the_footer_statistics_of_its_rows(tmp_path: Path) -> None:
    client = open_client(file_location(tmp_path), inline_threshold=0, blob_target_size=64 << 20)
    w, r = client.open("s00000000-0000-4000-8000-0000000000f5", KEY, VAL)
    rng = np.random.default_rng(11)
    n = part_index.INDEXED_ROW_GROUP_ROWS * 3 + 7  # indexed parts, several groups each
    w.compare_and_append(_table(rng, n).set_column(10, "ts", pa.array(rng.integers(0, 5, n))), 0, 5)
    parts = [p for _, b in client.machine(r.shard_id).fetch_latest().trace_batches() for p in b.parts]
    assert parts and max(p.count for p in parts) > part_index.INDEXED_ROW_GROUP_ROWS
    for p in parts:
        assert p.stats is not None and p.footer is not None  # an indexed part, with stats
        assert p.stats == part_stats(fetch_part(client.blob, p, SCHEMAS, r.shard_id), SCHEMAS)
    client.close()
