"""``PersistConfig`` checks every setting (persist_lib/config_rules.py): a bad type or
range, a broken rule between fields, an unknown field, a bad ``$PERSIST_METRICS_PORT``,
a bad ``persist --timeout`` or ``PersistResource`` setting is an ``InvalidConfig`` (an
``InvalidUsage`` and a ``ValueError``) naming each bad setting, raised where the value
was given; the config keeps its old values."""

from __future__ import annotations

import dataclasses
import math
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import dagster as dg
import numpy as np
import pytest

from bench.common import persist_config as bench_config
from dagster_project.resources import PersistResource
from persist_lib.config import MiB, PersistConfig
from persist_lib.config_rules import FIELD_RULES
from persist_lib.errors import InvalidConfig, InvalidUsage, PersistError

FIELDS = [f.name for f in dataclasses.fields(PersistConfig)]

# Per field: a value of the wrong type, a value of the right type out of range (None for
# fields without a range), and the edge of the range, which is accepted. A field added
# to PersistConfig without a row here (and a rule in FIELD_RULES) fails
# test_every_field_has_a_rule_and_examples.
EXAMPLES: dict[str, tuple[Any, Any, Any]] = {
    "blob_target_size": ("128MiB", 0, 1),
    "max_inflight_uploads": (2.0, 0, 1),
    "inline_threshold": (True, -5, 0),
    "inline_append_threshold": ("16k", -1, 0),
    "inline_max_total": (1.5, -1, 0),
    "unsorted_min_bytes": ("8MiB", -1, 0),
    "key_range_min_bytes": (False, -1, 0),
    "rollup_interval": ("128", -1, 0),
    "rollup_in_background": ("yes", None, False),
    "reader_lease_ms": (1.5, 0, 1),
    "writer_lease_ms": ("1h", -1, 1),
    "background_heartbeats": (1, None, False),
    "heartbeat_tick_s": ("1s", 0.0, 1e-3),
    "retry_deadline_s": (True, -1.0, 1e-3),
    "apply_lock_wait_s": ("5", 0, 1e-3),
    "snapshot_timeout_s": (None, math.nan, 1e-3),
    "fetch_parallelism": (True, 0, 1),
    "listen_poll_max_s": ([1.0], math.inf, 1e-3),
    "read_memory_budget": ("256MiB", MiB - 1, MiB),
    "compaction_enabled": ("", None, True),
    "compaction_memory_budget": (1024.0 * MiB, MiB - 1, MiB),
    "compaction_in_memory": (0, None, False),
    "compaction_time_layers": ("6", 0, 1),
    "compaction_layer_min_rows": ("x", 0, 1),
    "compaction_layer_max_first_share": ("0.25", 1.5, 1.0),
    "compaction_layer_kv_whole": ("yes", None, False),
    "compaction_workers": (None, 0, 1),
    "compaction_queue_max": (20.5, 0, 1),
    "gc_in_background": ("false", None, False),
    "compaction_retry_backoff_s": ("1", 0.0, 1e-3),
    "compaction_retry_backoff_max_s": (None, -300.0, 1.0),
    "compaction_quarantine_after": (True, 0, 1),
    "leak_grace_ms": (3600.0, -1, 0),
    "max_cached_shards": ("256", 0, 1),
    "metrics": ("on", None, False),
    "metrics_port": ("9100", 65536, 0),
    "now_ms": (1234, None, lambda: 0),
    "rng": (42, None, random.Random(1)),
}


def invalid(**kw: Any) -> InvalidConfig:
    with pytest.raises(InvalidConfig) as info:
        PersistConfig(**kw)
    return info.value


def test_every_field_has_a_rule_and_examples() -> None:
    assert set(FIELD_RULES) == set(FIELDS), "every PersistConfig field needs a rule (config_rules.py)"
    assert set(EXAMPLES) == set(FIELDS), "every PersistConfig field needs its examples here"
    assert PersistConfig(**{f: EXAMPLES[f][2] for f in FIELDS})  # every edge at once
    with pytest.raises(InvalidConfig):
        PersistConfig(**{f: EXAMPLES[f][0] for f in FIELDS})


@pytest.mark.parametrize("field", FIELDS)
def test_a_bad_type_is_refused_with_a_clear_typed_error(field: str) -> None:
    bad, _, edge = EXAMPLES[field]
    e = invalid(**{field: bad})
    assert isinstance(e, InvalidUsage) and isinstance(e, PersistError) and isinstance(e, ValueError)
    assert [p.field for p in e.problems] == [field]
    assert e.problems[0].value is bad
    msg = str(e)
    assert field in msg and repr(bad) in msg and "must be" in msg and "fix:" in msg
    PersistConfig(**{"background_heartbeats": False, field: edge})  # the edge of the range is fine


@pytest.mark.parametrize("field", [f for f in FIELDS if EXAMPLES[f][1] is not None])
def test_a_value_out_of_range_is_refused(field: str) -> None:
    _, bad, _ = EXAMPLES[field]
    e = invalid(**{field: bad})
    assert [p.field for p in e.problems] == [field]
    assert field in str(e) and repr(bad) in str(e)


@pytest.mark.parametrize("field", FIELDS)
def test_none_only_where_the_annotation_allows_it(field: str) -> None:
    annotation = str(PersistConfig.__dataclass_fields__[field].type)
    if "None" in annotation:
        assert getattr(PersistConfig(**{field: None}), field) is None
        assert "or None" in FIELD_RULES[field].allowed()
        invalid(**{field: EXAMPLES[field][1]})  # its range still holds
    else:
        assert [p.field for p in invalid(**{field: None}).problems] == [field]


@pytest.mark.parametrize("field", FIELDS)
def test_assigning_a_bad_value_later_is_refused_and_changes_nothing(field: str) -> None:
    cfg = PersistConfig.for_tests()
    before = getattr(cfg, field)
    bad = EXAMPLES[field][0]
    with pytest.raises(InvalidConfig) as info:
        setattr(cfg, field, bad)
    assert [p.field for p in info.value.problems] == [field]
    assert getattr(cfg, field) is before


def test_types_bool_is_not_an_int_an_int_is_a_float_numpy_ints_are_ints() -> None:
    assert [p.field for p in invalid(blob_target_size=True, compaction_layer_max_first_share=False).problems] == [
        "blob_target_size", "compaction_layer_max_first_share",
    ]
    cfg = PersistConfig(heartbeat_tick_s=1, compaction_layer_max_first_share=1, blob_target_size=np.int64(4096))
    assert cfg.heartbeat_tick_s == 1 and cfg.blob_target_size == 4096
    assert [p.field for p in invalid(fetch_parallelism=np.float64(4.0)).problems] == ["fetch_parallelism"]


def test_every_bad_setting_is_reported_at_once() -> None:
    e = invalid(compaction_layer_kv_whole="yes", compaction_layer_min_rows="x", inline_threshold=-5, metrics_port=-1)
    assert sorted(p.field for p in e.problems) == [
        "compaction_layer_kv_whole", "compaction_layer_min_rows", "inline_threshold", "metrics_port",
    ]
    assert str(e).startswith("invalid PersistConfig: 4 bad settings: (1) ")


def test_the_heartbeat_tick_must_fit_the_leases() -> None:
    e = invalid(reader_lease_ms=400)  # default tick 1 s: the lease would lapse between ticks
    assert [p.field for p in e.problems] == ["heartbeat_tick_s"] and "reader_lease_ms=400" in str(e)
    assert [p.field for p in invalid(writer_lease_ms=2000).problems] == ["heartbeat_tick_s"]
    PersistConfig(reader_lease_ms=400, heartbeat_tick_s=0.1)
    PersistConfig(reader_lease_ms=400, background_heartbeats=False)  # no heartbeat thread: no rule
    cfg = PersistConfig()
    with pytest.raises(InvalidConfig):
        cfg.reader_lease_ms = 400
    assert cfg.reader_lease_ms == 15 * 60 * 1000
    # changed together, in any order: fine
    assert cfg.update(reader_lease_ms=400, heartbeat_tick_s=0.1) is cfg
    assert (cfg.reader_lease_ms, cfg.heartbeat_tick_s) == (400, 0.1)
    with pytest.raises(InvalidConfig):  # all or nothing
        cfg.update(heartbeat_tick_s=0.05, writer_lease_ms=0)
    assert (cfg.heartbeat_tick_s, cfg.writer_lease_ms) == (0.1, 60 * 60 * 1000)
    # a field's own problem is reported, not a comparison with a bad value
    assert [p.field for p in invalid(reader_lease_ms="x").problems] == ["reader_lease_ms"]


def test_the_retry_backoff_must_not_exceed_its_max() -> None:
    e = invalid(compaction_retry_backoff_s=10.0, compaction_retry_backoff_max_s=5.0)
    assert [p.field for p in e.problems] == ["compaction_retry_backoff_s"] and "5.0" in str(e)
    PersistConfig(compaction_retry_backoff_s=5.0, compaction_retry_backoff_max_s=5.0)
    cfg = PersistConfig()
    with pytest.raises(InvalidConfig):
        cfg.compaction_retry_backoff_max_s = 0.5
    assert cfg.compaction_retry_backoff_max_s == 300.0


def test_an_unknown_field_is_refused_with_a_suggestion() -> None:
    with pytest.raises(InvalidConfig, match="did you mean 'inline_threshold'"):
        PersistConfig.for_tests(inline_treshold=0)
    cfg = PersistConfig.for_tests()
    with pytest.raises(InvalidConfig, match="did you mean 'blob_target_size'"):
        cfg.blob_target_sise = 4096
    assert not hasattr(cfg, "blob_target_sise")


def test_for_tests_checks_its_overrides_together() -> None:
    # one at a time, the short lease would first meet the default 1 s tick
    cfg = PersistConfig.for_tests(background_heartbeats=True, reader_lease_ms=400, heartbeat_tick_s=0.02)
    assert cfg.reader_lease_ms == 400
    with pytest.raises(InvalidConfig):
        PersistConfig.for_tests(background_heartbeats=True, reader_lease_ms=400)


@pytest.mark.parametrize("raw", ["abc", "70000", "-1", "9100.5"])
def test_a_bad_metrics_port_variable_is_named(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv("PERSIST_METRICS_PORT", raw)
    e = invalid()
    assert [(p.field, p.source, p.value) for p in e.problems] == [("metrics_port", "$PERSIST_METRICS_PORT", raw)]
    assert "$PERSIST_METRICS_PORT" in str(e) and repr(raw) in str(e)
    PersistConfig(metrics_port=9100)  # an explicit port wins over the variable
    off = PersistConfig(metrics=False)  # no metrics: the variable is not used
    with pytest.raises(InvalidConfig):
        off.metrics = True
    assert off.metrics is False
    monkeypatch.setenv("PERSIST_METRICS_PORT", "")  # empty: unset
    cfg = PersistConfig(metrics_port=9100)
    monkeypatch.setenv("PERSIST_METRICS_PORT", raw)
    with pytest.raises(InvalidConfig):  # back to the variable, which is bad
        cfg.metrics_port = None
    assert cfg.metrics_port == 9100


PERSIST = [sys.executable, "-m", "persist_lib.cli.main"]
REPO = Path(__file__).resolve().parents[1]


def _cli(args: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "PYTHONPATH": str(REPO), **env}
    return subprocess.run(PERSIST + args, env=full, capture_output=True, text=True, timeout=120)


def test_the_cli_names_a_bad_option_or_variable(tmp_path: Path) -> None:
    out = _cli(["--timeout", "-1", "shards"], PERSIST_HOME=str(tmp_path))
    assert out.returncode == 2, out.stderr
    assert "--timeout (field retry_deadline_s) = -1.0" in out.stderr and "Traceback" not in out.stderr
    assert "(default 30)" in out.stderr  # the option's default, not the field's
    out = _cli(["shards"], PERSIST_HOME=str(tmp_path), PERSIST_METRICS_PORT="http")
    assert out.returncode == 2, out.stderr
    assert "$PERSIST_METRICS_PORT" in out.stderr and "'http'" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "blob").exists()  # refused before anything was opened


def test_the_dagster_resource_names_its_bad_field(tmp_path: Path) -> None:
    res = PersistResource(home=str(tmp_path), reader_lease_ms=-5)
    with pytest.raises(InvalidConfig) as info:
        res.client()
    assert [(p.field, p.source) for p in info.value.problems] == [("reader_lease_ms", "PersistResource.reader_lease_ms")]
    assert not (tmp_path / "blob").exists()

    ran: list[bool] = []

    @dg.asset
    def uses_persist(persist: PersistResource) -> None:
        ran.append(True)

    result = dg.materialize(
        [uses_persist],
        resources={"persist": PersistResource.configure_at_launch()},
        run_config={"resources": {"persist": {"config": {"home": str(tmp_path), "reader_lease_ms": 0}}}},
        raise_on_error=False,
    )
    assert not result.success and not ran  # failed at resource initialisation, before the step
    failure = next(e for e in result.all_events if e.event_type_value == "RESOURCE_INIT_FAILURE")
    text = str(failure.event_specific_data)
    assert "InvalidConfig" in text and "PersistResource.reader_lease_ms" in text


def test_the_configs_the_code_base_builds_are_valid_and_checked(tmp_path: Path) -> None:
    from persist_lib.cli.main import build_parser, cli_config

    built = (
        PersistConfig(),
        PersistConfig.for_tests(),
        bench_config(),
        PersistResource(home=str(tmp_path)).persist_config(),
        cli_config(build_parser().parse_args(["shards"])),
    )
    for cfg in built:
        with pytest.raises(InvalidConfig):
            cfg.inline_threshold = -1
        assert cfg.inline_threshold == 4096
