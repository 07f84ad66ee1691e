"""Fixtures of the code-location tests (``home``, ``resources``, ``instance``): the
embedded default location under a temp ``PERSIST_HOME`` (no servers, no Spark), the code
location's resources on it, and a temporary on-disk Dagster instance, each made per test.
Use with ``pytest_plugins = ["tests.dagster_fixtures"]``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import dagster as dg
import pytest
from dagster_aws.s3 import S3Resource

from dagster_project.definitions import build_resources
from dagster_project.resources import LandingZoneResource, PersistResource, SparkResource


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for var in ("PERSIST_BLOB_URI", "PERSIST_CONSENSUS_URI", "PERSIST_LANDING_URI", "SPARK_MASTER_URL"):
        monkeypatch.delenv(var, raising=False)
    h = tmp_path / "persist"
    monkeypatch.setenv("PERSIST_HOME", str(h))
    return h


@pytest.fixture
def resources(home: Path) -> dict[str, object]:
    return build_resources(
        persist=PersistResource(home=str(home)),
        landing=LandingZoneResource(uri=str(home / "landing"), s3=S3Resource()),
        spark=SparkResource(),
    )


@pytest.fixture
def instance(tmp_path: Path) -> Iterator[dg.DagsterInstance]:
    (tmp_path / "dagster").mkdir()
    with dg.instance_for_test(temp_dir=str(tmp_path / "dagster")) as inst:
        yield inst
