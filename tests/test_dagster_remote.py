"""The code location on Postgres + S3, configured only through environment variables.

``PERSIST_BLOB_URI`` (moto S3), ``PERSIST_CONSENSUS_URI`` (the test Postgres) and
``PERSIST_LANDING_URI`` (an S3 prefix): the default resources of
``dagster_project.definitions`` pick them up; the arrival sensor lists the S3 landing
zone through dagster-aws's ``S3Resource`` and the ingestion writes to S3 + Postgres.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import boto3
import dagster as dg
import psycopg
import pytest

from dagster_project.assets import SOURCE_ASSETS
from dagster_project.definitions import build_resources
from dagster_project.resources import PersistResource
from dagster_project.sample import order_rows
from sensors.arrival import ARRIVAL_SENSORS

pytestmark = [pytest.mark.dagster, pytest.mark.postgres, pytest.mark.s3]


def _put_orders(s3: Any, bucket: str, prefix: str, batch: int, n: int) -> None:
    import json

    body = "\n".join(json.dumps(r) for r in order_rows(batch, n)) + "\n"
    s3.put_object(Bucket=bucket, Key=f"{prefix}/orders/orders-{batch:06d}.jsonl", Body=body)


def test_sensor_and_ingestion_on_s3_and_postgres(
    s3_server: Any, pg_consensus_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data_bucket, landing_bucket = s3_server.create_bucket(), s3_server.create_bucket()
    q = f"endpoint_url={s3_server.endpoint}&region=us-east-1"
    monkeypatch.setenv("PERSIST_BLOB_URI", f"s3://{data_bucket}/persist?{q}")
    monkeypatch.setenv("PERSIST_CONSENSUS_URI", pg_consensus_url)
    monkeypatch.setenv("PERSIST_LANDING_URI", f"s3://{landing_bucket}/incoming?{q}")
    monkeypatch.setenv("PERSIST_HOME", str(tmp_path / "unused"))
    monkeypatch.delenv("SPARK_MASTER_URL", raising=False)
    s3 = boto3.client("s3", endpoint_url=s3_server.endpoint, region_name="us-east-1")
    # Big enough for parts on S3 (appends inline parts up to 16 KiB in state).
    _put_orders(s3, landing_bucket, "incoming", 0, 4000)
    _put_orders(s3, landing_bucket, "incoming", 1, 4000)
    s3.put_object(Bucket=landing_bucket, Key="incoming/orders/_orders-2.jsonl", Body=b"{}\n")

    resources = build_resources()  # everything from the environment
    sa = SOURCE_ASSETS["orders"]
    sensor = ARRIVAL_SENSORS["orders"]
    (tmp_path / "dagster").mkdir()
    with dg.instance_for_test(temp_dir=str(tmp_path / "dagster")) as instance:
        with dg.build_sensor_context(instance=instance, resources=resources) as ctx:
            r = sensor(ctx)
        assert isinstance(r, dg.SensorResult)
        assert [q.run_key for q in r.run_requests] == ["orders:orders-000001.jsonl"]
        res = dg.materialize([sa.ingest, *sa.checks], resources=resources, instance=instance)
        assert res.success
        (mat,) = [
            m
            for m in res.get_asset_materialization_events()
            if m.asset_key == dg.AssetKey("orders")
        ]
        assert mat.materialization.metadata["records_appended"].value == 8000
        # Read back through the same environment: the upsert of both files (the last
        # record of each order id), exactly.
        latest = {r["order_id"]: r for r in order_rows(0, 4000) + order_rows(1, 4000)}
        persist = resources["persist"]
        assert isinstance(persist, PersistResource)
        with persist.read_only_controller() as ro:
            d = ro.describe("orders")
            reader = ro.acquire_read_handle("orders")
            try:
                got = reader.snapshot(d["metadata_upper"][0] - 1).to_pylist()
            finally:
                reader.expire()
        assert all(r["diff"] == 1 for r in got)
        assert sorted((r["order_id"], r["customer"], r["amount"], r["status"]) for r in got) == sorted(
            (k, v["customer"], v["amount"], v["status"]) for k, v in latest.items()
        )
        shards = {s for info in d["renditions"].values() for s in info["shards"]}
    # The data is on S3 and the state in Postgres, not under PERSIST_HOME: the collection's
    # shards have their logs in Postgres, and every part on S3 belongs to a shard logged
    # there.
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=data_bucket, Prefix="persist/").get("Contents", [])]
    with psycopg.connect(pg_consensus_url) as conn:
        logged = {row[0] for row in conn.execute("SELECT DISTINCT shard FROM consensus")}
    assert shards <= logged
    assert keys and {k.split("/")[1] for k in keys} <= logged, keys
    assert not (tmp_path / "unused").exists()
