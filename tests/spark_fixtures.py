"""The local SparkSession of a test session (``local[2]``, small memory, no UI).

Use it from a test module with ``pytest_plugins = ["tests.spark_fixtures"]`` (one
fixture definition for the whole session, however many modules use it). A process has
one SparkContext at a time: the standalone-cluster tests stop it to run theirs, so the
fixture hands out the live local session and builds a new one when it was stopped.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from typing import Any

import pytest

SPARK_TEST_CONF = {
    "spark.driver.memory": "1g",
    "spark.executor.memory": "1g",
    "spark.sql.shuffle.partitions": "2",
    "spark.default.parallelism": "2",
    "spark.ui.enabled": "false",
    "spark.sql.adaptive.enabled": "true",
    # Fail a job on the first task failure (what local mode does anyway): the failure
    # tests count on a failed task failing the job.
    "spark.task.maxFailures": "1",
}


_local_dirs: list[str] = []


def _alive(session: Any) -> bool:
    sc = session.sparkContext
    return sc._jsc is not None and str(sc.master).startswith("local")


def local_test_session() -> Any:
    """The live ``local[2]`` test session (a new one if another master's session ran)."""
    from pyspark.sql import SparkSession

    from persist_lib.spark.session import local_session

    active = SparkSession.getActiveSession()
    if active is not None and _alive(active):
        return active
    if active is not None:
        active.stop()
    session = local_session("local[2]", "persist-tests", SPARK_TEST_CONF)
    session.sparkContext.setLogLevel("ERROR")
    local_dir = session.sparkContext.getConf().get("spark.local.dir")
    if local_dir and "persist-spark-" in local_dir:
        _local_dirs.append(local_dir)
    return session


@pytest.fixture(scope="session")
def _spark_teardown() -> Iterator[None]:
    yield
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:
        active.stop()
    for d in _local_dirs:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def spark(_spark_teardown: None) -> Any:
    pytest.importorskip("pyspark")
    return local_test_session()
