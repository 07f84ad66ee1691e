"""Metrics (``persist_lib.shard.metrics``): per-shard counters and gauges, scraped over HTTP
from the Prometheus endpoint after real writes and reads, ``persist metrics``, and the
blob request counts (and their S3 cost) in Dagster metadata."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from persist_lib import PersistClient, PersistConfig, ShardId
from persist_lib.shard import metrics as pm

pytest.importorskip("prometheus_client")

REPO = Path(__file__).resolve().parents[1]
K = pa.schema([("k", pa.int64())])
V = pa.schema([("v", pa.string())])


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``{(family, labels): value}`` of persist's families, read over HTTP."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    assert "# TYPE persist_commits_total counter" in text
    return {(s.name, s.labels): s.value for s in pm.parse_exposition(text)}


def value(m: dict, name: str, **labels: str) -> float:
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


def test_endpoint_scraped_after_writes_and_reads_reports_what_was_done(tmp_path: Path) -> None:
    home = tmp_path / "home"
    cfg = PersistConfig.for_tests(inline_threshold=0)  # every part goes to blob
    a = PersistClient.default(home, cfg)
    sid = ShardId.new()
    s = str(sid)
    w, r = a.open(sid, K, V)
    n = 7
    for t in range(n):
        w.compare_and_append([(((i,), (f"v{t}",)), t, 1) for i in range(50)], t, t + 1)
    state = a.inspect(sid)
    parts = [p for b in state["batches"] for p in b["parts"]]
    assert len(parts) == n
    r.snapshot(n - 1)  # reads every part once
    listen = r.listen(2)  # 4 times behind the upper
    # A second "process" (its own state cache: another consensus URI for the same
    # database): its transitions run on a stale cached state, lose one CAS and re-run.
    b = PersistClient.open(
        f"file://{home / 'blob'}", f"unreliable+sqlite:///{home / 'consensus.db'}?unreliable_rate=0", cfg
    )
    wb, rb = b.open(sid, K, V)
    w.compare_and_append([(((0,), ("late",)), n, 1)], n, n + 1)  # a: stale after b's register
    rb.downgrade_since(1)  # b: stale after a's append
    far = cfg.now_ms() + 10 * cfg.writer_lease_ms
    expired = a.expire_leases(sid, now=far)[s]  # a: stale after b's downgrade; all lapsed
    server, thread = pm.start_http_server(0)
    try:
        m = scrape(server.server_port)
    finally:
        server.shutdown()
    # commits by transition; each of the three stale CASes lost once and was re-run
    assert value(m, "persist_commits", shard=s, transition="compare_and_append") == n + 1
    assert value(m, "persist_commits", shard=s, transition="register") == 2
    assert value(m, "persist_commits", shard=s, transition="downgrade_since") == 1
    assert value(m, "persist_commits", shard=s, transition="expire_leases") == 1
    assert value(m, "persist_cas_mismatches", shard=s) == 3 == value(m, "persist_cas_retries", shard=s)
    assert value(m, "persist_cas_attempts", shard=s) == (n + 1 + 2 + 1 + 1) + 3
    # blob: one PUT per part written, one GET per part read; bytes as recorded in state
    parts = [p for bt in a.inspect(sid)["batches"] for p in bt["parts"]]
    assert value(m, "persist_parts_written", shard=s) == n + 1 == len(parts)
    assert value(m, "persist_blob_requests", shard=s, op="put") == n + 1
    assert value(m, "persist_blob_bytes_written", shard=s) == sum(p["bytes"] for p in parts)
    assert value(m, "persist_parts_read", shard=s) == n == value(m, "persist_blob_requests", shard=s, op="get")
    assert value(m, "persist_blob_bytes_read", shard=s) == sum(p["bytes"] for p in parts if p["tmax"] < n)
    cost = value(m, "persist_blob_request_cost_usd", shard=s, op="put") + value(
        m, "persist_blob_request_cost_usd", shard=s, op="get"
    )
    assert cost == pytest.approx((n + 1) * 0.005 / 1000 + n * 0.0004 / 1000)
    assert value(m, "persist_lease_expiries", shard=s, kind="reader") == len(expired["readers"]) == 2
    assert value(m, "persist_lease_expiries", shard=s, kind="writer") == len(expired["writers"]) == 2
    # gauges: the shard state, compaction debt, listen lag
    st = a.inspect(sid)
    assert value(m, "persist_shard_upper", shard=s) == n + 1
    assert value(m, "persist_shard_batches", shard=s) == st["num_batches"]
    assert value(m, "persist_compaction_debt", shard=s) == st["compaction_debt"] > 0
    assert value(m, "persist_listen_lag", shard=s) == (n + 1) - listen.frontier.time == n - 2
    assert value(m, "persist_listens", shard=s) == 1
    # counters survive their client: closing folds them into the process totals
    b.close()
    after = pm.process_counters()[s]
    assert after.machine.committed_by["compare_and_append"] == n + 1 and after.parts_written == n + 1
    assert after.machine.committed_by["downgrade_since"] == 1
    a.close()


def test_metrics_off_counts_nothing_and_on_counts_s3_billing() -> None:
    n = uuid.uuid4().hex
    off = PersistClient.open(f"mem://{n}", f"mem://{n}", PersistConfig.for_tests(metrics=False, inline_threshold=0))
    assert off.metrics is None
    sid = ShardId.new()
    w, r = off.open(sid, K, V)
    w.compare_and_append([(((1,), ("a",)), 0, 1)], 0, 1)
    r.snapshot(0)
    off.close()
    assert str(sid) not in pm.process_counters()
    assert pm.put_requests(8 << 20) == 1 and pm.put_requests((8 << 20) + 1) == 4  # create, 2 parts, complete
    assert pm.list_requests(0) == 1 and pm.list_requests(2500) == 3
    assert pm.REQUEST_PRICE_USD == pytest.approx({"put": 5e-6, "get": 4e-7, "list": 5e-6, "delete": 0.0})
    on = PersistClient.open(f"mem://{n}x", f"mem://{n}x", PersistConfig.for_tests())
    assert on.metrics is not None
    list(on.blob.list_keys_and_metadata("sabc/"))
    on.blob.set("sabc/w/p1", b"x" * ((16 << 20) + 1))
    on.blob.delete("sabc/w/p1")
    t = on.metrics.by_shard()["sabc"]
    assert t.requests == [5, 0, 1, 1] and t.bytes_written == (16 << 20) + 1
    assert on.metrics.totals()["cost_usd"] == pytest.approx(6 * 5e-6)
    on.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


CHILD = """
import sys, pyarrow as pa
from persist_lib import PersistClient, PersistConfig, ShardId
c = PersistClient.default(sys.argv[1], PersistConfig.for_tests(inline_threshold=0))
sid = ShardId.new()
w, r = c.open(sid, pa.schema([("k", pa.int64())]), pa.schema([]))
for t in range(int(sys.argv[2])):
    w.compare_and_append([(((t,), ()), t, 1)], t, t + 1)
print(sid, flush=True)
sys.stdin.read()  # serve until the test is done
"""


def test_env_port_serves_a_process_and_persist_metrics_reads_it(tmp_path: Path) -> None:
    port = _free_port()
    home = tmp_path / "home"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PERSIST_")}
    env.update(PYTHONPATH=str(REPO), PERSIST_METRICS_PORT=str(port))
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(home), "5"],
        env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert child.stdout is not None
        sid = child.stdout.readline().strip()
        assert sid.startswith("s"), sid
        m = scrape(port)
        assert value(m, "persist_commits", shard=sid, transition="compare_and_append") == 5
        assert value(m, "persist_parts_written", shard=sid) == 5
        # `persist metrics --url`: that process's counters, per shard
        cli_env = {**env, "PERSIST_HOME": str(home)}
        cli_env.pop("PERSIST_METRICS_PORT")
        out = run_cli(["metrics", "--url", f"127.0.0.1:{port}", "--json"], cli_env)
        assert out.returncode == 0, out.stderr
        row = json.loads(out.stdout)[sid]
        assert row["commits"] == 6 and row["put"] == 5 and row["get"] == 0  # 5 appends + register
        assert row["cost_usd"] == pytest.approx(5 * 5e-6) and row["parts_written"] == 5
        out = run_cli(["metrics", "--url", f"127.0.0.1:{port}"], cli_env)
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()  # each shard id on its own line, its counters below
        assert any(x == sid and "$0.000025" in lines[i + 1] for i, x in enumerate(lines[:-1])), out.stdout
        assert max(len(x) for x in lines) <= 120, out.stdout
    finally:
        child.communicate("", timeout=30)
    # without --url: the shard states of the location, read now (the child is gone)
    out = run_cli(["metrics", "--json"], cli_env)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc[sid]["upper"] == 5 and doc[sid]["batches"] == 5 and doc[sid]["readers"] == 1


def run_cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "persist_lib.cli.main", *args], env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.dagster
def test_dagster_metadata_has_the_runs_blob_requests_and_cost(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import dagster as dg
    from dagster_aws.s3 import S3Resource

    from dagster_project.assets import persist_shard
    from dagster_project.definitions import build_resources
    from dagster_project.resources import LandingZoneResource, PersistResource, SparkResource
    from jobs.maintenance import gc_job

    for var in ("PERSIST_BLOB_URI", "PERSIST_CONSENSUS_URI", "PERSIST_LANDING_URI", "SPARK_MASTER_URL"):
        monkeypatch.delenv(var, raising=False)
    home = tmp_path / "persist"
    monkeypatch.setenv("PERSIST_HOME", str(home))
    client = PersistClient.default(home, PersistConfig.for_tests(inline_threshold=0))
    sid = ShardId.new()
    w, r = client.open(sid, K, V)
    for t in range(12):  # small batches: compaction owes merges
        w.compare_and_append([(((i,), (f"{t}-{i:08d}" * 4,)), t, 1) for i in range(200)], t, t + 1)
    w.expire()
    r.expire()
    client.close()
    resources: dict[str, Any] = build_resources(
        persist=PersistResource(home=str(home)),
        landing=LandingZoneResource(uri=str(home / "landing"), s3=S3Resource()),
        spark=SparkResource(),
    )
    (tmp_path / "dagster").mkdir()
    with dg.instance_for_test(temp_dir=str(tmp_path / "dagster")) as instance:
        instance.add_dynamic_partitions("persist_shards", [str(sid)])
        res = dg.materialize(
            [persist_shard],
            resources=resources,
            instance=instance,
            partition_key=str(sid),
            run_config={"ops": {"persist_shard": {"config": {"debt_threshold": 0}}}},
        )
        assert res.success
        mat = res.get_asset_materialization_events()[-1].materialization
        meta = {k: v.value for k, v in mat.metadata.items()}
        assert meta["merges_applied"] >= 1, meta
        assert meta["blob_put_requests"] >= 1  # the merged parts
        assert meta["blob_get_requests"] >= 2  # the parts it merged
        assert meta["blob_bytes_written"] > 0 and meta["persist_commits"] >= 1
        expect = meta["blob_put_requests"] * 5e-6 + meta["blob_get_requests"] * 4e-7 + meta["blob_list_requests"] * 5e-6
        assert meta["blob_request_cost_usd"] == pytest.approx(expect)
        gc = gc_job.execute_in_process(instance=instance, resources=resources)
        assert gc.success
        outs = [
            e.event_specific_data.metadata
            for e in gc.all_events
            if e.event_type_value == "STEP_OUTPUT" and e.event_specific_data is not None
        ]
        gmeta = {k: v.value for k, v in outs[0].items()}
        assert gmeta["blob_list_requests"] >= 1  # the leaked-blob sweep lists the shard
        assert "blob_request_cost_usd" in gmeta


def test_persist_metrics_never_creates_a_location(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PERSIST_")}
    env.update(PYTHONPATH=str(REPO), PERSIST_HOME=str(tmp_path / "nowhere"))
    out = run_cli(["metrics"], env)
    assert out.returncode == 2 and "LocationNotFound" in out.stderr
    assert not (tmp_path / "nowhere").exists()
