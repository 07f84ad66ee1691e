"""Whether a location exists, checked without creating anything.

Opening a ``file://`` blob creates its directory and opening a ``sqlite:`` consensus
creates its database: right for a writer, wrong for a command that only reads (run from
the wrong directory, ``persist collections`` would create an empty ``./.persist`` and
print ``[]``). ``require_existing_location`` looks at the paths first and raises
``LocationNotFound`` naming the location it looked for and how to point at the right
one. Only a local (SQLite) consensus can be missing this way; a Postgres one is taken
as given (its open never creates a database), and so is S3.
"""

from __future__ import annotations

import os
from urllib.parse import unquote, urlsplit

from persist_lib.errors import LocationNotFound
from persist_lib.location.redaction import SensitiveUrl

_UNRELIABLE = "unreliable+"
HOW_TO_POINT = (
    "run it from the directory that holds .persist, set PERSIST_HOME=/path/to/home (the "
    "embedded default is $PERSIST_HOME, else ./.persist in the working directory), or pass "
    "--blob URI --consensus URI (or set PERSIST_BLOB_URI / PERSIST_CONSENSUS_URI)"
)


def _strip(uri: str) -> str:
    while uri.startswith(_UNRELIABLE):
        uri = uri[len(_UNRELIABLE) :]
    return uri


def local_blob_dir(uri: str) -> str | None:
    """The directory of a ``file://`` blob URI (absolute), else None."""
    parts = urlsplit(_strip(uri))
    if parts.scheme != "file":
        return None
    p = unquote(parts.netloc + parts.path) if parts.netloc else unquote(parts.path)
    return os.path.abspath(p) if p else None


def local_consensus_file(uri: str) -> str | None:
    """The database file of a ``sqlite:`` consensus URI (absolute), else None."""
    parts = urlsplit(_strip(uri))
    if parts.scheme != "sqlite" or parts.netloc:
        return None
    p = unquote(parts.path[1:]) if parts.path.startswith("/") else ""
    return os.path.abspath(p) if p else None


def missing_parts(blob_uri: str, consensus_uri: str) -> list[str]:
    """What of the location is missing (empty: it exists, or can't be checked here).

    Only a local (SQLite) consensus can be checked; with one, a local blob directory
    must exist as well."""
    db = local_consensus_file(consensus_uri)
    if db is None:
        return []
    out = []
    if not os.path.isfile(db):
        out.append(f"the consensus database {db} does not exist")
    d = local_blob_dir(blob_uri)
    if d is not None and not os.path.isdir(d):
        out.append(f"the blob directory {d} does not exist")
    return out


_BLOB_SCHEMES = {"file", "s3", "mem"}
_CONSENSUS_SCHEMES = {"sqlite", "postgresql", "postgres", "mem"}


def require_existing_location(blob_uri: str, consensus_uri: str, *, command: str = "") -> None:
    """Raises ``LocationNotFound`` if the (local) location does not exist; creates nothing.

    A URI of an unknown scheme is left to ``open_blob``/``open_consensus``, which say
    what is wrong with it (``InvalidUri``)."""
    if (
        urlsplit(_strip(blob_uri)).scheme not in _BLOB_SCHEMES
        or urlsplit(_strip(consensus_uri)).scheme not in _CONSENSUS_SCHEMES
    ):
        return
    missing = missing_parts(blob_uri, consensus_uri)
    if not missing:
        return
    who = f"`persist {command}`" if command else "this command"
    raise LocationNotFound(
        f"no persist location at blob {SensitiveUrl(blob_uri)} + consensus "
        f"{SensitiveUrl(consensus_uri)}: {' and '.join(missing)} (working directory "
        f"{os.getcwd()}). {who} only reads a location and never creates one; to point it at "
        f"the right one, {HOW_TO_POINT}."
    )
