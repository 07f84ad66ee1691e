"""Dagster jobs of the persist platform and the schedules that launch them.

``dagster_project.definitions`` collects ``JOBS`` and ``SCHEDULES`` from here.
"""

from __future__ import annotations

from jobs.maintenance import (
    compaction_job,
    gc_job,
    gc_schedule,
    lease_expiry_job,
    lease_expiry_schedule,
)

JOBS = [compaction_job, gc_job, lease_expiry_job]
SCHEDULES = [gc_schedule, lease_expiry_schedule]

__all__ = [
    "JOBS",
    "SCHEDULES",
    "compaction_job",
    "gc_job",
    "gc_schedule",
    "lease_expiry_job",
    "lease_expiry_schedule",
]
