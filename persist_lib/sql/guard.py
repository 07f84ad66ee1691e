"""``persist sql`` is read-only: the DuckDB connection it runs queries on, and how
DuckDB's refusals become ``SqlReadOnly``.

The connection is opened with external access off -- no file or network access:
``COPY ... TO/FROM``, ``ATTACH``, ``EXPORT``/``IMPORT DATABASE``, ``INSTALL``/``LOAD``,
``read_text``/``read_csv``/``read_parquet``/``glob``/... on a path or URL, ``CREATE
SECRET`` --, extension auto-install and auto-load off, its only directory a private
spill directory (``temp_directory``) and its directory of verified part copies
(``allowed_directories``: the files a ``direct_scan`` view reads), and
``lock_configuration`` set when it opens, so no statement (``SET``, ``RESET``,
``PRAGMA``) can turn any of that back on. Registering Arrow sources
(``connection.register``, ``from_arrow``) still works on it: the collections and shards
are served from those streams or from the session's own copies of parts it verified,
never from the blob store's files. (A query may read those copies, the same rows the
shard gives it, and could overwrite them: that fools only its own session.)
"""

from __future__ import annotations

from typing import Any

from persist_lib.errors import InvalidUsage


class SqlReadOnly(InvalidUsage):
    """A statement tried to read or write a file, reach the network, install or load an
    extension, or change DuckDB's settings: ``persist sql`` only reads collections and
    shards."""


def read_only_connection(scratch_dir: str, copies_dir: str | None = None) -> Any:
    """A new in-memory DuckDB connection that can touch no file but its own spill
    directory ``scratch_dir`` (and, when given, ``copies_dir``: the session's verified
    part copies, ``direct_scan``) and no network, and whose settings no statement can
    change (external access off, extension auto-install/auto-load off, configuration
    locked). Arrow sources can still be registered on it."""
    import duckdb

    con = duckdb.connect(
        config={
            "autoinstall_known_extensions": False,
            "autoload_known_extensions": False,
            "temp_directory": scratch_dir,
        }
    )
    try:
        # DuckDB takes ``allowed_directories`` only once it runs, and only while external
        # access is on: set it, then turn external access off and lock, before any query.
        if copies_dir is not None:
            con.execute("SET allowed_directories = [?]", [copies_dir.rstrip("/") + "/"])
        con.execute("SET enable_external_access = false")
        con.execute("SET lock_configuration = true")  # last: after it nothing can be set
    except BaseException:
        con.close()
        raise
    return con


_LOCKED = "the configuration has been locked"


def read_only_error(e: BaseException) -> SqlReadOnly | None:
    """The ``SqlReadOnly`` a DuckDB error stands for (a refused file, network, extension
    or settings access), or None for any other error."""
    import duckdb

    text = str(e).strip()
    if not (isinstance(e, duckdb.PermissionException) or (isinstance(e, duckdb.Error) and _LOCKED in text)):
        return None
    first = text.splitlines()[0] if text else type(e).__name__
    return SqlReadOnly(
        f"persist sql is read-only: it reads collections and shards only, and DuckDB refused this "
        f"statement ({first}): no file or network access (COPY, ATTACH, read_csv/read_text/"
        "read_parquet on a path or URL, ...), no extensions (INSTALL/LOAD) and no settings "
        "(SET/RESET/PRAGMA). To export rows use `persist sql --json`, or in Python write "
        "SqlSession.snapshot(...).batches() with pyarrow"
    )
