"""Dagster resources: persist (``PersistResource``), Spark and the S3 landing zone.

* ``PersistResource`` wraps a ``PersistClient`` and a ``StorageController`` on one
  location. Empty URIs mean the embedded default, resolved in the process that uses the
  resource (run worker, sensor, code server): ``PERSIST_BLOB_URI`` /
  ``PERSIST_CONSENSUS_URI`` if set, else file blob + SQLite consensus under
  ``PERSIST_HOME`` (else ``./.persist``).
* ``SparkResource`` is dagster-pyspark's ``PySparkResource`` made lazy and optional
  (no ``spark.master`` = Spark is not configured and work runs in-process) and made to
  stop its session at teardown (``PySparkResource`` never calls ``spark.stop()``).
* ``LandingZoneResource`` names where source files land (a local directory or an S3
  prefix) and lists them; S3 goes through dagster-aws's ``S3Resource``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import dagster as dg
from dagster_aws.s3 import S3Resource
from dagster_pyspark import PySparkResource
from dagster_pyspark.resources import spark_session_from_config
from pydantic import PrivateAttr

from persist_lib.config import PersistConfig
from persist_lib.errors import InvalidConfig
from persist_lib.handles.client import PersistClient, default_home, default_uris
from persist_lib.ingest.errors import IngestConfigError
from persist_lib.ingest.landing_zone.stores import format_of, open_store
from persist_lib.location.check import missing_parts, require_existing_location
from persist_lib.location.redaction import redacted_value
from persist_lib.storage import StorageController


def _redacted_repr_args(args: Iterable[tuple[str | None, Any]]) -> Iterator[tuple[str | None, Any]]:
    """A pydantic model's ``__repr_args__`` with URI/DSN/secret fields redacted (also in
    nested models such as dagster-aws's ``S3Resource``, which holds a secret key)."""
    for name, value in args:
        if hasattr(value, "__repr_args__"):
            inner = ", ".join(
                f"{k}={v!r}" if k else repr(v) for k, v in _redacted_repr_args(value.__repr_args__())
            )
            yield name, _Shown(f"{type(value).__name__}({inner})")
        else:
            yield name, redacted_value(name or "", value)


class _Shown:
    """A value whose repr is a given (already redacted) string."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


#: PersistResource fields that set a ``PersistConfig`` field (named in its errors).
RESOURCE_FIELDS = {"reader_lease_ms": "PersistResource.reader_lease_ms"}


class PersistResource(dg.ConfigurableResource):
    """A persist location (Blob + Consensus) and its STORAGE controller.

    Leave ``blob_uri``/``consensus_uri`` empty for the embedded default (or the
    ``PERSIST_*`` environment variables); ``home`` overrides ``PERSIST_HOME``.
    """

    blob_uri: str = ""
    consensus_uri: str = ""
    home: str = ""
    reader_lease_ms: int = 15 * 60 * 1000

    _client: PersistClient | None = PrivateAttr(default=None)
    _controller: StorageController | None = PrivateAttr(default=None)

    def __repr_args__(self) -> Iterator[tuple[str | None, Any]]:  # repr and str: URIs redacted
        return _redacted_repr_args(super().__repr_args__())

    def uris(self) -> tuple[str, str]:
        """The (blob, consensus) URIs this resource opens (environment resolved now)."""
        blob, consensus = default_uris(self.home or None)
        return self.blob_uri or blob, self.consensus_uri or consensus

    def client(self) -> PersistClient:
        """The (cached) client; opened on first use."""
        if self._client is None:
            cfg = self.persist_config()  # checked before anything is created
            blob, consensus = self.uris()
            if blob.startswith("file://"):
                Path(blob[len("file://") :]).mkdir(parents=True, exist_ok=True)
            if consensus.startswith("sqlite:///"):
                Path(consensus[len("sqlite:///") :]).parent.mkdir(parents=True, exist_ok=True)
            self._client = PersistClient.open(blob, consensus, cfg)
        return self._client

    def persist_config(self) -> PersistConfig:
        """The client's configuration; a bad setting (``reader_lease_ms=-5``) is an
        ``InvalidConfig`` naming the resource field."""
        try:
            return PersistConfig(reader_lease_ms=self.reader_lease_ms)
        except InvalidConfig as e:
            raise e.with_sources(RESOURCE_FIELDS, what="PersistResource config") from None

    def setup_for_execution(self, context: dg.InitResourceContext) -> None:
        """Checks the configuration when a run initialises the resource, so a bad setting
        fails resource initialisation with ``InvalidConfig``, before any step runs."""
        self.persist_config()

    def controller(self) -> StorageController:
        """The (cached) STORAGE controller on this location (recovers on first use)."""
        if self._controller is None:
            self._controller = StorageController(self.client())
        return self._controller

    def location_exists(self) -> bool:
        """Whether the location exists (checked without creating it; remote locations
        always count as existing)."""
        return not missing_parts(*self.uris())

    def existing_client(self) -> PersistClient:
        """The client, for code that only reads (sensors): a local location that does
        not exist is a ``LocationNotFound`` instead of being created."""
        if self._client is None:
            require_existing_location(*self.uris())
        return self.client()

    @contextmanager
    def read_only_controller(self) -> Iterator[StorageController]:
        """A read-only STORAGE controller (no recovery, nothing registered that it
        keeps), for sensors and metadata: ``with persist.read_only_controller() as ctl``."""
        ctl = StorageController(self.existing_client(), read_only=True)
        try:
            yield ctl
        finally:
            ctl.close()

    def close(self) -> None:
        """Releases the controller's read holds and closes the client."""
        if self._controller is not None:
            release_controller(self._controller)
            self._controller = None
        if self._client is not None:
            self._client.close()
            self._client = None

    def teardown_after_execution(self, context: dg.InitResourceContext) -> None:
        self.close()


def release_controller(ctl: StorageController) -> None:
    """Expires the leased readers a controller holds on metadata shards.

    A short-lived controller (one Dagster step) must not leave holds behind: they would
    keep the metadata since (and so the collection of old renditions) back until their
    lease lapses.
    """
    close = getattr(ctl, "close", None)
    if callable(close):
        close()
        return
    readers = getattr(ctl, "_meta_readers", {})
    for r in list(readers.values()):
        try:
            r.expire()
        except Exception:  # noqa: BLE001 - best effort: the lease lapses anyway
            pass
    readers.clear()


class SparkResource(PySparkResource):
    """``PySparkResource``, lazy and optional, that stops its session when the run ends.

    ``spark_config`` without ``spark.master`` means "no Spark": ``enabled`` is false and
    callers fall back to in-process work. The session is created on first use (a run that
    does not need Spark never starts a JVM) and stopped in ``teardown_after_execution``
    unless ``stop_session`` is false (tests that share one session across runs).
    """

    spark_config: dict[str, Any] = {}
    stop_session: bool = True

    @property
    def enabled(self) -> bool:
        return bool(self.spark_config.get("spark.master"))

    def setup_for_execution(self, context: dg.InitResourceContext) -> None:
        """Nothing at set-up: the session is built on first use."""

    @property
    def spark_session(self) -> Any:
        if not self.enabled:
            raise dg.DagsterInvariantViolationError(
                "Spark is not configured: set SPARK_MASTER_URL (or spark_config['spark.master'])"
            )
        if self._spark_session is None:
            self._spark_session = spark_session_from_config(self.spark_config)
        return self._spark_session

    def teardown_after_execution(self, context: dg.InitResourceContext) -> None:
        if self._spark_session is not None and self.stop_session:
            self._spark_session.stop()
        self._spark_session = None


def spark_config_from_env(master: str | None = None) -> dict[str, Any]:
    """Spark settings for ``SPARK_MASTER_URL`` (empty, i.e. Spark disabled, when unset)."""
    master = master if master is not None else os.environ.get("SPARK_MASTER_URL", "")
    if not master:
        return {}
    return {
        "spark.master": master,
        "spark.app.name": "persist-platform",
        "spark.sql.shuffle.partitions": "4",
        "spark.ui.enabled": "false",
        "spark.sql.execution.arrow.pyspark.enabled": "true",
    }


@dataclass(frozen=True)
class LandingFile:
    """One file of a landing zone: its name relative to the zone, size and mtime."""

    name: str
    size: int
    mtime_ms: int


class LandingZoneResource(dg.ConfigurableResource):
    """Where source files land: a local directory or ``s3://bucket/prefix?endpoint_url=..``.

    Empty ``uri`` means ``PERSIST_LANDING_URI``, else ``$PERSIST_HOME/landing``. A source
    reads the sub-directory (sub-prefix) named after it. ``s3`` is used for S3 zones
    (the URI's ``endpoint_url``/``region`` fill in what it leaves unset).
    """

    uri: str = ""
    s3: S3Resource

    def __repr_args__(self) -> Iterator[tuple[str | None, Any]]:  # the URI and s3's secret key
        return _redacted_repr_args(super().__repr_args__())

    def setup_for_execution(self, context: dg.InitResourceContext) -> None:
        """Checks the zone's URI when a run initialises the resource (its form only: a
        local zone that does not exist yet is made by the ingestion), so a bad one fails
        resource initialisation, before any step runs."""
        uri = self.base_uri()
        try:
            open_store(uri)  # parses the URI; opens nothing
        except IngestConfigError as e:
            where = "LandingZoneResource.uri" if self.uri else "$PERSIST_LANDING_URI (LandingZoneResource.uri unset)"
            raise IngestConfigError(f"{where}: {e}; fix: give a local directory, file:///DIR or s3://BUCKET/PREFIX") from None

    def base_uri(self) -> str:
        uri = self.uri or os.environ.get("PERSIST_LANDING_URI", "")
        if not uri:
            uri = str(default_home() / "landing")
        return uri

    def source_uri(self, source: str) -> str:
        """The landing URI of one source (``<base>/<source>``)."""
        base = self.base_uri()
        if base.startswith("s3://"):
            parts = urlsplit(base)
            path = parts.path.rstrip("/") + "/" + source
            q = f"?{parts.query}" if parts.query else ""
            return f"s3://{parts.netloc}{path}{q}"
        return str(Path(_local_path(base)) / source)

    def is_s3(self) -> bool:
        return self.base_uri().startswith("s3://")

    def list_files(self, source: str, after: str = "") -> list[LandingFile]:
        """Files of ``source`` whose name sorts after ``after``, in name order."""
        uri = self.source_uri(source)
        if uri.startswith("s3://"):
            return self._list_s3(uri, after)
        root = Path(uri)
        if not root.is_dir():
            return []
        out = []
        for p in sorted(root.rglob("*")):
            name = p.relative_to(root).as_posix()
            if not p.is_file() or not is_landed_file(name):
                continue
            if name > after:
                st = p.stat()
                out.append(LandingFile(name, st.st_size, int(st.st_mtime * 1000)))
        return out

    def _list_s3(self, uri: str, after: str) -> list[LandingFile]:
        parts = urlsplit(uri)
        # not parse_qs: a '+' in a secret key stays a '+' (as in the ingestion's S3Store)
        q = {unquote(k): unquote(v) for k, _, v in (p.partition("=") for p in parts.query.split("&") if p)}
        bucket, prefix = parts.netloc, parts.path.lstrip("/").rstrip("/") + "/"
        s3 = self.s3
        creds = q.get("access_key_id") and q.get("secret_access_key")
        if (q.get("endpoint_url") and not s3.endpoint_url) or (creds and not s3.aws_access_key_id):
            s3 = S3Resource(
                endpoint_url=s3.endpoint_url or q.get("endpoint_url"),
                region_name=s3.region_name or q.get("region"),
                aws_access_key_id=s3.aws_access_key_id or q.get("access_key_id"),
                aws_secret_access_key=s3.aws_secret_access_key or q.get("secret_access_key"),
                aws_session_token=s3.aws_session_token or q.get("session_token"),
            )
        client = s3.get_client()
        kwargs: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix}
        if after:
            kwargs["StartAfter"] = prefix + after
        out: list[LandingFile] = []
        for page in client.get_paginator("list_objects_v2").paginate(**kwargs):
            for obj in page.get("Contents", []):
                name = obj["Key"][len(prefix) :]
                if not name or not is_landed_file(name) or name <= after:
                    continue
                mtime = int(obj["LastModified"].timestamp() * 1000)
                out.append(LandingFile(name, int(obj["Size"]), mtime))
        return sorted(out, key=lambda f: f.name)


def is_landed_file(name: str) -> bool:
    """Whether a name in a landing zone is a file ready for ingestion.

    The same rules as ``persist_lib.ingest.landing_zone``: producers write under a
    temporary name (leading ``.``/``_``, trailing ``.tmp``/``.partial``) and rename the
    file into place; only known formats (jsonl/csv/parquet, optionally gzipped) count.
    """
    parts = name.split("/")
    if any(p.startswith((".", "_")) for p in parts) or parts[-1].endswith((".tmp", ".partial")):
        return False
    return format_of(name) is not None


def _local_path(uri: str) -> str:
    return uri[len("file://") :] if uri.startswith("file://") else uri
