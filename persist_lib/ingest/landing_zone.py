"""A file landing zone: a local directory or an S3 prefix of JSON-lines, CSV and Parquet files.

Files are processed in name order, one partition (``files``); the address of a
record is ``(file name, row)`` (for JSON lines the line number, for CSV the record
number after the header, for Parquet the row index). The frontier ``(f, r)`` covers
every file named before ``f`` and the first ``r`` rows of ``f``.

Producers should write a file under a temporary name (starting with ``.`` or ``_``,
or ending in ``.tmp``/``.partial``, which are ignored) and rename it into place, so a
file is never seen half written; a landed file must not change afterwards.

What can't be decided from the data alone is recorded as *notes* in the remap shard
with the binding that covers it, so every instance decides the same way:

- ``file``: a file was completed with ``rows`` rows and ``size`` bytes (the
  manifest). Replays read exactly the manifest's files; a missing or resized file is
  ``SourceDataGone``, never a silent difference.
- ``unreadable``: the file could not be opened or parsed (corrupt Parquet or gzip,
  non-UTF-8 CSV, permission denied). It becomes one error record at ``(f, 0)``.
- ``late_file``: a file appeared with a name that sorts before the frontier. It is
  *not* ingested out of order: it becomes an error record (rename it to sort after the
  frontier to ingest it) and is listed in the run summary.
"""

from __future__ import annotations

import csv
import fnmatch
import gzip
import io
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

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
from persist_lib.ingest.errors import IngestConfigError, SourceDataGone, SourceUnavailable
from persist_lib.ingest.source import Address, Chunk, Frontier, Lag, Note, encode_address
from persist_lib.location.redaction import SensitiveUrl, redacted_dataclass_repr

PARTITION = "files"
_WHITESPACE = np.frombuffer(b" \t\n\r\x0b\x0c", dtype=np.uint8)
FORMATS = ("jsonl", "csv", "parquet")
_EXTENSIONS = {
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "jsonl",
    ".csv": "csv",
    ".parquet": "parquet",
    ".pq": "parquet",
}


def format_of(name: str) -> str | None:
    n = name[:-3] if name.endswith(".gz") else name
    for ext, fmt in _EXTENSIONS.items():
        if n.endswith(ext):
            return fmt
    return None


def _ignored(name: str) -> bool:
    base = name.rsplit("/", 1)[-1]
    return base.startswith((".", "_")) or base.endswith((".tmp", ".partial"))


@dataclass(frozen=True)
class FileInfo:
    name: str
    size: int


# ---------------------------------------------------------------------------------------
# Storage: local directory or S3 prefix


class _Store:
    uri: str

    def check(self) -> None:
        raise NotImplementedError

    def list_files(self) -> list[FileInfo]:
        raise NotImplementedError

    def read(self, name: str) -> bytes:
        raise NotImplementedError

    def describe(self) -> str:
        return self.uri


class LocalStore(_Store):
    def __init__(self, path: str) -> None:
        self.root = Path(path)
        self.uri = str(self.root)

    def check(self) -> None:
        if not self.root.exists():
            raise IngestConfigError(
                f"landing zone directory {self.root} does not exist: create it (mkdir -p "
                f"{self.root}) or fix the path"
            )
        if not self.root.is_dir():
            raise IngestConfigError(
                f"landing zone {self.root} is not a directory: pass the directory that holds the files"
            )

    def list_files(self) -> list[FileInfo]:
        out: list[FileInfo] = []
        try:
            for dirpath, dirnames, filenames in os.walk(self.root):
                dirnames[:] = [d for d in dirnames if not d.startswith((".", "_"))]
                for fn in filenames:
                    full = Path(dirpath) / fn
                    rel = full.relative_to(self.root).as_posix()
                    if _ignored(rel):
                        continue
                    try:
                        st = full.stat()
                    except FileNotFoundError:
                        continue  # renamed/deleted while listing
                    out.append(FileInfo(rel, st.st_size))
        except OSError as e:
            raise SourceUnavailable(f"cannot list landing zone {self.root}: {e}") from e
        out.sort(key=lambda f: f.name)
        return out

    def read(self, name: str) -> bytes:
        return (self.root / name).read_bytes()


class S3Store(_Store):
    """``s3://BUCKET/PREFIX[?endpoint_url=..&region=..&access_key_id=..&secret_access_key=..
    &session_token=..]`` (credentials default to boto3's chain: AWS_* variables...).
    The URI is held as a ``SensitiveUrl``: no repr, message or log shows its secrets."""

    _PARAMS = ("endpoint_url", "region", "access_key_id", "secret_access_key", "session_token")

    def __init__(self, uri: str) -> None:
        self._url = SensitiveUrl(uri)
        if self._url.problem:
            raise IngestConfigError(f"landing zone URI {self._url}: {self._url.problem}")
        parts = urlsplit(uri)
        self.bucket = parts.netloc
        if not self.bucket or "@" in self.bucket:
            raise IngestConfigError(
                f"landing zone URI {self._url.redacted!r} has no bucket (credentials go in "
                "parameters, not before the bucket): use s3://BUCKET/PREFIX[?endpoint_url=...&region=...]"
            )
        p = unquote(parts.path).strip("/")
        self.prefix = f"{p}/" if p else ""
        q: dict[str, str] = {}
        for piece in parts.query.split("&") if parts.query else []:
            k, _, v = piece.partition("=")
            q[unquote(k)] = unquote(v)  # not parse_qs: a '+' in a secret key stays a '+'
        unknown = sorted(set(q) - set(self._PARAMS))
        if unknown:
            raise IngestConfigError(
                self._url.scrub(
                    f"landing zone URI {self._url.redacted!r}: unknown parameter(s) {unknown}; "
                    f"supported: {', '.join(self._PARAMS)}"
                )
            )
        if ("access_key_id" in q) != ("secret_access_key" in q):
            raise IngestConfigError(
                f"landing zone URI {self._url.redacted!r}: access_key_id and secret_access_key "
                "must be given together"
            )
        self.endpoint_url = q.get("endpoint_url") or None
        self.region = q.get("region") or None
        self._credentials = {
            "aws_access_key_id": q.get("access_key_id") or None,
            "aws_secret_access_key": q.get("secret_access_key") or None,
            "aws_session_token": q.get("session_token") or None,
        }
        self.uri = f"s3://{self.bucket}/{self.prefix}"
        self._client: Any = None

    def __repr__(self) -> str:
        return f"S3Store({self._url.redacted!r})"

    def _s3(self) -> Any:
        if self._client is None:
            import boto3
            from botocore.config import Config

            self._client = boto3.client(
                "s3",
                endpoint_url=self.endpoint_url,
                region_name=self.region,
                **{k: v for k, v in self._credentials.items() if v},
                config=Config(retries={"max_attempts": 5, "mode": "standard"}, connect_timeout=5, read_timeout=60),
            )
        return self._client

    def _wrap(self, what: str, e: Exception) -> Exception:
        from botocore.exceptions import ClientError

        if isinstance(e, ClientError):
            code = e.response.get("Error", {}).get("Code", "")
            if code in ("NoSuchBucket", "404") and what == "check":
                return IngestConfigError(
                    self._url.scrub(
                        f"landing zone bucket {self.bucket!r} does not exist at "
                        f"{SensitiveUrl(self.endpoint_url or 'AWS')}: create it or fix the URI"
                    )
                )
            if code in ("AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
                return IngestConfigError(
                    f"landing zone {self.uri}: access denied ({code}); check the credentials "
                    "(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY) and the bucket policy"
                )
        return SourceUnavailable(
            self._url.scrub(f"landing zone {self.uri}: {what} failed: {type(e).__name__}: {e}")
        )

    def check(self) -> None:
        try:
            self._s3().head_bucket(Bucket=self.bucket)
        except Exception as e:  # noqa: BLE001 - classified by _wrap
            raise self._wrap("check", e) from None

    def list_files(self) -> list[FileInfo]:
        out: list[FileInfo] = []
        try:
            pages = self._s3().get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self.prefix
            )
            for page in pages:
                for obj in page.get("Contents", []):
                    rel = obj["Key"][len(self.prefix) :]
                    if not rel or rel.endswith("/") or _ignored(rel):
                        continue
                    out.append(FileInfo(rel, int(obj["Size"])))
        except Exception as e:  # noqa: BLE001
            raise self._wrap("list", e) from None
        out.sort(key=lambda f: f.name)
        return out

    def read(self, name: str) -> bytes:
        from botocore.exceptions import ClientError

        try:
            return bytes(self._s3().get_object(Bucket=self.bucket, Key=self.prefix + name)["Body"].read())
        except ClientError as e:
            code = e.response.get("Error", {}).get("Code", "")
            if code in ("NoSuchKey", "404"):
                raise FileNotFoundError(name) from None
            if code in ("AccessDenied", "403"):
                raise PermissionError(f"access denied reading {name}") from None
            raise self._wrap(f"reading {name}", e) from None
        except Exception as e:  # noqa: BLE001
            raise self._wrap(f"reading {name}", e) from None


def open_store(uri: str) -> _Store:
    if not isinstance(uri, str) or not uri:
        raise IngestConfigError(
            "landing zone URI must be a non-empty string (a directory, file:///DIR or "
            f"s3://BUCKET/PREFIX), got {type(uri).__name__} {SensitiveUrl(str(uri))!r}"
        )
    shown = SensitiveUrl(uri).redacted
    parts = urlsplit(uri)
    if parts.scheme in ("", "file") or (len(parts.scheme) == 1 and uri[1:3] in (":\\", ":/")):
        if parts.scheme == "file":
            if parts.netloc not in ("", "localhost"):
                raise IngestConfigError(
                    f"landing zone URI {shown!r}: file URIs need an absolute path (file:///DIR)"
                )
            return LocalStore(unquote(parts.path))
        return LocalStore(uri)
    if parts.scheme == "s3":
        return S3Store(uri)
    raise IngestConfigError(
        f"unsupported landing zone URI scheme {parts.scheme!r} in {shown!r}: use a local directory, "
        "file:///DIR or s3://BUCKET/PREFIX?endpoint_url=...&region=..."
    )


# ---------------------------------------------------------------------------------------
# Parsed files


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


# ---------------------------------------------------------------------------------------
# Source and reader


@dataclass
class LandingZoneSource:
    """A landing zone of files ingested in name order (see the module docstring).

    ``format`` is ``jsonl``, ``csv``, ``parquet`` or ``auto`` (by extension: .jsonl/
    .ndjson/.json, .csv, .parquet/.pq, each optionally .gz). ``pattern`` (fnmatch)
    restricts the files considered.
    """

    uri: str
    format: str = "auto"
    pattern: str | None = None
    csv_delimiter: str = ","
    kind: str = "landing_zone"
    _store: _Store = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.format not in (*FORMATS, "auto"):
            raise IngestConfigError(
                f"unknown file format {self.format!r}: use one of {', '.join(FORMATS)} or 'auto' "
                "(decided by each file's extension)"
            )
        if len(self.csv_delimiter) != 1:
            raise IngestConfigError(f"csv_delimiter must be one character, got {self.csv_delimiter!r}")
        self._store = open_store(self.uri)

    def __repr__(self) -> str:  # the URI may carry an S3 secret key
        return redacted_dataclass_repr(self)

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "uri": self._store.describe(), "format": self.format, "pattern": self.pattern}

    def partitions(self) -> tuple[str, ...]:
        return (PARTITION,)

    def initial_frontier(self) -> Frontier:
        return {PARTITION: ("", 0)}

    def check(self) -> None:
        self._store.check()

    def prepare(self) -> None:
        self.check()

    def format_for(self, name: str) -> str | None:
        if self.format != "auto":
            return self.format
        return format_of(name)

    def wanted(self, name: str) -> bool:
        if self.pattern is not None and not fnmatch.fnmatch(name, self.pattern):
            return False
        return self.format_for(name) is not None

    def list_files(self) -> list[FileInfo]:
        return [f for f in self._store.list_files() if self.wanted(f.name)]

    def open_reader(self, frontier: Frontier, notes: list[Note]) -> LandingZoneReader:
        return LandingZoneReader(self, frontier, notes)

    def release(self, frontier: Frontier) -> None:
        return None  # files are the producer's: nothing to release

    def close(self) -> None:
        return None


class LandingZoneReader:
    def __init__(self, source: LandingZoneSource, frontier: Frontier, notes: list[Note]) -> None:
        self.src = source
        f = frontier.get(PARTITION, ("", 0))
        self._pos: Address = (str(f[0]), int(f[1]))
        self.manifest: dict[str, tuple[int, int]] = {}
        self.unreadable: dict[str, str] = {}
        self.late: set[str] = set()
        self._cur: tuple[str, _Parsed] | None = None
        self._listing: list[FileInfo] = []
        self.add_notes(notes)

    @property
    def position(self) -> Frontier:
        return {PARTITION: self._pos}

    def add_notes(self, notes: Any) -> None:
        for n in notes:
            k = n.get("kind")
            if k == "file":
                self.manifest[n["file"]] = (int(n["rows"]), int(n["size"]))
            elif k == "unreadable":
                self.unreadable[n["file"]] = n["reason"]
            elif k == "late_file":
                self.late.add(n["file"])

    # ----- parsing --------------------------------------------------------------------

    def _parse(self, name: str, *, replay: bool) -> _Parsed:
        if self._cur is not None and self._cur[0] == name:
            return self._cur[1]
        if name in self.unreadable:
            size = self.manifest.get(name, (1, 0))[1]
            parsed: _Parsed = _UnreadableFile(self.unreadable[name], size)
        else:
            fmt = self.src.format_for(name) or "jsonl"
            try:
                data = self.src._store.read(name)
            except FileNotFoundError as e:
                if replay:
                    raise SourceDataGone(
                        f"landing zone {self.src._store.describe()}: file {name!r} is bound in the "
                        "remap shard but no longer exists; restore it, or rebuild the collection "
                        "in a new rendition (from the raw collection if kept)"
                    ) from e
                raise SourceUnavailable(f"file {name!r} disappeared while reading it") from e
            except (PermissionError, IsADirectoryError) as e:
                if replay:
                    raise SourceUnavailable(f"cannot read bound file {name!r}: {e}") from e
                parsed = _UnreadableFile(f"cannot read the file: {e}", 0)
                self._cur = (name, parsed)
                return parsed
            except OSError as e:
                raise SourceUnavailable(f"cannot read {name!r}: {e}") from e
            try:
                parsed = parse_file(name, data, fmt, csv_delimiter=self.src.csv_delimiter)
            except Unreadable as e:
                if replay and name not in self.unreadable:
                    # It was readable when bound, so its bytes changed since.
                    raise SourceDataGone(
                        f"bound file {name!r} can no longer be parsed ({e}); it changed after it "
                        "was ingested: restore it or rebuild in a new rendition"
                    ) from e
                parsed = _UnreadableFile(str(e), len(data))
            if replay and name in self.manifest:
                rows, size = self.manifest[name]
                if parsed.size != size or parsed.rows != rows:
                    raise SourceDataGone(
                        f"bound file {name!r} changed after it was ingested (was {rows} rows / "
                        f"{size} bytes, now {parsed.rows} rows / {parsed.size} bytes); landed files "
                        "must not change: restore it or rebuild in a new rendition"
                    )
        self._cur = (name, parsed)
        return parsed

    def _chunk(self, name: str, parsed: _Parsed, r0: int, r1: int, *, minting: bool) -> FileChunk:
        notes: tuple[Note, ...] = ()
        if minting and r1 >= parsed.rows:
            ns: list[Note] = []
            if isinstance(parsed, _UnreadableFile):
                ns.append({"kind": "unreadable", "file": name, "reason": parsed.reason})
            ns.append({"kind": "file", "file": name, "rows": parsed.rows, "size": parsed.size})
            notes = tuple(ns)
        return FileChunk(name, parsed, r0, r1, notes)

    # ----- reading --------------------------------------------------------------------

    def read(self, upto: Frontier | None, max_records: int) -> list[Chunk]:
        if upto is not None:
            return self._replay(tuple(upto[PARTITION]), max_records)
        return self._read_new(max_records)

    def _replay(self, upto: Address, max_records: int) -> list[Chunk]:
        """Reads ``[position, upto)`` exactly as bound: the manifest's files, then ``upto``'s."""
        uf, ur = str(upto[0]), int(upto[1])
        out: list[Chunk] = []
        budget = max_records
        while budget > 0 and self._pos < (uf, ur):
            f, r = self._pos
            if f == uf:
                name, start, end = f, r, ur
            elif f in self.manifest and r < self.manifest[f][0]:
                name, start, end = f, r, self.manifest[f][0]
            else:
                if f and r > 0 and f not in self.manifest:
                    raise SourceDataGone(
                        f"the remap shard binds past file {f!r} but records no row count for it; "
                        "the bindings are inconsistent with this source"
                    )
                nxt = min((n for n in self.manifest if f < n < uf), default=None)
                if nxt is not None:
                    name, start, end = nxt, 0, self.manifest[nxt][0]
                elif ur > 0:
                    name, start, end = uf, 0, ur
                else:
                    self._pos = (uf, ur)
                    break
            parsed = self._parse(name, replay=True)
            if end > parsed.rows:
                raise SourceDataGone(
                    f"bound file {name!r} has {parsed.rows} rows but the remap shard binds up to row "
                    f"{end}; it changed after it was ingested: restore it or rebuild in a new rendition"
                )
            stop = min(end, start + budget)
            if stop > start:
                out.append(self._chunk(name, parsed, start, stop, minting=False))
                budget -= stop - start
            self._pos = (name, stop)
            if stop >= parsed.rows:
                self._cur = None
        return out

    def _read_new(self, max_records: int) -> list[Chunk]:
        """Reads about ``max_records`` records past the position, noting what it decides."""
        listing = self.src.list_files()
        self._listing = listing
        names = {i.name for i in listing}
        out: list[Chunk] = []
        f, r = self._pos
        if f and f not in names and f not in self.manifest:
            # The partly ingested file vanished: record what was read, definitely.
            reason = (
                f"file {f!r} disappeared after {r} of its rows were ingested; the rest of it "
                "was not ingested"
            )
            notes: tuple[Note, ...] = (
                {"kind": "file", "file": f, "rows": r, "size": -1},
                {"kind": "vanished", "file": f,
                 "error": {"partition": PARTITION, "address": [f, r], "kind": "vanished_file", "reason": reason}},
            )
            out.append(FileChunk(f, _UnreadableFile(reason, 0), r, r, notes))
            self.manifest[f] = (r, -1)
        budget = max_records
        for info in listing:
            if budget <= 0:
                break
            name = info.name
            f, r = self._pos
            if name < f:
                continue
            if name in self.manifest and (name != f or r >= self.manifest[name][0]):
                continue  # completed before
            start = r if name == f else 0
            parsed = self._parse(name, replay=False)
            if start > parsed.rows:
                raise SourceDataGone(
                    f"file {name!r} has {parsed.rows} rows but the frontier is at row {start}; it "
                    "shrank after it was partly ingested"
                )
            stop = min(parsed.rows, start + budget)
            chunk = self._chunk(name, parsed, start, stop, minting=True)
            out.append(chunk)
            budget -= stop - start
            self._pos = (name, stop)
            if stop < parsed.rows:
                break
            self._cur = None
            self.manifest[name] = (parsed.rows, parsed.size)
        return out

    def observe(self) -> list[Note]:
        """Late files: listed, named before the frontier, never bound. Not ingested."""
        f, _ = self._pos
        notes: list[Note] = []
        for info in self._listing:
            if info.name >= f:
                break
            if info.name in self.manifest or info.name in self.late:
                continue
            reason = (
                f"late file: {info.name!r} arrived after the ingestion frontier had passed its name "
                f"(frontier at {encode_address(self._pos)}); files are ingested in name order, so it "
                "was not ingested: rename it to sort after the frontier to ingest it"
            )
            notes.append(
                {
                    "kind": "late_file",
                    "file": info.name,
                    "size": info.size,
                    "error": {"partition": PARTITION, "address": [info.name, 0], "kind": "late_file", "reason": reason},
                }
            )
            self.late.add(info.name)
        return notes

    def lag(self) -> Lag:
        f, r = self._pos
        behind = 0
        files = 0
        for info in self._listing:
            if info.name < f:
                continue
            if info.name == f:
                rows = self.manifest.get(f, (0, 0))[0] or (self._cur[1].rows if self._cur and self._cur[0] == f else 0)
                if rows:
                    behind += int(info.size * max(rows - r, 0) / rows)
                continue
            behind += info.size
            files += 1
        return Lag(bytes_behind=behind, detail={"files_behind": files})

    def close(self) -> None:
        self._cur = None
