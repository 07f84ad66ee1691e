"""Runs executed in-process, recorded as runs of the workspace's code location.

``JobDefinition.execute_in_process`` records a run with no code location (no
``remote_job_origin``): the Dagster UI lists it under Runs but leaves it off the
Overview timeline (which draws runs by repository and job) and cannot link it to its job.
``scripts/run_pipeline.py`` executes every step in-process (one Spark session, the
demo's resources), so ``recorded_in_workspace`` gives those runs the origin
``dagster dev -w workspace.yaml`` would have given them: the same code location name,
repository (``__repository__``, a ``Definitions`` object's) and job name. The origin is
computed from the workspace file alone (no code server is started).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import dagster as dg
from dagster._core.definitions.repository_definition.valid_definitions import (
    SINGLETON_REPOSITORY_NAME,
)
from dagster._core.remote_origin import RemoteJobOrigin, RemoteRepositoryOrigin
from dagster._core.workspace.load_target import WorkspaceFileTarget


def workspace_repository_origin(workspace_file: Path) -> RemoteRepositoryOrigin:
    """The repository origin of the (one) code location ``workspace_file`` loads."""
    origins = WorkspaceFileTarget(paths=[str(workspace_file)]).create_origins()
    if len(origins) != 1:
        raise ValueError(
            f"{workspace_file}: expected one code location, found {len(origins)} "
            f"({', '.join(o.location_name for o in origins) or 'none'})"
        )
    return RemoteRepositoryOrigin(origins[0], SINGLETON_REPOSITORY_NAME)


@contextmanager
def recorded_in_workspace(instance: dg.DagsterInstance, workspace_file: Path) -> Iterator[RemoteRepositoryOrigin]:
    """Within the block, every run the instance creates for a job (``execute_in_process``
    included) records the job's origin in the workspace's code location, unless the
    caller gave one."""
    repo = workspace_repository_origin(workspace_file)
    create = instance.create_run_for_job

    def create_with_origin(**kwargs: Any) -> Any:
        if kwargs.get("remote_job_origin") is None:
            kwargs["remote_job_origin"] = RemoteJobOrigin(repo, kwargs["job_def"].name)
        return create(**kwargs)

    instance.create_run_for_job = create_with_origin  # type: ignore[method-assign,assignment]
    try:
        yield repo
    finally:
        del instance.create_run_for_job
