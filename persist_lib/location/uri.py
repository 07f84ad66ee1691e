"""Blob and Consensus URIs: parsing, opening, and keeping passwords out of sight.

One string selects a backend (``PERSIST_BLOB_URI`` / ``PERSIST_CONSENSUS_URI``), so the
parsing rules live here and are strict: an unknown scheme, a missing bucket or path, or
an unknown query parameter is an ``InvalidUri`` that says what was wrong, shows the
(redacted) URI and lists the accepted forms, instead of silently opening the wrong
store.

Accepted blob URIs::

    file:///abs/dir              absolute directory
    file://rel/dir               relative to the working directory (host part + path)
    s3://bucket[/prefix][?endpoint_url=..&region=..&access_key_id=..&secret_access_key=..
                          &session_token=..]
                                 credentials default to boto3's chain (AWS_* env vars...)
    mem://name                   in-process (tests)
    unreliable+<blob-uri>        fault injection; its own parameters are the inner URI's
                                 query parameters prefixed ``unreliable_``: seed, rate
                                 (total unreliability split like Materialize), stall, stall_s

Accepted consensus URIs::

    sqlite:////abs/path/db       absolute path (4 slashes, as in SQLAlchemy)
    sqlite:///rel/path/db        relative to the working directory (3 slashes)
                                 [?synchronous=FULL|NORMAL|EXTRA&busy_timeout_ms=N]
    postgresql://user:pass@host:port/db[?libpq options]   (also postgres://)
                                 libpq options are passed through to psycopg, except
                                 persist_op_timeout_s=N: the bound on every wait for
                                 the server (default 15; PostgresConsensus docstring)
    mem://name                   in-process (tests)
    unreliable+<consensus-uri>   as for blobs

Passwords: ``SensitiveUrl`` holds a URI and redacts it in ``repr``/``str`` by parsing it
(``persist_lib.location.redaction``); a URI whose password is ambiguous (an unencoded
``@``, ``/``, ``?``, ``#``, ``&`` in a secret...) is refused with a hint to
percent-encode, before any driver sees it. ``redact`` removes passwords from text that
comes without its URI, e.g. a driver's error message.
"""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING
from urllib.parse import quote, unquote, urlsplit

from persist_lib.errors import InvalidUri
from persist_lib.location.base import Blob, Consensus
from persist_lib.location.redaction import REDACTED, SensitiveUrl, redact

__all__ = [
    "BLOB_URI_FORMS",
    "CONSENSUS_URI_FORMS",
    "REDACTED",
    "SensitiveUrl",
    "default_uris",
    "open_blob",
    "open_consensus",
    "redact",
]

if TYPE_CHECKING:  # pragma: no cover
    from persist_lib.location.unreliable import UnreliableHandle


BLOB_URI_FORMS = (
    "file:///abs/dir",
    "file://rel/dir",
    "s3://bucket[/prefix][?endpoint_url=URL&region=R&access_key_id=ID&secret_access_key=KEY]",
    "mem://name",
    "unreliable+<blob-uri>[?unreliable_seed=N&unreliable_rate=P]",
)
CONSENSUS_URI_FORMS = (
    "sqlite:////abs/path.db",
    "sqlite:///rel/path.db",
    "postgresql://user:password@host:port/dbname[?libpq-options]",
    "postgres://user:password@host:port/dbname[?libpq-options]",
    "mem://name",
    "unreliable+<consensus-uri>[?unreliable_seed=N&unreliable_rate=P]",
)

def _invalid(kind: str, uri: str, problem: str, forms: tuple[str, ...]) -> InvalidUri:
    listed = "; ".join(forms)
    url = SensitiveUrl(uri)
    return InvalidUri(
        f"invalid {kind} URI {url.redacted!r}: {url.scrub(problem)}. Accepted forms: {listed}"
    )


def _check_unambiguous(kind: str, uri: str, forms: tuple[str, ...]) -> None:
    """Refuses a URI whose secrets can't be located unambiguously (before any driver,
    whose error message could quote a piece of the password, sees it)."""
    problem = SensitiveUrl(uri).problem if isinstance(uri, str) else None
    if problem:
        raise _invalid(kind, uri, problem, forms)


def _params(
    kind: str, uri: str, query: str, allowed: tuple[str, ...], forms: tuple[str, ...]
) -> dict[str, str]:
    pairs: list[tuple[str, str]] = []
    for piece in query.split("&") if query else []:
        name, eq, value = piece.partition("=")
        if not eq or not name:
            raise _invalid(
                kind, uri, "malformed query string (expected NAME=VALUE&NAME=VALUE...)", forms
            )
        # Percent-decoding only: a '+' stays a '+' (AWS secret keys contain them).
        pairs.append((unquote(name), unquote(value)))
    out: dict[str, str] = {}
    for k, v in pairs:
        if k not in allowed:
            raise _invalid(
                kind,
                uri,
                f"unknown parameter {k!r} (allowed: {', '.join(allowed) or 'none'})",
                forms,
            )
        if k in out:
            raise _invalid(kind, uri, f"parameter {k!r} given twice", forms)
        out[k] = v
    return out


def _split(kind: str, uri: str, forms: tuple[str, ...]) -> tuple[str, str, str, str]:
    if not isinstance(uri, str) or not uri.strip():
        raise _invalid(kind, str(uri), "empty URI", forms)
    if any(c in uri for c in "\x00\r\n\t"):
        raise _invalid(kind, uri, "control characters are not allowed", forms)
    try:
        parts = urlsplit(uri)
    except ValueError as e:
        raise _invalid(kind, uri, f"not a URI ({redact(str(e))})", forms) from None
    if "://" not in uri or not parts.scheme:
        raise _invalid(kind, uri, "missing scheme (expected SCHEME://...)", forms)
    if parts.fragment:
        raise _invalid(kind, uri, "fragments ('#...') are not allowed", forms)
    return parts.scheme.lower(), parts.netloc, parts.path, parts.query


def _split_unreliable(
    kind: str, uri: str, forms: tuple[str, ...]
) -> tuple[str, UnreliableHandle] | None:
    """For ``unreliable+INNER``: (INNER without ``unreliable_*`` params, the handle)."""
    if not uri.lower().startswith("unreliable+"):
        return None
    from persist_lib.location.unreliable import FaultRates, UnreliableHandle

    inner = uri[len("unreliable+") :]
    base, sep, query = inner.partition("?")
    keep: list[str] = []
    opts: dict[str, str] = {}
    if sep:
        for piece in query.split("&"):
            name = piece.partition("=")[0]
            if name.startswith("unreliable_"):
                opts[name[len("unreliable_") :]] = unquote(piece.partition("=")[2])
            elif piece:
                keep.append(piece)
    allowed = {"seed", "rate", "stall", "stall_s"}
    unknown = set(opts) - allowed
    if unknown:
        raise _invalid(
            kind,
            uri,
            f"unknown parameter(s) {sorted('unreliable_' + u for u in unknown)} "
            f"(allowed: {', '.join(sorted('unreliable_' + a for a in allowed))})",
            forms,
        )
    try:
        seed = int(opts.get("seed", "0"))
        rate = float(opts.get("rate", "0.05"))
        stall = float(opts.get("stall", "0"))
        stall_s = float(opts.get("stall_s", "0.01"))
        base_rates = FaultRates.from_unreliability(rate)
        rates = FaultRates(
            determinate=base_rates.determinate * (1 - stall),
            applied_then_timeout=base_rates.applied_then_timeout * (1 - stall),
            timeout_only=base_rates.timeout_only * (1 - stall),
            stall=stall,
        )
    except ValueError as e:
        raise _invalid(kind, uri, f"bad unreliable_ parameter: {e}", forms) from None
    if not base:
        raise _invalid(kind, uri, "missing inner URI after 'unreliable+'", forms)
    inner_uri = base + ("?" + "&".join(keep) if keep else "")
    return inner_uri, UnreliableHandle(seed, rates, stall_s=stall_s)


def _file_path(kind: str, uri: str, netloc: str, path: str, forms: tuple[str, ...]) -> str:
    if netloc:
        # file://rel/dir: the "host" is the first relative path segment.
        p = unquote(netloc + path)
    else:
        p = unquote(path)
    if not p or p == "/":
        raise _invalid(kind, uri, "missing directory path", forms)
    if "\x00" in p:
        raise _invalid(kind, uri, "NUL in path", forms)
    return p


def open_blob(uri: str) -> Blob:
    """Opens the Blob a URI names (see the module docstring for the forms)."""
    forms = BLOB_URI_FORMS
    _check_unambiguous("blob", uri, forms)
    unreliable = _split_unreliable("blob", uri, forms)
    if unreliable is not None:
        from persist_lib.location.unreliable import UnreliableBlob

        return UnreliableBlob(open_blob(unreliable[0]), unreliable[1])
    scheme, netloc, path, query = _split("blob", uri, forms)
    if scheme == "mem":
        _params("blob", uri, query, (), forms)
        name = unquote(netloc + path)
        if not name:
            raise _invalid("blob", uri, "missing name (mem://NAME)", forms)
        from persist_lib.location.mem import MemBlob

        return MemBlob(name)
    if scheme == "file":
        _params("blob", uri, query, (), forms)
        from persist_lib.location.file_blob import FileBlob

        return FileBlob(_file_path("blob", uri, netloc, path, forms))
    if scheme == "s3":
        params = _params(
            "blob",
            uri,
            query,
            ("endpoint_url", "region", "access_key_id", "secret_access_key", "session_token"),
            forms,
        )
        if "@" in netloc:
            raise _invalid(
                "blob",
                uri,
                "credentials in the host part are not supported; use the access_key_id and "
                "secret_access_key parameters or the AWS_* environment variables",
                forms,
            )
        bucket = netloc
        if not bucket:
            raise _invalid("blob", uri, "missing bucket (s3://BUCKET/prefix)", forms)
        if not re.fullmatch(r"[a-z0-9][a-z0-9.\-_]{1,254}", bucket):
            raise _invalid("blob", uri, f"invalid bucket name {bucket!r}", forms)
        if ("access_key_id" in params) != ("secret_access_key" in params):
            raise _invalid(
                "blob",
                uri,
                "access_key_id and secret_access_key must be given together",
                forms,
            )
        from persist_lib.location.s3_blob import S3Blob

        return S3Blob(
            bucket,
            unquote(path).lstrip("/"),
            endpoint_url=params.get("endpoint_url") or None,
            region=params.get("region") or None,
            access_key=params.get("access_key_id") or None,
            secret_key=params.get("secret_access_key") or None,
            session_token=params.get("session_token") or None,
        )
    raise _invalid("blob", uri, f"unknown scheme {scheme!r}", forms)


def open_consensus(uri: str) -> Consensus:
    """Opens the Consensus a URI names (see the module docstring for the forms)."""
    forms = CONSENSUS_URI_FORMS
    _check_unambiguous("consensus", uri, forms)
    unreliable = _split_unreliable("consensus", uri, forms)
    if unreliable is not None:
        from persist_lib.location.unreliable import UnreliableConsensus

        return UnreliableConsensus(open_consensus(unreliable[0]), unreliable[1])
    scheme, netloc, path, query = _split("consensus", uri, forms)
    if scheme == "mem":
        _params("consensus", uri, query, (), forms)
        name = unquote(netloc + path)
        if not name:
            raise _invalid("consensus", uri, "missing name (mem://NAME)", forms)
        from persist_lib.location.mem import MemConsensus

        return MemConsensus(name)
    if scheme == "sqlite":
        params = _params("consensus", uri, query, ("synchronous", "busy_timeout_ms"), forms)
        if netloc:
            raise _invalid(
                "consensus",
                uri,
                f"unexpected host {netloc!r}: use sqlite:///rel/path or sqlite:////abs/path",
                forms,
            )
        p = unquote(path[1:]) if path.startswith("/") else ""
        if not p or p.endswith("/"):
            raise _invalid("consensus", uri, "missing database file path", forms)
        if "\x00" in p:
            raise _invalid("consensus", uri, "NUL in path", forms)
        sync = params.get("synchronous", "FULL").upper()
        if sync not in ("FULL", "NORMAL", "EXTRA"):
            raise _invalid(
                "consensus", uri, f"synchronous must be FULL, NORMAL or EXTRA, got {sync!r}", forms
            )
        try:
            busy_ms = int(params.get("busy_timeout_ms", "10000"))
        except ValueError:
            raise _invalid("consensus", uri, "busy_timeout_ms must be an integer", forms) from None
        if busy_ms < 0:
            raise _invalid("consensus", uri, "busy_timeout_ms must be >= 0", forms)
        from persist_lib.location.sqlite_consensus import SqliteConsensus

        return SqliteConsensus(p, synchronous=sync, busy_timeout_ms=busy_ms)
    if scheme in ("postgresql", "postgres"):
        uri, query, op_timeout_s = _take_pg_op_timeout(uri, query, forms)
        host = netloc.rpartition("@")[2]
        if not host and "host=" not in query:
            raise _invalid(
                "consensus", uri, "missing host (postgresql://user:pass@HOST:port/db)", forms
            )
        if not path.strip("/") and "dbname=" not in query:
            raise _invalid(
                "consensus", uri, "missing database name (postgresql://.../DBNAME)", forms
            )
        for hp in host.split(","):
            port = (
                hp.rpartition("]")[2].partition(":")[2]
                if hp.startswith("[")
                else hp.partition(":")[2]
            )
            if port and not port.isdigit():
                raise _invalid("consensus", uri, f"port {port!r} is not a number", forms)
        import psycopg

        try:
            psycopg.conninfo.conninfo_to_dict(uri)  # libpq's own parser: reject early
        except psycopg.Error as e:
            raise _invalid("consensus", uri, f"libpq rejects it: {redact(str(e))}", forms) from None
        from persist_lib.location.postgres_consensus import PostgresConsensus

        if op_timeout_s is None:
            return PostgresConsensus(uri)
        return PostgresConsensus(uri, op_timeout_s=op_timeout_s)
    raise _invalid("consensus", uri, f"unknown scheme {scheme!r}", forms)


_PG_OP_TIMEOUT = "persist_op_timeout_s"


def _take_pg_op_timeout(
    uri: str, query: str, forms: tuple[str, ...]
) -> tuple[str, str, float | None]:
    """Removes persist's own ``persist_op_timeout_s=N`` from a Postgres URI (libpq would
    refuse it): (the URI without it, its query without it, N or None)."""
    pieces = query.split("&") if query else []
    mine = [p for p in pieces if p.partition("=")[0] == _PG_OP_TIMEOUT]
    if not mine:
        return uri, query, None
    if len(mine) > 1:
        raise _invalid("consensus", uri, f"parameter {_PG_OP_TIMEOUT!r} given twice", forms)
    raw = unquote(mine[0].partition("=")[2])
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise _invalid(
            "consensus", uri,
            f"{_PG_OP_TIMEOUT} must be a positive number of seconds, got {raw!r}", forms,
        )
    rest = "&".join(p for p in pieces if p.partition("=")[0] != _PG_OP_TIMEOUT)
    base, _, tail = uri.partition("?")
    fragment = tail.partition("#")[2]
    new_uri = base + (f"?{rest}" if rest else "") + (f"#{fragment}" if fragment else "")
    return new_uri, rest, value


def default_uris(home: str | None = None) -> tuple[str, str]:
    """The embedded default (docs/design.md section 4): ``$PERSIST_BLOB_URI`` /
    ``$PERSIST_CONSENSUS_URI`` if set, else a file blob and a SQLite consensus under
    ``home`` (default ``$PERSIST_HOME``, else ``./.persist``)."""
    home = home or os.environ.get("PERSIST_HOME") or ".persist"
    home = os.path.abspath(home)
    blob = os.environ.get("PERSIST_BLOB_URI") or "file://" + quote(os.path.join(home, "blob"))
    consensus = os.environ.get("PERSIST_CONSENSUS_URI") or (
        "sqlite:///" + quote(os.path.join(home, "consensus.db"))
    )
    return blob, consensus
