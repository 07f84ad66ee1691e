"""Security properties of the location layer (research/reliability.md section 7).

1. Hostile blob keys never escape the file blob root: every one raises
   ``InvalidBlobKey`` (or is stored inside the root), checked on a fixed list and by a
   Hypothesis property; symlinks planted under the root are never followed.
2. Credentials never leak: a canary password in a Postgres URL and an S3 URI never
   shows in a ``repr``/``str``, an ``InvalidUri`` message, a connection-failure error
   (including its traceback), or any log line.
3. SQL is never built from strings: no ``execute(...)`` in ``persist_lib`` gets an
   f-string, ``%``/``+``-built or ``.format``-built query (AST check).
"""

from __future__ import annotations

import ast
import logging
import os
import socket
import tempfile
import traceback
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote, unquote

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import persist_lib
from persist_lib.errors import Determinate, InvalidBlobKey, InvalidUri, PersistError
from persist_lib.location import (
    FileBlob,
    RetryingConsensus,
    RetryPolicy,
    SensitiveUrl,
    VersionedData,
    open_blob,
    open_consensus,
    redact,
    validate_key,
)
from tests.support.secrets import NASTY_PASSWORDS, assert_no_leak

CANARY = "canary-S3cr3t-pw"

HOSTILE_KEYS = [
    "",
    ".",
    "..",
    "../x",
    "a/../../x",
    "a/..",
    "a/./b",
    "/etc/passwd",
    "//etc/passwd",
    "a//b",
    "a/",
    "a\x00b",
    "\x00",
    "..\\x",
    "a\\..\\..\\x",
    "C:\\Windows",
    "\u2215etc\u2215passwd",  # division slash
    "\uff0e\uff0e/x",  # fullwidth full stops
    "a/\u2024\u2024/x",  # one dot leaders
    "a\u2044b",  # fraction slash
    "caf\u00e9",
    "a/b\u200b",  # zero-width space
    "%2e%2e/x",
    "a%2fb",
    ".hidden",
    "a/.tmp-0123",
    "a/b\n",
    "a b",
    "~/x",
    "x" * 5000,
    "a/" + "b" * 300,
    "/".join(["a"] * 600),
]


@pytest.fixture
def jail(tmp_path: Path) -> Iterator[tuple[FileBlob, Path, Path]]:
    """A FileBlob root plus an 'outside' directory (with a secret) next to it."""
    root = tmp_path / "root"
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"top secret")
    yield FileBlob(root), root, outside


def _outside_state(outside: Path) -> dict[str, bytes]:
    return {str(p.relative_to(outside)): p.read_bytes() for p in outside.rglob("*") if p.is_file()}


@pytest.mark.parametrize("key", HOSTILE_KEYS, ids=lambda k: repr(k)[:40])
def test_hostile_keys_are_rejected(jail: tuple[FileBlob, Path, Path], key: str) -> None:
    blob, root, outside = jail
    before = _outside_state(outside)
    for op in (
        lambda: blob.set(key, b"pwned"),
        lambda: blob.get(key),
        lambda: blob.delete(key),
    ):
        with pytest.raises(InvalidBlobKey) as ei:
            op()
        msg = str(ei.value)
        assert repr(key)[:50] in msg or repr(key[:200])[:50] in msg  # names the key
        assert "keys must be" in msg  # and the rule
    assert _outside_state(outside) == before
    assert not any(p.is_file() for p in root.rglob("*"))


def test_symlinks_under_the_root_are_never_followed(jail: tuple[FileBlob, Path, Path]) -> None:
    blob, root, outside = jail
    blob.set("real/x", b"inside")
    os.symlink(outside, root / "evil")  # a directory symlink pointing outside
    os.symlink(outside / "secret", root / "link")  # a file symlink pointing outside
    os.symlink(root / "real", root / "alias")  # even a symlink pointing inside
    before = _outside_state(outside)
    for key in ("evil/secret", "evil/new", "link", "alias/x"):
        with pytest.raises(InvalidBlobKey, match="symlink"):
            blob.get(key)
        with pytest.raises(InvalidBlobKey, match="symlink"):
            blob.set(key, b"pwned")
        with pytest.raises(InvalidBlobKey, match="symlink"):
            blob.delete(key)
    assert _outside_state(outside) == before
    assert (root / "link").is_symlink() and (root / "evil").is_symlink()
    keys = [m.key for m in blob.list_keys_and_metadata("")]
    assert keys == ["real/x"]  # symlinks are not listed, let alone descended into
    assert list(blob.list_keys_and_metadata("evil/")) == []
    assert list(blob.list_keys_and_metadata("alias/")) == []
    assert blob.get("real/x") == b"inside"


def test_symlink_swapped_in_for_a_directory(jail: tuple[FileBlob, Path, Path]) -> None:
    blob, root, outside = jail
    blob.set("d/x", b"1")
    os.rename(root / "d", root / "d-moved")
    os.symlink(outside, root / "d")  # an attacker swaps the directory for a symlink
    with pytest.raises(InvalidBlobKey):
        blob.set("d/y", b"pwned")
    assert not (outside / "y").exists()


def test_temp_files_are_not_listed(jail: tuple[FileBlob, Path, Path]) -> None:
    blob, root, _ = jail
    blob.set("a/b", b"v")
    (root / "a" / ".tmp-deadbeef").write_bytes(b"partial")
    assert [m.key for m in blob.list_keys_and_metadata("")] == ["a/b"]
    assert blob.cleanup_temp_files(older_than_s=-1) == 1


_FRAGMENTS = st.sampled_from(
    [
        "..",
        ".",
        "/",
        "\\",
        "\x00",
        "a",
        "b0",
        "=",
        "-",
        "_",
        "\u2215",
        "\uff0e",
        "%2e",
        " ",
        "\n",
        "~",
        "C:",
        "\u00e9",
        "x" * 64,
    ]
)
_KEYS = st.one_of(
    st.text(max_size=80),
    st.lists(_FRAGMENTS, max_size=12).map("".join),
    st.lists(st.sampled_from(["a", "..", ".", "b.c", "", "_-="]), max_size=6).map("/".join),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(key=_KEYS)
def test_property_no_key_escapes_the_root(key: str) -> None:
    with tempfile.TemporaryDirectory() as d:
        root = Path(d) / "root"
        outside = Path(d) / "outside"
        outside.mkdir()
        blob = FileBlob(root)
        try:
            blob.set(key, b"v")
        except InvalidBlobKey:
            assert blob_key_is_invalid(key)
            return
        # accepted: it must be stored strictly inside the root, and readable back
        target = os.path.realpath(os.path.join(str(root), key))
        assert os.path.commonpath([str(root.resolve()), target]) == str(root.resolve())
        assert ".." not in key.split("/") and key.isascii() and not key.startswith("/")
        assert blob.get(key) == b"v"
        assert [m.key for m in blob.list_keys_and_metadata("")] == [key]
        assert blob.delete(key) == 1
        assert list(outside.iterdir()) == []


def blob_key_is_invalid(key: str) -> bool:
    try:
        validate_key(key)
    except InvalidBlobKey:
        return True
    return False


# -- credentials ----------------------------------------------------------------------


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _all_text(e: BaseException) -> str:
    return str(e) + repr(e) + "".join(traceback.format_exception(e))


def test_sensitive_url_and_redact() -> None:
    url = f"postgresql://persist:{CANARY}@db.example:5432/persist?sslmode=require"
    s = SensitiveUrl(url)
    assert CANARY not in str(s) and CANARY not in repr(s) and CANARY not in f"{s}"
    assert "persist:****@db.example:5432" in str(s)
    assert s.raw == url and SensitiveUrl(s) == s
    for text in (
        f"host=h user=u password={CANARY} dbname=d",
        f"host=h password='{CANARY} with space' dbname=d",
        f"s3://b/p?endpoint_url=http://h&secret_access_key={CANARY}&region=r",
        f"error talking to postgres://u:{CANARY}@h/db: refused",
        f"postgresql://u:{CANARY.replace('-', '%2D')}@h/db",
        f"https://u:{CANARY}@minio:9000",
        f"PASSWORD={CANARY}",
    ):
        out = redact(text)
        assert CANARY not in out and CANARY.replace("-", "%2D") not in out, out
        assert "****" in out
    assert redact("nothing secret here: s3://b/p?region=x") == (
        "nothing secret here: s3://b/p?region=x"
    )


def test_postgres_canary_never_leaks(caplog: pytest.LogCaptureFixture) -> None:
    from persist_lib.location.postgres_consensus import PostgresConsensus

    caplog.set_level(logging.DEBUG)
    url = f"postgresql://persist:{CANARY}@127.0.0.1:{_closed_port()}/db"
    c = open_consensus(url)
    assert isinstance(c, PostgresConsensus)
    texts = [repr(c), str(c), c.describe(), repr(c.url), str(c.url)]
    errors: list[BaseException] = []
    for op in (
        lambda: c.head("k"),
        lambda: c.compare_and_set("k", None, VersionedData(0, b"x")),
        lambda: c.truncate("k", 0),
        lambda: list(c.list_keys()),
    ):
        with pytest.raises(Determinate) as ei:
            op()
        errors.append(ei.value)
        assert ei.value.__cause__ is None and ei.value.__context__ is None
    c.wait_for_change("k", None, timeout_s=0.3)  # starts the listener thread: it logs
    retrying = RetryingConsensus(c, RetryPolicy(deadline_s=0.05))
    with pytest.raises(Determinate) as ei:
        retrying.head("k")
    errors.append(ei.value)
    c.close()
    texts += [_all_text(e) for e in errors]
    texts.append(caplog.text)
    texts += [repr(r.args) + r.getMessage() for r in caplog.records]
    for t in texts:
        assert CANARY not in t, t
    assert "127.0.0.1" in str(errors[0])  # still says where it tried


def test_postgres_canary_never_leaks_from_a_live_server(
    pg_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    from persist_lib.location.postgres_consensus import PostgresConsensus

    assert CANARY in pg_url  # the session server's role really uses the canary
    caplog.set_level(logging.DEBUG)
    c = PostgresConsensus(pg_url, table="canary_table")
    assert c.compare_and_set("k", None, VersionedData(0, b"x")).value == "committed"
    c.wait_for_change("k", 0, timeout_s=0.1)
    wrong = PostgresConsensus(pg_url.replace(CANARY, CANARY + "-wrong"))
    with pytest.raises(Determinate) as ei:
        wrong.head("k")
    assert "password authentication failed" in str(ei.value)
    bad_table = PostgresConsensus(pg_url, table="canary_table", schema="no_such_schema_x")
    bad_table._setup_done = True  # skip creation: the query fails on the server
    with pytest.raises(Determinate) as ei2:
        bad_table.head("k")
    for t in (_all_text(ei.value), _all_text(ei2.value), repr(c), caplog.text):
        assert CANARY not in t and (CANARY + "-wrong") not in t
    for x in (c, wrong, bad_table):
        x.close()


@pytest.mark.s3
def test_s3_canary_never_leaks(s3_endpoint: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    uris = [
        f"s3://no-such-bucket-canary/p?endpoint_url={s3_endpoint}&region=us-east-1"
        f"&access_key_id=AKIDCANARY&secret_access_key={CANARY}",
        f"s3://bkt/p?endpoint_url=http://127.0.0.1:{_closed_port()}&region=us-east-1"
        f"&access_key_id=AKIDCANARY&secret_access_key={CANARY}",
    ]
    texts: list[str] = []
    for uri in uris:
        b = open_blob(uri)
        texts += [repr(b), str(b), b.describe()]
        for op in ("set", "get", "delete", "list"):
            with pytest.raises(PersistError) as ei:
                if op == "set":
                    b.set("k", b"v")
                elif op == "get":
                    b.get("k")
                elif op == "delete":
                    b.delete("k")
                else:
                    list(b.list_keys_and_metadata(""))
            texts.append(_all_text(ei.value))
        b.close()
        wrapped = open_blob("unreliable+" + uri + "&unreliable_seed=3")
        texts += [repr(wrapped), wrapped.describe()]
    texts.append(caplog.text)
    for t in texts:
        assert CANARY not in t, t


@pytest.mark.parametrize(
    "uri",
    [
        f"bogus://user:{CANARY}@host/x",
        f"postgresql://user:{CANARY}@/",
        f"postgresql://user:{CANARY}@host:5432",
        f"s3://bucket/p?secret_access_key={CANARY}&bogus=1",
        f"s3://bucket/p?secret_access_key={CANARY}",  # without access_key_id
        f"s3://AKID:{CANARY}@bucket/p",
        f"s3://bucket/p?secret_access_key={CANARY}#frag",
        f"sqlite://host/x?password={CANARY}",
        f"unreliable+s3://bucket/p?secret_access_key={CANARY}&unreliable_nope=1",
    ],
)
def test_invalid_uri_messages_are_redacted(uri: str) -> None:
    opener = open_consensus if uri.startswith(("postgres", "sqlite")) else open_blob
    with pytest.raises(InvalidUri) as ei:
        opener(uri)
    assert CANARY not in _all_text(ei.value)
    assert "Accepted forms" in str(ei.value)


# -- hostile passwords ------------------------------------------------------------------


def _libpq_quoted(pw: str) -> str:
    return "'" + pw.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _uri_templates(pw: str, encoded: bool) -> list[tuple[str, str, str]]:
    """(kind, URI, a part the redacted form must still show) with ``pw`` in it, written
    correctly (percent-encoded) or raw (as a careless user would)."""
    p = quote(pw, safe="") if encoded else pw
    endpoint = f"http://u:{p}@minio:9000"
    if encoded:
        endpoint = quote(endpoint, safe="")
    out = [
        ("consensus", f"postgresql://persist:{p}@db.example:5432/persist?sslmode=require", "db.example"),
        ("consensus", f"postgres://persist:{p}@db.example/persist", "db.example"),
        ("consensus", f"unreliable+postgresql://persist:{p}@db.example:5432/db?unreliable_seed=3", "db.example"),
        ("consensus", f"postgresql://persist@db.example:5432/persist?password={p}", "db.example"),
        ("blob", f"s3://bkt/p?endpoint_url=http://minio:9000&region=r&access_key_id=AK&secret_access_key={p}", "bkt"),
        ("blob", f"s3://bkt/p?region=r&access_key_id=AK&secret_access_key=x&session_token={p}", "bkt"),
        ("blob", f"unreliable+s3://bkt/p?access_key_id=AK&secret_access_key={p}&unreliable_seed=1", "bkt"),
        ("blob", f"s3://bkt/p?endpoint_url={endpoint}&region=r", "bkt"),
        ("other", f"https://u:{p}@minio:9000/x", "minio"),
    ]
    if encoded:
        out.append(("other", f"host=db.example user=persist password={_libpq_quoted(pw)} dbname=d", "db.example"))
    return out


@pytest.mark.parametrize("encoded", [True, False], ids=["encoded", "raw"])
@pytest.mark.parametrize("pw", NASTY_PASSWORDS)
def test_nasty_passwords_never_show(pw: str, encoded: bool) -> None:
    """Every URI form, with the password percent-encoded (as it must be) or raw: its
    SensitiveUrl, the opener's error or backend repr, and scrubbed messages never show
    the password in any spelling. Encoded URIs are accepted and keep their host."""
    for kind, uri, keep in _uri_templates(pw, encoded):
        s = SensitiveUrl(uri)
        texts = [str(s), repr(s), f"{s}", f"{s:>10}", s.redacted, repr([s]), repr({"u": s})]
        texts.append(s.scrub(f"error talking to {uri}: refused ({pw}, {quote(pw, safe='')})"))
        if encoded:
            assert s.problem is None, (uri, s.problem)
            assert keep in s.redacted, s.redacted
            texts.append(redact(f"error talking to {uri}: refused"))
        if kind != "other":
            opener = open_consensus if kind == "consensus" else open_blob
            try:
                backend = opener(uri)
            except InvalidUri as e:
                assert not encoded, f"{uri}: a percent-encoded password must be accepted: {e}"
                texts.append(_all_text(e))
            else:
                assert s.problem is None, f"{uri}: an ambiguous URI was opened"
                texts += [repr(backend), str(backend), backend.describe()]
                backend.close()
        assert_no_leak(texts, pw, uri)


@pytest.mark.parametrize("pw", NASTY_PASSWORDS)
def test_nasty_passwords_are_refused_or_parsed_exactly(pw: str) -> None:
    """A raw password is either refused (ambiguous) or read exactly as the user wrote it
    by libpq: never silently cut at a special character."""
    from psycopg.conninfo import conninfo_to_dict

    from persist_lib.location.postgres_consensus import PostgresConsensus

    uri = f"postgresql://persist:{pw}@127.0.0.1:5432/db"
    try:
        c = open_consensus(uri)
    except InvalidUri as e:
        assert "percent-encode" in str(e)
        with pytest.raises(InvalidUri):
            PostgresConsensus(uri)  # constructed directly: refused as well
        return
    assert isinstance(c, PostgresConsensus)
    assert conninfo_to_dict(uri)["password"] == unquote(pw)
    c.close()


# -- SQL is never built from strings --------------------------------------------------

_EXEC_NAMES = {"execute", "executemany", "executescript", "SQL", "Composed"}


def _is_dynamic_str(node: ast.AST) -> bool:
    """An f-string, a %-formatted or concatenated string, or a str.format call."""
    if isinstance(node, ast.JoinedStr):
        return True
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod | ast.Add):
        return any(
            isinstance(x, ast.Constant | ast.JoinedStr)
            and not isinstance(getattr(x, "value", ""), int)
            or _is_dynamic_str(x)
            for x in (node.left, node.right)
        )
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "format"
        and isinstance(node.func.value, ast.Constant | ast.JoinedStr)
    ):
        return True
    return False


def find_string_built_sql(source: str, filename: str = "<src>") -> list[str]:
    """``file:line`` of every execute()/SQL() call given a string-built query."""
    tree = ast.parse(source, filename)
    problems: list[str] = []
    scopes = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    scopes.append(tree)  # type: ignore[arg-type]
    for scope in scopes:
        dynamic_names: set[str] = set()
        for n in ast.walk(scope):
            if isinstance(n, ast.Assign) and _is_dynamic_str(n.value):
                dynamic_names |= {t.id for t in n.targets if isinstance(t, ast.Name)}
        for n in ast.walk(scope):
            if not isinstance(n, ast.Call) or not n.args:
                continue
            f = n.func
            name = (
                f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            )
            if name not in _EXEC_NAMES:
                continue
            arg = n.args[0]
            if _is_dynamic_str(arg) or (isinstance(arg, ast.Name) and arg.id in dynamic_names):
                problems.append(f"{filename}:{n.lineno}")
    return sorted(set(problems))


def test_sql_checker_catches_string_built_sql() -> None:
    bad = (
        "def f(cur, key, t):\n"
        "    cur.execute(f'SELECT * FROM t WHERE k = {key}')\n"
        "    cur.execute('SELECT * FROM %s' % t)\n"
        "    cur.execute('SELECT * FROM ' + t)\n"
        "    cur.execute('SELECT * FROM {}'.format(t))\n"
        "    q = f'DELETE FROM {t}'\n"
        "    cur.execute(q)\n"
        "    sql.SQL(f'SELECT {t}')\n"
    )
    assert len(find_string_built_sql(bad)) == 6
    good = (
        "def f(cur, key):\n"
        "    cur.execute('SELECT * FROM t WHERE k = %s', (key,))\n"
        "    cur.execute(sql.SQL('SELECT * FROM {}').format(sql.Identifier('t')), (key,))\n"
        "    cur.execute(QUERY, {'k': key})\n"
    )
    assert find_string_built_sql(good) == []


def test_no_string_built_sql_in_persist_lib() -> None:
    pkg = Path(persist_lib.__file__).parent
    files = sorted(pkg.rglob("*.py"))
    assert any(f.name == "postgres_consensus.py" for f in files)
    problems: list[str] = []
    for f in files:
        problems += find_string_built_sql(f.read_text(), str(f.relative_to(pkg.parent)))
    assert problems == [], f"SQL built from strings (use parameters / psycopg.sql): {problems}"
