"""Dagster sensors of the persist platform: source arrivals, compaction debt, downstream.

``dagster_project.definitions`` collects ``SENSORS`` from here.
"""

from __future__ import annotations

from sensors.arrival import ARRIVAL_SENSORS, build_arrival_sensor
from sensors.compaction import build_compaction_debt_sensor, compaction_debt_sensor
from sensors.downstream import DOWNSTREAM_SENSORS, build_downstream_sensor

SENSORS = [*ARRIVAL_SENSORS.values(), compaction_debt_sensor, *DOWNSTREAM_SENSORS.values()]

__all__ = [
    "ARRIVAL_SENSORS",
    "DOWNSTREAM_SENSORS",
    "SENSORS",
    "build_arrival_sensor",
    "build_compaction_debt_sensor",
    "build_downstream_sensor",
    "compaction_debt_sensor",
]
