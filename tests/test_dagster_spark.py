"""Dagster with Spark: ingestion, rendition build and compaction through ``SparkResource``.

One local Spark session is shared by the module (``persist_lib.spark.local_session``:
``getOrCreate`` returns it to the resource too); the resource is told not to stop it.
That the resource stops its session at teardown is checked without starting a JVM.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dagster as dg
import pytest
from dagster_aws.s3 import S3Resource

from dagster_project.assets import SOURCE_ASSETS, persist_shard
from dagster_project.definitions import build_resources
from dagster_project.resources import LandingZoneResource, PersistResource, SparkResource
from dagster_project.sample import write_orders_file

pytestmark = [pytest.mark.dagster]

ORDERS = SOURCE_ASSETS["orders"]


class _Session:
    stopped = 0

    def stop(self) -> None:
        self.stopped += 1


def test_spark_resource_is_lazy_optional_and_stops_its_session() -> None:
    off = SparkResource()
    assert not off.enabled
    with pytest.raises(dg.DagsterInvariantViolationError, match="SPARK_MASTER_URL"):
        _ = off.spark_session
    res = SparkResource(spark_config={"spark.master": "local[1]"})
    assert res.enabled
    session = _Session()

    @dg.asset
    def uses_spark(spark: SparkResource) -> None:
        spark._spark_session = session  # what spark_session would have built

    assert dg.materialize([uses_spark], resources={"spark": res}).success
    assert session.stopped == 1
    keep = SparkResource(spark_config={"spark.master": "local[1]"}, stop_session=False)
    session2 = _Session()

    @dg.asset
    def uses_spark_kept(spark: SparkResource) -> None:
        spark._spark_session = session2

    assert dg.materialize([uses_spark_kept], resources={"spark": keep}).success
    assert session2.stopped == 0


@pytest.fixture(scope="module")
def spark() -> Iterator[Any]:
    pytest.importorskip("pyspark")
    from persist_lib.spark import local_session

    yield local_session(app_name="dagster-tests")


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for var in ("PERSIST_BLOB_URI", "PERSIST_CONSENSUS_URI", "PERSIST_LANDING_URI"):
        monkeypatch.delenv(var, raising=False)
    h = tmp_path / "persist"
    monkeypatch.setenv("PERSIST_HOME", str(h))
    return h


@pytest.mark.spark
def test_spark_ingestion_backfill_and_compaction(spark: Any, home: Path, tmp_path: Path) -> None:
    resources = build_resources(
        persist=PersistResource(home=str(home)),
        landing=LandingZoneResource(uri=str(home / "landing"), s3=S3Resource()),
        spark=SparkResource(
            spark_config={"spark.master": spark.sparkContext.master}, stop_session=False
        ),
    )
    landing = home / "landing" / "orders"
    for b in range(2):
        write_orders_file(landing, b, 200, id_space=300)
    (tmp_path / "dagster").mkdir()
    with dg.instance_for_test(temp_dir=str(tmp_path / "dagster")) as instance:
        res = dg.materialize(
            [ORDERS.ingest, *ORDERS.checks], resources=resources, instance=instance
        )
        assert res.success
        mats = {m.asset_key.to_user_string(): m for m in res.get_asset_materialization_events()}
        meta = mats["orders"].materialization.metadata
        assert meta["engine"].value == "spark"
        assert meta["records_appended"].value == 400

        instance.add_dynamic_partitions("orders_renditions", ["r1"])
        res = dg.materialize(
            [ORDERS.rendition],
            resources=resources,
            instance=instance,
            partition_key="r1",
            run_config={"ops": {"orders_rendition": {"config": {"num_shards": 2}}}},
        )
        assert res.success
        meta = res.get_asset_materialization_events()[0].materialization.metadata
        assert meta["build_engine"].value == "spark"
        assert meta["active_rendition"].value == "r1" and meta["num_shards"].value == 2

        shard = (
            PersistResource(home=str(home))
            .controller()
            .describe("orders")["renditions"]["r1"]["shards"][0]
        )
        # More batches on the shard, then compact it on Spark (no size floor).
        write_orders_file(landing, 2, 50, id_space=300)
        assert dg.materialize([ORDERS.ingest], resources=resources, instance=instance).success
        instance.add_dynamic_partitions("persist_shards", [shard])
        res = dg.materialize(
            [persist_shard],
            resources=resources,
            instance=instance,
            partition_key=shard,
            run_config={
                "ops": {"persist_shard": {"config": {"debt_threshold": -1, "spark_min_bytes": 0}}}
            },
        )
        assert res.success
        meta = res.get_asset_materialization_events()[0].materialization.metadata
        assert meta["compaction_engine"].value == "spark"
    assert spark.sparkContext._jsc is not None  # the shared session is still alive


@pytest.mark.spark
@pytest.mark.kafka
def test_a_kafka_source_is_ingested_on_spark(
    spark: Any, home: Path, tmp_path: Path, kafka_broker: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With Spark configured, the Kafka source's ingestion decodes its bound offset ranges
    on executors (``engine: spark``) and the collection is the topic's upserted state."""
    import dataclasses
    import json
    import uuid

    from dagster_project.assets import build_source_assets
    from dagster_project.checks import read_latest
    from dagster_project.sources import EVENTS

    monkeypatch.setenv("PERSIST_KAFKA_BOOTSTRAP", kafka_broker.bootstrap)
    spec = dataclasses.replace(EVENTS, topic=f"events-{uuid.uuid4().hex[:8]}")
    kafka_broker.create_topic(spec.topic, 2)
    rows = [(i, {"kind": f"k{i % 3}", "amount": i * 0.5}) for i in range(400)] + [(i, None) for i in range(0, 400, 7)]
    kafka_broker.produce(
        spec.topic, [(k % 2, json.dumps(k).encode(), None if v is None else json.dumps(v).encode()) for k, v in rows]
    )
    expected = {k: (v["kind"], float(v["amount"])) for k, v in rows if v is not None and k % 7}
    resources = build_resources(
        persist=PersistResource(home=str(home)),
        landing=LandingZoneResource(uri=str(home / "landing"), s3=S3Resource()),
        spark=SparkResource(spark_config={"spark.master": spark.sparkContext.master}, stop_session=False),
    )
    sa = build_source_assets(spec)
    (tmp_path / "dagster").mkdir()
    with dg.instance_for_test(temp_dir=str(tmp_path / "dagster")) as instance:
        res = dg.materialize([sa.ingest, *sa.checks], resources=resources, instance=instance)
        assert res.success
        (mat,) = [m for m in res.get_asset_materialization_events() if m.asset_key == dg.AssetKey("events")]
        meta = {k: v.value for k, v in mat.materialization.metadata.items()}
        assert meta["engine"] == "spark" and meta["records_appended"] == len(rows)
        df, _ = read_latest(resources["persist"], "events")  # type: ignore[arg-type]
        assert {int(r.id): (r.kind, float(r.amount)) for r in df.itertuples(index=False)} == expected
    assert spark.sparkContext._jsc is not None
