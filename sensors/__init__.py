"""Dagster sensors of the persist platform: source arrivals, compaction debt, downstream.

``dagster_project.definitions`` collects ``SENSORS`` from here.
"""

from __future__ import annotations

from sensors.compaction import build_compaction_debt_sensor, compaction_debt_sensor

SENSORS = [compaction_debt_sensor]

__all__ = ["SENSORS", "build_compaction_debt_sensor", "compaction_debt_sensor"]
