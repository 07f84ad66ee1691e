"""A Spark standalone cluster on this machine: one master and N workers, loopback only.

pyspark's pip package is a whole Spark distribution: ``bin/spark-class`` starts the
standalone ``Master`` and ``Worker`` daemons that a production cluster runs (docker/
runs the same classes). The tests and benchmarks use this module to run persist_lib's
Spark jobs on executors that are separate JVMs with their own Python workers, on workers
that can be killed — what ``local[N]`` (executors inside the driver) cannot show.

Each daemon is started in its own process group, so ``kill_worker`` takes down the
worker JVM, its executor JVM and their Python workers at once, the way a lost machine
does. ``worker_python`` picks the interpreter the workers' environment offers (the
executors still run the Python the driver names in ``spark.pyspark.python``); ``env``
adds or overrides worker environment variables.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from persist_lib.errors import InvalidUsage

_MASTER = "org.apache.spark.deploy.master.Master"
_WORKER = "org.apache.spark.deploy.worker.Worker"


class ClusterStartError(InvalidUsage):
    """A standalone master or worker did not come up (the message holds its log tail)."""


def spark_home() -> Path:
    """The Spark distribution inside the installed pyspark package."""
    try:
        import pyspark
    except ImportError as e:  # pragma: no cover - the spark extra is part of dev
        raise InvalidUsage("pyspark is not installed: pip install 'persist-platform[spark]'") from e
    home = Path(pyspark.__file__).parent
    if not (home / "bin" / "spark-class").exists():
        raise InvalidUsage(f"{home} has no bin/spark-class: is pyspark a full pip install?")
    return home


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _parent(pid: int) -> int:
    """The parent of ``pid`` (0 if unknown), from /proc (Linux)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
    return int(stat.rsplit(")", 1)[1].split()[1])


def _descendants(root: int) -> list[int]:
    """Every process below ``root`` (from /proc; empty where there is no /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else []:
        if entry.name.isdigit():
            children.setdefault(_parent(int(entry.name)), []).append(int(entry.name))
    out: list[int] = []
    todo = [root]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


@dataclass
class _Daemon:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path
    web_port: int

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signals the daemon's whole process group (its executors and Python workers)."""
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"


@dataclass
class StandaloneCluster:
    """A standalone Spark master and ``workers`` workers on 127.0.0.1 (a context manager).

    ``cores`` and ``memory`` are per worker; worker ``i`` listens on 127.0.0.(2+i) unless
    ``distinct_hosts`` is false. ``url`` is the ``spark://`` master URL to
    give a SparkSession. ``stop()`` kills every daemon's process group and removes the
    scratch directory.
    """

    workers: int = 2
    cores: int = 1
    memory: str = "1g"
    worker_python: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    start_timeout_s: float = 90.0
    distinct_hosts: bool = True
    _dir: Path | None = None
    _master: _Daemon | None = None
    _workers: list[_Daemon] = field(default_factory=list)
    _port: int = 0

    # -- lifecycle -------------------------------------------------------------------

    def __enter__(self) -> StandaloneCluster:
        self.start()
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    @property
    def url(self) -> str:
        return f"spark://127.0.0.1:{self._port}"

    @property
    def scratch(self) -> Path:
        assert self._dir is not None, "cluster not started"
        return self._dir

    def start(self) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="persist-spark-cluster-"))
        self._port = free_port()
        web = free_port()
        self._master = self._spawn(
            "master", [_MASTER, "--host", "127.0.0.1", "--port", str(self._port), "--webui-port", str(web)], web
        )
        try:
            self._wait(lambda: self._master_json() is not None, "master", self._master)
            started = [self._spawn_worker() for _ in range(self.workers)]
            for d in started:  # started together: JVM start-up is most of the wait
                self._wait(lambda: self.alive_workers() >= len(started), d.name, d)
        except BaseException:
            self.stop()
            raise

    def add_worker(self) -> int:
        """Starts one more worker and waits until the master lists it ALIVE; its index."""
        want = sum(1 for w in self._workers if w.alive()) + 1
        d = self._spawn_worker()
        self._wait(lambda: self.alive_workers() >= want, d.name, d)
        return len(self._workers) - 1

    def _spawn_worker(self) -> _Daemon:
        i = len(self._workers)
        # Each worker on its own loopback address, so Spark sees separate hosts (it won't
        # run a speculative copy of a task on the host of the original attempt).
        host = f"127.0.0.{2 + i}" if self.distinct_hosts else "127.0.0.1"
        web = free_port()
        work = self.scratch / f"worker-{i}"
        work.mkdir()
        d = self._spawn(
            f"worker-{i}",
            [
                _WORKER,
                "--host", host,
                "--cores", str(self.cores),
                "--memory", self.memory,
                "--webui-port", str(web),
                "--work-dir", str(work),
                self.url,
            ],
            web,
            {"SPARK_LOCAL_IP": host},
        )
        self._workers.append(d)
        return d

    def stop(self) -> None:
        for d in [*self._workers, *([self._master] if self._master else [])]:
            d.kill(signal.SIGKILL)
            try:
                d.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:  # pragma: no cover
                pass
        self._workers = []
        self._master = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    # -- faults ----------------------------------------------------------------------

    def kill_worker(self, index: int) -> None:
        """kill -9 of worker ``index``, its executor and their Python workers (a lost machine).

        pyspark's Python daemon puts itself in its own process group, so the worker's
        descendants are collected from /proc first and killed with the group.
        """
        d = self._workers[index]
        tree = _descendants(d.proc.pid)
        d.kill(signal.SIGKILL)
        for pid in tree:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        d.proc.wait(timeout=10)

    def worker_of_pid(self, pid: int) -> int | None:
        """The worker whose process tree holds ``pid`` (an executor's Python worker), if any."""
        roots = {d.proc.pid: i for i, d in enumerate(self._workers) if d.alive()}
        seen = 0
        while pid > 1 and seen < 64:  # walk up the parents (Python worker -> daemon -> executor -> worker)
            if pid in roots:
                return roots[pid]
            pid = _parent(pid)
            seen += 1
        return None

    # -- state -----------------------------------------------------------------------

    def alive_workers(self) -> int:
        state = self._master_json()
        if state is None:
            return 0
        return sum(1 for w in state.get("workers", []) if w.get("state") == "ALIVE")

    def status(self) -> dict[str, Any]:
        """The master's JSON status (workers, cores, running applications)."""
        return self._master_json() or {}

    def logs(self) -> str:
        parts = [self._master, *self._workers]
        return "\n".join(f"== {d.name} ==\n{d.tail()}" for d in parts if d is not None)

    # -- internals -------------------------------------------------------------------

    def _spawn(
        self, name: str, args: list[str], web_port: int, extra: Mapping[str, str] | None = None
    ) -> _Daemon:
        home = spark_home()
        log = self.scratch / f"{name}.log"
        env = dict(os.environ)
        env.update(
            SPARK_HOME=str(home),
            SPARK_LOCAL_IP="127.0.0.1",
            SPARK_LOCAL_DIRS=str(self.scratch / "local"),
            SPARK_LOG_DIR=str(self.scratch),
            SPARK_NO_DAEMONIZE="1",
            # Small daemons: the master and the workers only schedule.
            SPARK_DAEMON_MEMORY="256m",
        )
        if self.worker_python:
            env["PYSPARK_PYTHON"] = self.worker_python
        env.update(self.env)
        env.update(extra or {})
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [str(home / "bin" / "spark-class"), *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=str(self.scratch),
                start_new_session=True,  # its own process group: kill_worker takes all of it
            )
        return _Daemon(name, proc, log, web_port)

    def _master_json(self) -> dict[str, Any] | None:
        if self._master is None:
            return None
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{self._master.web_port}/json/", timeout=2
            ) as r:
                data: dict[str, Any] = json.loads(r.read())
                return data
        except (OSError, ValueError):
            return None

    def _wait(self, ready: Any, what: str, d: _Daemon) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while not ready():
            if not d.alive():
                raise ClusterStartError(f"Spark {what} exited with {d.proc.returncode}:\n{d.tail()}")
            if time.monotonic() > deadline:
                raise ClusterStartError(
                    f"Spark {what} not ready after {self.start_timeout_s:.0f} s:\n{d.tail()}"
                )
            time.sleep(0.2)
