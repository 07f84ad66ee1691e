"""The Kafka source in Dagster: the lag sensor (group offsets = durable frontier) and the
ingestion assets, against the session's Tansu broker."""

from __future__ import annotations

import dataclasses
import json
import uuid
from pathlib import Path
from typing import Any

import dagster as dg
import pytest
from dagster_aws.s3 import S3Resource

from dagster_project.assets import build_source_assets
from dagster_project.checks import read_latest
from dagster_project.definitions import build_resources
from dagster_project.resources import LandingZoneResource, PersistResource, SparkResource
from dagster_project.sources import EVENTS
from jobs.ingestion import ingestion_job
from sensors.arrival import build_kafka_lag_sensor
from tests.support.kafka_server import KafkaBroker

pytestmark = [pytest.mark.dagster, pytest.mark.kafka]


def test_kafka_lag_sensor_and_ingestion(
    kafka_broker: KafkaBroker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "persist"
    monkeypatch.setenv("PERSIST_HOME", str(home))
    monkeypatch.setenv("PERSIST_KAFKA_BOOTSTRAP", kafka_broker.bootstrap)
    spec = dataclasses.replace(EVENTS, topic=f"events-{uuid.uuid4().hex[:8]}")
    kafka_broker.create_topic(spec.topic, 2)
    expected: dict[int, tuple[str, float]] = {}

    def produce(rows: list[tuple[int, dict[str, Any] | None]]) -> None:
        kafka_broker.produce(
            spec.topic,
            [(k % 2, json.dumps(k).encode(), None if v is None else json.dumps(v).encode()) for k, v in rows],
        )
        for k, v in rows:
            if v is None:
                expected.pop(k, None)
            else:
                expected[k] = (v["kind"], float(v["amount"]))

    resources = build_resources(
        persist=PersistResource(home=str(home)),
        landing=LandingZoneResource(uri=str(home / "landing"), s3=S3Resource()),
        spark=SparkResource(),
    )
    sa = build_source_assets(spec)
    sensor = build_kafka_lag_sensor(spec, ingestion_job(sa))
    (tmp_path / "dagster").mkdir()
    with dg.instance_for_test(temp_dir=str(tmp_path / "dagster")) as instance:

        def tick(cursor: str | None) -> dg.SensorResult:
            with dg.build_sensor_context(instance=instance, cursor=cursor) as ctx:
                r = sensor(ctx)
            assert isinstance(r, dg.SensorResult) and r.cursor
            return r

        def ingest() -> dict[str, Any]:
            res = dg.materialize([sa.ingest, *sa.checks], resources=resources, instance=instance)
            assert res.success
            assert all(e.passed for e in res.get_asset_check_evaluations())
            (mat,) = [m for m in res.get_asset_materialization_events() if m.asset_key == dg.AssetKey("events")]
            return {k: v.value for k, v in mat.materialization.metadata.items()}

        def collection() -> dict[int, tuple[str, float]]:
            df, _ = read_latest(resources["persist"], "events")  # type: ignore[arg-type]
            return {int(r.id): (r.kind, float(r.amount)) for r in df.itertuples(index=False)}

        produce([(i, {"kind": "k" + str(i % 3), "amount": i * 1.5}) for i in range(30)] + [(4, None), (7, None)])
        r1 = tick(None)
        assert len(r1.run_requests) == 1 and r1.run_requests[0].run_key.startswith("events:")
        assert int(r1.run_requests[0].tags["persist/lag_records"]) > 0
        meta = ingest()
        assert meta["records_appended"] == 32
        assert collection() == expected
        assert not tick(r1.cursor).run_requests  # caught up: the group offsets are the frontier

        produce([(4, {"kind": "back", "amount": 1.0}), (10, None), (40, {"kind": "new", "amount": 2.0})])
        r2 = tick(r1.cursor)
        assert len(r2.run_requests) == 1 and r2.run_requests[0].run_key != r1.run_requests[0].run_key
        meta = ingest()
        assert meta["records_appended"] == 3
        assert collection() == expected
        assert not tick(r2.cursor).run_requests
