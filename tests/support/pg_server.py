"""A throwaway PostgreSQL server for the test session (docs/design.md section 15).

``PgServer.start()`` runs ``initdb`` into a fresh temp directory and starts
``postgres`` on a free 127.0.0.1 port (plus a unix socket in the temp dir) with
``wal_level=logical``, ``fsync=on`` and ``max_connections=200``. When running as root
it runs the server as the ``postgres`` OS user (via ``runuser``), since Postgres
refuses to run as root.

Authentication: the unix socket is ``trust`` (admin use by the harness only); TCP uses
``scram-sha-256``, and the tests connect as role ``persist`` with the password
``canary-S3cr3t-pw`` (a canary the security tests grep for). ``persist`` may create
databases so each test can get a fresh one (``create_database``).

Set ``PERSIST_TEST_PG_URL`` to use an existing server instead (a URL of a role that may
``CREATE DATABASE``).
"""

from __future__ import annotations

import atexit
import glob
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from urllib.parse import quote, urlsplit, urlunsplit

PG_USER = "persist"
PG_PASSWORD = "canary-S3cr3t-pw"
PG_DATABASE = "persist_test"


class PgUnavailable(RuntimeError):
    """No Postgres binaries (or the server did not start)."""


def find_bindir() -> str:
    """The directory with initdb/pg_ctl/postgres: pg_config --bindir, the Debian
    layout, or PATH."""
    candidates: list[str] = []
    pg_config = shutil.which("pg_config")
    if pg_config:
        try:
            out = subprocess.run(
                [pg_config, "--bindir"], capture_output=True, text=True, timeout=10, check=True
            ).stdout.strip()
            candidates.append(out)
        except (OSError, subprocess.SubprocessError):
            pass
    candidates += sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)
    initdb = shutil.which("initdb")
    if initdb:
        candidates.append(os.path.dirname(initdb))
    for d in candidates:
        if all(os.access(os.path.join(d, b), os.X_OK) for b in ("initdb", "pg_ctl", "postgres")):
            return d
    raise PgUnavailable(
        "PostgreSQL server binaries (initdb, pg_ctl, postgres) not found via pg_config "
        "--bindir, /usr/lib/postgresql/*/bin or PATH; install postgresql (apt-get install "
        "postgresql) or set PERSIST_TEST_PG_URL, or set PERSIST_TEST_ALLOW_SKIP_PG=1 to skip"
    )


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _url(user: str, password: str, host: str, port: int, db: str) -> str:
    return f"postgresql://{quote(user)}:{quote(password, safe='')}@{host}:{port}/{quote(db)}"


class PgServer:
    """A running throwaway server (or an external one, see PERSIST_TEST_PG_URL)."""

    def __init__(self) -> None:
        self.tmpdir: str | None = None
        self.datadir: str | None = None
        self.host = "127.0.0.1"
        self.port = 0
        self.bindir: str | None = None
        self._as_postgres = False
        self._external_url: str | None = None
        self._lock = threading.Lock()
        self._stopped = False

    # -- lifecycle -----------------------------------------------------------------

    @classmethod
    def start(cls) -> PgServer:
        srv = cls()
        ext = os.environ.get("PERSIST_TEST_PG_URL")
        if ext:
            srv._external_url = ext
            parts = urlsplit(ext)
            srv.host = parts.hostname or "127.0.0.1"
            srv.port = parts.port or 5432
            srv._create_db_if_missing(PG_DATABASE)
            return srv
        srv._start_local()
        return srv

    def _cmd(self, args: list[str]) -> list[str]:
        if self._as_postgres:
            return ["runuser", "-u", "postgres", "--", *args]
        return args

    def _start_local(self) -> None:
        self.bindir = find_bindir()
        self._as_postgres = os.geteuid() == 0
        # Not under pytest's tmp_path: that is 0700 root and the postgres user must
        # reach the directory.
        self.tmpdir = tempfile.mkdtemp(prefix="persist-pg-")
        self.datadir = os.path.join(self.tmpdir, "data")
        self.sockdir = os.path.join(self.tmpdir, "sock")
        os.makedirs(self.sockdir)
        if self._as_postgres:
            shutil.chown(self.tmpdir, "postgres", "postgres")
            shutil.chown(self.sockdir, "postgres", "postgres")
        atexit.register(self.stop)
        initdb = [
            os.path.join(self.bindir, "initdb"),
            "-D",
            self.datadir,
            "-U",
            "postgres",
            "--auth-local=trust",
            "--auth-host=scram-sha-256",
            "--encoding=UTF8",
            "--locale=C",
            "--no-sync",  # the throwaway cluster's initial files need no fsync
            "--no-instructions",
        ]
        res = subprocess.run(self._cmd(initdb), capture_output=True, text=True, timeout=120)
        if res.returncode != 0:
            raise PgUnavailable(f"initdb failed ({res.returncode}): {res.stderr.strip()}")
        last_err = ""
        for _ in range(5):  # the free port may be taken between probing and binding
            self.port = free_port()
            opts = " ".join(
                [
                    f"-p {self.port}",
                    "-c listen_addresses=127.0.0.1",
                    f"-c unix_socket_directories={self.sockdir}",
                    "-c wal_level=logical",
                    "-c max_wal_senders=10",
                    "-c max_replication_slots=40",  # the CDC tests leave slots behind
                    "-c fsync=on",
                    "-c max_connections=200",
                    "-c shared_buffers=32MB",
                    "-c logging_collector=off",
                ]
            )
            ctl = [
                os.path.join(self.bindir, "pg_ctl"),
                "-D",
                self.datadir,
                "-l",
                os.path.join(self.tmpdir, "postgres.log"),
                "-o",
                opts,
                "-w",
                "-t",
                "60",
                "start",
            ]
            res = subprocess.run(self._cmd(ctl), capture_output=True, text=True, timeout=90)
            if res.returncode == 0:
                break
            last_err = res.stderr.strip() + "\n" + self.log_tail()
        else:
            raise PgUnavailable(f"postgres did not start: {last_err}")
        self._bootstrap()

    def _admin_connect(self, dbname: str = "postgres"):  # type: ignore[no-untyped-def]
        import psycopg

        if self._external_url:
            parts = urlsplit(self._external_url)
            return psycopg.connect(urlunsplit(parts._replace(path="/" + dbname)), autocommit=True)
        return psycopg.connect(
            host=self.sockdir, port=self.port, user="postgres", dbname=dbname, autocommit=True
        )

    def _bootstrap(self) -> None:
        from psycopg import sql

        with self._admin_connect() as conn:
            conn.execute(
                sql.SQL("CREATE ROLE {} LOGIN SUPERUSER CREATEDB REPLICATION PASSWORD {}").format(
                    sql.Identifier(PG_USER), sql.Literal(PG_PASSWORD)
                )
            )
            conn.execute(
                sql.SQL("CREATE DATABASE {} OWNER {}").format(
                    sql.Identifier(PG_DATABASE), sql.Identifier(PG_USER)
                )
            )

    def _create_db_if_missing(self, name: str) -> None:
        from psycopg import sql

        with self._admin_connect() as conn:
            exists = conn.execute(
                "SELECT 1 FROM pg_database WHERE datname = %s", (name,)
            ).fetchone()
            if not exists:
                conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))

    def stop(self) -> None:
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        if self._external_url or not self.tmpdir:
            return
        if (
            self.bindir
            and self.datadir
            and os.path.exists(os.path.join(self.datadir, "postmaster.pid"))
        ):
            subprocess.run(
                self._cmd(
                    [
                        os.path.join(self.bindir, "pg_ctl"),
                        "-D",
                        self.datadir,
                        "-m",
                        "immediate",
                        "-w",
                        "stop",
                    ]
                ),
                capture_output=True,
                timeout=60,
            )
        shutil.rmtree(self.tmpdir, ignore_errors=True)

    def log_tail(self, n: int = 30) -> str:
        if not self.tmpdir:
            return ""
        try:
            with open(os.path.join(self.tmpdir, "postgres.log")) as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    # -- URLs ----------------------------------------------------------------------

    def url_for(self, dbname: str) -> str:
        """A password-authenticated TCP URL (role ``persist``) for database ``dbname``."""
        if self._external_url:
            parts = urlsplit(self._external_url)
            return urlunsplit(parts._replace(path="/" + quote(dbname)))
        return _url(PG_USER, PG_PASSWORD, self.host, self.port, dbname)

    @property
    def url(self) -> str:
        """The session database's URL."""
        return self.url_for(PG_DATABASE)

    def create_database(self, prefix: str = "t") -> str:
        """Creates a fresh, empty database and returns its URL."""
        from psycopg import sql

        name = f"{prefix}_{uuid.uuid4().hex[:12]}"
        with self._admin_connect() as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        return self.url_for(name)

    def __repr__(self) -> str:
        return f"PgServer(host={self.host!r}, port={self.port})"


def wait_until_accepting(url: str, timeout_s: float = 10.0) -> None:
    """Blocks until ``url`` accepts connections (used after restarts in tests)."""
    import psycopg

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            psycopg.connect(url, connect_timeout=2).close()
            return
        except psycopg.OperationalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
