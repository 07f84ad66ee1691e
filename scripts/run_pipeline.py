"""The whole persist platform pipeline on the embedded default, through Dagster.

    .venv/bin/python scripts/run_pipeline.py [--reset] [--no-spark] [--rows N]

Every step is a Dagster run executed in-process against the instance in
``$DAGSTER_HOME`` (default ``./.dagster_home``, created with ``dagster_home/dagster.yaml``),
so the runs, materializations and check results are recorded and can be browsed
afterwards with ``DAGSTER_HOME=$PWD/.dagster_home .venv/bin/dagster dev -w workspace.yaml``.
Persist data lives under ``$PERSIST_HOME`` (default ``./.persist``).

1. a sample landing zone: JSON-lines order files under ``$PERSIST_HOME/landing/orders``;
2. the arrival sensor is evaluated (as the daemon would) and its run request executed:
   Spark ingestion (local[2]) into the 4-shard ``orders`` collection with reclocking,
   plus the GE checks; a second batch of files arrives and is ingested the same way;
3. the downstream asset sensor launches ``orders_summary``;
4. the compaction-debt sensor requests compaction of shards in debt (big ones on Spark);
5. a rendition backfill builds ``orders`` again from ``orders.raw`` with 8 shards
   (Spark), catches up and hands over; the old rendition is collected;
6. GC and lease expiry (what the schedules launch), and one tick of the compaction-debt
   sensor as the daemon would run it;
7. a short report: contents, frontiers, batches, bytes, runs.

Sensor cursors: every evaluation of a sensor of the code location leaves its cursor in
the instance, stored the way the daemon stores it (``dagster_project.sensor_state``), and
the runs it requested carry the daemon's ``dagster/sensor_name`` and ``dagster/run_key``
tags: the first ``dagster dev`` afterwards carries on from there instead of launching
again what the demo already did. A second run of the demo starts from those cursors.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _setup_env(args: argparse.Namespace) -> tuple[Path, Path]:
    dagster_home = Path(os.environ.get("DAGSTER_HOME") or ROOT / ".dagster_home").resolve()
    persist_home = Path(os.environ.get("PERSIST_HOME") or ROOT / ".persist").resolve()
    if args.reset:
        for d in (dagster_home, persist_home):
            shutil.rmtree(d, ignore_errors=True)
    dagster_home.mkdir(parents=True, exist_ok=True)
    if not (dagster_home / "dagster.yaml").exists():
        shutil.copy(ROOT / "dagster_home" / "dagster.yaml", dagster_home / "dagster.yaml")
    os.environ["DAGSTER_HOME"] = str(dagster_home)
    os.environ["PERSIST_HOME"] = str(persist_home)
    for var in ("PERSIST_BLOB_URI", "PERSIST_CONSENSUS_URI", "PERSIST_LANDING_URI"):
        os.environ.pop(var, None)  # the embedded default, whatever the shell has
    os.environ.setdefault("GX_ANALYTICS_ENABLED", "False")
    return dagster_home, persist_home


class Pipeline:
    """Runs the steps and remembers what happened for the report."""

    def __init__(self, args: argparse.Namespace, persist_home: Path) -> None:
        import dagster as dg
        from dagster_aws.s3 import S3Resource

        from dagster_project.definitions import build_defs
        from dagster_project.resources import LandingZoneResource, PersistResource, SparkResource

        self.dg = dg
        self.args = args
        self.home = persist_home
        self.landing = persist_home / "landing" / "orders"
        self.instance = dg.DagsterInstance.get()
        self.spark_session: Any = None
        spark_config: dict[str, Any] = {}
        if not args.no_spark:
            from persist_lib.spark import local_session

            self.spark_session = local_session(master="local[2]", app_name="persist-pipeline")
            self.spark_session.sparkContext.setLogLevel("ERROR")
            spark_config = {"spark.master": self.spark_session.sparkContext.master}
        self.resources = {
            "persist": PersistResource(),
            # One session for the whole pipeline; stopped at the end.
            "spark": SparkResource(spark_config=spark_config, stop_session=False),
            "landing": LandingZoneResource(uri=str(persist_home / "landing"), s3=S3Resource()),
        }
        self.defs = build_defs(**self.resources)
        self.runs: list[tuple[str, str, float]] = []
        #: cursors the code location's sensors were left at by our evaluations
        self.cursors: dict[str, str | None] = {}

    # ----- helpers -------------------------------------------------------------------

    def step(self, title: str) -> None:
        print(f"\n== {title}", flush=True)

    def run_job(self, name: str, **kwargs: Any) -> Any:
        from dagster_project.run_origin import recorded_in_workspace

        t0 = time.monotonic()
        job = self.defs.resolve_job_def(name)
        # Dagster's event log still records everything; the console shows warnings only.
        run_config = dict(kwargs.pop("run_config", None) or {})
        run_config["loggers"] = {"console": {"config": {"log_level": self.args.log_level}}}
        # recorded as a run of the workspace's code location: on the Overview timeline
        with recorded_in_workspace(self.instance, ROOT / "workspace.yaml"):
            res = job.execute_in_process(
                instance=self.instance, raise_on_error=False, run_config=run_config, **kwargs
            )
        secs = time.monotonic() - t0
        status = "SUCCESS" if res.success else "FAILURE"
        self.runs.append(
            (
                name + (f"[{kwargs['partition_key']}]" if "partition_key" in kwargs else ""),
                status,
                secs,
            )
        )
        print(f"   run {res.run_id[:8]} {name} -> {status} ({secs:.1f}s)", flush=True)
        if not res.success:
            for ev in res.all_events:
                if ev.is_failure:
                    print(f"     {ev.message}", file=sys.stderr)
            raise SystemExit(f"run of {name} failed")
        return res

    def sensor(self, name: str, cursor: str | None = None) -> Any:
        """Evaluates a sensor as the daemon would: from the cursor the instance holds
        for it (unless ``cursor`` is given), applying its partition requests and asset
        events; a sensor of the code location has its new cursor remembered."""
        from dagster_project.sensor_state import stored_sensor_cursor

        dg = self.dg
        sensor = self.defs.resolve_sensor_def(name) if isinstance(name, str) else name
        if isinstance(name, str) and cursor is None:
            cursor = self.cursors.get(name, stored_sensor_cursor(self.instance, name))
        with dg.build_sensor_context(
            instance=self.instance, cursor=cursor, resources=self.resources, definitions=self.defs
        ) as ctx:
            result = sensor(ctx)
        for req in getattr(result, "dynamic_partitions_requests", None) or []:
            have = set(self.instance.get_dynamic_partitions(req.partitions_def_name))
            if isinstance(req, dg.DeleteDynamicPartitionsRequest):
                for k in req.partition_keys:
                    if k in have:
                        self.instance.delete_dynamic_partition(req.partitions_def_name, k)
                continue
            keys = [k for k in req.partition_keys if k not in have]
            if keys:
                self.instance.add_dynamic_partitions(req.partitions_def_name, keys)
        for ev in getattr(result, "asset_events", None) or []:
            self.instance.report_runless_asset_event(ev)
        if isinstance(name, str):
            self.cursors[name] = result.cursor
        return result

    def materialization(self, res: Any, asset: str) -> Any:
        """The metadata of ``asset``'s materialization in run ``res``."""
        key = self.dg.AssetKey(asset)
        (mat,) = [e for e in res.get_asset_materialization_events() if e.asset_key == key]
        return mat.materialization.metadata

    def sensor_tags(self, sensor: str, req: Any) -> dict[str, str]:
        """The tags the daemon puts on a run it launches for ``req`` (plus the request's)."""
        tags = dict(req.tags or {})
        tags["dagster/sensor_name"] = sensor
        if req.run_key:
            tags["dagster/run_key"] = req.run_key
        return tags

    def save_sensor_cursors(self) -> None:
        """Leaves every evaluated sensor's cursor in the instance (as the daemon would)."""
        from dagster_project.sensor_state import store_sensor_cursors

        stored = store_sensor_cursors(self.instance, self.cursors, ROOT / "workspace.yaml")
        print("   sensor cursors saved: " + ", ".join(f"{k}={v}" for k, v in sorted(stored.items())))

    def last_ingested_file(self) -> str | None:
        runs = self.instance.get_runs(
            filters=self.dg.RunsFilter(
                job_name="ingest_orders_job", statuses=[self.dg.DagsterRunStatus.SUCCESS]
            ),
            limit=1,
        )
        return runs[0].tags.get("persist/last_file") if runs else None

    def next_batch(self) -> int:
        names = sorted(p.name for p in self.landing.glob("orders-*.jsonl"))
        return int(names[-1].split("-")[1].split(".")[0]) + 1 if names else 0

    # ----- steps ---------------------------------------------------------------------

    def land(self, files: int, rows: int, bad_rows: int = 0) -> None:
        from dagster_project.sample import write_orders_file

        first = self.next_batch()
        for b in range(first, first + files):
            write_orders_file(
                self.landing, b, rows, id_space=rows * 3, bad_rows=bad_rows if b == first else 0
            )
        print(
            f"   landed orders-{first:06d}..{first + files - 1:06d}.jsonl ({files} x {rows} rows) in {self.landing}"
        )

    def ingest_on_arrival(self) -> None:
        from dagster_project.sensor_state import stored_sensor_cursor

        name = "orders_arrival_sensor"
        cursor = self.cursors.get(name) or stored_sensor_cursor(self.instance, name)
        cursor = cursor or self.last_ingested_file()
        result = self.sensor(name, cursor)
        print(
            f"   orders_arrival_sensor(cursor={cursor!r}) -> {len(result.run_requests)} run request(s), cursor {result.cursor!r}"
        )
        again = self.sensor(name, result.cursor)
        print(f"   re-evaluated with the new cursor -> {len(again.run_requests)} run request(s)")
        for req in result.run_requests:
            print(f"   run_key {req.run_key}")
            self.run_job(
                "ingest_orders_job", tags=self.sensor_tags(name, req), run_config=req.run_config
            )

    def downstream(self) -> None:
        name = "orders_summary_sensor"
        result = self.sensor(name)
        for req in result.run_requests:
            self.run_job("orders_summary_job", tags=self.sensor_tags(name, req))
        if not result.run_requests:
            print(f"   {name}: {result.skip_reason}")

    def revenue(self) -> None:
        """The I/O manager's demo (dagster_project/revenue.py): today's partition of
        demo/orders_daily_revenue, then demo/orders_revenue_trend reading it as of the time
        that materialization recorded."""
        import datetime as dt

        today = dt.datetime.now(dt.UTC).date().isoformat()
        day = self.run_job("orders_daily_revenue_job", partition_key=today)
        trend = self.run_job("orders_revenue_trend_job")
        for res, key in ((day, "orders_daily_revenue"), (trend, "orders_revenue_trend")):
            (ev,) = [e for e in res.get_asset_materialization_events() if e.asset_key.path[-1] == key]
            md = ev.materialization.metadata
            print(f"   demo.{key}: {md['persist/rows'].value} rows at persist time {md['persist/time'].value}")

    def compaction_tick(self) -> None:
        """One tick of the code location's compaction-debt sensor (its own threshold)."""
        name = "compaction_debt_sensor"
        result = self.sensor(name)
        print(f"   {name} -> {len(result.run_requests)} run request(s)")
        for req in result.run_requests:
            self.run_job(
                "compaction_job",
                partition_key=req.partition_key,
                run_config=req.run_config,
                tags=self.sensor_tags(name, req),
            )

    def compact(self) -> None:
        from sensors.compaction import build_compaction_debt_sensor

        threshold = self.args.debt_threshold
        sensor = build_compaction_debt_sensor(threshold=threshold, name="pipeline_compaction")
        result = self.sensor(sensor, None)  # type: ignore[arg-type]
        print(
            f"   compaction_debt_sensor(threshold={threshold}) -> {len(result.run_requests)} shard(s) in debt"
        )
        for req in result.run_requests:
            cfg = json.loads(json.dumps(req.run_config))
            # Show Spark compaction on the demo's (small) shards: no size floor.
            cfg["ops"]["persist_shard"]["config"]["spark_min_bytes"] = 0
            # launched for the code location's compaction-debt sensor (the demo's threshold
            # and size floor differ): tagged as that sensor's run, not a manual launch
            tags = self.sensor_tags("compaction_debt_sensor", req)
            tags["persist/debt_threshold"] = str(threshold)
            res = self.run_job(
                "compaction_job", partition_key=req.partition_key, run_config=cfg, tags=tags
            )
            meta = self.materialization(res, "persist_shard")
            print(
                f"     {req.partition_key}: {meta['compaction_engine'].value}, debt "
                f"{meta['compaction_debt_before'].value} -> {meta['compaction_debt'].value}, "
                f"batches now {meta['batches'].value}"
            )

    def backfill(self, num_shards: int) -> str:
        from dagster_project.resources import PersistResource
        from persist_lib.timefmt import time_text

        with PersistResource().read_only_controller() as ctl:  # leaves no hold behind
            have = ctl.describe("orders")["renditions"]
        rendition = f"r{max(int(r[1:]) for r in have if r[1:].isdigit()) + 1}"
        self.instance.add_dynamic_partitions("orders_renditions", [rendition])
        res = self.run_job(
            "orders_rendition_job",
            partition_key=rendition,
            run_config={"ops": {"orders_rendition": {"config": {"num_shards": num_shards}}}},
        )
        meta = self.materialization(res, "orders_rendition")
        print(
            f"   {meta['previous_rendition'].value} -> {rendition} ({num_shards} shards, built "
            f"({meta['build_engine'].value}) from {meta['raw_records_replayed'].value} raw records), "
            f"handed over at {time_text(int(meta['handover_at'].value))}"
        )
        return rendition

    def maintenance(self) -> None:
        res = self.run_job(
            "gc_job",
            run_config={"ops": {"collect_garbage_op": {"config": {"grace_period_ms": 0}}}},
        )
        out = res.output_for_node("collect_garbage_op")
        print(
            f"     GC: {out['shards']} shards, {out['blobs_deleted']} blobs "
            f"({out['bytes_deleted']} bytes) deleted, {out['leaked_blobs_deleted']} leaked blobs, "
            f"renditions collected {out['renditions_collected'] or '{}'}"
        )
        res = self.run_job("lease_expiry_job")
        out = res.output_for_node("expire_leases_op")
        print(
            f"     leases: {out['shards_scanned']} shards, {out['readers_expired']} readers and "
            f"{out['writers_expired']} writers expired"
        )

    def report(self) -> None:
        from dagster_project.checks import read_latest
        from dagster_project.metadata import frontier_text
        from persist_lib.location.redaction import SensitiveUrl

        persist = self.resources["persist"]
        ctl = persist.controller()  # type: ignore[attr-defined]
        print("\n== Report")
        blob_uri, consensus_uri = persist.uris()  # type: ignore[attr-defined]
        print(f"   persist: {SensitiveUrl(blob_uri)} + {SensitiveUrl(consensus_uri)}")
        print(
            f"   {'collection':<15} {'active':<7} {'shards':>6} {'since':>14} {'upper':>14} {'batches':>8} {'updates':>8} {'bytes':>9}"
        )
        for name in ctl.list_collections():
            d = ctl.describe(name)
            r = d["active_rendition"]
            info = d["renditions"][r]
            print(
                f"   {name:<15} {r:<7} {info['num_shards']:>6} {frontier_text(info['since']):>14} "
                f"{frontier_text(info['upper']):>14} {info['batches']:>8} {info['updates']:>8} {info['bytes']:>9}"
            )
        d = ctl.describe("orders")
        print(
            "   renditions of orders: "
            + ", ".join(
                f"{k} ({v['status']}, {v['num_shards']} shards)"
                for k, v in sorted(d["renditions"].items())
            )
        )
        df, as_of = read_latest(persist, "orders")  # type: ignore[arg-type]
        if as_of is not None and len(df):
            by = df.groupby("status")["diff"].sum()
            print(
                f"   orders as of {as_of}: {int(df['diff'].sum())} orders, amount "
                f"{float((df['amount'] * df['diff']).sum()):,.2f}; "
                + ", ".join(f"{k} {int(v)}" for k, v in by.items())
            )
        errors, _ = read_latest(persist, "orders.errors")  # type: ignore[arg-type]
        print(f"   orders.errors: {len(errors)} record(s) that failed to decode")
        persist.close()  # type: ignore[attr-defined]
        ok = sum(1 for _, s, _ in self.runs if s == "SUCCESS")
        print(
            f"   Dagster runs: {ok}/{len(self.runs)} succeeded, recorded in {os.environ['DAGSTER_HOME']}"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--reset", action="store_true", help="wipe $PERSIST_HOME and $DAGSTER_HOME first"
    )
    p.add_argument("--no-spark", action="store_true", help="run everything in-process")
    p.add_argument("--rows", type=int, default=2000, help="rows per landed file (default 2000)")
    p.add_argument("--debt-threshold", type=int, default=0, help="compaction-debt threshold")
    p.add_argument("--log-level", default="WARNING", help="Dagster console log level")
    args = p.parse_args(argv)
    dagster_home, persist_home = _setup_env(args)
    t0 = time.monotonic()
    print(f"persist pipeline: PERSIST_HOME={persist_home} DAGSTER_HOME={dagster_home}", flush=True)
    pipe = Pipeline(args, persist_home)
    try:
        pipe.step("1. Landing zone: first arrivals")
        pipe.land(files=3, rows=args.rows)
        pipe.step("2. Arrival sensor -> ingestion (Spark, reclocked, 4 shards) + GE checks")
        pipe.ingest_on_arrival()
        pipe.step("   more files land (one with undecodable lines) -> sensor -> ingestion")
        pipe.land(files=2, rows=args.rows, bad_rows=2)
        pipe.ingest_on_arrival()
        pipe.step("3. Asset sensor -> downstream orders_summary")
        pipe.downstream()
        pipe.step("   PersistIOManager: today's revenue per status, then the trend read as of it")
        pipe.revenue()
        pipe.step("4. Compaction-debt sensor -> compaction")
        pipe.compact()
        pipe.step("5. Rendition backfill from orders.raw (8 shards) and hand-over")
        pipe.backfill(num_shards=8)
        pipe.step("   the hand-over re-materialized orders -> asset sensor -> orders_summary")
        pipe.downstream()
        pipe.step("6. Maintenance: GC and lease expiry (what the schedules launch)")
        pipe.maintenance()
        pipe.compaction_tick()
        pipe.report()
        pipe.save_sensor_cursors()
    finally:
        if pipe.spark_session is not None:
            pipe.spark_session.stop()
        pipe.instance.dispose()
    print(
        f"\ndone in {time.monotonic() - t0:.0f}s; browse it: DAGSTER_HOME={dagster_home} .venv/bin/dagster dev -w workspace.yaml"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
