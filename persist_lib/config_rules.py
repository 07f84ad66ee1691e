"""What each ``PersistConfig`` setting may be: one rule per field, the rules that tie
fields together, and the environment variable that stands in for a field.

``PersistConfig`` (``persist_lib.config``) checks its values against these rules when it
is built and when a field is changed, and raises ``InvalidConfig`` naming every bad
setting at once. The ranges are those the code that reads each field relies on (for
example ``BatchBuilder`` refuses ``max_inflight_uploads < 1`` when a write starts, the
merge planner a ``compaction_memory_budget`` under 1 MiB when a background merge
runs): checked here, a bad value fails where it was given, not deep inside later.

Types are strict: a bool is not an int (``True`` is not a size), an int is accepted
where a float is expected, a string never is, and ``None`` only where the field's
annotation allows it. Floats must be finite.
"""

from __future__ import annotations

import difflib
import math
import numbers
import os
import random
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import MISSING, dataclass, fields
from typing import Any, ClassVar, Literal, Self, TypeVar

from persist_lib.errors import ConfigProblem, InvalidConfig

MiB = 1 << 20

Kind = Literal["int", "float", "bool", "callable", "rng", "choice", "str"]

#: The environment variable that gives the metrics port when ``metrics_port`` is None.
METRICS_PORT_ENV = "PERSIST_METRICS_PORT"


@dataclass(frozen=True)
class Rule:
    """The type and range one field must have. ``lo``/``hi`` bound numbers (``lo_open``:
    strictly greater); ``optional``: None is allowed too; ``unit`` and ``meaning`` go into
    the message (what the value counts, what special values mean)."""

    kind: Kind
    lo: float | None = None
    lo_open: bool = False
    hi: float | None = None
    unit: str = ""
    optional: bool = False
    meaning: str = ""
    choices: tuple[str, ...] = ()  # kind "choice": the strings allowed

    def allowed(self) -> str:
        """What the rule allows, in words."""
        if self.kind == "bool":
            text = "must be True or False (a bool; not 0/1 or a string)"
        elif self.kind == "callable":
            text = "must be a callable"
        elif self.kind == "rng":
            text = "must be a random.Random"
        elif self.kind == "choice":
            text = f"must be one of {', '.join(repr(c) for c in self.choices)}"
        elif self.kind == "str":
            text = "must be a string" + (" (not empty)" if self.lo else "")
        else:
            noun = "an int (not a bool)" if self.kind == "int" else "a finite number (int or float)"
            bounds = []
            if self.lo is not None:
                bounds.append(f"{'>' if self.lo_open else '>='} {_num(self.lo)}")
            if self.hi is not None:
                bounds.append(f"<= {_num(self.hi)}")
            text = f"must be {noun}" + (f" {' and '.join(bounds)}" if bounds else "")
            if self.unit:
                text += f" ({self.unit})"
        if self.optional:
            text += ", or None"
        if self.meaning:
            text += f"; {self.meaning}"
        return text

    def is_bad(self, value: Any) -> bool:
        """Whether ``value`` breaks the rule."""
        if value is None:
            return not self.optional
        if self.kind == "bool":
            return not isinstance(value, bool)
        if self.kind == "callable":
            return not callable(value)
        if self.kind == "rng":
            return not isinstance(value, random.Random)
        if self.kind == "choice":
            return not isinstance(value, str) or value not in self.choices
        if self.kind == "str":
            return not isinstance(value, str) or len(value) < (self.lo or 0)
        if isinstance(value, bool):
            return True
        if self.kind == "int":
            if not isinstance(value, numbers.Integral):
                return True
        elif not isinstance(value, numbers.Real) or not math.isfinite(value):
            return True
        if self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo):
            return True
        return self.hi is not None and value > self.hi

    def check(self, field: str, value: Any, default: Any) -> ConfigProblem | None:
        if not self.is_bad(value):
            return None
        # a non-optional field whose default is None is a required one: no default to name
        fix = "fix: give such a value" + ("" if default is None and not self.optional else f" (default {default!r})")
        return ConfigProblem(field, value, self.allowed(), fix)


def field_default(f: Any) -> Any:
    """A dataclass field's default, for the messages (a factory stands for its default)."""
    if f.default is not MISSING:
        return f.default
    return f"{f.default_factory.__name__}()" if f.default_factory is not MISSING else None


def _num(x: float) -> str:
    if x == int(x) and abs(x) >= MiB and int(x) % MiB == 0:
        return f"{int(x) >> 20} MiB ({int(x)})"
    return str(int(x)) if x == int(x) else str(x)


def _bytes(lo: int = 0, meaning: str = "", *, optional: bool = False) -> Rule:
    return Rule("int", lo=lo, unit="bytes", optional=optional, meaning=meaning)


def _count(lo: int = 1, meaning: str = "") -> Rule:
    return Rule("int", lo=lo, meaning=meaning)


def _seconds(meaning: str = "") -> Rule:
    return Rule("float", lo=0, lo_open=True, unit="seconds", meaning=meaning)


def _ms(meaning: str = "") -> Rule:
    return Rule("int", lo=0, lo_open=True, unit="milliseconds", meaning=meaning)


_FLAG = Rule("bool")

#: One rule per ``PersistConfig`` field (tests/test_config_validation.py checks that every
#: field has one).
FIELD_RULES: dict[str, Rule] = {
    "blob_target_size": _bytes(1, "the Arrow bytes at which a part is flushed"),
    "max_inflight_uploads": _count(1, "part uploads running at once per write"),
    "inline_threshold": _bytes(0, "0 turns inlining off everywhere"),
    "inline_append_threshold": _bytes(0, "0: appends never inline"),
    "inline_max_total": _bytes(0, "0: nothing is inlined"),
    "unsorted_min_bytes": _bytes(0, "None: every part is sorted on write", optional=True),
    "key_range_min_bytes": _bytes(0, "None: chunks are cut in row order", optional=True),
    "rollup_interval": _count(0, "seqnos between rollups; 0: no rollups"),
    "rollup_in_background": _FLAG,
    "reader_lease_ms": _ms(),
    "writer_lease_ms": _ms(),
    "background_heartbeats": _FLAG,
    "heartbeat_tick_s": _seconds("how often the heartbeat thread looks for due handles"),
    "retry_deadline_s": _seconds("how long a location call is retried"),
    "apply_lock_wait_s": _seconds("how long a thread waits for its turn on a shard"),
    "snapshot_timeout_s": _seconds("how long a read waits for its as-of time"),
    "fetch_parallelism": _count(1, "fetch threads of the process's shared pool"),
    "listen_poll_max_s": _seconds("the longest wait between polls of a listen"),
    "read_memory_budget": _bytes(MiB, "what a streaming read holds at once"),
    "compaction_enabled": _FLAG,
    "compaction_memory_budget": _bytes(MiB, "what one merge holds at once"),
    "compaction_in_memory": _FLAG,
    "compaction_time_layers": _count(1, "1: one run, no time layers"),
    "compaction_layer_min_rows": _count(1, "smaller layers are not split off"),
    "compaction_layer_max_first_share": Rule(
        "float", lo=0, lo_open=True, hi=1, unit="a share of a merge's updates",
        meaning="to turn time layers off set compaction_time_layers=1",
    ),
    "compaction_layer_kv_whole": _FLAG,
    "compaction_workers": _count(1, "background merge threads per client"),
    "compaction_queue_max": _count(1, "queued merges per client"),
    "gc_in_background": _FLAG,
    "compaction_retry_backoff_s": _seconds("the first wait before a failed merge is retried"),
    "compaction_retry_backoff_max_s": _seconds("the longest such wait"),
    "compaction_quarantine_after": _count(1, "deterministic failures before a merge is quarantined"),
    "leak_grace_ms": Rule("int", lo=0, unit="milliseconds", meaning="0: no extra guard"),
    "max_cached_shards": _count(1, "shard machines a client keeps"),
    "metrics": _FLAG,
    "metrics_port": Rule(
        "int", lo=0, hi=65535, unit="a TCP port", optional=True,
        meaning=f"0: any free port; None: ${METRICS_PORT_ENV} decides",
    ),
    "now_ms": Rule("callable", meaning="one returning ms since the epoch"),
    "rng": Rule("rng"),
}


@dataclass(frozen=True)
class CrossRule:
    """A rule between fields: ``check`` gets the values (each already of its own field's
    type and range) and returns the problem, if any."""

    fields: tuple[str, ...]
    check: Callable[[Mapping[str, Any]], ConfigProblem | None]


def _heartbeat_within_leases(v: Mapping[str, Any]) -> ConfigProblem | None:
    """A handle's heartbeat falls due a quarter of the way into its lease and the thread
    looks for due heartbeats once a tick: a tick under half the shorter lease makes the
    heartbeat by three quarters of it. A longer tick lets leases lapse between ticks."""
    if not v["background_heartbeats"]:
        return None
    lease = min(v["reader_lease_ms"], v["writer_lease_ms"])
    if v["heartbeat_tick_s"] * 1000.0 < lease / 2:
        return None
    return ConfigProblem(
        "heartbeat_tick_s", v["heartbeat_tick_s"],
        f"with background_heartbeats, must be under half the shorter lease (reader_lease_ms="
        f"{v['reader_lease_ms']}, writer_lease_ms={v['writer_lease_ms']}): < {lease / 2000.0} s, "
        "or leases lapse between heartbeats",
        "fix: lower heartbeat_tick_s, lengthen the leases, or set background_heartbeats=False "
        "(and heartbeat the handles yourself)",
    )


def _backoff_within_max(v: Mapping[str, Any]) -> ConfigProblem | None:
    """The retry wait doubles from ``compaction_retry_backoff_s`` up to the max: a max
    below the first wait would silently replace it."""
    if v["compaction_retry_backoff_s"] <= v["compaction_retry_backoff_max_s"]:
        return None
    return ConfigProblem(
        "compaction_retry_backoff_s", v["compaction_retry_backoff_s"],
        f"must be <= compaction_retry_backoff_max_s ({v['compaction_retry_backoff_max_s']} s)",
        "fix: lower compaction_retry_backoff_s or raise compaction_retry_backoff_max_s",
    )


CROSS_RULES: tuple[CrossRule, ...] = (
    CrossRule(("background_heartbeats", "heartbeat_tick_s", "reader_lease_ms", "writer_lease_ms"),
              _heartbeat_within_leases),
    CrossRule(("compaction_retry_backoff_s", "compaction_retry_backoff_max_s"), _backoff_within_max),
)


def env_metrics_port_problem(metrics: Any, metrics_port: Any) -> ConfigProblem | None:
    """``$PERSIST_METRICS_PORT`` when it decides the port (``metrics`` on and
    ``metrics_port`` None: the client then serves on it): an int from 0 to 65535, or
    unset/empty."""
    if metrics is not True or metrics_port is not None:
        return None
    raw = os.environ.get(METRICS_PORT_ENV) or ""
    if not raw:
        return None
    try:
        port = int(raw)
    except ValueError:
        port = -1
    if 0 <= port <= 65535:
        return None
    return ConfigProblem(
        "metrics_port", raw, f"${METRICS_PORT_ENV} must be a TCP port, an int from 0 to 65535 "
        "(0: any free port)", f"fix: set ${METRICS_PORT_ENV} to a port, unset it (no metrics "
        "endpoint), or give metrics_port", source=f"${METRICS_PORT_ENV}",
    )


def rule_problems(
    rules: Mapping[str, Rule],
    values: Mapping[str, Any],
    defaults: Mapping[str, Any],
    cross: Iterable[CrossRule] = (),
    changed: Iterable[str] | None = None,
) -> list[ConfigProblem]:
    """Every broken rule of ``values`` against a table of ``rules`` (any config's: the
    ingestion's, a source's, the Dagster I/O manager's): the field rules of ``changed``
    (None: every field of ``rules``), then the ``cross`` rules that involve a changed
    field and whose fields are all valid."""
    names = list(rules) if changed is None else list(changed)
    out: list[ConfigProblem] = []
    for name in names:
        p = rules[name].check(name, values[name], defaults.get(name))
        if p is not None:
            out.append(p)
    bad = {p.field for p in out}
    for rule in cross:
        if any(f in names for f in rule.fields) and not any(
            f in bad or rules[f].is_bad(values[f]) for f in rule.fields
        ):
            p = rule.check(values)
            if p is not None:
                out.append(p)
    return out


class ConfigWarning(UserWarning):
    """A process switch in the environment (``$PERSIST_KERNELS``, ...) has a value it does
    not know: the switch keeps its default and this warning names the variable."""


_warned_env: set[tuple[str, str]] = set()


def env_choice(name: str, choices: tuple[str, ...], default: str) -> str:
    """The value of the environment switch ``name`` (case-insensitive; unset or empty:
    ``default``). A value outside ``choices`` is a typo that would otherwise be silently
    ignored: a ``ConfigWarning`` (once per variable and value) names it and the default
    is used -- a performance switch never stops the work."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    if raw.lower() in choices:
        return raw.lower()
    if (name, raw) not in _warned_env:
        _warned_env.add((name, raw))
        warnings.warn(
            f"ignoring ${name}={raw!r}: use one of {', '.join(choices)} (default {default!r}); "
            f"fix: correct it or unset {name}",
            ConfigWarning, stacklevel=2,
        )
    return default


def problems(
    values: Mapping[str, Any], defaults: Mapping[str, Any], changed: Iterable[str] | None = None
) -> list[ConfigProblem]:
    """Every broken rule of ``values`` (a whole ``PersistConfig``'s fields): the field
    rules of ``changed`` (None: all fields), then the cross rules that involve a changed
    field and whose fields are all valid, then the environment (on a whole check)."""
    names = list(values) if changed is None else list(changed)
    out = rule_problems(FIELD_RULES, values, defaults, CROSS_RULES, names)
    bad = {p.field for p in out}
    if changed is None or "metrics_port" in names or "metrics" in names:
        p = env_metrics_port_problem(values["metrics"], values["metrics_port"]) if "metrics_port" not in bad else None
        if p is not None:
            out.append(p)
    return out


class CheckedConfig:
    """The checks of a dataclass config against its rule table (``PersistConfig``,
    ``IngestConfig``): every field when it is built, and a field again whenever it is
    assigned afterwards (``cfg.x = ...``; the config keeps its old value on a refusal),
    as one ``ERROR`` naming every bad setting. Reads of a field stay plain attribute
    reads. An unknown field name is refused too, not silently set and ignored. A
    subclass sets ``RULES`` (one rule per field), ``CROSS`` and ``ERROR``, and may
    extend ``_problems`` (``PersistConfig``: its environment variable)."""

    RULES: ClassVar[Mapping[str, Rule]]
    CROSS: ClassVar[tuple[CrossRule, ...]] = ()
    ERROR: ClassVar[type[InvalidConfig]] = InvalidConfig

    def __post_init__(self) -> None:
        found = self._problems(self._values(), None)
        if found:
            raise self.ERROR(found)
        object.__setattr__(self, "_checked", True)

    def __setattr__(self, name: str, value: Any) -> None:
        # While ``__init__`` assigns the fields one by one nothing is checked:
        # ``__post_init__`` checks them all at once.
        if "_checked" in self.__dict__ and not name.startswith("_"):
            self._check_changes({name: value})
        object.__setattr__(self, name, value)

    def update(self, **changes: Any) -> Self:
        """Assigns several fields at once, checked together (so a change that is only valid
        with another one, such as a shorter lease with a shorter heartbeat tick, does not
        fail on the way): all of them, or none and ``ERROR``. Returns ``self``."""
        self._check_changes(changes)
        for k, v in changes.items():
            object.__setattr__(self, k, v)
        return self

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """Each field's default (for the messages; factories stand for their defaults),
        worked out once per class."""
        got: dict[str, Any] | None = cls.__dict__.get("_DEFAULTS")
        if got is None:
            got = {f.name: field_default(f) for f in fields(cls)}  # type: ignore[arg-type]
            cls._DEFAULTS = got  # type: ignore[attr-defined]
        return got

    @classmethod
    def unknown_fields(cls, names: Mapping[str, Any]) -> None:
        """``ERROR`` for the names in ``names`` that are not fields, with the nearest
        field as a hint."""
        unknown = []
        for name, value in names.items():
            if name not in cls.RULES:
                near = difflib.get_close_matches(name, list(cls.RULES), n=1)
                hint = f"did you mean {near[0]!r}?" if near else f"see the fields of {cls.__name__}"
                unknown.append(ConfigProblem(name, value, f"is not a field of {cls.__name__}", f"fix: {hint}"))
        if unknown:
            raise cls.ERROR(unknown)

    def _problems(self, values: Mapping[str, Any], changed: Iterable[str] | None) -> list[ConfigProblem]:
        return rule_problems(self.RULES, values, self.defaults(), self.CROSS, changed)

    def _values(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in self.RULES}

    def _check_changes(self, changes: dict[str, Any]) -> None:
        self.unknown_fields(changes)
        found = self._problems({**self._values(), **changes}, changes)
        if found:
            raise self.ERROR(found)


C = TypeVar("C")


def config_of(config: object, cls: type[C], *, what: str, error: type[InvalidConfig], hint: str) -> C:
    """``config`` when it is a ``cls``, the defaults for None; anything else (a dict of
    settings, a path, ``False``) is an ``error``, not silently replaced by the defaults."""
    if config is None:
        return cls()
    if isinstance(config, cls):
        return config
    name = cls.__name__
    fix = f"fix: pass {name}(**settings)" if isinstance(config, dict) else hint
    problem = ConfigProblem("config", config, f"must be a {name} or None, not a {type(config).__name__}", fix)
    raise error([problem], what=what)
