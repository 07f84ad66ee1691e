"""The code location from the command line, as docs/dagster.md says to run it.

- ``dagster job launch -w workspace.yaml -j ingest_orders_job`` with ``DAGSTER_HOME`` set
  to a temp dir holding ``dagster_home/dagster.yaml`` (DefaultRunCoordinator: no daemon)
  completes, and its materializations are in the instance;
- ``dagster-webserver -w workspace.yaml`` serves the asset graph (GraphQL ``assetNodes``).

Each test runs the real CLI in a subprocess from the repository root.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import dagster as dg
import pytest

from dagster_project.sample import write_orders_file

pytestmark = pytest.mark.dagster

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


@pytest.fixture
def cli_env(tmp_path: Path) -> dict[str, str]:
    """DAGSTER_HOME (with the local dagster.yaml) and PERSIST_HOME in a temp dir."""
    dagster_home = tmp_path / "dagster_home"
    dagster_home.mkdir()
    shutil.copy(ROOT / "dagster_home" / "dagster.yaml", dagster_home / "dagster.yaml")
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PERSIST_", "DAGSTER_", "SPARK_MASTER"))
    }
    env.update(DAGSTER_HOME=str(dagster_home), PERSIST_HOME=str(tmp_path / "persist"))
    return env


def test_job_launch_runs_without_a_daemon(
    cli_env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_orders_file(tmp_path / "persist" / "landing" / "orders", 0, 50)
    proc = subprocess.run(
        [str(BIN / "dagster"), "job", "launch", "-w", "workspace.yaml", "-j", "ingest_orders_job"],
        cwd=ROOT,
        env=cli_env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    monkeypatch.setenv("DAGSTER_HOME", cli_env["DAGSTER_HOME"])
    instance = dg.DagsterInstance.get()
    try:
        deadline = time.monotonic() + 180
        while True:
            runs = instance.get_runs()
            if runs and runs[0].is_finished:
                break
            assert time.monotonic() < deadline, f"run did not finish: {runs}"
            time.sleep(1)
        (run,) = runs
        assert run.job_name == "ingest_orders_job"
        assert run.status == dg.DagsterRunStatus.SUCCESS, proc.stdout[-3000:]
        mat = instance.get_latest_materialization_event(dg.AssetKey("orders"))
        assert mat is not None and mat.run_id == run.run_id
        meta = mat.asset_materialization.metadata  # type: ignore[union-attr]
        assert meta["records_appended"].value == 50
        assert meta["num_shards"].value == 4
    finally:
        instance.dispose()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def webserver(cli_env: dict[str, str], tmp_path: Path) -> Iterator[str]:
    port = _free_port()
    log = open(tmp_path / "webserver.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [
            str(BIN / "dagster-webserver"),
            "-w",
            "workspace.yaml",
            "-h",
            "127.0.0.1",
            "-p",
            str(port),
        ],
        cwd=ROOT,
        env=cli_env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{url}/server_info", timeout=2):
                    break
            except OSError:
                assert proc.poll() is None, (tmp_path / "webserver.log").read_text()[-3000:]
                assert time.monotonic() < deadline, "webserver did not start"
                time.sleep(0.5)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def graphql(url: str, query: str) -> dict:
    req = urllib.request.Request(
        f"{url}/graphql",
        data=json.dumps({"query": query}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


def test_webserver_serves_the_asset_graph(webserver: str) -> None:
    deadline = time.monotonic() + 60
    while True:  # the code location loads in the background
        data = graphql(
            webserver,
            "{ workspaceOrError { ... on Workspace { locationEntries { name loadStatus } } } }",
        )
        entries = data["data"]["workspaceOrError"]["locationEntries"]
        if entries and all(e["loadStatus"] == "LOADED" for e in entries):
            break
        assert time.monotonic() < deadline, entries
        time.sleep(0.5)
    assert [e["name"] for e in entries] == ["persist_platform"]
    nodes = graphql(
        webserver, "{ assetNodes { assetKey { path } groupName dependencyKeys { path } } }"
    )
    nodes = nodes["data"]["assetNodes"]
    keys = {"/".join(n["assetKey"]["path"]) for n in nodes}
    assert {
        "orders_landing",
        "orders_remap",
        "orders_raw",
        "orders",
        "orders_errors",
        "orders_rendition",
        "orders_summary",
        "persist_shard",
    } <= keys
    deps = {
        "/".join(n["assetKey"]["path"]): {"/".join(d["path"]) for d in n["dependencyKeys"]}
        for n in nodes
    }
    assert deps["orders"] == {"orders_remap"}
    assert deps["orders_summary"] == {"orders"}
    assert deps["orders_rendition"] == {"orders_raw"}


@pytest.mark.parametrize("num_shards", [-3, 5000])
def test_out_of_range_num_shards_is_refused_at_launch(
    cli_env: dict[str, str], num_shards: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 30 item 4: a launch with a bad shard count fails at once (nothing runs) and
    says what is allowed; it used to be accepted and die in the run with a pydantic
    traceback."""
    config = {"ops": {"orders_rendition": {"config": {"num_shards": num_shards}}}}
    proc = subprocess.run(
        [
            str(BIN / "dagster"),
            "job",
            "launch",
            "-w",
            "workspace.yaml",
            "-j",
            "orders_rendition_job",
            "--tags",
            '{"dagster/partition": "r1"}',
            "--config-json",
            json.dumps(config),
        ],
        cwd=ROOT,
        env=cli_env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert (
        f"num_shards must be a whole number from 1 to 1024 (0 = the source's default), "
        f"got {num_shards}"
    ) in out, out[-3000:]
    monkeypatch.setenv("DAGSTER_HOME", cli_env["DAGSTER_HOME"])
    instance = dg.DagsterInstance.get()
    try:
        assert instance.get_runs() == []  # refused before a run was created
    finally:
        instance.dispose()
