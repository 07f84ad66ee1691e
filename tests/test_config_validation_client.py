"""``PersistClient(config=...)`` refuses what is not a ``PersistConfig`` (before any
location is opened or created), and a bad ``$PERSIST_TABLE_WIDTH`` is a one-line warning
naming the variable, not a silent default or a crash of the CLI."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from persist_lib.cli import fit
from persist_lib.config import PersistConfig
from persist_lib.errors import InvalidConfig, InvalidUsage
from persist_lib.handles.client import PersistClient


@pytest.mark.parametrize("bad", [{}, {"read_memory_budget": 1 << 30}, "cfg.toml", 0, False, PersistConfig])
def test_a_config_that_is_not_a_persist_config_is_refused(tmp_path: Path, bad: Any) -> None:
    home = tmp_path / "home"
    with pytest.raises(InvalidConfig) as info:
        PersistClient.default(home, config=bad)
    assert isinstance(info.value, InvalidUsage)
    (p,) = info.value.problems
    assert p.field == "config" and "must be a PersistConfig" in p.allowed
    assert "PersistConfig(" in p.fix
    assert not home.exists()  # refused before anything was created
    blob = f"file://{tmp_path / 'b'}"
    with pytest.raises(InvalidConfig):
        PersistClient.open(blob, f"sqlite:///{tmp_path / 'c.db'}", bad)
    assert not (tmp_path / "b").exists() and not (tmp_path / "c.db").exists()


def test_none_and_a_persist_config_are_accepted(tmp_path: Path) -> None:
    cfg = PersistConfig.for_tests()
    with PersistClient.default(tmp_path / "a", config=cfg) as c:
        assert c.config is cfg
    with PersistClient.default(tmp_path / "b") as c:
        assert c.config == PersistConfig(now_ms=c.config.now_ms, rng=c.config.rng)


@pytest.mark.parametrize("raw", ["wide", "-1", "12.5", "²", "１２０"])
def test_a_bad_table_width_warns_once_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], raw: str
) -> None:
    monkeypatch.setattr(fit, "_warned", set())
    monkeypatch.setenv("PERSIST_TABLE_WIDTH", raw)
    assert fit.line_width() == fit.DEFAULT_WIDTH  # the default (stdout is not a terminal here)
    assert fit.line_width() == fit.DEFAULT_WIDTH
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err  # one line, once
    assert err.startswith("persist: warning: ignoring PERSIST_TABLE_WIDTH=") and repr(raw) in err
    assert "whole number" in err and "unset it" in err


@pytest.mark.parametrize(("raw", "width"), [("160", 160), (" 80 ", 80), ("0", 10**9), ("", fit.DEFAULT_WIDTH)])
def test_a_good_table_width_is_used_silently(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], raw: str, width: int
) -> None:
    monkeypatch.setenv("PERSIST_TABLE_WIDTH", raw)
    assert fit.line_width() == width
    assert capsys.readouterr().err == ""


# ----- process switches: an unknown value is a warning naming the variable -------------


def test_an_unknown_kernels_switch_warns_naming_it_and_keeps_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    from persist_lib import config_rules
    from persist_lib.config_rules import ConfigWarning
    from persist_lib.shard import kernels

    monkeypatch.setattr(config_rules, "_warned_env", set())
    monkeypatch.setenv("PERSIST_KERNELS", "numpy")
    assert kernels.polars() is None  # the known value still works
    default = _polars_default(monkeypatch)
    monkeypatch.setenv("PERSIST_KERNELS", "nmupy")
    with pytest.warns(ConfigWarning, match=r"ignoring \$PERSIST_KERNELS='nmupy': use one of numpy, auto") as rec:
        assert kernels.polars() is default  # the default: as if unset
        assert kernels.polars() is default
    assert len(rec) == 1  # once per variable and value


def _polars_default(monkeypatch: pytest.MonkeyPatch) -> Any:
    from persist_lib.shard import kernels

    monkeypatch.delenv("PERSIST_KERNELS")
    return kernels.polars()


@pytest.mark.parametrize(("name", "choices", "default"), [
    ("PERSIST_KAFKA_NATIVE", ("0", "1"), "1"),
    ("PERSIST_KEEP_FREED_PAGES", ("0", "1"), "1"),
])
def test_the_on_off_switches_warn_on_anything_but_0_or_1(
    monkeypatch: pytest.MonkeyPatch, name: str, choices: tuple[str, ...], default: str
) -> None:
    from persist_lib import config_rules
    from persist_lib.config_rules import ConfigWarning, env_choice

    monkeypatch.setattr(config_rules, "_warned_env", set())
    for good in ("0", "1", " 1 "):
        monkeypatch.setenv(name, good)
        assert env_choice(name, choices, default) == good.strip()
    monkeypatch.setenv(name, "off")
    with pytest.warns(ConfigWarning, match=rf"\${name}='off'"):
        assert env_choice(name, choices, default) == default
