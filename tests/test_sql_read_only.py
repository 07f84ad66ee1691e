"""``persist sql`` / ``SqlSession`` are read-only: every statement that touches a file, the
network, an extension or a DuckDB setting is refused with ``SqlReadOnly`` (issue 26,
defect 4), and time-travel queries keep working on the same session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from persist_lib import PersistClient, PersistConfig
from persist_lib.errors import InvalidUsage
from persist_lib.sql.engine import SqlReadOnly, SqlSession
from tests.test_sql import T0, orders_like, run

pytest.importorskip("duckdb")


@pytest.fixture()
def home(tmp_path: Path) -> Path:
    h = tmp_path / "home"
    client = PersistClient.default(h, PersistConfig.for_tests())
    orders_like(client).close()
    client.close()
    return h


def _refused_statements(home: Path, out: Path) -> list[str]:
    """Statements that would write, read or fetch something outside the session."""
    db = home / "consensus.db"
    return [
        # writes: over the consensus log, into a directory, a database
        f"COPY (SELECT * FROM orders) TO '{db}' (FORMAT csv)",
        f"COPY (SELECT * FROM orders AS OF {T0 + 1000}) TO '{out}/orders.parquet' (FORMAT parquet)",
        f"EXPORT DATABASE '{out}/export'",
        f"ATTACH '{out}/new.duckdb' AS x",
        f"ATTACH '{db}' AS c (TYPE sqlite)",
        # reads of any file, by path or glob
        "SELECT * FROM read_text('/etc/passwd')",
        "SELECT * FROM read_csv('/etc/passwd', sep = ':')",
        "SELECT * FROM read_blob('/etc/hostname')",
        f"SELECT * FROM read_parquet('{home}/blob/**/*')",
        "SELECT * FROM read_json('/etc/hostname')",
        "SELECT * FROM glob('/etc/*')",
        "COPY t FROM '/etc/passwd'",
        # the network (httpfs) and extensions
        "SELECT * FROM read_csv('https://example.com/x.csv')",
        "SELECT * FROM read_parquet('s3://bucket/x.parquet')",
        "INSTALL httpfs",
        "FORCE INSTALL httpfs FROM 'http://127.0.0.1:9/'",
        "LOAD httpfs",
        "CREATE SECRET (TYPE s3, KEY_ID 'a', SECRET 'b')",
        # ways back: settings are locked
        "SET enable_external_access = true",
        "RESET enable_external_access",
        "SET lock_configuration = false",
        "SET allowed_directories = ['/']",
        "SET temp_directory = '/tmp'",
        "PRAGMA enable_profiling = 'json'",
        f"SET profiling_output = '{out}/profile.json'",
        "SET enable_external_access = true; SELECT * FROM read_text('/etc/passwd')",
    ]


def test_every_file_network_and_settings_statement_is_refused(home: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    sentinel = home / "sentinel.db"
    sentinel.write_bytes(b"must stay as it is")
    client = PersistClient.open_existing(
        f"file://{home / 'blob'}", f"sqlite:///{home / 'consensus.db'}", PersistConfig.for_tests()
    )
    with SqlSession(client) as s:
        q = f"SELECT status, sum(diff) AS n FROM orders AS OF {T0 + 3000} GROUP BY 1 ORDER BY 1"
        before = s.sql(q).fetchall()
        changes = s.sql(f"SELECT count(*) FROM changes(orders, {T0 + 1000}, {T0 + 3000})").fetchall()
        assert sum(n for _, n in before) == 20 and changes[0][0] > 0
        s.sql("CREATE TABLE t (line VARCHAR)")  # the in-memory catalog is the session's own
        for stmt in [*_refused_statements(home, out), f"COPY (SELECT 1) TO '{sentinel}'"]:
            with pytest.raises(SqlReadOnly, match="persist sql is read-only") as ei:
                s.sql(stmt)
            assert isinstance(ei.value, InvalidUsage), stmt
        # nothing was written anywhere, and the session still time-travels
        assert sorted(os.listdir(out)) == []
        assert sentinel.read_bytes() == b"must stay as it is"
        assert s.sql(q).fetchall() == before
        assert s.sql(f"SELECT count(*) FROM changes(orders, {T0 + 1000}, {T0 + 3000})").fetchall() == changes
        assert s.relation("orders", T0 + 3000).aggregate("sum(diff)").fetchall() == [(20,)]
        settings = dict(
            s.connection.sql(
                "SELECT name, value FROM duckdb_settings() WHERE name IN "
                "('enable_external_access', 'lock_configuration', 'autoload_known_extensions', "
                "'autoinstall_known_extensions')"
            ).fetchall()
        )
        assert settings == {
            "enable_external_access": "false",
            "lock_configuration": "true",
            "autoload_known_extensions": "false",
            "autoinstall_known_extensions": "false",
        }
        scratch = s._scratch
        assert scratch is not None and (os.stat(scratch).st_mode & 0o777) == 0o700
    assert not os.path.exists(scratch)  # the spill directory goes with the session
    client.close()


def test_persist_sql_cli_refuses_files_and_settings(home: Path) -> None:
    db = home / "consensus.db"
    for stmt in (
        f"COPY (SELECT * FROM orders) TO '{db}' (FORMAT csv)",
        "SET enable_external_access = true; SELECT * FROM read_text('/etc/passwd')",
    ):
        out = run(["sql", stmt], home)
        assert out.returncode == 2, (stmt, out.stdout, out.stderr)
        assert "persist sql is read-only" in out.stderr, out.stderr
        assert "root:" not in out.stdout + out.stderr
        assert db.read_bytes()[:16] == b"SQLite format 3\x00"  # not overwritten by COPY
    # DuckDB's shell commands are not SQL: a parse error, nothing read
    out = run(["sql", ".read /etc/passwd"], home)
    assert out.returncode == 2 and "root:" not in out.stdout + out.stderr
    # the location is intact and time travel works
    good = run(["sql", "--json", f"SELECT sum(diff) AS n FROM orders AS OF {T0 + 3000}"], home)
    assert good.returncode == 0 and '"n": 20' in good.stdout, good.stdout + good.stderr
