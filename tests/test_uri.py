"""Blob and Consensus URIs: every accepted form opens the right backend; malformed ones
raise ``InvalidUri`` saying what was wrong and listing the accepted forms."""

from __future__ import annotations

import os
from pathlib import Path

import psycopg
import pytest

from persist_lib.errors import InvalidUri
from persist_lib.location import (
    FileBlob,
    MemBlob,
    MemConsensus,
    SqliteConsensus,
    UnreliableBlob,
    UnreliableConsensus,
    default_uris,
    open_blob,
    open_consensus,
)
from persist_lib.location.postgres_consensus import PostgresConsensus
from persist_lib.location.s3_blob import S3Blob


def test_mem_uris() -> None:
    b = open_blob("mem://uri-test")
    assert isinstance(b, MemBlob) and b.name == "uri-test"
    c = open_consensus("mem://uri-test")
    assert isinstance(c, MemConsensus) and c.name == "uri-test"
    assert b.describe() == "mem://uri-test"


def test_file_uris(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    abs_blob = open_blob(f"file://{tmp_path}/abs dir".replace(" ", "%20"))
    assert isinstance(abs_blob, FileBlob)
    assert abs_blob.root == str(tmp_path.resolve() / "abs dir")
    monkeypatch.chdir(tmp_path)
    rel = open_blob("file://rel/dir")  # relative: the host part is the first segment
    assert isinstance(rel, FileBlob) and rel.root == str(tmp_path.resolve() / "rel" / "dir")
    rel1 = open_blob("file://single")
    assert isinstance(rel1, FileBlob) and rel1.root == str(tmp_path.resolve() / "single")


def test_sqlite_uris(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    c = open_consensus(f"sqlite:///{tmp_path}/a/c.db")  # 4 slashes: absolute
    assert isinstance(c, SqliteConsensus) and c.path == str(tmp_path / "a" / "c.db")
    assert (tmp_path / "a" / "c.db").exists()
    c.close()
    monkeypatch.chdir(tmp_path)
    rel = open_consensus("sqlite:///rel/c.db?synchronous=normal&busy_timeout_ms=250")
    assert isinstance(rel, SqliteConsensus)
    assert rel.path == os.path.join(str(tmp_path), "rel", "c.db")
    assert rel.synchronous == "NORMAL" and rel.busy_timeout_ms == 250
    rel.close()


def test_s3_uris(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "from-env")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "from-env-secret")
    b = open_blob("s3://my-bucket/some/prefix?endpoint_url=http://127.0.0.1:9000&region=eu-west-1")
    assert isinstance(b, S3Blob)
    assert (b.bucket, b.prefix, b.endpoint_url, b.region) == (
        "my-bucket",
        "some/prefix/",
        "http://127.0.0.1:9000",
        "eu-west-1",
    )
    no_prefix = open_blob("s3://my-bucket")
    assert (
        isinstance(no_prefix, S3Blob) and no_prefix.prefix == "" and no_prefix.endpoint_url is None
    )
    creds = open_blob("s3://b.dotted/p/?access_key_id=AK&secret_access_key=SK&region=us-east-1")
    assert isinstance(creds, S3Blob) and creds.prefix == "p/"
    assert "SK" not in repr(creds)


def test_postgres_uris() -> None:
    # (uri, what repr/describe show, where libpq connects)
    cases = [
        (
            "postgresql://user:pw@localhost:5432/db",
            'postgresql://user:****@localhost:5432/db (table "consensus")',
            {"user": "user", "password": "pw", "host": "localhost", "port": "5432", "dbname": "db"},
        ),
        (
            "postgres://user:pw@localhost/db?sslmode=disable&connect_timeout=3",
            'postgres://user:****@localhost/db?sslmode=disable&connect_timeout=3 (table "consensus")',
            {"user": "user", "password": "pw", "host": "localhost", "dbname": "db",
             "sslmode": "disable", "connect_timeout": "3"},
        ),
        (
            "postgresql://localhost/db",
            'postgresql://localhost/db (table "consensus")',
            {"host": "localhost", "dbname": "db"},
        ),
        (
            "postgresql:///db?host=/var/run/postgresql",
            'postgresql:///db?host=/var/run/postgresql (table "consensus")',
            {"host": "/var/run/postgresql", "dbname": "db"},
        ),
    ]
    for uri, shown, conninfo in cases:
        c = open_consensus(uri)  # lazy: nothing connects until the first call
        assert isinstance(c, PostgresConsensus)
        assert c.url.raw == uri
        assert psycopg.conninfo.conninfo_to_dict(c.url.raw) == conninfo
        assert (c.describe(), repr(c)) == (shown, f"PostgresConsensus({shown!r})")
        assert ":pw@" not in str(c.url) and ":pw@" not in f"{c.url}"
        c.close()
    for bad, why in (
        ("postgresql://user:pw@/db", "missing host"),
        ("postgresql://localhost/", "missing database name"),
        ("postgresql://localhost:54x2/db", "port '54x2' is not a number"),
    ):
        with pytest.raises(InvalidUri, match=why) as e:
            open_consensus(bad)
        assert "pw" not in str(e.value)


def test_unreliable_uris() -> None:
    b = open_blob("unreliable+mem://u?unreliable_seed=7&unreliable_rate=0.2")
    assert isinstance(b, UnreliableBlob) and isinstance(b.inner, MemBlob)
    assert b.handle.seed == 7
    assert b.handle.rates.determinate == pytest.approx(0.16)
    c = open_consensus("unreliable+mem://u")
    assert isinstance(c, UnreliableConsensus)
    assert c.handle.rates.total() == pytest.approx(0.0975)
    s3 = open_blob("unreliable+s3://bkt/p?region=us-east-1&unreliable_stall=0.5")
    assert isinstance(s3, UnreliableBlob) and isinstance(s3.inner, S3Blob)
    assert s3.inner.region == "us-east-1" and s3.handle.rates.stall == pytest.approx(0.5)


def test_default_uris(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PERSIST_BLOB_URI", raising=False)
    monkeypatch.delenv("PERSIST_CONSENSUS_URI", raising=False)
    home = tmp_path / "home with space"
    blob, consensus = default_uris(str(home))
    b = open_blob(blob)
    c = open_consensus(consensus)
    assert isinstance(b, FileBlob) and b.root == str(home.resolve() / "blob")
    assert isinstance(c, SqliteConsensus) and c.path == str(home / "consensus.db")
    c.close()
    monkeypatch.setenv("PERSIST_BLOB_URI", "mem://x")
    assert default_uris(str(home))[0] == "mem://x"


BAD_BLOB = [
    ("", "empty URI"),
    ("   ", "empty URI"),
    ("just-a-path", "missing scheme"),
    ("/abs/path", "missing scheme"),
    ("ftp://host/x", "unknown scheme 'ftp'"),
    ("sqlite:///x.db", "unknown scheme 'sqlite'"),  # a consensus URI used as a blob
    ("file://", "missing directory path"),
    ("file:///", "missing directory path"),
    ("file:///tmp/x?fsync=0", "unknown parameter 'fsync'"),
    ("s3://", "missing bucket"),
    ("s3:///prefix", "missing bucket"),
    ("s3://UPPER/p", "invalid bucket name"),
    ("s3://b/p", "invalid bucket name"),
    ("s3://bkt/p?endpoint=http://x", "unknown parameter 'endpoint'"),
    ("s3://bkt/p?region=a&region=b", "given twice"),
    ("s3://bkt/p?access_key_id=AK", "must be given together"),
    ("s3://AK:SK@bucket/p", "credentials in the host part"),
    ("s3://bkt/p#frag", "fragments"),
    ("s3://bkt/p?region", "malformed query"),
    ("mem://", "missing name"),
    ("mem://x?y=1", "unknown parameter 'y'"),
    ("unreliable+", "missing inner URI"),
    ("unreliable+mem://x?unreliable_bogus=1", "unknown parameter"),
    ("unreliable+mem://x?unreliable_rate=abc", "bad unreliable_ parameter"),
    ("unreliable+mem://x?unreliable_rate=2", "bad unreliable_ parameter"),
    ("file:///tmp/a\x00b", "control characters"),
    ("http://[::1/x", "not a URI"),
]

BAD_CONSENSUS = [
    ("", "empty URI"),
    ("consensus.db", "missing scheme"),
    ("mysql://u@h/db", "unknown scheme 'mysql'"),
    ("file:///tmp/x", "unknown scheme 'file'"),  # a blob URI used as consensus
    ("sqlite://", "missing database file path"),
    ("sqlite:///", "missing database file path"),
    ("sqlite:///dir/", "missing database file path"),
    ("sqlite://host/x.db", "unexpected host 'host'"),
    ("sqlite:///x.db?synchronous=OFF", "synchronous must be"),
    ("sqlite:///x.db?busy_timeout_ms=soon", "busy_timeout_ms must be an integer"),
    ("sqlite:///x.db?busy_timeout_ms=-1", "busy_timeout_ms must be >= 0"),
    ("sqlite:///x.db?journal_mode=DELETE", "unknown parameter 'journal_mode'"),
    ("postgresql://", "missing host"),
    ("postgresql://user:pw@/db", "missing host"),
    ("postgres://user:pw@host", "missing database name"),
    ("postgresql://user:pw@host/", "missing database name"),
    ("postgresql://u:pw@host/db?bogus_option=1", "libpq rejects it"),
    ("postgresql://u:pw@host:notaport/db", "port 'notaport' is not a number"),
    ("mem://", "missing name"),
]


@pytest.mark.parametrize(("uri", "problem"), BAD_BLOB, ids=[repr(u) for u, _ in BAD_BLOB])
def test_malformed_blob_uris(uri: str, problem: str) -> None:
    with pytest.raises(InvalidUri) as ei:
        open_blob(uri)
    msg = str(ei.value)
    assert problem in msg
    assert "invalid blob URI" in msg
    assert "Accepted forms: file:///abs/dir" in msg and "s3://bucket" in msg


@pytest.mark.parametrize(("uri", "problem"), BAD_CONSENSUS, ids=[repr(u) for u, _ in BAD_CONSENSUS])
def test_malformed_consensus_uris(uri: str, problem: str) -> None:
    with pytest.raises(InvalidUri) as ei:
        open_consensus(uri)
    msg = str(ei.value)
    assert problem in msg
    assert "invalid consensus URI" in msg
    assert "sqlite:////abs/path.db" in msg and "postgresql://" in msg


def test_invalid_uri_is_a_usage_error() -> None:
    with pytest.raises(ValueError):  # InvalidUri -> InvalidUsage -> ValueError
        open_blob("nope")
