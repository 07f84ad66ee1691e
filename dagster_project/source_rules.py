"""What a ``SourceSpec`` (``sources.py``) may hold: one rule per setting and the rules
between them (a CDC source needs its table, a Kafka source its topic, ``delete_field``
the upsert envelope), with the machinery of ``persist_lib.config_rules``. Checked when
the spec is built -- when the code location loads -- so a bad source fails there with
``InvalidConfig`` naming every bad setting, not in the middle of an ingestion run."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from persist_lib.config_rules import CrossRule, Rule, rule_problems
from persist_lib.errors import ConfigProblem, InvalidConfig, InvalidUsage
from persist_lib.ingest.kafka.config import FORMATS as KAFKA_FORMATS
from persist_lib.ingest.landing_zone.stores import FORMATS as FILE_FORMATS
from persist_lib.storage.controller import check_name

KINDS = ("landing_zone", "postgres_cdc", "kafka")
ENVELOPES = ("upsert", "append_only", "append", "none")  # the last two: append_only's aliases

SOURCE_RULES: dict[str, Rule] = {
    "name": Rule("str", lo=1, meaning="the collection, asset and ingestion name"),
    "envelope": Rule("choice", choices=ENVELOPES),
    "kind": Rule("choice", choices=KINDS),
    "format": Rule("choice", choices=(*FILE_FORMATS, "auto"), meaning="landing zone files; auto: by extension"),
    "table": Rule("str", meaning="postgres_cdc: TABLE or SCHEMA.TABLE"),
    "dsn_env": Rule("str", lo=1, meaning="postgres_cdc: the environment variable holding the DSN"),
    "topic": Rule("str", meaning="kafka: the topic"),
    "bootstrap_env": Rule("str", lo=1, meaning="kafka: the environment variable holding the bootstrap URL"),
    "key_format": Rule("choice", choices=KAFKA_FORMATS, meaning="kafka: how message keys are decoded"),
    "num_shards": Rule("int", lo=1, hi=1024, meaning="shards of the source's collections"),
    "rendition_shards": Rule("int", lo=0, hi=1024, meaning="shards of a rebuilt rendition; 0: num_shards"),
    "delete_field": Rule("str", optional=True, meaning="upsert: the boolean field whose true rows delete their key"),
    "description": Rule("str"),
    "transform": Rule("callable", optional=True, meaning="one taking and returning a pyarrow Table"),
    "on_schema_change": Rule("choice", choices=("evolve", "fail")),
}


def _name_is_a_collection_name(v: Mapping[str, Any]) -> ConfigProblem | None:
    try:
        check_name("source", v["name"])
    except InvalidUsage as e:
        return ConfigProblem("name", v["name"], f"must be a collection name ({str(e).split(': ', 1)[-1]})",
                             "fix: rename the source, e.g. 'orders'")
    return None


def _needs(kind: str, field: str, what: str) -> CrossRule:
    def check(v: Mapping[str, Any]) -> ConfigProblem | None:
        if v["kind"] != kind or v[field]:
            return None
        return ConfigProblem(field, v[field], f"a {kind} source needs its {what}", f"fix: set {field}=...")

    return CrossRule(("kind", field), check)


def _delete_needs_upsert(v: Mapping[str, Any]) -> ConfigProblem | None:
    if v["delete_field"] is None or v["envelope"] == "upsert":
        return None
    return ConfigProblem("delete_field", v["delete_field"],
                         f"only means something with envelope='upsert' (envelope is {v['envelope']!r})",
                         "fix: drop delete_field or use envelope='upsert'")


SOURCE_CROSS_RULES: tuple[CrossRule, ...] = (
    CrossRule(("name",), _name_is_a_collection_name),
    _needs("postgres_cdc", "table", "table (TABLE or SCHEMA.TABLE)"),
    _needs("kafka", "topic", "topic"),
    CrossRule(("delete_field", "envelope"), _delete_needs_upsert),
)


def check_source_spec(values: Mapping[str, Any], defaults: Mapping[str, Any]) -> None:
    """Raises ``InvalidConfig`` naming every bad setting of a source spec (by name)."""
    found = rule_problems(SOURCE_RULES, values, defaults, SOURCE_CROSS_RULES)
    if found:
        raise InvalidConfig(found, what=f"SourceSpec {values.get('name')!r}")
