"""``IngestConfig``: the tunables of an ingestion, each checked against its rule (type,
range) when the config is built or a field is assigned.

A bad value raises ``InvalidIngestConfig`` (an ``InvalidConfig`` and an
``IngestConfigError``) naming every bad setting at once, with the machinery of
``persist_lib.config_rules``; the CLI renames the fields it sets after its options
(``with_sources``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields

from persist_lib.config_rules import (
    CheckedConfig,
    CrossRule,
    Rule,
    config_of,
    field_default,
    rule_problems,
)
from persist_lib.ingest.errors import InvalidIngestConfig

_RECORDS = "records"


def _records(meaning: str) -> Rule:
    return Rule("int", lo=1, unit=_RECORDS, meaning=meaning)


def _seconds(meaning: str) -> Rule:
    return Rule("float", lo=0, lo_open=True, unit="seconds", meaning=meaning)


#: One rule per ``IngestConfig`` field (the tests check that every field has one).
INGEST_RULES: dict[str, Rule] = {
    "max_records_per_binding": _records("the extent of a newly minted binding"),
    "read_chunk_records": _records("replay reads in chunks of this many"),
    "max_append_records": _records("consecutive bindings share one append up to this"),
    "timestamp_interval_ms": Rule(
        "int", lo=1, unit="milliseconds", meaning="minted times are rounded down to a multiple of it"
    ),
    "since_window_ms": Rule(
        "int", lo=0, unit="milliseconds", optional=True,
        meaning="history kept readable below the upper; None: all history",
    ),
    "poll_interval_s": _seconds("continuous mode: how often to look for new data"),
    "replay_timeout_s": _seconds("how long a replay waits for bound data to become readable"),
    "keep_raw": Rule("bool"),
    "unsorted_min_bytes": Rule(
        "int", lo=0, unit="bytes", optional=True,
        meaning="output appends this large are written unsorted; None: the client's PersistConfig decides",
    ),
}


#: No rule ties two fields together: a ``max_append_records`` below one binding is valid
#: (every binding is then appended alone), as is any window with any interval.
INGEST_CROSS_RULES: tuple[CrossRule, ...] = ()


@dataclass
class IngestConfig(CheckedConfig):
    """Tunables of an ingestion (none of them changes what a binding means). Checked
    against ``INGEST_RULES`` when built and when a field is assigned (the config keeps
    its old value); a bad value is an ``InvalidIngestConfig`` naming every bad setting."""

    max_records_per_binding: int = 100_000  # extent of a newly minted binding
    read_chunk_records: int = 100_000  # replay reads in chunks of this many records
    max_append_records: int = 250_000  # consecutive bindings share one append up to this
    timestamp_interval_ms: int = 1  # minted times are rounded down to a multiple of this
    since_window_ms: int | None = 3_600_000  # history kept readable below the upper (None: all)
    poll_interval_s: float = 1.0  # continuous mode: how often to look for new data
    replay_timeout_s: float = 30.0  # wait this long for bound data to become readable
    keep_raw: bool = False  # also write the undecoded records (the raw collection)
    # Output appends of at least this many Arrow bytes are written unsorted (the compactor
    # sorts them; reads consolidate either way): a 100,000-record binding's append then
    # costs its Parquet encoding but no sort. None: the client's PersistConfig decides.
    unsorted_min_bytes: int | None = 1 << 20

    RULES = INGEST_RULES
    CROSS = INGEST_CROSS_RULES
    ERROR = InvalidIngestConfig


def ingest_config_of(config: object) -> IngestConfig:
    """``config`` when it is an ``IngestConfig``, the defaults for None; anything else is
    an ``InvalidIngestConfig`` (not silently replaced by the defaults)."""
    return config_of(
        config, IngestConfig, what="Ingestion config", error=InvalidIngestConfig,
        hint="fix: pass IngestConfig(**settings)",
    )


def require_valid_settings(obj: object, rules: Mapping[str, Rule], what: str) -> None:
    """Checks the fields of the dataclass ``obj`` (a source's settings) that ``rules``
    names: every broken rule at once, as an ``InvalidIngestConfig`` about ``what``."""
    defaults = {f.name: field_default(f) for f in fields(obj) if f.name in rules}  # type: ignore[arg-type]
    found = rule_problems(rules, {n: getattr(obj, n) for n in rules}, defaults)
    if found:
        raise InvalidIngestConfig(found, what=what)
