"""``PersistIOManager``'s settings are all checked when a run initialises it: a bad
``default_mode``, ``num_shards``, ``prefix``, ``ledger`` or ``read_memory_budget`` fails
resource initialisation with ``InvalidIOManagerConfig`` naming every bad field (as
``PersistIOManager.<field>``), before any step runs or anything is written."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import dagster as dg
import pyarrow as pa
import pytest
from dagster_aws.s3 import S3Resource

from dagster_project.io_manager import IOManagerConfigError, PersistIOManager
from dagster_project.io_manager.errors import InvalidIOManagerConfig
from dagster_project.io_manager.factory_config import (
    IO_MANAGER_DEFAULTS,
    IO_MANAGER_RULES,
    check_io_manager_settings,
)
from dagster_project.resources import LandingZoneResource, PersistResource
from persist_lib.errors import InvalidConfig


def _materialize(tmp_path: Path, **settings: Any) -> tuple[dg.ExecuteInJobResult, list[bool]]:
    ran: list[bool] = []

    @dg.asset(metadata={"persist/key": ["id"]})
    def orders() -> pa.Table:
        ran.append(True)
        return pa.table({"id": [1, 2], "v": ["a", "b"]})

    persist = PersistResource(home=str(tmp_path / "home"))
    result = dg.materialize(
        [orders], resources={"io_manager": PersistIOManager(persist=persist, **settings)}, raise_on_error=False
    )
    return result, ran


def test_every_field_has_a_rule_and_a_default() -> None:
    fields = [f for f in PersistIOManager.model_fields if f != "persist"]
    assert fields == list(IO_MANAGER_RULES) == list(IO_MANAGER_DEFAULTS)
    assert all(PersistIOManager.model_fields[f].default == IO_MANAGER_DEFAULTS[f] for f in fields)
    check_io_manager_settings(IO_MANAGER_DEFAULTS)  # the defaults (what the code location uses) are valid


def test_bad_settings_fail_the_run_at_init_naming_every_field(tmp_path: Path) -> None:
    result, ran = _materialize(tmp_path, prefix="1st", ledger="the ledger", num_shards=0, read_memory_budget=1000)
    assert not result.success and not ran  # failed at initialisation, before the step
    failure = next(e for e in result.all_events if e.event_type_value == "RESOURCE_INIT_FAILURE")
    text = str(failure.event_specific_data)
    assert "InvalidIOManagerConfig" in text and "4 bad settings" in text
    for field in ("prefix", "ledger", "num_shards", "read_memory_budget"):
        assert f"PersistIOManager.{field} (field {field})" in text
    assert not (tmp_path / "home").exists()  # nothing was opened or written


@pytest.mark.parametrize(
    ("field", "bad"),
    [("default_mode", "merge"), ("num_shards", 1025), ("prefix", "a,b"), ("ledger", ""), ("read_memory_budget", 1)],
)
def test_each_bad_setting_is_a_typed_error(field: str, bad: Any) -> None:
    iom = PersistIOManager(persist=PersistResource(), **{field: bad})
    with pytest.raises(InvalidIOManagerConfig) as info:
        iom.create_io_manager(dg.build_init_resource_context())
    assert isinstance(info.value, InvalidConfig) and isinstance(info.value, IOManagerConfigError)
    (p,) = info.value.problems
    assert (p.field, p.value, p.source) == (field, bad, f"PersistIOManager.{field}")


def test_good_settings_still_materialize(tmp_path: Path) -> None:
    result, ran = _materialize(tmp_path, prefix="analytics", ledger="io.writes", num_shards=2, read_memory_budget=1 << 20)
    assert result.success and ran == [True]


# ----- SourceSpec: checked where the source is declared (the code location's load) -----


def test_a_source_spec_names_every_bad_setting_at_once() -> None:
    import dataclasses

    from dagster_project.sources import ORDERS

    with pytest.raises(InvalidConfig) as info:
        dataclasses.replace(ORDERS, name="bad name", kind="kafka", num_shards=0, envelope="append_only",
                            delete_field="_deleted", format="xml", on_schema_change="ignore")
    assert sorted(p.field for p in info.value.problems) == sorted(
        ["num_shards", "format", "on_schema_change", "name", "topic", "delete_field"]
    )
    text = str(info.value)
    assert text.startswith("invalid SourceSpec 'bad name': 6 bad settings")
    assert "a kafka source needs its topic" in text and "only means something with envelope='upsert'" in text
    with pytest.raises(InvalidConfig, match="a postgres_cdc source needs its table"):
        dataclasses.replace(ORDERS, kind="postgres_cdc")


def test_the_code_locations_sources_are_valid() -> None:
    import dataclasses

    from dagster_project.sources import CUSTOMERS, EVENTS, ORDERS

    for spec in (ORDERS, CUSTOMERS, EVENTS):
        assert dataclasses.replace(spec) == spec


# ----- LandingZoneResource: its URI is checked at resource initialisation ---------------


@pytest.mark.parametrize(("uri", "env", "named"), [
    ("ftp://host/zone", "", "LandingZoneResource.uri"),
    ("", "s3://?region=x", "$PERSIST_LANDING_URI"),
])
def test_a_bad_landing_uri_fails_the_run_at_init(
    monkeypatch: pytest.MonkeyPatch, uri: str, env: str, named: str
) -> None:
    monkeypatch.setenv("PERSIST_LANDING_URI", env)
    ran: list[bool] = []

    @dg.asset
    def lands(landing: LandingZoneResource) -> None:
        ran.append(True)

    result = dg.materialize(
        [lands], resources={"landing": LandingZoneResource(uri=uri, s3=S3Resource())}, raise_on_error=False
    )
    assert not result.success and not ran
    failure = next(e for e in result.all_events if e.event_type_value == "RESOURCE_INIT_FAILURE")
    text = str(failure.event_specific_data)
    assert "IngestConfigError" in text and named in text


def test_a_good_landing_uri_initialises(tmp_path: Path) -> None:
    @dg.asset
    def lands(landing: LandingZoneResource) -> str:
        return landing.source_uri("orders")

    result = dg.materialize(
        [lands], resources={"landing": LandingZoneResource(uri=str(tmp_path / "zone"), s3=S3Resource())}
    )
    assert result.success and result.output_for_node("lands") == str(tmp_path / "zone" / "orders")
    assert not (tmp_path / "zone").exists()  # the check makes nothing
