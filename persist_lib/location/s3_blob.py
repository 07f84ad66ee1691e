"""A Blob on S3 or an S3-compatible server (``s3://bucket/prefix?...``) via boto3.

Why it looks the way it does:

- Values up to 8 MiB go in one PUT (atomic by S3's semantics); larger ones use a
  multipart upload of 8 MiB parts, which S3 also makes visible atomically at
  ``CompleteMultipartUpload``; a failed upload is aborted so no parts linger.
- botocore >= 1.36 sends CRC32 checksums by default, which some S3-compatible servers
  reject, so checksums are only computed/validated ``when_required``
  (research/reliability.md section 6). botocore's own retries are off by default
  (``max_attempts=1``): ``persist_lib.location.retry`` retries with knowledge of which
  operations are idempotent.
- Errors carry what may have happened: a failure to connect is ``Determinate`` for
  every operation; a timeout or dropped connection *after* sending is ``Indeterminate``
  for writes (PUT / complete-multipart / DELETE) and ``Determinate`` for reads; 5xx
  answers likewise; 4xx answers are ``Determinate`` with a hint. Credentials never
  appear in messages or reprs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import boto3
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectTimeoutError,
    EndpointConnectionError,
    NoCredentialsError,
    ParamValidationError,
    PartialCredentialsError,
)

from persist_lib.errors import Determinate, Indeterminate, InvalidUsage
from persist_lib.location.base import Blob, BlobMetadata, check_range
from persist_lib.location.redaction import SensitiveUrl, scrub, secret_forms

__all__ = ["MULTIPART_PART_SIZE", "S3Blob"]

T = TypeVar("T")

MULTIPART_PART_SIZE = 8 * 1024 * 1024
_MIN_PART_SIZE = 5 * 1024 * 1024  # S3's minimum for all but the last part


class S3Blob(Blob):
    """Blob on S3: keys are stored as ``prefix + key`` in ``bucket``."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        access_key: str | None = None,
        secret_key: str | None = None,
        session_token: str | None = None,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float = 60.0,
        max_attempts: int = 1,
        part_size: int = MULTIPART_PART_SIZE,
        addressing_style: str | None = None,
    ) -> None:
        if not bucket:
            raise InvalidUsage("S3Blob needs a bucket name")
        if part_size < _MIN_PART_SIZE:
            raise InvalidUsage(
                f"S3 multipart part size must be >= {_MIN_PART_SIZE}, got {part_size}"
            )
        self.bucket = bucket
        p = prefix.strip("/")
        self.prefix = f"{p}/" if p else ""
        self.endpoint_url = endpoint_url
        self.region = region
        self.part_size = part_size
        self._endpoint = SensitiveUrl(endpoint_url or "")
        # every spelling of the secret key, the session token and an endpoint password
        self._secrets = secret_forms([secret_key, session_token]) + self._endpoint.secrets
        config = Config(
            connect_timeout=connect_timeout_s,
            read_timeout=read_timeout_s,
            retries={"total_max_attempts": max(1, max_attempts), "mode": "standard"},
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            s3={"addressing_style": addressing_style or ("path" if endpoint_url else "auto")},
            max_pool_connections=32,
        )
        session = boto3.session.Session(
            aws_access_key_id=access_key,
            aws_secret_access_key=secret_key,
            aws_session_token=session_token,
            region_name=region,
        )
        self._client: Any = session.client("s3", endpoint_url=endpoint_url, config=config)

    # -- helpers -------------------------------------------------------------------

    def describe(self) -> str:
        where = f"s3://{self.bucket}/{self.prefix}"
        if self.endpoint_url:
            where += f" at {self._endpoint}"
        return where

    def __repr__(self) -> str:
        return f"S3Blob({self.describe()!r})"

    def _redact(self, text: str) -> str:
        return scrub(self._endpoint.scrub(text), self._secrets)

    def _call(self, op: str, key: str, write: bool, fn: Callable[[], T]) -> T:
        """Runs ``fn``, translating botocore errors (raised outside the except block so
        no botocore exception is chained to ours)."""
        err: Exception | None = None
        try:
            return fn()
        except ClientError as e:
            err = self._client_error(op, key, write, e)
        except (EndpointConnectionError, ConnectTimeoutError) as e:
            err = Determinate(
                self._msg(
                    op,
                    key,
                    f"could not connect: {e}",
                    "the operation did not happen; check endpoint_url and that the server is up",
                )
            )
        except (NoCredentialsError, PartialCredentialsError) as e:
            err = Determinate(
                self._msg(
                    op,
                    key,
                    f"no usable credentials ({type(e).__name__})",
                    "set access_key_id/secret_access_key or the AWS_* variables",
                )
            )
        except ParamValidationError as e:
            err = InvalidUsage(self._msg(op, key, f"invalid request: {e}", "fix the call"))
        except BotoCoreError as e:
            if write:
                err = Indeterminate(
                    self._msg(
                        op,
                        key,
                        f"{type(e).__name__}: {e}",
                        "the write may or may not have happened",
                    )
                )
            else:
                err = Determinate(self._msg(op, key, f"{type(e).__name__}: {e}", "retry"))
        assert err is not None
        raise err

    def _msg(self, op: str, key: str, problem: str, hint: str) -> str:
        return self._redact(
            f"S3 blob {self.describe()}: {op} of key {key!r} failed: {problem}; {hint}"
        )

    def _client_error(self, op: str, key: str, write: bool, e: ClientError) -> Exception:
        err = e.response.get("Error", {}) or {}
        code = str(err.get("Code", "?"))
        message = str(err.get("Message", "") or "")
        status = int((e.response.get("ResponseMetadata") or {}).get("HTTPStatusCode", 0) or 0)
        problem = f"HTTP {status} {code}" + (f": {message}" if message else "")
        if code == "NoSuchBucket":
            return Determinate(self._msg(op, key, problem, f"create bucket {self.bucket!r} first"))
        if status in (401, 403) or code in (
            "AccessDenied",
            "InvalidAccessKeyId",
            "SignatureDoesNotMatch",
        ):
            return Determinate(
                self._msg(op, key, problem, "check the credentials and the bucket policy")
            )
        if status >= 500 or status == 0:
            if write:
                return Indeterminate(
                    self._msg(op, key, problem, "the write may or may not have happened")
                )
            return Determinate(self._msg(op, key, problem, "server error; retry"))
        return Determinate(self._msg(op, key, problem, "the operation did not happen"))

    @staticmethod
    def _is_not_found(e: ClientError) -> bool:
        code = str((e.response.get("Error") or {}).get("Code", ""))
        status = (e.response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
        return code in ("NoSuchKey", "404", "NotFound") or status == 404 and code != "NoSuchBucket"

    # -- Blob ----------------------------------------------------------------------

    def get(self, key: str) -> bytes | None:
        k = self.prefix + key

        def run() -> bytes | None:
            try:
                resp = self._client.get_object(Bucket=self.bucket, Key=k)
            except ClientError as e:
                if self._is_not_found(e):
                    return None
                raise
            body = resp["Body"]
            try:
                return bytes(body.read())
            finally:
                body.close()

        return self._call("get", key, False, run)

    def get_range(self, key: str, start: int, end: int) -> bytes | None:
        """One ranged GET (``Range: bytes=start-(end-1)``)."""
        check_range(key, start, end)
        if end == start:
            # An empty range can't be expressed as an HTTP Range: ask whether it exists.
            whole = self.get(key)
            return None if whole is None else b""
        k = self.prefix + key

        def run() -> bytes | None:
            try:
                resp = self._client.get_object(Bucket=self.bucket, Key=k, Range=f"bytes={start}-{end - 1}")
            except ClientError as e:
                if self._is_not_found(e):
                    return None
                if e.response.get("Error", {}).get("Code") == "InvalidRange":
                    return b""  # the range starts at or past the end of the value
                raise
            body = resp["Body"]
            try:
                return bytes(body.read())
            finally:
                body.close()

        return self._call("get", key, False, run)

    def set(self, key: str, value: bytes) -> None:
        k = self.prefix + key
        data = bytes(value)
        if len(data) <= self.part_size:
            self._call(
                "set",
                key,
                True,
                lambda: self._client.put_object(Bucket=self.bucket, Key=k, Body=data),
            )
            return
        self._multipart(key, k, data)

    def _multipart(self, key: str, k: str, data: bytes) -> None:
        created = self._call(
            "set (create multipart upload)",
            key,
            False,  # nothing is visible until complete: determinate
            lambda: self._client.create_multipart_upload(Bucket=self.bucket, Key=k),
        )
        upload_id = created["UploadId"]
        completed = False
        try:
            parts = []
            view = memoryview(data)
            for i, off in enumerate(range(0, len(data), self.part_size)):
                chunk = bytes(view[off : off + self.part_size])
                n = i + 1
                resp = self._call(
                    f"set (upload part {n})",
                    key,
                    False,
                    lambda chunk=chunk, n=n: self._client.upload_part(  # type: ignore[misc]
                        Bucket=self.bucket, Key=k, PartNumber=n, UploadId=upload_id, Body=chunk
                    ),
                )
                parts.append({"ETag": resp["ETag"], "PartNumber": n})
            self._call(
                "set (complete multipart upload)",
                key,
                True,
                lambda: self._client.complete_multipart_upload(
                    Bucket=self.bucket,
                    Key=k,
                    UploadId=upload_id,
                    MultipartUpload={"Parts": parts},
                ),
            )
            completed = True
        finally:
            if not completed:
                try:
                    self._client.abort_multipart_upload(
                        Bucket=self.bucket, Key=k, UploadId=upload_id
                    )
                except Exception:  # best effort; a lifecycle rule cleans up the rest
                    pass

    def delete(self, key: str) -> int | None:
        k = self.prefix + key

        def size() -> int | None:
            try:
                head = self._client.head_object(Bucket=self.bucket, Key=k)
            except ClientError as e:
                if self._is_not_found(e):
                    return None
                raise
            return int(head.get("ContentLength", 0))

        n = self._call("delete (head)", key, False, size)
        # Delete even when HEAD said 404: a HEAD can't tell a missing key from a missing
        # bucket (no error body), and a concurrent writer may have just finished.
        self._call(
            "delete", key, True, lambda: self._client.delete_object(Bucket=self.bucket, Key=k)
        )
        return n

    def list_keys_and_metadata(self, prefix: str) -> Iterator[BlobMetadata]:
        full = self.prefix + prefix

        def run() -> list[BlobMetadata]:
            out = []
            paginator = self._client.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=self.bucket, Prefix=full):
                for obj in page.get("Contents", []) or []:
                    key = str(obj["Key"])
                    if not key.startswith(self.prefix):
                        continue
                    out.append(
                        BlobMetadata(
                            key[len(self.prefix) :],
                            int(obj.get("Size", 0)),
                            int(obj["LastModified"].timestamp() * 1000),
                        )
                    )
            return out

        yield from self._call("list", prefix, False, run)

    def close(self) -> None:
        try:
            self._client.close()
        except Exception:
            pass
