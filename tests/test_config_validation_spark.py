"""The Spark pin TTL: ``$PERSIST_SPARK_PIN_TTL_S`` and ``sweep(ttl_s=)`` are checked by
the ``config_rules`` rule of a positive number of seconds; a bad one is an
``InvalidConfig`` naming the setting, and a sweep given one removes nothing (a TTL of
zero or less would remove the pins that running reads still use)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from persist_lib.errors import InvalidConfig, InvalidUsage
from persist_lib.spark.pins import PIN_DIR, PIN_TTL_ENV, pin_ttl_s, sweep


def _young_pin(root: Path) -> Path:
    pin = root / PIN_DIR / f"{int(time.time())}-{os.getpid()}-live"
    pin.mkdir(parents=True)
    return pin


@pytest.mark.parametrize("bad", [0, -1, -3600.0, float("nan"), float("inf"), "3600", True])
def test_a_bad_sweep_ttl_is_refused_and_removes_nothing(tmp_path: Path, bad: Any) -> None:
    pin = _young_pin(tmp_path)
    with pytest.raises(InvalidConfig) as info:
        sweep(str(tmp_path), ttl_s=bad)
    (p,) = info.value.problems
    assert p.field == "ttl_s" and "> 0 (seconds)" in p.allowed
    assert pin.is_dir()  # a live read's pin survives
    assert sweep(str(tmp_path), ttl_s=3600) == 0 and pin.is_dir()


@pytest.mark.parametrize("raw", ["soon", "-5", "0", "nan", "inf"])
def test_a_bad_pin_ttl_variable_is_an_invalid_config_naming_it(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv(PIN_TTL_ENV, raw)
    with pytest.raises(InvalidConfig) as info:
        pin_ttl_s()
    assert isinstance(info.value, InvalidUsage)
    (p,) = info.value.problems
    assert (p.source, p.value) == ("$PERSIST_SPARK_PIN_TTL_S", raw)
    assert "unset it for the default 86400" in p.fix
    monkeypatch.setenv(PIN_TTL_ENV, " 90 ")
    assert pin_ttl_s() == 90.0


# ----- SparkIngestion's own options ---------------------------------------------------------


def test_spark_ingestion_names_every_bad_option_before_touching_spark(tmp_path: Path) -> None:
    import pyarrow as pa

    from persist_lib.handles.client import PersistClient
    from persist_lib.ingest import LandingZoneSource
    from persist_lib.ingest.errors import IngestConfigError, InvalidIngestConfig
    from persist_lib.spark.ingest import SparkIngestion

    key = pa.schema([pa.field("id", pa.int64())])
    zone = LandingZoneSource(str(tmp_path))
    with PersistClient.default(tmp_path / "home") as client:
        with pytest.raises(InvalidIngestConfig) as info:
            SparkIngestion(None, client, "orders", zone, key, pa.schema([]),
                           records_per_job="1M", min_piece_records=0, parallelism=0)
        assert isinstance(info.value, IngestConfigError)
        assert [p.field for p in info.value.problems] == ["records_per_job", "min_piece_records", "parallelism"]
        assert str(info.value).startswith("invalid SparkIngestion options: 3 bad settings")
