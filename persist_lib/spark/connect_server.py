"""A Spark Connect server started from pyspark's own installation, for tests and benchmarks.

Teams reach shared clusters through Spark Connect (``sc://host:port``): the client
process holds no JVM and no ``SparkContext``, only a gRPC channel. To test
``persist_lib.spark`` through exactly that path without a cluster, ``SparkConnectServer``
runs ``org.apache.spark.sql.connect.service.SparkConnectServer`` (the jar ships inside
the pyspark wheel) with ``spark-submit`` on a local master, bound to 127.0.0.1 on a free
port, with a private temp dir for its log and ``spark.local.dir``. Its Python workers
run ``python`` (default: this interpreter) with this process's environment and the
directory of this ``persist_lib`` first on ``PYTHONPATH``, so they import the same code.

Usage::

    with SparkConnectServer(master="local[2]") as server:
        spark = server.session()        # a Connect SparkSession on server.url
        ...

Importing this module does not import pyspark.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from persist_lib.errors import PersistError

SERVER_CLASS = "org.apache.spark.sql.connect.service.SparkConnectServer"

# Small and quiet by default: the tests share a 2-core machine. ``conf`` overrides these.
DEFAULT_SERVER_CONF: dict[str, str] = {
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.driver.memory": "1g",
    "spark.sql.shuffle.partitions": "4",
    "spark.sql.session.timeZone": "UTC",
    "spark.sql.execution.arrow.maxRecordsPerBatch": "65536",
    "spark.python.worker.reuse": "true",
    "spark.port.maxRetries": "64",
}


class SparkConnectServerError(PersistError):
    """The Spark Connect server could not be started (the message has its log tail)."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks (``/proc/PID/stat`` field 22), or None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _descendants(pid: int) -> list[tuple[int, str | None]]:
    """Every process below ``pid`` with its start time (Linux ``/proc``; empty elsewhere).

    pyspark's Python daemon puts itself in its own process group, so killing the
    server's group alone could leave it (and its workers) behind. The start time tells
    a leftover from a new process that reused the pid.
    """
    out: list[tuple[int, str | None]] = []
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for t in tasks:
            try:
                kids = Path(f"/proc/{p}/task/{t}/children").read_text().split()
            except OSError:
                continue
            for k in kids:
                out.append((int(k), _start_time(int(k))))
                todo.append(int(k))
    return out


def pyspark_home() -> Path:
    """The directory of the installed pyspark package (its ``bin/`` and ``jars/``)."""
    import importlib.util

    spec = importlib.util.find_spec("pyspark")
    if spec is None or spec.origin is None:
        raise SparkConnectServerError("pyspark is not installed (pip install 'pyspark[connect]')")
    return Path(spec.origin).parent


class SparkConnectServer:
    """A Spark Connect server process on ``127.0.0.1:<free port>`` (a context manager).

    ``master``: the server's master URL (``local[2]``, ``spark://...``). ``conf``: extra
    ``--conf`` settings (over ``DEFAULT_SERVER_CONF``). ``python``: the interpreter of
    the server's Python workers (default: this one). ``port``: default a free one.
    ``start_timeout_s``: how long to wait for the port to accept connections.
    """

    def __init__(
        self,
        master: str = "local[2]",
        *,
        conf: dict[str, str] | None = None,
        python: str | None = None,
        port: int | None = None,
        start_timeout_s: float = 180.0,
        env: dict[str, str] | None = None,
    ) -> None:
        self.master = master
        self.conf = dict(DEFAULT_SERVER_CONF)
        self.conf.update(conf or {})
        self.python = python or sys.executable
        self.port = port or _free_port()
        self.start_timeout_s = start_timeout_s
        self.extra_env = dict(env or {})
        self.workdir: Path | None = None
        self.log_path: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: Any = None

    @property
    def url(self) -> str:
        """The ``sc://`` URL clients connect to."""
        return f"sc://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def command(self) -> list[str]:
        """The ``spark-submit`` command line that starts the server."""
        home = pyspark_home()
        submit = home / "bin" / "spark-submit"
        jars = sorted((home / "jars").glob("spark-connect_*.jar"))
        if not submit.exists() or not jars:
            raise SparkConnectServerError(
                f"pyspark at {home} has no bin/spark-submit or jars/spark-connect_*.jar; "
                "install pyspark[connect] >= 4.0 from PyPI"
            )
        assert self.workdir is not None
        conf = dict(self.conf)
        conf.update(
            {
                "spark.connect.grpc.binding.address": "127.0.0.1",
                "spark.connect.grpc.binding.port": str(self.port),
                "spark.connect.grpc.port.maxRetries": "0",  # never a port we don't wait for
                "spark.driver.bindAddress": "127.0.0.1",
                "spark.driver.host": "127.0.0.1",
                "spark.local.dir": str(self.workdir / "local"),
                "spark.pyspark.python": self.python,
                "spark.pyspark.driver.python": self.python,
            }
        )
        cmd = [str(submit), "--master", self.master, "--class", SERVER_CLASS, "--name", "persist-spark-connect"]
        for k, v in conf.items():
            cmd += ["--conf", f"{k}={v}"]
        return [*cmd, str(jars[-1])]

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        # The server is a classic Spark application: none of the client-side switches.
        for k in ("SPARK_REMOTE", "SPARK_CONNECT_MODE_ENABLED", "SPARK_LOCAL_REMOTE", "SPARK_API_MODE"):
            env.pop(k, None)
        env["SPARK_HOME"] = str(pyspark_home())  # pyspark's own jars, whatever else is installed
        env["PYSPARK_PYTHON"] = self.python
        env["PYSPARK_DRIVER_PYTHON"] = self.python
        env["SPARK_LOCAL_IP"] = "127.0.0.1"
        # The workers import the persist_lib this process imported (a checkout, say).
        here = str(Path(__file__).resolve().parents[2])
        paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        env["PYTHONPATH"] = os.pathsep.join([here, *[p for p in paths if p != here]])
        env.update(self.extra_env)
        return env

    def start(self) -> SparkConnectServer:
        """Starts the server and waits until its port accepts connections."""
        if self._proc is not None:
            raise SparkConnectServerError("the server was already started")
        self.workdir = Path(tempfile.mkdtemp(prefix="persist-spark-connect-"))
        (self.workdir / "local").mkdir()
        self.log_path = self.workdir / "server.log"
        cmd = self.command()
        self._log = open(self.log_path, "wb")  # noqa: SIM115 (closed in stop())
        try:
            self._proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
                env=self._env(), cwd=str(self.workdir), start_new_session=True,
            )
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            code = self._proc.poll()
            if code is not None:
                raise SparkConnectServerError(
                    f"the Spark Connect server exited with code {code} before accepting connections "
                    f"on 127.0.0.1:{self.port}; the end of its log:\n{self.log_tail()}"
                )
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=1.0):
                return
            if time.monotonic() > deadline:
                raise SparkConnectServerError(
                    f"the Spark Connect server did not accept connections on 127.0.0.1:{self.port} "
                    f"within {self.start_timeout_s:.0f} s; the end of its log:\n{self.log_tail()}"
                )
            time.sleep(0.25)

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the server's log."""
        if self.log_path is None or not self.log_path.exists():
            return "(no log)"
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def session(self) -> Any:
        """A new Connect ``SparkSession`` on this server.

        Built with ``pyspark.sql.connect.session.SparkSession.builder`` rather than
        ``pyspark.sql.SparkSession.builder.remote(url)``: the latter refuses to start
        while a classic ``SparkContext`` lives in the process (``SESSION_ALREADY_EXIST``)
        and sets ``SPARK_CONNECT_MODE_ENABLED``, which switches pyspark's process-wide
        function dispatch to Connect and breaks classic sessions of the same process.
        """
        from pyspark.sql.connect.session import SparkSession as ConnectSession

        return ConnectSession.builder.remote(self.url).create()

    def stop(self, timeout_s: float = 20.0) -> None:
        """Stops the server and every process it started; removes its temp dir."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            kids = _descendants(proc.pid)
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGTERM)  # the JVM's shutdown hooks stop Spark
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(OSError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=timeout_s)
            for k, started in kids:  # the Python daemon and workers (their own process group)
                if started is not None and _start_time(k) == started:
                    with contextlib.suppress(OSError):
                        os.kill(k, signal.SIGKILL)
        elif proc is not None:
            proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None

    def __enter__(self) -> SparkConnectServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
