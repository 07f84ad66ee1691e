"""The one SparkSession of a test session (``local[2]``, small memory, no UI).

Use it from a test module with ``pytest_plugins = ["tests.spark_fixtures"]`` (one
fixture definition for the whole session, however many modules use it).
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


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    pytest.importorskip("pyspark")
    from persist_lib.spark.session import local_session

    session = local_session("local[2]", "persist-tests", SPARK_TEST_CONF)
    session.sparkContext.setLogLevel("ERROR")
    local_dir = session.sparkContext.getConf().get("spark.local.dir")
    try:
        yield session
    finally:
        session.stop()
        if local_dir and "persist-spark-" in local_dir:
            shutil.rmtree(local_dir, ignore_errors=True)
