"""What ``PersistIOManager``'s own settings may be: one rule per field (with the
machinery of ``persist_lib.config_rules``) and the collection-name rule for ``prefix``
and ``ledger``. Checked when a run initialises the I/O manager, so a bad setting fails
resource initialisation with ``InvalidIOManagerConfig`` naming every bad field, before
any step runs -- not at the first write or read that would use it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dagster_project.io_manager.errors import InvalidIOManagerConfig
from dagster_project.io_manager.settings import MODES
from persist_lib.config_rules import CrossRule, Rule, rule_problems
from persist_lib.errors import ConfigProblem, InvalidUsage
from persist_lib.storage.controller import check_name

MiB = 1 << 20

#: One rule per ``PersistIOManager`` setting (besides the ``persist`` resource).
IO_MANAGER_RULES: dict[str, Rule] = {
    "default_mode": Rule("choice", choices=MODES, meaning="the write mode of assets that set no persist/mode"),
    "num_shards": Rule("int", lo=1, hi=1024, meaning="shards of the collections it creates"),
    "prefix": Rule("str", meaning="a namespace put before every asset key; '': none"),
    "ledger": Rule("str", lo=1, meaning="the collection that records which writes landed"),
    "read_memory_budget": Rule(
        "int", lo=MiB, unit="bytes", optional=True,
        meaning="what a LazyFrame input's streaming read decodes at once; None: persist's read_memory_budget",
    ),
}

IO_MANAGER_DEFAULTS: dict[str, Any] = {
    "default_mode": "overwrite", "num_shards": 1, "prefix": "", "ledger": "dagster_io.writes", "read_memory_budget": None,
}


def _name_problem(field: str, name: str, fix: str) -> ConfigProblem | None:
    try:
        check_name(field, name)
    except InvalidUsage as e:
        return ConfigProblem(field, name, f"must be a valid collection name ({str(e).split(': ', 1)[-1]})", fix)
    return None


def _prefix_is_a_name(v: Mapping[str, Any]) -> ConfigProblem | None:
    """Every collection is named ``<prefix>.<asset key>``: the prefix must start one."""
    if v["prefix"] == "":
        return None
    return _name_problem("prefix", v["prefix"], "fix: give a name such as 'analytics', or '' for no prefix")


def _ledger_is_a_name(v: Mapping[str, Any]) -> ConfigProblem | None:
    return _name_problem("ledger", v["ledger"], "fix: give a collection name (default 'dagster_io.writes')")


IO_MANAGER_CROSS_RULES: tuple[CrossRule, ...] = (
    CrossRule(("prefix",), _prefix_is_a_name),
    CrossRule(("ledger",), _ledger_is_a_name),
)


def check_io_manager_settings(values: Mapping[str, Any]) -> None:
    """Raises ``InvalidIOManagerConfig`` naming every bad setting (as
    ``PersistIOManager.<field>``), or returns."""
    found = rule_problems(IO_MANAGER_RULES, values, IO_MANAGER_DEFAULTS, IO_MANAGER_CROSS_RULES)
    if found:
        sources = {f: f"PersistIOManager.{f}" for f in IO_MANAGER_RULES}
        raise InvalidIOManagerConfig(found, what="PersistIOManager config").with_sources(sources)
