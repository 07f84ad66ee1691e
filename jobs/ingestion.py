"""Per-source jobs: ingestion, rendition backfill and downstream work.

- ``ingest_<src>_job``: one run-once ingestion pass (the multi-asset ``ingest_<src>``:
  remap, raw, collection, errors) plus its GE checks; launched by the source's arrival
  sensor, or ``dagster job launch -w workspace.yaml -j ingest_orders_job``.
- ``<src>_rendition_job``: a rendition backfill (partition = the new rendition's name).
- ``<src>_summary_job``: downstream work, launched by the asset sensor on ``<src>``.

The in-process executor runs every step in the run worker: one process, one (lazily
started) Spark session, no extra process per step.
"""

from __future__ import annotations

import dagster as dg

from dagster_project.assets import SOURCE_ASSETS, SourceAssets


def ingestion_job(sa: SourceAssets) -> dg.UnresolvedAssetJobDefinition:
    return dg.define_asset_job(
        f"ingest_{sa.spec.name}_job",
        selection=dg.AssetSelection.assets(sa.ingest),
        description=f"Ingest what landed for {sa.spec.name!r} (run-once), then check it.",
        executor_def=dg.in_process_executor,
        tags={"persist/source": sa.spec.name},
    )


def rendition_job(sa: SourceAssets) -> dg.UnresolvedAssetJobDefinition:
    return dg.define_asset_job(
        f"{sa.spec.name}_rendition_job",
        selection=dg.AssetSelection.assets(sa.rendition),
        description=(
            f"Backfill a rendition of {sa.spec.name!r} (partition = rendition name): build it "
            "from the raw collection, catch up, check it (blocking), hand over, collect the old one."
        ),
        executor_def=dg.in_process_executor,
        tags={"persist/source": sa.spec.name},
    )


def summary_job(sa: SourceAssets) -> dg.UnresolvedAssetJobDefinition:
    return dg.define_asset_job(
        f"{sa.spec.name}_summary_job",
        selection=dg.AssetSelection.assets(sa.summary),
        description=f"Downstream work on {sa.spec.name!r}.",
        executor_def=dg.in_process_executor,
    )


INGESTION_JOBS = {name: ingestion_job(sa) for name, sa in SOURCE_ASSETS.items()}
RENDITION_JOBS = {name: rendition_job(sa) for name, sa in SOURCE_ASSETS.items()}
SUMMARY_JOBS = {name: summary_job(sa) for name, sa in SOURCE_ASSETS.items()}
