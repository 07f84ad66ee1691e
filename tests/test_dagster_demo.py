"""``make demo`` (``scripts/run_pipeline.py``) leaves the instance as the daemon would.

The demo evaluates the sensors itself and executes their run requests. It must leave
each sensor's cursor in the instance (where the sensor daemon keeps it), so that the
first ``dagster dev`` afterwards does not launch runs nobody asked for. Checked with the
daemon's own sensor iteration against the demo's instance and workspace.yaml.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest

pytestmark = pytest.mark.dagster

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # (~17 s: the whole demo pipeline; `make demo` is the README's first command)
def test_demo_leaves_sensor_cursors_so_the_daemon_launches_nothing_new(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dagster._core.instance.ref import InstanceRef
    from dagster._core.scheduler.instigation import InstigatorType, TickStatus
    from dagster._core.workspace.context import WorkspaceProcessContext
    from dagster._core.workspace.load_target import WorkspaceFileTarget
    from dagster._daemon.sensor import execute_sensor_iteration

    dagster_home, persist_home = tmp_path / "dagster_home", tmp_path / "persist"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PERSIST_", "SPARK_"))}
    env.update(DAGSTER_HOME=str(dagster_home), PERSIST_HOME=str(persist_home))
    out = subprocess.run(
        [sys.executable, "scripts/run_pipeline.py", "--no-spark", "--rows", "60"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]

    # What the daemon of `dagster dev -w workspace.yaml` does on its first tick.
    for k in [k for k in os.environ if k.startswith(("PERSIST_", "SPARK_"))]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("DAGSTER_HOME", str(dagster_home))
    monkeypatch.setenv("PERSIST_HOME", str(persist_home))
    monkeypatch.chdir(ROOT)
    with dg.DagsterInstance.from_ref(InstanceRef.from_dir(str(dagster_home))) as instance:
        runs_before = instance.get_runs_count()
        target = WorkspaceFileTarget(paths=[str(ROOT / "workspace.yaml")])
        with WorkspaceProcessContext(instance, target) as process:
            list(
                execute_sensor_iteration(
                    process, logging.getLogger("test-sensor-daemon"), None, None
                )
            )
            # issue 30 item 8: the demo's runs are on the Overview timeline (the UI draws a
            # run there only with its repository origin: the one the workspace gives its job)
            # and its compaction runs were launched by the compaction-debt sensor
            from dagster_graphql.test.utils import execute_dagster_graphql

            ctx = process.create_request_context()
            repo = ctx.get_code_location("persist_platform").get_repository("__repository__")
            demo_runs = instance.get_runs()
            assert demo_runs
            for run in demo_runs:
                expected = repo.get_full_job(run.job_name).get_remote_origin()
                assert run.remote_job_origin == expected, run.job_name
            compactions = [r for r in demo_runs if r.job_name == "compaction_job"]
            assert compactions and all(
                r.tags.get("dagster/sensor_name") == "compaction_debt_sensor" for r in compactions
            )
            doc = execute_dagster_graphql(
                ctx,
                "{ runsOrError { ... on Runs { results { jobName repositoryOrigin "
                "{ repositoryName repositoryLocationName } } } } }",
            )
            assert not doc.errors, doc.errors
            results = doc.data["runsOrError"]["results"]
            assert len(results) == len(demo_runs)
            assert all(
                r["repositoryOrigin"] == {"repositoryName": "__repository__", "repositoryLocationName": "persist_platform"}
                for r in results
            ), results
        new_runs = instance.get_runs(limit=instance.get_runs_count() - runs_before)
        assert instance.get_runs_count() == runs_before, [
            (r.job_name, r.tags.get("dagster/run_key")) for r in new_runs
        ]
        states = {
            s.instigator_name: s
            for s in instance.all_instigator_state(instigator_type=InstigatorType.SENSOR)
        }
        assert states["orders_arrival_sensor"].instigator_data.cursor == "orders-000004.jsonl"  # type: ignore[union-attr]
        # every sensor ticked (they are still running by default) and skipped
        for name in ("orders_arrival_sensor", "orders_summary_sensor", "compaction_debt_sensor"):
            state = next(
                s
                for s in instance.all_instigator_state(instigator_type=InstigatorType.SENSOR)
                if s.instigator_name == name
            )
            ticks = instance.get_ticks(state.instigator_origin_id, state.selector_id, limit=1)
            assert ticks and ticks[0].status == TickStatus.SKIPPED, (name, ticks and ticks[0])
