"""SQLite consensus: a closed instance's idle connections are reused by the next
instance on the same file (no last-close checkpoint and WAL rebuild per client), and
never for another file that took the same name."""

from __future__ import annotations

import os
from pathlib import Path

from persist_lib.location.base import VersionedData
from persist_lib.location.sqlite_consensus import SqliteConsensus


def test_close_keeps_the_wal_and_the_next_instance_reuses_the_connection(tmp_path: Path) -> None:
    db = tmp_path / "c.db"
    a = SqliteConsensus(db)
    a.compare_and_set("k", None, VersionedData(1, b"one"))
    conn = a._conn()
    a.close()
    # The last close of a WAL database would checkpoint and delete the WAL: kept idle,
    # it did not, and the next instance gets the same, initialised connection.
    assert (tmp_path / "c.db-wal").exists()
    b = SqliteConsensus(db)
    assert b._conn() is conn
    assert b.head("k") == VersionedData(1, b"one")
    b.close()


def test_a_file_recreated_under_the_same_name_is_connected_afresh(tmp_path: Path) -> None:
    db = tmp_path / "c.db"
    a = SqliteConsensus(db)
    a.compare_and_set("k", None, VersionedData(1, b"old file"))
    a.close()
    for suffix in ("", "-wal", "-shm"):
        p = Path(f"{db}{suffix}")
        if p.exists():
            os.unlink(p)
    b = SqliteConsensus(db)  # a new, empty database at the same path
    assert b.head("k") is None
    b.compare_and_set("k", None, VersionedData(1, b"new file"))
    b.close()
    c = SqliteConsensus(db)
    assert c.head("k") == VersionedData(1, b"new file")
    c.close()
