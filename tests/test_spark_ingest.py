"""Spark ingestion of a landing zone produces the same collections as the in-process
ingester: same bindings, same decoded rows and errors, same contents at every time."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from persist_lib import PersistClient, PersistConfig
from persist_lib.ingest import IngestConfig, IngestConfigError, Ingestion, LandingZoneSource
from tests.test_ingest_support import DELETE, KEY, VAL, compare_locations, make_zone
from tests.test_spark_support import file_location

pytest_plugins = ["tests.spark_fixtures"]
pytestmark = pytest.mark.spark


@pytest.mark.parametrize(
    ("envelope", "keep_raw"), [("upsert", True), ("append_only", False)], ids=["upsert+raw", "append_only"]
)
def test_spark_and_in_process_ingestion_produce_identical_collections(
    spark: Any, tmp_path: Path, envelope: str, keep_raw: bool
) -> None:
    from persist_lib.spark import SparkIngestion

    zone = make_zone(tmp_path / "zone", seed=5, files=8, rows=40)
    a, b = file_location(tmp_path, "inproc"), file_location(tmp_path, "spark")
    cfg = IngestConfig(max_records_per_binding=30, max_append_records=70, keep_raw=keep_raw)
    kw: dict[str, Any] = {"envelope": envelope, "config": cfg, "clock": lambda: 1}
    if envelope == "upsert":
        kw["delete_field"] = DELETE
    ca = PersistClient.open(*a, PersistConfig.for_tests())
    cb = PersistClient.open(*b, PersistConfig.for_tests())
    with Ingestion(ca, "ing", LandingZoneSource(str(zone.path)), KEY, VAL, **kw) as ing:
        sa = ing.run_once()
        applied_a = list(ing.applied)
    # Small jobs and pieces, so bindings span jobs and files are decoded in pieces.
    with SparkIngestion(
        spark, cb, "ing", LandingZoneSource(str(zone.path)), KEY, VAL,
        records_per_job=100, min_piece_records=9, **kw,
    ) as ing:
        sb = ing.run_once()
        applied_b = list(ing.applied)
    assert applied_a == applied_b, "the same bindings (files/rows at times)"
    for k in ("upper", "records", "errors", "updates", "bindings_minted"):
        assert sa[k] == sb[k], k
    assert sb["spark"]["records_on_executors"] > 0 and sb["spark"]["jobs"] >= 2
    assert sb["errors"] == zone.bad
    roles = ["data", "errors", "remap"] + (["state", "raw"] if envelope == "upsert" else [])
    compare_locations(a, b, "ing", roles)
    # A second run with nothing new is a no-op for both.
    with SparkIngestion(spark, cb, "ing", LandingZoneSource(str(zone.path)), KEY, VAL, **kw) as ing:
        again = ing.run_once()
    assert again["records"] == 0 and again["upper"] == sb["upper"]
    ca.close()
    cb.close()


def test_spark_ingestion_resumes_what_the_in_process_ingester_started(spark: Any, tmp_path: Path) -> None:
    from persist_lib.spark import ingest_landing_zone

    zone = make_zone(tmp_path / "zone", seed=6, files=6, rows=30)
    a, b = file_location(tmp_path, "one"), file_location(tmp_path, "two")
    cfg = IngestConfig(max_records_per_binding=25)
    kw: dict[str, Any] = {"envelope": "upsert", "delete_field": DELETE, "config": cfg, "clock": lambda: 1}
    ca = PersistClient.open(*a, PersistConfig.for_tests())
    cb = PersistClient.open(*b, PersistConfig.for_tests())
    with Ingestion(ca, "ing", LandingZoneSource(str(zone.path)), KEY, VAL, **kw) as ing:
        ing.run_once()
    # b: half in-process, then the rest on Spark (the same remap shard drives both).
    with Ingestion(cb, "ing", LandingZoneSource(str(zone.path)), KEY, VAL, **kw) as ing:
        ing.run_once(max_records=60)
    s = ingest_landing_zone(spark, cb, "ing", LandingZoneSource(str(zone.path)), KEY, VAL, **kw)
    assert s["spark"]["records_on_executors"] > 0
    compare_locations(a, b, "ing", ["data", "errors", "state", "remap"])
    ca.close()
    cb.close()


def test_only_landing_zones_are_distributed(spark: Any, tmp_path: Path) -> None:
    from persist_lib.spark import SparkIngestion

    client = PersistClient.open(*file_location(tmp_path), PersistConfig.for_tests())

    class Other:
        kind = "other"

    with pytest.raises(IngestConfigError, match="LandingZoneSource"):
        SparkIngestion(spark, client, "x", Other(), KEY, VAL)  # type: ignore[arg-type]
    client.close()
