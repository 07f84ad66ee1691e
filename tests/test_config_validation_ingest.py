"""The ingestion's settings are checked where they are given: ``IngestConfig`` (every
field: type and range, all bad settings at once, on assignment too), ``Ingestion(config=)``,
the sources' numeric and switch settings (``KafkaSource``, ``LandingZoneSource``,
``PgCdcSource``), and ``persist ingest``'s options, named as the user spelled them. A bad
setting is an ``InvalidIngestConfig``: an ``InvalidConfig`` and an ``IngestConfigError``."""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from persist_lib.errors import InvalidConfig, InvalidUsage
from persist_lib.ingest import IngestConfig
from persist_lib.ingest.errors import IngestConfigError, InvalidIngestConfig
from persist_lib.ingest.ingest_config import INGEST_RULES

REPO = Path(__file__).resolve().parents[1]

# Per field: a value of the wrong type, one of the right type out of range (None: no
# range), and the edge of the range (accepted).
EXAMPLES: dict[str, tuple[Any, Any, Any]] = {
    "max_records_per_binding": ("100k", 0, 1),
    "read_chunk_records": (1.5, 0, 1),
    "max_append_records": (True, -1, 1),
    "timestamp_interval_ms": ("1", 0, 1),
    "since_window_ms": (60.5, -1, 0),
    "poll_interval_s": ("1s", 0.0, 1e-3),
    "replay_timeout_s": (None, math.inf, 1e-3),
    "keep_raw": (1, None, True),
    "unsorted_min_bytes": ("1MiB", -1, 0),
}


def test_every_field_has_a_rule_and_examples() -> None:
    names = [f.name for f in dataclasses.fields(IngestConfig)]
    assert names == list(INGEST_RULES) == list(EXAMPLES)


@pytest.mark.parametrize("field", list(EXAMPLES))
def test_a_bad_type_or_range_is_refused_naming_the_field(field: str) -> None:
    wrong_type, out_of_range, edge = EXAMPLES[field]
    for bad in (wrong_type, out_of_range):
        if bad is None and field != "replay_timeout_s":
            continue
        with pytest.raises(InvalidIngestConfig) as info:
            IngestConfig(**{field: bad})
        assert isinstance(info.value, InvalidConfig) and isinstance(info.value, IngestConfigError)
        assert isinstance(info.value, InvalidUsage) and isinstance(info.value, ValueError)
        (p,) = info.value.problems
        assert p.field == field and p.value is bad and "fix:" in p.fix
        assert f"{field} = {bad!r}" in str(info.value)
    assert getattr(IngestConfig(**{field: edge}), field) == edge


@pytest.mark.parametrize("field", list(EXAMPLES))
def test_assigning_a_bad_value_later_is_refused_and_changes_nothing(field: str) -> None:
    cfg = IngestConfig()
    before = getattr(cfg, field)
    with pytest.raises(InvalidIngestConfig):
        setattr(cfg, field, EXAMPLES[field][0])
    assert getattr(cfg, field) == before
    with pytest.raises(InvalidIngestConfig, match="not a field of IngestConfig"):
        cfg.poll_interval = 2.0  # type: ignore[attr-defined]  # a typo, not a new attribute


def test_every_bad_setting_is_reported_at_once() -> None:
    with pytest.raises(InvalidIngestConfig) as info:
        IngestConfig(max_records_per_binding=0, poll_interval_s=-1, keep_raw="yes", since_window_ms="1h")
    assert [p.field for p in info.value.problems] == [
        "max_records_per_binding", "since_window_ms", "poll_interval_s", "keep_raw",
    ]
    assert str(info.value).startswith("invalid IngestConfig: 4 bad settings: (1) max_records_per_binding = 0")


def test_the_ingestion_refuses_a_config_that_is_not_an_ingest_config(tmp_path: Path) -> None:
    import pyarrow as pa

    from persist_lib.handles.client import PersistClient
    from persist_lib.ingest import Ingestion, LandingZoneSource

    zone = tmp_path / "zone"
    zone.mkdir()
    key = pa.schema([pa.field("id", pa.int64())])
    with PersistClient.default(tmp_path / "home") as client:
        for bad in ({"keep_raw": True}, False, "cfg"):
            with pytest.raises(InvalidIngestConfig) as info:
                Ingestion(client, "orders", LandingZoneSource(str(zone)), key, pa.schema([]), config=bad)  # type: ignore[arg-type]
            assert info.value.problems[0].field == "config" and "IngestConfig(" in info.value.problems[0].fix


def _cli(args: list[str], home: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "PERSIST_HOME": str(home)}
    return subprocess.run([sys.executable, "-m", "persist_lib.cli.main", *args], env=env, capture_output=True, text=True, timeout=120)


def test_the_cli_names_its_options(tmp_path: Path) -> None:
    zone = tmp_path / "zone"
    zone.mkdir()
    out = _cli(["ingest", "files", "x", str(zone), "--key", "id:int64", "--poll", "0", "--records-per-binding", "0"],
               tmp_path / "home")
    assert out.returncode == 2, out.stderr
    assert "--poll (field poll_interval_s) = 0.0" in out.stderr, out.stderr
    assert "--records-per-binding (field max_records_per_binding) = 0" in out.stderr
    assert "Traceback" not in out.stderr


# ----- the sources' settings --------------------------------------------------------------

def _kafka(**kw: Any) -> Any:
    from persist_lib.ingest import KafkaSource

    return KafkaSource("localhost:9092", kw.pop("topic", "orders"), **kw)


def _zone(tmp_path: Path, **kw: Any) -> Any:
    from persist_lib.ingest import LandingZoneSource

    return LandingZoneSource(str(tmp_path), **kw)


def _cdc(**kw: Any) -> Any:
    from persist_lib.ingest import PgCdcSource

    return PgCdcSource("postgresql://u:secret@localhost:5432/db", kw.pop("table", "public.orders"), **kw)


@pytest.mark.parametrize(
    ("build", "what", "bad", "good"),
    [
        (_kafka, "KafkaSource", {"timeout_s": 0, "poll_s": "0.2", "metadata_interval_s": -1.0, "prefetch": -1,
                                 "commit_offsets": "yes", "ranges": 1, "group_id": 7, "topic": ""},
         {"timeout_s": 0.5, "poll_s": 1, "metadata_interval_s": 2.0, "prefetch": 0, "commit_offsets": False,
          "ranges": True, "group_id": "g"}),
        (_cdc, "PgCdcSource", {"table": "", "slot": 5, "create": "no", "snapshot": 0},
         {"table": "orders", "slot": "s", "create": False, "snapshot": False}),
    ],
)
def test_a_source_names_every_bad_setting_at_once(build: Any, what: str, bad: dict[str, Any], good: dict[str, Any]) -> None:
    with pytest.raises(InvalidIngestConfig) as info:
        build(**bad)
    assert isinstance(info.value, IngestConfigError)
    assert sorted(p.field for p in info.value.problems) == sorted(bad)
    assert str(info.value).startswith(f"invalid {what}: {len(bad)} bad settings")
    assert "secret" not in str(info.value)
    src = build(**good)
    assert all(getattr(src, k) == v for k, v in good.items())


def test_a_landing_zone_names_its_bad_settings(tmp_path: Path) -> None:
    with pytest.raises(InvalidIngestConfig) as info:
        _zone(tmp_path, pattern=["*.csv"], csv_delimiter=9)
    assert [p.field for p in info.value.problems] == ["pattern", "csv_delimiter"]
    with pytest.raises(IngestConfigError, match="one character"):
        _zone(tmp_path, csv_delimiter=";;")
    assert _zone(tmp_path, pattern="*.csv", csv_delimiter=";").csv_delimiter == ";"


def test_a_kafka_bootstrap_url_that_is_not_a_string_is_refused_without_showing_it() -> None:
    from persist_lib.ingest import KafkaSource

    with pytest.raises(IngestConfigError) as info:
        KafkaSource(b"kafka://u:secret@h:9092", "t")  # type: ignore[arg-type]
    assert "bootstrap_url must be a non-empty string, not a bytes" in str(info.value)
    assert "secret" not in str(info.value)
