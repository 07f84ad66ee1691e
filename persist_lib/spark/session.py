"""Building a small local SparkSession that can run persist_lib on its executors.

Spark's Python workers must import ``persist_lib`` with the same interpreter as the
driver, and the tests and benchmarks share a 2-core machine with other work, so the
helper pins ``PYSPARK_PYTHON`` to ``sys.executable`` and keeps memory, shuffle
partitions and the UI small. Production sessions (a Dagster ``PySparkResource``, a
standalone cluster) build their own session; nothing in ``persist_lib.spark`` needs
these settings except the Python executable on the executors.
"""

from __future__ import annotations

import os
import sys
from typing import Any

SMALL_LOCAL_CONF: dict[str, str] = {
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.driver.memory": "1g",
    "spark.executor.memory": "1g",
    "spark.sql.shuffle.partitions": "4",
    "spark.default.parallelism": "2",
    "spark.sql.adaptive.enabled": "true",
    "spark.sql.session.timeZone": "UTC",
    "spark.sql.execution.arrow.pyspark.enabled": "true",
    "spark.sql.execution.arrow.maxRecordsPerBatch": "65536",
    "spark.python.worker.reuse": "true",
    "spark.driver.bindAddress": "127.0.0.1",
    "spark.driver.host": "127.0.0.1",
    "spark.port.maxRetries": "64",
    "spark.local.dir": "",  # filled in by local_session (a private temp dir)
}


def local_session(
    master: str = "local[2]",
    app_name: str = "persist-spark",
    conf: dict[str, str] | None = None,
) -> Any:
    """A new local ``SparkSession`` (``getOrCreate``: an existing one is returned as is).

    ``conf`` overrides ``SMALL_LOCAL_CONF``. Static settings (memory, master) only take
    effect if no session exists yet in this process.
    """
    import tempfile

    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    settings = dict(SMALL_LOCAL_CONF)
    if SparkSession.getActiveSession() is None:  # an existing session keeps its dirs
        settings["spark.local.dir"] = tempfile.mkdtemp(prefix="persist-spark-")
    else:
        del settings["spark.local.dir"]
    settings.update(conf or {})
    builder = SparkSession.builder.master(master).appName(app_name)
    for k, v in settings.items():
        builder = builder.config(k, v)
    return builder.getOrCreate()
