"""A Dagster I/O manager that stores any asset in persist (``PersistIOManager``).

One module per concern: ``settings`` (the ``persist/*`` metadata), ``type_handlers``
(pyarrow, pandas, polars, PySpark <-> Arrow), ``spark_read`` (PySpark inputs read on the
executors), ``spark_write`` (PySpark outputs written by the executors), ``lazy_read`` (polars LazyFrame inputs streamed within a budget),
``write_modes`` (overwrite as a diff, append, upsert), ``keyed_diff`` (the diff by a sort
on the key), ``partitions`` (partition key -> rows), ``ledger`` (retried steps never
write twice), ``lineage`` (materialization metadata, data versions, which time an input
reads, ``as_of`` a run) and ``manager`` (the I/O manager itself).
"""

from dagster_project.io_manager.errors import (
    AsOfNotReadable,
    IOManagerConfigError,
    NoRecordedMaterialization,
    OutputSchemaMismatch,
    PartitionMismatch,
    RunDidNotMaterialize,
    UnknownAsOfRun,
)
from dagster_project.io_manager.manager import PersistIOManager, collection_name

__all__ = [
    "AsOfNotReadable",
    "IOManagerConfigError",
    "NoRecordedMaterialization",
    "OutputSchemaMismatch",
    "PartitionMismatch",
    "PersistIOManager",
    "RunDidNotMaterialize",
    "UnknownAsOfRun",
    "collection_name",
]
