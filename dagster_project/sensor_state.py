"""Sensor cursors kept in the Dagster instance the way the sensor daemon keeps them.

``scripts/run_pipeline.py`` evaluates sensors itself (as the daemon would) and executes
their run requests. Unless it also leaves each sensor's cursor in the instance, the
daemon of the first ``dagster dev`` afterwards starts those sensors from no cursor and
launches runs nobody asked for (every landed file ingested again, a summary of data
already summarised). ``store_sensor_cursors`` writes the cursors into the sensors'
instigator state, keyed exactly as the daemon looks them up: the workspace file is
loaded as ``dagster dev -w workspace.yaml`` loads it, so origin and selector are the
daemon's own. A sensor that is running by default stays running (the state is created
as ``DECLARED_IN_CODE``, as the daemon creates it); one with a stored state keeps its
status and tick history. This uses Dagster's instigator-state API (the one
``dagster sensor cursor --set`` uses, which would create the state as *stopped*).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path

import dagster as dg
from dagster._core.scheduler.instigation import (
    InstigatorState,
    InstigatorStatus,
    InstigatorType,
    SensorInstigatorData,
)
from dagster._core.workspace.context import WorkspaceProcessContext
from dagster._core.workspace.load_target import WorkspaceFileTarget


def store_sensor_cursors(
    instance: dg.DagsterInstance, cursors: Mapping[str, str | None], workspace_file: Path
) -> dict[str, str | None]:
    """Sets the cursor of each named sensor of the workspace's code locations; returns
    what was stored (sensors the workspace does not define are skipped)."""
    stored: dict[str, str | None] = {}
    target = WorkspaceFileTarget(paths=[str(workspace_file)])
    with WorkspaceProcessContext(instance, target, code_server_log_level="WARNING") as process:
        request = process.create_request_context()
        for name, entry in request.get_code_location_entries().items():
            location = entry.code_location
            if location is None:
                raise RuntimeError(
                    f"code location {name!r} of {workspace_file} failed to load: "
                    f"{entry.load_error.message if entry.load_error else 'unknown error'}"
                )
            for repo in location.get_repositories().values():
                for sensor in repo.get_sensors():
                    if sensor.name not in cursors:
                        continue
                    cursor = cursors[sensor.name]
                    state = instance.get_instigator_state(
                        sensor.get_remote_origin_id(), sensor.selector_id
                    )
                    if state is None:
                        running = sensor.default_status == dg.DefaultSensorStatus.RUNNING
                        instance.add_instigator_state(
                            InstigatorState(
                                sensor.get_remote_origin(),
                                InstigatorType.SENSOR,
                                InstigatorStatus.DECLARED_IN_CODE
                                if running
                                else InstigatorStatus.STOPPED,
                                SensorInstigatorData(
                                    min_interval=sensor.min_interval_seconds,
                                    cursor=cursor,
                                    last_sensor_start_timestamp=time.time(),
                                    sensor_type=sensor.sensor_type,
                                ),
                            )
                        )
                    else:
                        data = state.instigator_data
                        assert isinstance(data, SensorInstigatorData)
                        instance.update_instigator_state(
                            state.with_data(
                                SensorInstigatorData(
                                    last_tick_timestamp=data.last_tick_timestamp,
                                    last_run_key=data.last_run_key,
                                    min_interval=sensor.min_interval_seconds,
                                    cursor=cursor,
                                    last_tick_start_timestamp=data.last_tick_start_timestamp,
                                    last_sensor_start_timestamp=data.last_sensor_start_timestamp,
                                    sensor_type=sensor.sensor_type,
                                    last_tick_success_timestamp=data.last_tick_success_timestamp,
                                )
                            )
                        )
                    stored[sensor.name] = cursor
    return stored


def stored_sensor_cursor(instance: dg.DagsterInstance, sensor_name: str) -> str | None:
    """The cursor the instance holds for a sensor of that name (None if none)."""
    for state in instance.all_instigator_state(instigator_type=InstigatorType.SENSOR):
        if state.instigator_name == sensor_name:
            data = state.instigator_data
            if isinstance(data, SensorInstigatorData):
                return data.cursor
    return None
