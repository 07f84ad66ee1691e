"""The I/O manager's typed errors (subclasses of persist's ``InvalidUsage``).

Each message is one line naming the asset, what was wrong and how to fix it; nothing is
written when one is raised.
"""

from __future__ import annotations

from collections.abc import Sequence

from persist_lib.errors import ConfigProblem, InvalidConfig, InvalidUsage, SchemaMismatch


class IOManagerConfigError(InvalidUsage):
    """The I/O manager or an asset's ``persist/*`` metadata is configured wrongly."""


class InvalidIOManagerConfig(InvalidConfig, IOManagerConfigError):
    """``PersistIOManager``'s own settings broke their rules (``factory_config``):
    ``problems`` names every bad setting at once; the run fails at resource
    initialisation, before any step."""

    def __init__(self, problems: Sequence[ConfigProblem], *, what: str = "PersistIOManager config") -> None:
        super().__init__(problems, what=what)


class OutputSchemaMismatch(SchemaMismatch):
    """An output's schema differs from the schemas its collection was created with."""


class PartitionMismatch(InvalidUsage):
    """An output holds rows outside the partition(s) being materialized."""


class NoRecordedMaterialization(InvalidUsage):
    """An input is read as of its upstream's recorded materialization, but none exists."""


class AsOfNotReadable(IOManagerConfigError):
    """An input's integer ``persist/as_of`` is at or beyond its collection's upper: that
    time is not complete yet, so reading it would wait for writes that may never come."""


class UnknownAsOfRun(IOManagerConfigError):
    """An input's ``persist/as_of`` names a run the Dagster instance does not know."""


class RunDidNotMaterialize(NoRecordedMaterialization):
    """An input's ``persist/as_of`` names a run that recorded no persist time for the
    upstream asset (or for the partitions being loaded)."""
