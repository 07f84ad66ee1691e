"""The ``Chunk`` contract of a landing zone's file chunks: ``take`` and ``split``.

The ingestion driver cuts a chunk with ``take(n)`` when it holds more records than the
binding being minted has room for. The landing zone reader never reads past the room it
is given, so today only a Kafka chunk reaches that path through ``Ingestion``; a file
chunk must still keep the contract (it is the ``Chunk`` interface, and any change to the
reader's read-ahead would reach it), so it is checked here directly on chunks read from
real files: the head and the tail together are the chunk, record for record, nothing
lost or repeated, for every cut.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

from persist_lib.ingest import LandingZoneSource
from persist_lib.ingest.decode import DecodeSpec
from persist_lib.ingest.landing_zone.files import PARTITION, FileChunk

KEY = pa.schema([("id", pa.int64())])
VAL = pa.schema([("name", pa.string())])
SPEC = DecodeSpec(KEY, VAL)


def _zone(path: Path) -> dict[str, int]:
    """Three files of 7 records each (one JSON line malformed): name -> addresses (a
    blank line is an address too: the JSON lines file has a blank line, so 8)."""
    path.mkdir()
    lines = [json.dumps({"id": i, "name": f"j{i}"}) for i in range(6)]
    lines.insert(3, '{"id": "three", "name": ')  # malformed: an error record, not a row
    (path / "a.jsonl").write_text("\n".join(lines[:5]) + "\n\n" + "\n".join(lines[5:]) + "\n")
    pacsv.write_csv(pa.table({"id": list(range(10, 17)), "name": [f"c{i}" for i in range(7)]}), path / "b.csv")
    pq.write_table(pa.table({"id": list(range(20, 27)), "name": [f"p{i}" for i in range(7)]}), path / "c.parquet")
    return {"a.jsonl": 8, "b.csv": 7, "c.parquet": 7}


def _chunks(tmp_path: Path) -> list[FileChunk]:
    expected = _zone(tmp_path / "zone")
    reader = LandingZoneSource(str(tmp_path / "zone")).open_reader({PARTITION: ("", 0)}, [])
    chunks = reader.read(None, 1000)
    assert all(isinstance(c, FileChunk) for c in chunks)
    got = {c.file: c.num_records for c in chunks if isinstance(c, FileChunk)}
    assert got == expected
    return [c for c in chunks if isinstance(c, FileChunk)]


def _content(chunks: list[Any]) -> tuple[list[dict[str, Any]], list[tuple[Any, ...]]]:
    rows: list[dict[str, Any]] = []
    errors: list[tuple[Any, ...]] = []
    for c in chunks:
        d = c.decode(SPEC)
        rows.extend(d.rows.select(["id", "name"]).to_pylist())
        errors.extend((e.address, e.kind) for e in d.errors)
    return rows, errors


def test_take_cuts_a_file_chunk_into_head_and_tail_losing_nothing(tmp_path: Path) -> None:
    for chunk in _chunks(tmp_path):
        whole_rows, whole_errors = _content([chunk])
        assert len(whole_rows) + len(whole_errors) == chunk.num_records - chunk.num_blank
        for n in range(-1, chunk.num_records + 2):
            head, tail = chunk.take(n)
            if n >= chunk.num_records:
                assert head is chunk and tail is None
                continue
            assert isinstance(head, FileChunk) and isinstance(tail, FileChunk)
            k = max(n, 0)
            assert (head.start, head.end) == ((chunk.file, chunk.r0), (chunk.file, chunk.r0 + k))
            assert (tail.start, tail.end) == ((chunk.file, chunk.r0 + k), (chunk.file, chunk.r1))
            assert head.num_records == k and tail.num_records == chunk.num_records - k
            assert head.num_blank + tail.num_blank == chunk.num_blank
            assert head.notes == () and tail.notes == chunk.notes, "the file's note rides on its end"
            assert _content([head, tail]) == (whole_rows, whole_errors), (chunk, n)


def test_split_at_every_address_keeps_every_record(tmp_path: Path) -> None:
    for chunk in _chunks(tmp_path):
        whole = _content([chunk])
        for r in range(chunk.r0 + 1, chunk.r1):
            head, tail = chunk.split((chunk.file, r))
            assert head is not None and tail is not None
            assert head.end == tail.start == (chunk.file, r)
            assert _content([head, tail]) == whole
        assert chunk.split((chunk.file, chunk.r1)) == (chunk, None)
        assert chunk.split((chunk.file, chunk.r0)) == (None, chunk)
        assert chunk.split(("zzz", 0)) == (chunk, None)
        assert chunk.split(("", 0)) == (None, chunk)


@pytest.mark.parametrize("n", [1, 3, 6])
def test_repeated_takes_hand_out_every_record_once(tmp_path: Path, n: int) -> None:
    for chunk in _chunks(tmp_path):
        pieces: list[Any] = []
        rest: Any = chunk
        while rest is not None:
            head, rest = rest.take(n)
            pieces.append(head)
        assert [p.num_records for p in pieces[:-1]] == [n] * (len(pieces) - 1)
        assert sum(p.num_records for p in pieces) == chunk.num_records
        assert _content(pieces) == _content([chunk])
