"""A landed file parsed (JSON lines, CSV or Parquet, optionally gzipped) and its rows
cut into ``FileChunk``s ``[r0, r1)``: row-wise decoding, so any cut decodes the same; a
file that can't be parsed (``Unreadable``) becomes one error record."""

from __future__ import annotations

import csv
import gzip
import io
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from persist_lib.ingest.addresses import Address, Note
from persist_lib.ingest.csv_records import decode_csv_records, read_csv_records
from persist_lib.ingest.decode import (
    Decoded,
    DecodeSpec,
    ErrorRecord,
    conform_typed,
    decode_json_lines,
    empty_rows,
    merge_good_and_bad,
    raw_table,
    rows_to_json_lines,
)
from persist_lib.ingest.errors import IngestConfigError
from persist_lib.ingest.landing_zone.stores import FORMATS
from persist_lib.ingest.source import Chunk

PARTITION = "files"
_WHITESPACE = np.frombuffer(b" \t\n\r\x0b\x0c", dtype=np.uint8)


class Unreadable(Exception):
    """A file's structure can't be parsed (definitely: its bytes are what they are)."""


def _maybe_gunzip(name: str, data: bytes) -> bytes:
    if name.endswith(".gz"):
        try:
            return gzip.decompress(data)
        except (OSError, EOFError, gzip.BadGzipFile) as e:
            raise Unreadable(f"not a valid gzip file: {e}") from e
    return data


class _Parsed:
    fmt: str
    rows: int  # addresses (JSON lines: lines; CSV: records after the header), blank ones too
    size: int
    _blank_cs: np.ndarray | None = None  # prefix sums of the blank rows (computed once)

    def decode(self, spec: DecodeSpec, file: str, r0: int, r1: int) -> Decoded:
        raise NotImplementedError

    def _blank_rows(self) -> np.ndarray:
        """One bool per row: the row is blank (no record)."""
        return np.zeros(self.rows, dtype=bool)

    def blank_between(self, r0: int, r1: int) -> int:
        """How many of rows ``[r0, r1)`` are blank: addresses that hold no record."""
        if self._blank_cs is None:
            self._blank_cs = np.concatenate(([0], np.cumsum(self._blank_rows(), dtype=np.int64)))
        return int(self._blank_cs[r1] - self._blank_cs[r0])


class _JsonLines(_Parsed):
    fmt = "jsonl"

    def __init__(self, data: bytes, size: int) -> None:
        self.data = data
        self.size = size
        arr = np.frombuffer(data, dtype=np.uint8)
        nl = np.flatnonzero(arr == 10)
        ends = nl
        if len(data) and data[-1:] != b"\n":
            ends = np.append(nl, len(data))
        self.starts = np.concatenate(([0], nl + 1))[: len(ends)]
        self.ends = ends
        self.rows = int(len(ends))

    def line(self, i: int) -> bytes:
        return self.data[int(self.starts[i]) : int(self.ends[i])]

    def _blank_rows(self) -> np.ndarray:
        # blank = only ASCII whitespace (what bytes.strip() removes, as decode() skips)
        arr = np.frombuffer(self.data, dtype=np.uint8)
        solid = np.concatenate(([0], np.cumsum(~np.isin(arr, _WHITESPACE), dtype=np.int64)))
        return np.asarray(solid[self.ends] - solid[self.starts] == 0, dtype=bool)

    def decode(self, spec: DecodeSpec, file: str, r0: int, r1: int) -> Decoded:
        lines = [self.line(i) for i in range(r0, r1)]
        idx = [i for i, ln in enumerate(lines) if ln.strip()]
        good = lines if len(idx) == len(lines) else [lines[i] for i in idx]
        table, bad = decode_json_lines(spec, good)
        rows, bad_all = merge_good_and_bad(spec, len(good), table, bad)
        errors = [
            ErrorRecord(PARTITION, (file, r0 + idx[i]), kind, reason, good[i]) for i, kind, reason in bad_all
        ]
        raw = None
        if spec.keep_raw:
            raw = raw_table(PARTITION, [(file, r0 + i) for i in idx], "jsonl", good)
        return Decoded(rows, errors, raw)


class _Csv(_Parsed):
    fmt = "csv"

    def __init__(self, data: bytes, size: int, delimiter: str) -> None:
        self.size = size
        # Bytes that are not UTF-8 become lone surrogates (U+DC80-U+DCFF, which valid
        # UTF-8 never decodes to): the records holding them go to errors as invalid_utf8,
        # the others are ingested (decode_csv_records).
        try:
            text, self.not_utf8 = data.decode("utf-8-sig"), False
        except UnicodeDecodeError:
            text, self.not_utf8 = data.decode("utf-8-sig", errors="surrogateescape"), True
        records, self.unparsed = read_csv_records(text, delimiter)
        if 0 in self.unparsed:
            raise Unreadable(f"the CSV header can't be parsed: {self.unparsed[0][0]}")
        self.unparsed = {i - 1: v for i, v in self.unparsed.items()}
        if not records:
            self.header: list[str] = []
            self.records: list[list[str]] = []
        else:
            self.header = [h.strip() for h in records[0]]
            self.records = records[1:]
        self.delimiter = delimiter
        self.rows = len(self.records)

    def _blank_rows(self) -> np.ndarray:  # decode skips these
        return np.array([not r and i not in self.unparsed for i, r in enumerate(self.records)], dtype=bool)

    def _raw(self, rec: list[str]) -> bytes:
        buf = io.StringIO()
        csv.writer(buf, delimiter=self.delimiter, lineterminator="").writerow(rec)
        return buf.getvalue().encode("utf-8", errors="surrogateescape")  # the bytes as read

    def decode(self, spec: DecodeSpec, file: str, r0: int, r1: int) -> Decoded:
        recs = self.records[r0:r1]
        unparsed = {i - r0: v for i, v in self.unparsed.items() if r0 <= i < r1}
        raw = None
        if spec.keep_raw:  # self-describing: the header with the fields (blank records have none)
            nb = [i for i, r in enumerate(recs) if r or i in unparsed]
            raw = raw_table(
                PARTITION, [(file, r0 + i) for i in nb], "csv-json",
                [
                    json.dumps(
                        {"h": self.header, "f": recs[i]}
                        if i not in unparsed
                        else {"h": self.header, "f": [], "e": unparsed[i][0]}
                    ).encode()
                    for i in nb
                ],
            )
        missing = [k for k in spec.key_names if k not in self.header]
        if missing:
            errs = []
            if r0 == 0 and recs:
                errs.append(
                    ErrorRecord(
                        PARTITION, (file, 0), "missing_key_column",
                        f"the CSV header {self.header} has no key column(s) {missing}; every row "
                        f"of this file ({self.rows}) is skipped",
                        None,
                    )
                )
            return Decoded(empty_rows(spec), errs, raw)
        rows, all_bad = decode_csv_records(
            spec, self.header, recs, {i: v[0] for i, v in unparsed.items()}, not_utf8=self.not_utf8
        )
        errors = [
            ErrorRecord(PARTITION, (file, r0 + i), k, reason, unparsed[i][1] if i in unparsed else self._raw(recs[i]))
            for i, k, reason in all_bad
        ]
        return Decoded(rows, errors, raw)


class _Parquet(_Parsed):
    fmt = "parquet"

    def __init__(self, data: bytes, size: int) -> None:
        self.size = size
        try:
            self.table = pq.read_table(pa.BufferReader(data))
        except (pa.ArrowException, OSError, ValueError) as e:
            raise Unreadable(f"not a readable Parquet file: {e}") from e
        self.rows = self.table.num_rows

    def decode(self, spec: DecodeSpec, file: str, r0: int, r1: int) -> Decoded:
        part = self.table.slice(r0, r1 - r0)
        raw = None
        if spec.keep_raw:
            raw = raw_table(PARTITION, [(file, r0 + i) for i in range(part.num_rows)], "parquet-json", rows_to_json_lines(part))
        conformed, file_error, bad = conform_typed(spec, part)
        if file_error is not None or conformed is None:
            errs = []
            if r0 == 0 and part.num_rows:
                errs.append(ErrorRecord(PARTITION, (file, 0), "schema_mismatch", file_error or "", None))
            return Decoded(empty_rows(spec), errs, raw)
        rows, bad_all = merge_good_and_bad(spec, part.num_rows, conformed, bad)
        errors = [ErrorRecord(PARTITION, (file, r0 + i), k, reason, None) for i, k, reason in bad_all]
        return Decoded(rows, errors, raw)


class _UnreadableFile(_Parsed):
    fmt = "unreadable"

    def __init__(self, reason: str, size: int) -> None:
        self.reason = reason
        self.size = size
        self.rows = 1  # the error occupies row 0

    def decode(self, spec: DecodeSpec, file: str, r0: int, r1: int) -> Decoded:
        errs = []
        if r0 == 0 and r1 > 0:
            errs.append(ErrorRecord(PARTITION, (file, 0), "unreadable_file", self.reason, None))
        return Decoded(empty_rows(spec), errs, None)


def parse_file(name: str, data: bytes, fmt: str, *, csv_delimiter: str = ",") -> _Parsed:
    size = len(data)
    body = _maybe_gunzip(name, data)
    if fmt == "jsonl":
        return _JsonLines(body, size)
    if fmt == "csv":
        return _Csv(body, size, csv_delimiter)
    if fmt == "parquet":
        return _Parquet(body, size)
    raise IngestConfigError(f"unknown file format {fmt!r}: use one of {FORMATS} (or 'auto')")


class FileChunk(Chunk):
    """Rows ``[r0, r1)`` of one file."""

    def __init__(self, file: str, parsed: _Parsed, r0: int, r1: int, notes: tuple[Note, ...] = ()) -> None:
        self.partition = PARTITION
        self.file = file
        self.parsed = parsed
        self.r0 = r0
        self.r1 = r1
        self.start = (file, r0)
        self.end = (file, r1)
        self.num_records = r1 - r0  # addresses: what bindings are cut by
        rows = max(parsed.rows, 1)
        self.nbytes = int(parsed.size * (r1 - r0) / rows)
        self.notes = notes

    @property
    def num_blank(self) -> int:  # type: ignore[override]  # derived, never assigned
        return self.parsed.blank_between(self.r0, self.r1)

    def split(self, at: Address) -> tuple[Chunk | None, Chunk | None]:
        af, ar = at[0], int(at[1])
        if af > self.file:
            return self, None
        if af < self.file:
            return None, self
        cut = min(max(ar, self.r0), self.r1)
        if cut >= self.r1:
            return self, None
        if cut <= self.r0 and self.r1 > self.r0:
            return None, self
        return (
            FileChunk(self.file, self.parsed, self.r0, cut),
            FileChunk(self.file, self.parsed, cut, self.r1, self.notes),
        )

    def take(self, n: int) -> tuple[Chunk, Chunk | None]:
        if n >= self.num_records:
            return self, None
        cut = self.r0 + max(n, 0)
        return (
            FileChunk(self.file, self.parsed, self.r0, cut),
            FileChunk(self.file, self.parsed, cut, self.r1, self.notes),
        )

    def decode(self, spec: DecodeSpec) -> Decoded:
        if self.num_records == 0:
            return Decoded(empty_rows(spec), [], None)
        return self.parsed.decode(spec, self.file, self.r0, self.r1)

    def __repr__(self) -> str:
        return f"FileChunk({self.file!r}, rows [{self.r0}, {self.r1}))"

