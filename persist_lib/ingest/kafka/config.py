"""A Kafka source's settings: the bootstrap URL (with SASL credentials and librdkafka
settings in it), the metadata columns of ``include``, the supported formats and how
consumers fetch. Pure parsing, below everything else in the package."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

from persist_lib.config_rules import Rule
from persist_lib.ingest.errors import IngestConfigError
from persist_lib.location.redaction import SensitiveUrl

FORMATS = ("json", "text", "bytes", "none")
READERS = ("thread", "process")  # where a reader prefetches and decodes (KafkaSource.reader)
METADATA = ("partition", "offset", "timestamp", "headers", "topic")

# How the reader's consumer fetches (bench/kafka_ingest.py gives its raw-consume anchor the
# same settings). ``fetch.queue.backoff.ms``: librdkafka's default (1000 ms) stops fetching
# a partition for a second whenever its local queue reached ``queued.min.messages``; a
# reader that drains the queue faster than that then waits for the broker with nothing
# to do -- measured: a raw consume of 1M messages took 1.5-4 s instead of 0.65-1.3 s, and
# ``run_once`` took such a pause for the end of the topic (poll_s) and returned early.
# ``reconnect.backoff.ms`` (librdkafka: 100): a fresh consumer suppresses "connect to
# any broker" for half of it after its first connection attempt, so its first metadata
# request or fetch often waited ~50 ms for nothing (a topic check's ``list_topics``
# against Tansu took 1 or 53 ms, about half the time each); 10 ms (still doubling up to
# ``reconnect.backoff.max.ms`` while a broker stays down) takes that to a few ms.
FETCH_SETTINGS: dict[str, Any] = {
    "fetch.wait.max.ms": 100,
    "queued.min.messages": 200_000,
    "fetch.queue.backoff.ms": 50,
    "reconnect.backoff.ms": 10,
}


def _positive_seconds(meaning: str) -> Rule:
    return Rule("float", lo=0, lo_open=True, unit="seconds", meaning=meaning)


#: The rules of a Kafka source's plain settings, checked together (every bad one named)
#: before the formats, the URL and the librdkafka settings are parsed. The bootstrap URL
#: is checked apart: it may hold a SASL password, and a problem shows the bad value.
KAFKA_RULES: dict[str, Rule] = {
    "topic": Rule("str", lo=1, meaning="the topic's name"),
    "key_field": Rule("str", optional=True, meaning="None: the only candidate field"),
    "value_field": Rule("str", optional=True, meaning="None: the only candidate field"),
    "group_id": Rule("str", optional=True, meaning="None: persist_NAME"),
    "commit_offsets": Rule("bool"),
    "timeout_s": _positive_seconds("how long an unreachable broker is retried"),
    "poll_s": _positive_seconds("the longest wait of one poll for messages"),
    "metadata_interval_s": _positive_seconds("how often partition metadata is refreshed"),
    "prefetch": Rule("int", lo=0, unit="messages", meaning="read and decoded ahead; 0: only when asked"),
    "ranges": Rule("bool"),
}


def _parse_include(include: Mapping[str, str] | Sequence[str] | str | None) -> dict[str, str]:
    """``include`` -> {column name: metadata kind}."""
    if include is None:
        return {}
    if isinstance(include, str):
        items: list[tuple[str, str]] = []
        for part in [p.strip() for p in include.split(",") if p.strip()]:
            kind, _, col = part.partition("=")
            items.append((kind.strip(), col.strip() or f"kafka_{kind.strip()}"))
    elif isinstance(include, Mapping):
        items = [(str(k), str(v)) for k, v in include.items()]
    else:
        items = [(str(k), f"kafka_{k}") for k in include]
    out: dict[str, str] = {}
    for kind, col in items:
        if kind not in METADATA:
            raise IngestConfigError(
                f"unknown Kafka metadata {kind!r} in include: use any of {', '.join(METADATA)} "
                "(optionally KIND=COLUMN, e.g. 'timestamp=ts')"
            )
        out[col] = kind
    return out


def _bootstrap_of(url: str) -> tuple[str, dict[str, str]]:
    """``kafka://[USER:PASSWORD@]HOST:PORT[,HOST:PORT]?security_protocol=...`` or a
    plain ``HOST:PORT,...`` list -> (bootstrap.servers, extra librdkafka settings)."""
    if "://" not in url:
        return url, {}
    parts = urlsplit(url)
    if parts.scheme != "kafka":
        raise IngestConfigError(
            f"Kafka bootstrap URL {SensitiveUrl(url)}: use kafka://[USER:PASSWORD@]HOST:PORT[,HOST:PORT]"
            "[?security_protocol=SASL_SSL&sasl_mechanism=PLAIN] or a plain HOST:PORT list"
        )
    netloc = parts.netloc
    conf: dict[str, str] = {}
    if "@" in netloc:
        userinfo, _, netloc = netloc.rpartition("@")
        user, _, pw = userinfo.partition(":")
        conf["sasl.username"] = unquote(user)
        conf["sasl.password"] = unquote(pw)
        conf.setdefault("security.protocol", "SASL_SSL")
        conf.setdefault("sasl.mechanism", "PLAIN")
    for k, v in parse_qsl(parts.query, keep_blank_values=True):
        conf[k.replace("_", ".")] = v
    if not netloc:
        raise IngestConfigError(f"Kafka bootstrap URL {SensitiveUrl(url)} names no HOST:PORT")
    return netloc, conf
