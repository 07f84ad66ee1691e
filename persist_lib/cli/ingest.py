"""``persist ingest ...``: run and inspect ingestions from the command line.

- ``persist ingest files NAME URI --key id:int64 --value name:string,qty:float64 ...``
- ``persist ingest postgres NAME DSN TABLE --key id:int64 --value ...``
- ``persist ingest kafka NAME BOOTSTRAP TOPIC --key id:int64 --value ... [--key-format json]``
- ``persist ingest status NAME``

A run prints its summary (a text view; ``--json`` for the JSON document; progress goes
to stderr as a bar with ``--progress``, the default on a terminal). ``--follow`` keeps
ingesting until interrupted (or ``--duration`` seconds).
"""

from __future__ import annotations

import argparse
import re
import signal
import sys
import threading
from typing import Any

import pyarrow as pa

from persist_lib.cli.main import command
from persist_lib.handles.client import PersistClient
from persist_lib.ingest.errors import IngestConfigError, InvalidIngestConfig

_TYPES: dict[str, pa.DataType] = {
    "int8": pa.int8(), "int16": pa.int16(), "int32": pa.int32(), "int64": pa.int64(),
    "uint8": pa.uint8(), "uint16": pa.uint16(), "uint32": pa.uint32(), "uint64": pa.uint64(),
    "float32": pa.float32(), "float64": pa.float64(), "double": pa.float64(), "float": pa.float64(),
    "string": pa.string(), "str": pa.string(), "text": pa.string(), "bool": pa.bool_(),
    "boolean": pa.bool_(), "binary": pa.binary(), "bytes": pa.binary(), "date": pa.date32(),
    "date32": pa.date32(), "timestamp": pa.timestamp("us"), "timestamptz": pa.timestamp("us", tz="UTC"),
}


def parse_fields(spec: str | None, what: str) -> pa.Schema:
    """``"id:int64,name:string,qty:float64!"`` -> a schema (``!``: not nullable)."""
    if not spec:
        return pa.schema([])
    fields = []
    for part in re.split(r",(?![^(]*\))", spec):
        part = part.strip()
        m = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_]*):([a-z0-9_]+|decimal\(\d+,\s*\d+\))(!?)", part)
        if not m:
            raise IngestConfigError(
                f"{what} field {part!r} is not NAME:TYPE (e.g. id:int64, price:decimal(10,2), "
                f"qty:float64! for not null); types: {', '.join(sorted(_TYPES))}, decimal(P,S)"
            )
        name, tname, bang = m.groups()
        if tname.startswith("decimal"):
            p, s = re.findall(r"\d+", tname)
            t = pa.decimal128(int(p), int(s))
        elif tname in _TYPES:
            t = _TYPES[tname]
        else:
            raise IngestConfigError(f"{what} field {name!r}: unknown type {tname!r}; use one of {', '.join(sorted(_TYPES))}")
        fields.append(pa.field(name, t, nullable=not bang))
    return pa.schema(fields)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--key", required=True, help="key fields, e.g. id:int64 (the upsert/routing key)")
    p.add_argument("--value", default="", help="value fields, e.g. name:string,qty:float64 (! = not null)")
    p.add_argument("--records-per-binding", type=int, default=100_000, help="records per minted binding")
    p.add_argument("--keep-raw", action="store_true", help="also keep the undecoded records (raw collection)")
    p.add_argument("--storage", action="store_true", help="write STORAGE collections instead of plain shards")
    p.add_argument("--shards", type=int, default=1, help="shards per collection with --storage")
    p.add_argument("--follow", action="store_true", help="keep ingesting until interrupted")
    p.add_argument("--duration", type=float, default=None, help="with --follow: stop after this many seconds")
    p.add_argument("--poll", type=float, default=1.0, help="with --follow: seconds between looks for new data")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--progress", dest="progress", action="store_true", default=None, help="show a progress bar")
    g.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")


def _args(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="ingest_cmd", required=True)
    f = sub.add_parser("files", help="ingest a landing zone (directory or S3 prefix) of JSON lines/CSV/Parquet")
    f.add_argument("name", help="ingestion name (names its shards or collections)")
    f.add_argument("uri", help="directory, file:///DIR or s3://BUCKET/PREFIX?endpoint_url=...&region=...")
    f.add_argument("--format", default="auto", help="jsonl, csv, parquet or auto (by extension)")
    f.add_argument("--pattern", default=None, help="only files matching this glob")
    f.add_argument("--envelope", default="append_only", choices=["append_only", "upsert"])
    f.add_argument("--delete-field", default=None, help="upsert: boolean field marking deletes")
    _common(f)
    g = sub.add_parser("postgres", help="ingest a Postgres table by logical replication (pgoutput)")
    g.add_argument("name", help="ingestion name")
    g.add_argument("dsn", help="postgresql://USER:PASSWORD@HOST:PORT/DB (wal_level=logical)")
    g.add_argument("table", help="TABLE or SCHEMA.TABLE")
    g.add_argument("--slot", default=None, help="replication slot (default persist_NAME)")
    g.add_argument("--publication", default=None, help="publication (default persist_NAME)")
    _common(g)
    k = sub.add_parser("kafka", help="ingest a Kafka topic (offsets per partition, group offsets committed when durable)")
    k.add_argument("name", help="ingestion name")
    k.add_argument("bootstrap", help="HOST:PORT[,HOST:PORT] or kafka://USER:PASSWORD@HOST:PORT?security_protocol=SASL_SSL")
    k.add_argument("topic", help="the topic")
    k.add_argument("--key-format", default="none", choices=["json", "text", "bytes", "none"],
                   help="message key: JSON (object fields, or a scalar for one key field), text, bytes, or none")
    k.add_argument("--value-format", default="json", choices=["json", "text", "bytes"], help="message value")
    k.add_argument("--key-field", default=None, help="text/bytes key: the field it goes to")
    k.add_argument("--value-field", default=None, help="text/bytes value: the field it goes to")
    k.add_argument("--include", default=None,
                   help="metadata columns: partition,offset,timestamp,headers,topic (KIND=COLUMN to rename; default kafka_KIND)")
    k.add_argument("--group", default=None, help="consumer group for the committed offsets (default persist_NAME)")
    k.add_argument("--envelope", default="append_only", choices=["append_only", "none", "upsert"],
                   help="upsert: latest value per key, a null value (tombstone) deletes")
    k.add_argument("--timeout", type=float, default=30.0, help="seconds to retry an unreachable broker")
    k.add_argument("--reader", default=None, choices=["thread", "process"],
                   help="where messages are fetched and decoded ahead of the ingestion: a thread of this "
                   "process or a reader process (default: KafkaSource's)")
    _common(k)
    s = sub.add_parser("status", help="an ingestion's frontier, uppers and remap shard")
    s.add_argument("name", help="ingestion name")


#: The ``IngestConfig`` fields ``persist ingest`` sets, and the options that set them.
INGEST_OPTIONS = {"max_records_per_binding": "--records-per-binding", "poll_interval_s": "--poll"}


def _run(client: PersistClient, ns: argparse.Namespace, source: Any, envelope: str, delete_field: str | None) -> Any:
    from persist_lib.ingest.driver import IngestConfig, Ingestion
    from persist_lib.ingest.outputs import StorageOutputs
    from persist_lib.ingest.progress import ProgressBar

    key = parse_fields(ns.key, "key")
    val = parse_fields(ns.value, "value")
    outputs = None
    ctl = None
    if ns.storage:
        from persist_lib.storage import StorageController

        ctl = StorageController(client)
        outputs = StorageOutputs(ctl, ns.name, num_shards=ns.shards)
    show = ns.progress if ns.progress is not None else sys.stderr.isatty()
    try:
        cfg = IngestConfig(max_records_per_binding=ns.records_per_binding, keep_raw=ns.keep_raw, poll_interval_s=ns.poll)
    except InvalidIngestConfig as e:  # named as the options the user gave
        raise e.with_sources(INGEST_OPTIONS, what="persist ingest options") from None
    try:
        with Ingestion(
            client, ns.name, source, key, val, envelope=envelope, delete_field=delete_field,
            outputs=outputs, config=cfg, progress=ProgressBar() if show else None,
        ) as ing:
            if not ns.follow:
                return ing.run_once()
            stop = threading.Event()
            prev = signal.signal(signal.SIGINT, lambda *_: stop.set())
            try:
                return ing.run(stop=stop, max_duration_s=ns.duration)
            finally:
                signal.signal(signal.SIGINT, prev)
    finally:
        if ctl is not None:  # its metadata readers would hold back retired renditions
            ctl.close()


def _human(client: PersistClient, ns: argparse.Namespace, doc: Any) -> str:
    from persist_lib.cli.human import ingest_run_text, ingest_status_text

    return ingest_status_text(doc) if ns.ingest_cmd == "status" else ingest_run_text(doc)


@command(
    "ingest",
    "ingest sources (file landing zones, Postgres CDC, Kafka) with reclocking",
    _args,
    creates_location=lambda ns: ns.ingest_cmd != "status",
    human=_human,
)
def _ingest(client: PersistClient, ns: argparse.Namespace) -> Any:
    if ns.ingest_cmd == "files":
        from persist_lib.ingest.landing_zone import LandingZoneSource

        src = LandingZoneSource(ns.uri, format=ns.format, pattern=ns.pattern)
        return _run(client, ns, src, ns.envelope, ns.delete_field)
    if ns.ingest_cmd == "postgres":
        from persist_lib.ingest.pg_cdc import PgCdcSource

        return _run(client, ns, PgCdcSource(ns.dsn, ns.table, slot=ns.slot, publication=ns.publication), "upsert", None)
    if ns.ingest_cmd == "kafka":
        from persist_lib.ingest.kafka import KafkaSource

        ksrc = KafkaSource(
            ns.bootstrap, ns.topic, key_format=ns.key_format, value_format=ns.value_format,
            key_field=ns.key_field, value_field=ns.value_field, include=ns.include, group_id=ns.group,
            timeout_s=ns.timeout, **({"reader": ns.reader} if ns.reader else {}),
        )
        return _run(client, ns, ksrc, ns.envelope, None)
    return status(client, ns.name)


def status(client: PersistClient, name: str) -> dict[str, Any]:
    """Uppers/sinces of an ingestion's plain shards and its remap frontier (no ingestion)."""
    from persist_lib.ingest.outputs import ROLES, shard_id_for
    from persist_lib.ingest.remap import REMAP_KEY, REMAP_VAL, RemapShard

    out: dict[str, Any] = {"name": name, "shards": {}}
    for role in ROLES:
        sid = shard_id_for(name, role)
        st = client.machine(sid).fetch_latest()
        if st.exists:
            out["shards"][role] = {"shard": str(sid), "since": st.since.elements, "upper": st.upper.elements}
    if "remap" not in out["shards"]:
        raise IngestConfigError(
            f"no ingestion named {name!r} at this location (no remap shard {shard_id_for(name, 'remap')}); "
            "check the name and --blob/--consensus"
        )
    rm = RemapShard(client, shard_id_for(name, "remap"), {}, label=f"{name}/remap")
    try:
        upper = out["shards"]["remap"]["upper"][0] if out["shards"]["remap"]["upper"] else 0
        rm.load(upper - 1 if upper > 0 else None)
        out["frontier"] = {p: list(a) for p, a in rm.frontier.items()}
        out["notes"] = len(rm.all_notes())
        out["late_files"] = [n["file"] for n in rm.all_notes() if n.get("kind") == "late_file"]
    finally:
        rm.close()
    _ = (REMAP_KEY, REMAP_VAL)
    return out
