"""Dagster jobs of the persist platform and the schedules that launch them.

``dagster_project.definitions`` collects ``JOBS`` and ``SCHEDULES`` from here.
"""

from __future__ import annotations

from jobs.ingestion import INGESTION_JOBS, RENDITION_JOBS, SUMMARY_JOBS
from jobs.insert import insert_job
from jobs.maintenance import (
    compaction_job,
    gc_job,
    gc_schedule,
    lease_expiry_job,
    lease_expiry_schedule,
    txn_maintenance_job,
    txn_maintenance_schedule,
)
from jobs.schema import evolve_schema_job

JOBS = [
    *INGESTION_JOBS.values(),
    *RENDITION_JOBS.values(),
    *SUMMARY_JOBS.values(),
    compaction_job,
    gc_job,
    lease_expiry_job,
    evolve_schema_job,
    txn_maintenance_job,
    insert_job,
]
SCHEDULES = [gc_schedule, lease_expiry_schedule, txn_maintenance_schedule]

__all__ = [
    "INGESTION_JOBS",
    "JOBS",
    "RENDITION_JOBS",
    "SCHEDULES",
    "SUMMARY_JOBS",
    "compaction_job",
    "evolve_schema_job",
    "gc_job",
    "gc_schedule",
    "insert_job",
    "lease_expiry_job",
    "lease_expiry_schedule",
    "txn_maintenance_job",
    "txn_maintenance_schedule",
]
