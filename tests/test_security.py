"""Security at the client/handle layer (R11). The location layer has its own tests
(``tests/test_location_security.py``: hostile blob keys, symlinks, URI redaction, SQL
lint); these cover what sits on top:

1. **Credentials**: a canary password (in the Postgres URL and as an S3 secret key in
   the blob URI) never appears in the repr/str of clients, handles, listens, splits,
   inspect output, in any error message (with its whole chain and traceback) across
   failure paths, or in captured logs at DEBUG.
2. **Hostile shard ids** are rejected by every client entry point before any I/O.
3. **Blob keys from state never escape**: a crafted consensus entry that references a
   part, a rollup or garbage at ``../secret`` (or an absolute path) is never read or
   deleted outside the blob root, whatever the checksums say.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import importlib
import inspect
import logging
import os
import pkgutil
import re
import socket
import textwrap
import traceback
import uuid
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import Any
from urllib.parse import quote, urlsplit

import pyarrow as pa
import pytest

from persist_lib import PersistClient, PersistConfig, ShardId
from persist_lib.errors import InvalidUri, InvalidUsage, PersistError
from persist_lib.location.base import CaSResult, VersionedData
from persist_lib.location.sqlite_consensus import SqliteConsensus
from persist_lib.shard import state as st
from persist_lib.shard.batch_meta import PartMeta
from persist_lib.shard.machine import clear_state_cache, frame, unframe
from tests.support.secrets import CANARY, NASTY_PASSWORDS, assert_no_leak

KEY = pa.schema([("k", pa.string())])
VAL = pa.schema([("v", pa.int64())])


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _text(e: BaseException) -> str:
    """Everything an exception can show: message, repr, args, chain, traceback."""
    return "".join(traceback.format_exception(e)) + repr(e) + repr(e.args) + str(e)


def _assert_clean(texts: list[str]) -> None:
    for t in texts:
        assert CANARY not in t, t[:2000]


# ----- 1. credentials --------------------------------------------------------------------------


@pytest.mark.postgres
@pytest.mark.s3
def test_canary_never_shows_in_client_objects(
    pg_url: str, s3_server: object, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    assert CANARY in pg_url
    endpoint = s3_server.endpoint  # type: ignore[attr-defined]
    bucket = s3_server.create_bucket()  # type: ignore[attr-defined]
    blob_uri = (
        f"s3://{bucket}/p?endpoint_url={endpoint}&region=us-east-1"
        f"&access_key_id=testing&secret_access_key={CANARY}"
    )
    c = PersistClient.open(blob_uri, pg_url, PersistConfig.for_tests(inline_threshold=0))
    shard = ShardId.new()
    w, r = c.open(shard, KEY, VAL)
    w.compare_and_append([((("a",), (1,)), 0, 1)], 0, 1)
    since = c.open_critical_since(shard, KEY, VAL)
    lst = r.listen(0)
    splits = r.snapshot_splits(0, 2) + r.range_splits(0, 1, 2)
    m = c.machine(shard)
    texts = [
        repr(c), str(c), repr(w), str(w), repr(r), str(r), repr(since), str(since), repr(lst),
        repr(c.blob), str(c.blob), c.blob.describe(), repr(c.consensus), c.consensus.describe(),
        repr(c.raw_blob), repr(c.raw_consensus), repr(m), repr(c.config),
        repr(splits), str(splits), str(c.inspect(shard)), repr(r.snapshot(0)),
    ]
    r.release_splits()
    c.close()
    texts.append(caplog.text)
    texts += [r_.getMessage() + repr(r_.args) for r_ in caplog.records]
    _assert_clean(texts)


@pytest.mark.postgres
def test_canary_never_leaks_on_client_failure_paths(
    pg_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    blob_uri = "file://" + quote(str(tmp_path / "blob"))
    down = f"postgresql://persist:{CANARY}@127.0.0.1:{_closed_port()}/db"
    wrong = pg_url.replace(CANARY, CANARY + "-wrong")
    texts: list[str] = []
    for uri in (down, wrong):
        c = PersistClient.open(blob_uri, uri, PersistConfig.for_tests(retry_deadline_s=0.2))
        texts += [repr(c), str(c)]
        for op in (
            lambda c=c: c.open(ShardId.new(), KEY, VAL),
            lambda c=c: c.open_writer(ShardId.new(), KEY, VAL),
            lambda c=c: c.inspect(ShardId.new()),
            lambda c=c: c.expire_leases(),
            lambda c=c: c.list_shards(),
        ):
            with pytest.raises(PersistError) as ei:
                op()
            texts.append(_text(ei.value))
        c.close()
    # A live client whose consensus goes away mid-flight (handles already open).
    c = PersistClient.open(blob_uri, pg_url, PersistConfig.for_tests(retry_deadline_s=0.2))
    w, r = c.open(ShardId.new(), KEY, VAL)
    c.consensus.inner.url = type(c.consensus.inner.url)(wrong)  # type: ignore[attr-defined]
    c.consensus.inner._drop_conn()  # type: ignore[attr-defined]
    for op in (
        lambda: w.compare_and_append([((("a",), (1,)), 0, 1)], 0, 1),
        lambda: w.heartbeat(),
        lambda: r.downgrade_since(0),
        lambda: w.fetch_recent_upper(),
    ):
        with pytest.raises(PersistError) as ei:
            op()
        texts.append(_text(ei.value))
    c.close()
    texts.append(caplog.text)
    texts += [r_.getMessage() + repr(r_.args) for r_ in caplog.records]
    _assert_clean(texts)
    _assert_clean([t.replace(CANARY + "-wrong", "") for t in texts])


@pytest.mark.s3
def test_canary_never_leaks_from_blob_failures(s3_server: object, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    endpoint = s3_server.endpoint  # type: ignore[attr-defined]
    blob_uri = (
        f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/p?endpoint_url={endpoint}&region=us-east-1"
        f"&access_key_id=testing&secret_access_key={CANARY}"
    )
    c = PersistClient.open(
        blob_uri, f"mem://{uuid.uuid4().hex}", PersistConfig.for_tests(inline_threshold=0, retry_deadline_s=0.2)
    )
    w, r = c.open(ShardId.new(), KEY, VAL)
    texts = [repr(c)]
    with pytest.raises(PersistError) as ei:
        w.compare_and_append([((("a",), (1,)), 0, 1)], 0, 1)  # the part upload fails
    texts.append(_text(ei.value))
    c.close()
    texts.append(caplog.text)
    _assert_clean(texts)


# ----- 1b. every class that holds a URI, a DSN or a location, with hostile passwords -----------

_SENSITIVE_NAME = re.compile(r"uri|url|dsn|conninfo|password|passwd|secret|credential", re.I)
_SENSITIVE_CLASS = re.compile(r"(Uri|Url|URL|Dsn|DSN|Conninfo|Password|Secret|Credential)(?![a-z])")
_HOLDER_TYPE = re.compile(r"\b(Blob|Consensus|PersistClient|ShardContext|HandleContext)\b")
_PACKAGES = ("persist_lib", "dagster_project", "jobs", "sensors")


def _all_modules() -> list[ModuleType]:
    mods: list[ModuleType] = []
    for pkg in _PACKAGES:
        root = importlib.import_module(pkg)
        mods.append(root)
        for info in pkgutil.walk_packages(root.__path__, pkg + "."):
            mods.append(importlib.import_module(info.name))
    return mods


def _why_sensitive(cls: type) -> list[str]:
    """Why ``cls`` may hold a credential: a field, ``__init__`` parameter or ``self.``
    attribute named like a URI/DSN/secret, being a Blob/Consensus, or taking a Blob,
    Consensus or PersistClient (whose URIs its repr or errors could show)."""
    from persist_lib.location.base import Blob, Consensus

    why: list[str] = []
    if _SENSITIVE_CLASS.search(cls.__name__):
        why.append(f"class {cls.__name__}")
    names = set(cls.__dict__.get("__annotations__", {}))
    if dataclasses.is_dataclass(cls):
        names |= {f.name for f in dataclasses.fields(cls)}
    names |= set(getattr(cls, "model_fields", {}) or {})
    why += [f"field {n}" for n in sorted(names) if _SENSITIVE_NAME.search(n)]
    try:
        params = inspect.signature(cls.__init__).parameters.values()  # type: ignore[misc]
    except (TypeError, ValueError):
        params = []  # type: ignore[assignment]
    for p in params:
        if _SENSITIVE_NAME.search(p.name):
            why.append(f"__init__({p.name})")
        elif _HOLDER_TYPE.search(str(p.annotation)):
            why.append(f"__init__({p.name}: {p.annotation})")
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):
        tree = None
    for n in ast.walk(tree) if tree is not None else ():
        if (
            isinstance(n, ast.Attribute)
            and isinstance(n.ctx, ast.Store)
            and isinstance(n.value, ast.Name)
            and n.value.id == "self"
            and _SENSITIVE_NAME.search(n.attr)
        ):
            why.append(f"self.{n.attr}")
    if issubclass(cls, (Blob, Consensus)):
        why.append("a Blob/Consensus")
    return sorted(set(why))


def _sensitive_classes() -> dict[str, tuple[type, list[str]]]:
    """Every class of the project (by ``module.QualName``) that may hold a credential."""
    out: dict[str, tuple[type, list[str]]] = {}
    for mod in _all_modules():
        for obj in vars(mod).values():
            if inspect.isclass(obj) and obj.__module__ == mod.__name__ and not inspect.isabstract(obj):
                why = _why_sensitive(obj)
                if why:
                    out[f"{mod.__name__}.{obj.__qualname__}"] = (obj, why)
    return out


@dataclasses.dataclass
class _World:
    """A location whose credentials are one hostile password: Postgres consensus (a role
    with that password), S3 blob and landing zone (that password as secret key)."""

    pw: str
    tmp: Path
    blob_uri: str
    consensus_uri: str
    landing_uri: str
    client: PersistClient
    shard: ShardId
    w: Any
    r: Any
    closers: list[Any] = dataclasses.field(default_factory=list)

    def keep(self, obj: Any) -> Any:
        """``obj``, closed (if it can be) when the world ends."""
        self.closers.append(obj)
        return obj

    def close(self) -> None:
        for obj in reversed(self.closers):
            close = getattr(obj, "close", None)
            if callable(close):
                try:
                    close()
                except Exception:  # noqa: BLE001 - best effort clean-up
                    pass
        self.client.close()


def _role_url(pg_url: str, pw: str, suffix: str = "") -> str:
    """A superuser role whose password is ``pw``; its URL, percent-encoded properly
    (``suffix`` is appended to the password in the URL only: a wrong password)."""
    from psycopg import connect, sql

    role = "nasty_" + hashlib.sha256(pw.encode()).hexdigest()[:12]
    with connect(pg_url, autocommit=True) as conn:
        exists = conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,)).fetchone()
        verb = "ALTER" if exists else "CREATE"
        conn.execute(
            sql.SQL(verb + " ROLE {} LOGIN SUPERUSER PASSWORD {}").format(
                sql.Identifier(role), sql.Literal(pw)
            )
        )
    parts = urlsplit(pg_url)
    return f"postgresql://{role}:{quote(pw + suffix, safe='')}@{parts.hostname}:{parts.port}{parts.path}"


def _world(pw: str, pg_url: str, s3: Any, tmp: Path) -> _World:
    enc = quote(pw, safe="")
    bucket = s3.create_bucket()
    creds = f"region=us-east-1&access_key_id=testing&secret_access_key={enc}"
    blob_uri = f"s3://{bucket}/p?endpoint_url={s3.endpoint}&{creds}"
    landing_uri = f"s3://{bucket}/landing?endpoint_url={s3.endpoint}&{creds}"
    consensus_uri = _role_url(pg_url, pw)
    client = PersistClient.open(blob_uri, consensus_uri, PersistConfig.for_tests(inline_threshold=0))
    shard = ShardId.new()
    w, r = client.open(shard, KEY, VAL)
    # the hostile password really authenticates (Postgres) and signs (S3) end to end
    w.compare_and_append([((("a",), (1,)), 0, 1)], 0, 1)
    assert r.snapshot(0).num_rows == 1
    return _World(pw, tmp, blob_uri, consensus_uri, landing_uri, client, shard, w, r)


def _dagster_source_spec(x: _World) -> list[Any]:
    from dagster_project.sources import SourceSpec

    os.environ["PERSIST_TEST_NASTY_DSN"] = x.consensus_uri  # removed by the test
    return [SourceSpec("nasty", KEY, VAL, kind="postgres_cdc", table="t", dsn_env="PERSIST_TEST_NASTY_DSN")]


def _persist_resource(x: _World) -> list[Any]:
    from dagster_project.resources import PersistResource

    res = PersistResource(blob_uri=x.blob_uri, consensus_uri=x.consensus_uri)
    client = x.keep(res).client()
    return [res, client]


def _landing_resource(x: _World) -> list[Any]:
    from dagster_aws.s3 import S3Resource

    from dagster_project.resources import LandingZoneResource

    s3 = S3Resource(aws_access_key_id="testing", aws_secret_access_key=x.pw)
    return [LandingZoneResource(uri=x.landing_uri, s3=s3)]


def _pg_cdc(x: _World) -> list[Any]:
    from persist_lib.ingest.pg_cdc import PgCdcSource

    src = PgCdcSource(x.consensus_uri, "public.nasty_t")
    src.attach(x.client, "nasty")
    return [src]


def _kafka_source(x: _World, topic_only: bool = False) -> list[Any]:
    """Kafka sources (or, ``topic_only``, the ``KafkaTopic`` they are built on) holding
    the password in every place a Kafka credential can be."""
    from persist_lib.ingest.kafka import KafkaSource
    from persist_lib.ingest.kafka.topic import KafkaTopic
    from tests.test_kafka_secrets import KAFKA_SECRET_SETTINGS

    cls = KafkaTopic if topic_only else KafkaSource

    enc = quote(x.pw, safe="")
    url = f"kafka://alice:{enc}@127.0.0.1:9?security_protocol=SASL_PLAINTEXT&sasl_mechanism=PLAIN"
    src = cls(url, "t", config={"sasl.password": x.pw})
    # librdkafka's other secret-bearing settings, in config and (those whose names say
    # nothing of a password or secret) in the URL: hidden because they are not on the
    # allow-list, whatever their name
    unnamed = ("ssl.key.pem", "sasl.oauthbearer.config", "sasl.oauthbearer.extensions", "ssl.certificate.pem")
    in_url = "&".join(f"{k.replace('.', '_')}={enc}" for k in unnamed)
    other = cls(
        f"kafka://alice:userinfo-pw@127.0.0.1:9?security_protocol=SASL_SSL&{in_url}",
        "t",
        config={k: x.pw for k in KAFKA_SECRET_SETTINGS},
    )
    for s in (src, other):
        s.attach(x.client, "nasty")
    return [src, other]


def _splits(x: _World, kind: str) -> list[Any]:
    out = x.r.snapshot_splits(0, 2) if kind == "snapshot" else x.r.range_splits(0, 1, 2)
    x.r.release_splits()
    return list(out)


def _merger(x: _World) -> list[Any]:
    from persist_lib.shard.codec import Schemas
    from persist_lib.shard.kway_merge import Merger
    from persist_lib.shard.memory_plan import MemoryPlan, MergeStats

    plan = MemoryPlan(1 << 24, 1 << 20, 1 << 22, 1 << 20)
    return [Merger(x.client.blob, Schemas.create(KEY, VAL), str(x.shard), None, plan, MergeStats())]


def _merge_ctx(x: _World) -> list[Any]:
    from persist_lib.shard.codec import Schemas
    from persist_lib.shard.kway_merge import MergeCtx
    from persist_lib.shard.memory_plan import MergeStats

    return [
        MergeCtx(
            x.client.blob, Schemas.create(KEY, VAL), str(x.shard), None, 1 << 24, 1 << 20,
            1 << 20, MergeStats(), True,
        )
    ]


def _key_range_stream(x: _World) -> list[Any]:
    from persist_lib.shard.codec import Schemas
    from persist_lib.shard.memory_plan import MergeStats
    from persist_lib.shard.range_stream import _KeyRangeStream

    return [
        _KeyRangeStream(
            x.client.blob, Schemas.create(KEY, VAL), str(x.shard), [], None, None, None, MergeStats(),
            "canary", 1 << 10,
        )
    ]


def _spark_specs(x: _World, which: str) -> list[Any]:
    from persist_lib.ingest.landing_zone import LandingZoneSource
    from persist_lib.spark.compact import _MergeSpec
    from persist_lib.spark.ingest import _SourceSpec
    from persist_lib.spark.write import _WriteSpec

    if which == "write":
        return [_WriteSpec(x.blob_uri, (str(x.shard),), {}, "w", 0, 1, 1 << 20, 0, 1, 1 << 20)]
    if which == "merge":
        return [_MergeSpec(x.blob_uri, str(x.shard), {}, None, "w", 0, 1, None, 1 << 20, 0)]
    return [_SourceSpec(x.landing_uri, "jsonl", None, ","), _SourceSpec.of(LandingZoneSource(x.landing_uri))]


def _invalid_uris(x: _World) -> list[Any]:
    """The errors of URIs that are wrong (not their password): it must not show."""
    from persist_lib.location import open_blob, open_consensus

    enc = quote(x.pw, safe="")
    errors: list[Any] = []
    for opener, uri in (
        (open_consensus, x.consensus_uri.rpartition("/")[0]),  # no database name
        (open_consensus, x.consensus_uri.replace("postgresql://", "postgresq://")),  # scheme
        (open_consensus, f"{x.consensus_uri}?bogus_option=1"),  # libpq rejects it
        (open_blob, f"s3://bkt/p?secret_access_key={enc}"),  # no access_key_id
        (open_blob, f"{x.blob_uri}&bogus=1"),
        (open_blob, f"s3://AKID:{enc}@bkt/p"),
    ):
        with pytest.raises(InvalidUri) as ei:
            opener(uri)
        errors.append(ei.value)
    return errors


def _sql_session(x: _World) -> list[Any]:
    from persist_lib.sql.engine import SqlSession

    return [SqlSession(x.client, as_of=0)]


def _txns(x: _World) -> Any:
    """A ``Txns`` on the hostile world with its log opened and read (its handles live)."""
    from persist_lib.txn.txns import Txns

    t = x.keep(Txns(x.client))
    t.log.read()
    return t


def _one_shot(x: _World) -> list[Any]:
    """A one-shot snapshot reader (``PersistClient.snapshot`` builds one per call)."""
    from persist_lib.handles.one_shot import ONE_SHOT_READER, OneShotSnapshot
    from persist_lib.shard.codec import Schemas

    m = x.client.machine(x.shard)
    return [OneShotSnapshot(x.client, m, ONE_SHOT_READER, Schemas.create(KEY, VAL), "one-shot snapshot")]


def _compaction_writers(x: _World) -> list[Any]:
    """A compactor's shared writers, holding one registered writer of each kind."""
    from persist_lib.shard.compaction_writers import CompactionWriters

    writers = CompactionWriters(x.client)
    for layered in (False, True):
        writers.acquire(x.client.machine(x.shard), layered=layered)
    return [writers]


def _exhibits() -> dict[str, Callable[[_World], list[Any]]]:
    """How to build each credential-holding class on a hostile world."""
    from persist_lib.handles.maintenance import BackgroundCompactor
    from persist_lib.ingest.driver import Ingestion
    from persist_lib.ingest.landing_zone import LandingZoneSource
    from persist_lib.ingest.landing_zone.stores import LocalStore, S3Store
    from persist_lib.ingest.outputs import ShardOutput, ShardOutputs
    from persist_lib.ingest.pg_cdc import PgCdcSource
    from persist_lib.ingest.remap import RemapShard
    from persist_lib.location import (
        FileBlob,
        MemBlob,
        MemConsensus,
        SqliteConsensus,
        open_blob,
        open_consensus,
    )
    from persist_lib.location.postgres_consensus import PostgresConsensus
    from persist_lib.location.redaction import SensitiveUrl, _parse
    from persist_lib.shard.batch_builder import BatchBuilder
    from persist_lib.shard.codec import Schemas
    from persist_lib.shard.compaction_writers import SharedPartWriter
    from persist_lib.shard.part_writers import PartWriter
    from persist_lib.spark.ingest import SparkIngestion
    from persist_lib.storage.controller import StorageController
    from persist_lib.testing.audit import AuditBlob, AuditConsensus
    from persist_lib.testing.corruption import CorruptingBlob, CorruptingConsensus
    from persist_lib.testing.faults import ScriptedConsensus
    from persist_lib.testing.history_config import HistoryConfig
    from persist_lib.testing.hooks import InterruptingBlob, InterruptingConsensus, InterruptPlan
    from persist_lib.testing.planted import (
        HeadDeletingConsensus,
        NoPkSqliteConsensus,
        NotExistsPostgresConsensus,
    )
    from persist_lib.testing.txn_config import TxnHistoryConfig

    def same(b: bytes) -> bytes:
        return b

    return {
        # the redaction itself, and the error that shows a URI
        "persist_lib.location.redaction.SensitiveUrl": lambda x: [
            SensitiveUrl(x.consensus_uri),
            SensitiveUrl(x.blob_uri),
            SensitiveUrl(x.landing_uri),
        ],
        "persist_lib.location.redaction._Parsed": lambda x: [_parse(x.consensus_uri), _parse(x.blob_uri)],
        "persist_lib.errors.InvalidUri": _invalid_uris,
        # Dagster resources and configs
        "dagster_project.resources.PersistResource": _persist_resource,
        "dagster_project.resources.LandingZoneResource": _landing_resource,
        "dagster_project.sources.SourceSpec": _dagster_source_spec,
        # clients, handles, machines, splits
        "persist_lib.handles.client.PersistClient": lambda x: [x.client],
        "persist_lib.sql.engine.SqlSession": _sql_session,
        "persist_lib.handles.write.WriteHandle": lambda x: [x.w],
        "persist_lib.handles.read.ReadHandle": lambda x: [x.r],
        # (the layers ReadHandle is built from: the same object)
        "persist_lib.handles.leased_reader.LeasedReader": lambda x: [x.r],
        "persist_lib.handles.snapshot.SnapshotReader": lambda x: [x.r],
        "persist_lib.handles.one_shot.OneShotSnapshot": _one_shot,
        "persist_lib.shard.machine.Machine": lambda x: [x.client.machine(x.shard)],
        "persist_lib.handles.splits.SnapshotSplit": lambda x: _splits(x, "snapshot"),
        "persist_lib.handles.splits.RangeSplit": lambda x: _splits(x, "range"),
        "persist_lib.shard.batch_builder.BatchBuilder": lambda x: [
            BatchBuilder(x.client.blob, Schemas.create(KEY, VAL), shard=str(x.shard), writer="w", lower=0)
        ],
        "persist_lib.shard.kway_merge.Merger": _merger,
        "persist_lib.shard.kway_merge.MergeCtx": _merge_ctx,
        "persist_lib.shard.range_stream._KeyRangeStream": _key_range_stream,
        "persist_lib.handles.maintenance.BackgroundCompactor": lambda x: [x.keep(BackgroundCompactor(x.client))],
        "persist_lib.storage.controller.StorageController": lambda x: [x.keep(StorageController(x.client))],
        "persist_lib.txn.txns.Txns": lambda x: [_txns(x)],
        "persist_lib.txn.log.TxnLog": lambda x: [_txns(x).log],
        # blob and consensus backends and their wrappers
        "persist_lib.location.s3_blob.S3Blob": lambda x: [x.client.raw_blob, x.keep(open_blob(x.blob_uri))],
        "persist_lib.location.postgres_consensus.PostgresConsensus": lambda x: [
            x.client.raw_consensus,
            x.keep(PostgresConsensus(x.consensus_uri)),
        ],
        "persist_lib.location.retry.RetryingBlob": lambda x: [x.client.blob],
        "persist_lib.location.retry.RetryingConsensus": lambda x: [x.client.consensus],
        "persist_lib.location.unreliable.UnreliableBlob": lambda x: [
            x.keep(open_blob(f"unreliable+{x.blob_uri}&unreliable_seed=1"))
        ],
        "persist_lib.location.unreliable.UnreliableConsensus": lambda x: [
            x.keep(open_consensus(f"unreliable+{x.consensus_uri}?unreliable_seed=1"))
        ],
        "persist_lib.location.file_blob.FileBlob": lambda x: [FileBlob(x.tmp / "fileblob")],
        "persist_lib.location.mem.MemBlob": lambda x: [MemBlob(uuid.uuid4().hex)],
        "persist_lib.location.mem.MemConsensus": lambda x: [MemConsensus(uuid.uuid4().hex)],
        "persist_lib.location.sqlite_consensus.SqliteConsensus": lambda x: [
            x.keep(SqliteConsensus(x.tmp / "c.db"))
        ],
        "persist_lib.testing.audit.AuditBlob": lambda x: [
            AuditBlob(x.client.raw_blob, MemBlob(uuid.uuid4().hex), x.client.raw_consensus, None)
        ],
        "persist_lib.testing.audit.AuditConsensus": lambda x: [
            AuditConsensus(x.client.raw_consensus, str(x.tmp / "archive"))
        ],
        "persist_lib.testing.corruption.CorruptingBlob": lambda x: [CorruptingBlob(x.client.raw_blob, None, same)],
        "persist_lib.testing.corruption.CorruptingConsensus": lambda x: [
            CorruptingConsensus(x.client.raw_consensus, None, same)
        ],
        "persist_lib.testing.faults.ScriptedConsensus": lambda x: [ScriptedConsensus(x.client.raw_consensus)],
        "persist_lib.testing.hooks.InterruptingBlob": lambda x: [
            InterruptingBlob(x.client.raw_blob, InterruptPlan(1, 0.0))
        ],
        "persist_lib.testing.hooks.InterruptingConsensus": lambda x: [
            InterruptingConsensus(x.client.raw_consensus, InterruptPlan(1, 0.0))
        ],
        "persist_lib.shard.part_writers.PartWriter": lambda x: [
            PartWriter.register(x.client.machine(x.shard), purpose="canary", context=x.client)
        ],
        "persist_lib.shard.compaction_writers.SharedPartWriter": lambda x: [
            SharedPartWriter.register(x.client.machine(x.shard), purpose="canary", context=x.client)
        ],
        "persist_lib.shard.compaction_writers.CompactionWriters": _compaction_writers,
        "persist_lib.testing.planted.HeadDeletingConsensus": lambda x: [
            HeadDeletingConsensus(x.client.raw_consensus)
        ],
        "persist_lib.testing.planted.NoPkSqliteConsensus": lambda x: [
            x.keep(NoPkSqliteConsensus(str(x.tmp / "nopk.db")))
        ],
        "persist_lib.testing.planted.NotExistsPostgresConsensus": lambda x: [
            x.keep(NotExistsPostgresConsensus(x.consensus_uri))
        ],
        "persist_lib.testing.history_config.HistoryConfig": lambda x: [
            HistoryConfig(seed=1, root=str(x.tmp), consensus_uri=x.consensus_uri, shard_id=str(x.shard))
        ],
        "persist_lib.testing.txn_config.TxnHistoryConfig": lambda x: [
            TxnHistoryConfig(seed=1, root=str(x.tmp), consensus_uri=x.consensus_uri, shard_id=str(x.shard))
        ],
        # Spark specs (what executors get)
        "persist_lib.spark.write._WriteSpec": lambda x: _spark_specs(x, "write"),
        "persist_lib.spark.compact._MergeSpec": lambda x: _spark_specs(x, "merge"),
        "persist_lib.spark.ingest._SourceSpec": lambda x: _spark_specs(x, "source"),
        # ingestion: sources, stores, outputs, drivers
        "persist_lib.ingest.pg_cdc.PgCdcSource": _pg_cdc,
        "persist_lib.ingest.landing_zone.source.LandingZoneSource": lambda x: [LandingZoneSource(x.landing_uri)],
        "persist_lib.ingest.kafka.source.KafkaSource": _kafka_source,
        "persist_lib.ingest.kafka.topic.KafkaTopic": lambda x: _kafka_source(x, topic_only=True),
        "persist_lib.ingest.landing_zone.stores.S3Store": lambda x: [S3Store(x.landing_uri)],
        "persist_lib.ingest.landing_zone.stores._Store": lambda x: [S3Store(x.landing_uri)],
        "persist_lib.ingest.landing_zone.stores.LocalStore": lambda x: [LocalStore(str(x.tmp))],
        "persist_lib.ingest.outputs.ShardOutput": lambda x: [
            x.keep(ShardOutput(x.client, ShardId.new(), KEY, VAL, role="data", label="nasty"))
        ],
        "persist_lib.ingest.outputs.ShardOutputs": lambda x: [x.keep(ShardOutputs(x.client, "nasty"))],
        "persist_lib.ingest.remap.RemapShard": lambda x: [
            RemapShard(x.client, ShardId.new(), {"wal": (0,)}, label="nasty")
        ],
        "persist_lib.ingest.driver.Ingestion": lambda x: [
            Ingestion(x.client, "nasty", PgCdcSource(x.consensus_uri, "public.nasty_t"), KEY, VAL)
        ],
        "persist_lib.spark.ingest.SparkIngestion": lambda x: [
            SparkIngestion(None, x.client, "nasty", LandingZoneSource(x.landing_uri), KEY, VAL)
        ],
    }


def _shown(obj: Any) -> list[str]:
    """What an object can show: repr, str, format and its ``describe()`` (an exception:
    everything, with its chain and traceback)."""
    texts = [repr(obj), str(obj), format(obj, ""), repr([obj]), repr({"x": obj})]
    if isinstance(obj, BaseException):
        texts.append(_text(obj))
    describe = getattr(obj, "describe", None)
    if callable(describe):
        try:
            texts.append(repr(describe()))
        except TypeError:
            pass  # a describe(name) of another kind
    return texts


def test_every_credential_holder_is_exhibited() -> None:
    """The canary test below builds every class that may hold a credential: a new class
    with a URI/DSN/secret field (or one holding a location) fails here until it is added."""
    found = _sensitive_classes()
    exhibits = _exhibits()
    missing = {k: v[1] for k, v in found.items() if k not in exhibits}
    assert not missing, (
        "classes that may hold a URI/DSN/secret but that the canary test does not construct "
        f"(add them to _exhibits in tests/test_security.py): {missing}"
    )
    stale = sorted(set(exhibits) - set(found))
    assert not stale, f"_exhibits lists classes that no longer hold a credential: {stale}"
    assert len(found) >= 40  # the walk really found them


# Each password builds every credential holder against real servers (~5-8 s apiece): the
# default suite runs the canary, the one with every delimiter at once and the non-ASCII one;
# the slow tier runs them all.
_QUICK_PASSWORDS = {NASTY_PASSWORDS[0], NASTY_PASSWORDS[-1], "c\u00e4n\u00e4ry-pw-\u20ac"}


@pytest.mark.postgres
@pytest.mark.s3
@pytest.mark.parametrize(
    "pw",
    [pytest.param(pw, marks=() if pw in _QUICK_PASSWORDS else pytest.mark.slow) for pw in NASTY_PASSWORDS],
)
def test_every_credential_holder_redacts_hostile_passwords(
    pw: str, pg_url: str, s3_server: object, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    found = _sensitive_classes()
    x = _world(pw, pg_url, s3_server, tmp_path)
    texts: list[str] = []
    try:
        for name, build in _exhibits().items():
            objs = build(x)
            cls = found[name][0]
            assert objs and isinstance(objs[0], cls), (name, objs)  # (then related objects)
            for o in objs:
                for t in _shown(o):
                    assert_no_leak([t], pw, name)
                texts += _shown(o)
    finally:
        os.environ.pop("PERSIST_TEST_NASTY_DSN", None)
        x.close()
    texts.append(caplog.text)
    texts += [r.getMessage() + repr(r.args) for r in caplog.records]
    assert_no_leak(texts, pw, "logs")


@pytest.mark.postgres
@pytest.mark.s3
@pytest.mark.parametrize("pw", NASTY_PASSWORDS)
def test_hostile_passwords_never_leak_from_failures(
    pw: str, pg_url: str, s3_server: object, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Connection failures with a hostile password -- a closed port, a wrong password on
    a live server, a missing bucket -- for the client, the backends, the pg CDC source and
    the S3 landing zone; each URI written correctly (percent-encoded) and raw."""
    from persist_lib.ingest.errors import IngestError
    from persist_lib.ingest.landing_zone import LandingZoneSource
    from persist_lib.ingest.pg_cdc import PgCdcSource
    from persist_lib.location import open_blob

    caplog.set_level(logging.DEBUG)
    enc = quote(pw, safe="")
    port = _closed_port()
    endpoint = s3_server.endpoint  # type: ignore[attr-defined]
    blob_uri = "file://" + quote(str(tmp_path / "blob"))
    wrong = _role_url(pg_url, pw, suffix="-wrong")
    texts: list[str] = []

    def expect_failure(op: Callable[[], object], kinds: tuple[type[BaseException], ...]) -> str:
        with pytest.raises(kinds) as ei:
            op()
        texts.append(_text(ei.value))
        return str(ei.value)

    # the client on a consensus that is down / refuses the password
    auth_failures = 0
    for uri in (f"postgresql://u:{p}@127.0.0.1:{port}/db" for p in (enc, pw)):
        try:
            c = PersistClient.open(blob_uri, uri, PersistConfig.for_tests(retry_deadline_s=0.2))
        except PersistError as e:  # a raw password that can't be read unambiguously
            assert "percent-encode" in str(e)
            texts.append(_text(e))
            continue
        texts += [repr(c), str(c)]
        expect_failure(lambda c=c: c.open(ShardId.new(), KEY, VAL), (PersistError,))
        expect_failure(lambda c=c: c.list_shards(), (PersistError,))
        c.close()
    c = PersistClient.open(blob_uri, wrong, PersistConfig.for_tests(retry_deadline_s=0.2))
    texts += [repr(c), str(c)]
    msg = expect_failure(lambda: c.open(ShardId.new(), KEY, VAL), (PersistError,))
    auth_failures += "password authentication failed" in msg
    c.close()

    # the pg CDC source: down, wrong password, raw DSN
    for dsn in (f"postgresql://u:{enc}@127.0.0.1:{port}/db", wrong, f"postgresql://u:{pw}@127.0.0.1:{port}/db"):
        try:
            src = PgCdcSource(dsn, "public.t")
        except IngestError as e:
            texts.append(_text(e))
            continue
        texts += [repr(src), str(src), repr(src.describe())]
        msg = expect_failure(src.check, (IngestError,))
        auth_failures += "password authentication failed" in msg
        src.close()
    assert auth_failures == 2, "the wrong password must reach the server (client and CDC)"

    # S3: the blob on a closed port, the landing zone on a missing bucket; encoded and raw
    for p in (enc, pw):
        creds = f"region=us-east-1&access_key_id=AKID&secret_access_key={p}"
        try:
            b = open_blob(f"s3://bkt/p?endpoint_url=http://127.0.0.1:{port}&{creds}")
        except PersistError as e:
            texts.append(_text(e))
        else:
            texts += [repr(b), b.describe()]
            expect_failure(lambda b=b: b.get("k"), (PersistError,))
            expect_failure(lambda b=b: list(b.list_keys_and_metadata("")), (PersistError,))
            b.close()
        try:
            src = LandingZoneSource(f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/x?endpoint_url={endpoint}&{creds}")
        except IngestError as e:
            texts.append(_text(e))
        else:
            texts += [repr(src), repr(src.describe())]
            expect_failure(src.check, (IngestError,))
            expect_failure(src.list_files, (IngestError,))

    texts.append(caplog.text)
    texts += [r.getMessage() + repr(r.args) for r in caplog.records]
    assert_no_leak(texts, pw, "failure paths")


# ----- 2. hostile shard ids --------------------------------------------------------------------

HOSTILE_SHARDS = [
    "",
    "..",
    "../x",
    "/etc/passwd",
    "s../../x",
    f"{ShardId.new()}/../x",
    f"../{ShardId.new()}",
    f"{ShardId.new()}\x00",
    f"{ShardId.new()}\n",
    f" {ShardId.new()}",
    str(ShardId.new()).upper(),
    "s" + "\uff10" * 8 + str(uuid.uuid4())[8:],  # fullwidth digits
    "s" + "0" * 5000,
    "shard; DROP TABLE consensus; --",
    "s' OR '1'='1",
]


@pytest.mark.parametrize("bad", HOSTILE_SHARDS, ids=range(len(HOSTILE_SHARDS)))
def test_hostile_shard_ids_are_rejected(bad: str, tmp_path: Path) -> None:
    blob_root = tmp_path / "blob"
    c = PersistClient.open("file://" + quote(str(blob_root)), "sqlite:///" + quote(str(tmp_path / "c.db")),
                           PersistConfig.for_tests())
    for op in (
        lambda: c.open(bad, KEY, VAL),
        lambda: c.open_writer(bad, KEY, VAL),
        lambda: c.open_leased_reader(bad, KEY, VAL),
        lambda: c.open_critical_since(bad, KEY, VAL),
        lambda: c.inspect(bad),
        lambda: c.expire_leases(bad),
        lambda: c.compact(bad),
        lambda: c.gc(bad),
        lambda: c.finalize(bad),
        lambda: c.unreferenced_blobs(bad),
        lambda: c.machine(bad),
    ):
        with pytest.raises(InvalidUsage):
            op()
    assert list(c.consensus.list_keys()) == []
    assert not blob_root.exists() or not any(blob_root.rglob("*"))
    c.close()


def test_hostile_critical_reader_id_is_rejected(tmp_path: Path) -> None:
    c = PersistClient.open(f"mem://{uuid.uuid4().hex}", f"mem://{uuid.uuid4().hex}", PersistConfig.for_tests())
    for bad in ("../x", "c", "r" + str(uuid.uuid4()), "c" + str(uuid.uuid4()) + "/.."):
        with pytest.raises(InvalidUsage):
            c.open_critical_since(ShardId.new(), KEY, VAL, reader_id=bad)


# ----- 3. blob keys from state never escape -----------------------------------------------------


class _Jail:
    """A shard on file blob + SQLite, plus a secret file next to the blob root."""

    def __init__(self, tmp_path: Path) -> None:
        self.root = tmp_path / "blob"
        self.db = tmp_path / "c.db"
        self.outside = tmp_path / "secret"
        self.payload = b"not yours"
        self.outside.write_bytes(self.payload)
        self.blob_uri = "file://" + quote(str(self.root))
        self.cons_uri = "sqlite:///" + quote(str(self.db))
        self.shard = str(ShardId.new())
        c = self.client(inline_threshold=0, rollup_interval=1000)
        w, _ = c.open(self.shard, KEY, VAL)
        w.compare_and_append([((("a",), (1,)), 0, 1)], 0, 1)
        c.close()
        clear_state_cache()

    def client(self, **cfg: object) -> PersistClient:
        return PersistClient.open(self.blob_uri, self.cons_uri, PersistConfig.for_tests(retry_deadline_s=0.3, **cfg))

    def forge(self, mutate) -> None:  # type: ignore[no-untyped-def]
        """Appends a consensus entry whose state is ``mutate(current state)``."""
        cons = SqliteConsensus(self.db)
        entries = cons.scan(self.shard, 0, 10_000)
        cur = st.ShardState(self.shard)
        for e in entries:
            cur = st.apply_diff(cur, unframe(e.data, shard=self.shard, what="x"), e.seqno)
        new = replace(mutate(cur), seqno=cur.seqno + 1, walltime_ms=cur.walltime_ms + 1)
        res = cons.compare_and_set(self.shard, cur.seqno, VersionedData(new.seqno, frame(st.encode_diff(cur, new))))
        assert res is CaSResult.COMMITTED
        cons.close()
        clear_state_cache()

    def outside_intact(self) -> bool:
        return self.outside.exists() and self.outside.read_bytes() == self.payload


def _hostile_keys(j: _Jail) -> list[str]:
    return [
        "../secret",
        f"{j.shard}/../../secret",
        str(j.outside),
        "/" + str(j.outside).lstrip("/"),
        f"{j.shard}/w/../../../secret",
    ]


@pytest.mark.parametrize("i", range(5))
def test_part_key_from_state_never_escapes(tmp_path: Path, i: int) -> None:
    j = _Jail(tmp_path)
    key = _hostile_keys(j)[i]
    sha = hashlib.sha256(j.payload).hexdigest()

    def point_part_outside(s: st.ShardState) -> st.ShardState:
        batches = dict(s.batches)
        bid = max(batches)
        b = batches[bid]
        p = PartMeta(key=key, size=len(j.payload), count=1, sha256=sha, tmin=0, tmax=0)
        batches[bid] = replace(b, parts=(p,))
        return replace(s, batches=batches)

    j.forge(point_part_outside)
    c = j.client()
    r = c.open_leased_reader(j.shard, KEY, VAL)
    with pytest.raises(PersistError) as ei:
        r.snapshot(0)
    assert j.payload.decode() not in _text(ei.value)
    c.close()
    assert j.outside_intact()


@pytest.mark.parametrize("i", range(5))
def test_garbage_key_from_state_is_never_deleted_outside(tmp_path: Path, i: int) -> None:
    j = _Jail(tmp_path)
    key = _hostile_keys(j)[i]
    j.forge(lambda s: replace(s, garbage={**s.garbage, key: st.GarbageEntry(1, 9)}))
    c = j.client()
    c.machine(j.shard).write_rollup()  # GC needs a rollup at or after the garbage's seqno
    try:
        c.gc(j.shard)
    except PersistError:
        pass  # refusing is fine; deleting outside the root is not
    c.close()
    assert j.outside_intact()


@pytest.mark.parametrize("i", range(5))
def test_rollup_key_from_state_never_escapes(tmp_path: Path, i: int) -> None:
    j = _Jail(tmp_path)
    key = _hostile_keys(j)[i]
    j.forge(lambda s: replace(s, rollups={**s.rollups, s.seqno: st.RollupRef(key, 9)}))
    j.outside.write_bytes(j.payload)
    clear_state_cache()
    c = j.client()
    try:
        r = c.open_leased_reader(j.shard, KEY, VAL)  # a cold open loads the latest rollup
        r.snapshot(0)
        c.gc(j.shard)  # and GC may delete old rollups
    except PersistError as e:
        assert j.payload.decode() not in _text(e)
    c.close()
    assert j.outside_intact()
