"""Where landed files are: a local directory (``LocalStore``) or an S3 prefix
(``S3Store``), listed (temporary names ignored) and read whole; ``open_store`` picks one
by URI. And which format a file is in, by its extension (``format_of``)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from persist_lib.ingest.errors import IngestConfigError, SourceUnavailable
from persist_lib.location.redaction import SensitiveUrl

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

