"""The Postgres CDC source in Dagster: LSN-cursor arrival sensor and ingestion assets.

Uses the throwaway Postgres server of the test session (``wal_level=logical``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dagster as dg
import psycopg
import pytest
from dagster_aws.s3 import S3Resource

from dagster_project.assets import build_source_assets
from dagster_project.checks import read_latest
from dagster_project.definitions import build_resources
from dagster_project.resources import LandingZoneResource, PersistResource, SparkResource
from dagster_project.sources import CUSTOMERS
from jobs.ingestion import ingestion_job
from sensors.arrival import build_cdc_arrival_sensor

pytestmark = [pytest.mark.dagster, pytest.mark.postgres]


@pytest.fixture
def source_db(pg_server: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[psycopg.Connection]:
    dsn = pg_server.create_database("cdc")
    monkeypatch.setenv("PERSIST_CDC_DSN", dsn)
    conn = psycopg.connect(dsn, autocommit=True)
    conn.execute(
        "CREATE TABLE customers (id bigint PRIMARY KEY, name text NOT NULL, email text, "
        "balance float8)"
    )
    conn.execute(
        "INSERT INTO customers SELECT g, 'c' || g, 'c' || g || '@x.org', g * 10.0 "
        "FROM generate_series(1, 20) g"
    )
    yield conn
    slot = conn.execute(
        "SELECT slot_name FROM pg_replication_slots WHERE database = current_database()"
    ).fetchall()
    for (name,) in slot:
        conn.execute("SELECT pg_drop_replication_slot(%s)", (name,))
    conn.close()


def test_cdc_sensor_and_ingestion(
    source_db: psycopg.Connection, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "persist"
    monkeypatch.setenv("PERSIST_HOME", str(home))
    resources = build_resources(
        persist=PersistResource(home=str(home)),
        landing=LandingZoneResource(uri=str(home / "landing"), s3=S3Resource()),
        spark=SparkResource(),
    )
    sa = build_source_assets(CUSTOMERS)
    sensor = build_cdc_arrival_sensor(CUSTOMERS, ingestion_job(sa))
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
            (mat,) = [
                m
                for m in res.get_asset_materialization_events()
                if m.asset_key == dg.AssetKey("customers")
            ]
            return {k: v.value for k, v in mat.materialization.metadata.items()}

        def table() -> dict[int, tuple[Any, ...]]:
            rows = source_db.execute("SELECT id, name, email, balance FROM customers").fetchall()
            return {r[0]: tuple(r[1:]) for r in rows}

        def collection() -> dict[int, tuple[Any, ...]]:
            df, _ = read_latest(resources["persist"], "customers")  # type: ignore[arg-type]
            return {
                int(r.id): (r.name, r.email, float(r.balance)) for r in df.itertuples(index=False)
            }

        r1 = tick(None)  # no slot yet: the first run takes the snapshot
        assert len(r1.run_requests) == 1
        assert r1.run_requests[0].run_key.startswith("customers:")
        meta = ingest()
        assert meta["records_appended"] == 20 and "wal" in str(meta["source_frontier"])
        assert collection() == table()

        r2 = tick(r1.cursor)  # the WAL moved (slot, snapshot) but nothing for the table
        assert not r2.run_requests
        assert not tick(r2.cursor).run_requests

        with source_db.transaction():
            source_db.execute("UPDATE customers SET balance = balance + 1 WHERE id <= 5")
            source_db.execute("DELETE FROM customers WHERE id = 20")
            source_db.execute("INSERT INTO customers VALUES (21, 'new', NULL, 0)")
        r3 = tick(r2.cursor)
        assert (
            len(r3.run_requests) == 1 and r3.run_requests[0].run_key != r1.run_requests[0].run_key
        )
        assert not tick(r3.cursor).run_requests  # same LSN: nothing new
        meta = ingest()
        assert meta["records_appended"] == 7  # the row changes of one transaction
        assert collection() == table()
        assert not tick(r3.cursor).run_requests
