"""Making sure Spark executors can run persist_lib — and shipping it to them when they can't.

On ``local[N]`` the executors are the driver's own process tree and import what the
driver imports. On a cluster they are other machines: their Python must have the
binary dependencies (pyarrow, numpy; boto3 for ``s3://`` blobs) and the *same*
persist_lib as the driver, or a task fails deep inside a job with a bare
``ModuleNotFoundError`` — or, worse, an older persist_lib writes parts the driver's
version doesn't expect. Two supported set-ups:

* **Workers with the project installed** (one image for the driver and the workers, as
  in docker/): the probe finds the same persist_lib and nothing is shipped.
* **Workers without it**: the driver zips its own ``persist_lib`` (pure Python) and adds
  it to the job with ``addPyFile`` (Spark Connect: ``addArtifacts(pyfile=True)``), which
  Python workers put ahead of site-packages. Binary dependencies can't be shipped this
  way; a worker that lacks them gets a clear error naming the module and the worker.

``prepare_executors(spark)`` runs once per Spark application (cached): one small probe
job — a function pickled by value, so it runs even where persist_lib can't be imported
— reports every executor's Python, the location and code fingerprint of the persist_lib
it would import (found with ``importlib.util.find_spec``, never imported, so a reused
Python worker can't keep a stale copy in ``sys.modules``) and which required modules
are missing. ``ship`` (or ``PERSIST_SPARK_SHIP``): ``auto`` ships when an executor lacks
persist_lib or has different code, ``always`` ships unconditionally, ``never`` raises
instead. Every public ``persist_lib.spark`` entry point calls it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import tempfile
import threading
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from persist_lib.errors import InvalidUsage

log = logging.getLogger(__name__)

SHIP_MODES = ("auto", "always", "never")
REQUIRED_MODULES = ("pyarrow", "numpy")
_PIP = {"confluent_kafka": "confluent-kafka"}  # module -> the package that provides it


class ExecutorEnvironmentError(InvalidUsage):
    """Spark executors can't run persist_lib as configured (the message says what to fix)."""


@dataclass(frozen=True)
class ExecutorProbe:
    """What one probe task saw on its executor."""

    host: str
    python: str
    executable: str
    persist_lib: str | None  # where it would import from (None: not importable)
    fingerprint: str | None  # sha256 of its sources (zips: the shipped file's name)
    missing: tuple[str, ...]


@dataclass(frozen=True)
class ExecutorCheck:
    """The result of ``prepare_executors``: what the executors run and whether we shipped."""

    master: str
    probes: tuple[ExecutorProbe, ...]
    shipped: str | None  # the zip added to the job, if any
    skipped: bool = False  # local master: executors are the driver's processes
    modules: tuple[str, ...] = ()  # the modules checked on every executor

    def to_json(self) -> dict[str, Any]:
        return {
            "master": self.master,
            "skipped": self.skipped,
            "shipped": os.path.basename(self.shipped) if self.shipped else None,
            "executors": sorted({f"{p.host} {p.executable} (Python {p.python})" for p in self.probes}),
        }


_lock = threading.Lock()
_prepared: dict[str, ExecutorCheck] = {}


def package_dir() -> Path:
    import persist_lib

    return Path(persist_lib.__file__).parent


def _sources(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def fingerprint(root: Path | None = None) -> str:
    """sha256 over persist_lib's source files (relative path and bytes, in order)."""
    root = root or package_dir()
    h = hashlib.sha256()
    for p in _sources(root):
        h.update(p.relative_to(root).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def build_project_zip(dest_dir: str | None = None) -> str:
    """A zip of the driver's persist_lib (sources only), named after its fingerprint."""
    root = package_dir()
    fp = fingerprint(root)
    dest = Path(dest_dir or tempfile.gettempdir()) / f"persist_lib-{fp[:16]}.zip"
    if not dest.exists():
        tmp = dest.with_suffix(f".tmp{os.getpid()}")
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as z:
            for p in _sources(root):
                z.write(p, (Path("persist_lib") / p.relative_to(root)).as_posix())
        os.replace(tmp, dest)
    return str(dest)


# The probe runs where persist_lib may not be importable: its source is compiled in a
# namespace that isn't an importable module, so cloudpickle ships it by value.
_PROBE_SRC = r'''
def probe(batches):
    import hashlib, importlib.util, os, socket, sys
    import pyarrow as pa
    missing = []
    for m in REQUIRED:
        try:
            if importlib.util.find_spec(m) is None:
                missing.append(m)
        except Exception:
            missing.append(m)
    where = fp = None
    try:
        spec = importlib.util.find_spec("persist_lib")
    except Exception:
        spec = None
    if spec is not None and spec.origin:
        where = os.path.dirname(spec.origin)
        if ".zip" in where:
            fp = "zip:" + os.path.basename(where.split(".zip")[0] + ".zip")
        else:
            h = hashlib.sha256()
            files = []
            for d, dirs, names in os.walk(where):
                dirs[:] = [x for x in dirs if x != "__pycache__"]
                files += [os.path.join(d, n) for n in names if n.endswith(".py")]
            rels = sorted((os.path.relpath(f, where).replace(os.sep, "/"), f) for f in files)
            for rel, f in rels:
                with open(f, "rb") as fh:
                    h.update(rel.encode() + b"\0" + fh.read() + b"\0")
            fp = h.hexdigest()
    n = 0
    for b in batches:
        n += b.num_rows
    yield pa.RecordBatch.from_pydict({
        "host": [socket.gethostname()],
        "python": ["%d.%d.%d" % sys.version_info[:3]],
        "executable": [sys.executable],
        "persist_lib": [where],
        "fingerprint": [fp],
        "missing": [",".join(missing)],
    })
'''


def _probe_fn(required: tuple[str, ...]) -> Any:
    ns: dict[str, Any] = {"__name__": "persist_executor_probe", "REQUIRED": required}
    exec(compile(_PROBE_SRC, "<persist executor probe>", "exec"), ns)
    return ns["probe"]


def _is_connect(spark: Any) -> bool:
    from persist_lib.spark._common import is_connect

    return is_connect(spark)


def _app_key(spark: Any) -> tuple[str, str]:
    """(a key of this Spark application, its master URL)."""
    if _is_connect(spark):
        return f"connect:{getattr(spark, 'session_id', id(spark))}", "sc://"
    sc = spark.sparkContext
    return f"{sc.applicationId}:{id(sc)}", str(sc.master)


def _probe(spark: Any, required: tuple[str, ...], tasks: int) -> list[ExecutorProbe]:
    schema = "host string, python string, executable string, persist_lib string, fingerprint string, missing string"
    df = spark.range(tasks, numPartitions=tasks).mapInArrow(_probe_fn(required), schema)
    try:
        rows = df.collect()
    except Exception as e:
        text = str(e)
        hint = ""
        if "No module named" in text:
            mod = text.split("No module named", 1)[1].strip().split()[0].strip("'\"")
            hint = f" (module {mod!r} is missing on the executors' Python)"
        raise ExecutorEnvironmentError(
            f"Spark executors can't run a Python task{hint}: the executors' Python must have "
            f"pyspark, {', '.join(required)} installed, the same Python minor version as the "
            f"driver, and be the interpreter named by PYSPARK_PYTHON / spark.pyspark.python. "
            f"Spark said: {text.strip().splitlines()[0][:400] if text.strip() else type(e).__name__}"
        ) from e
    return [
        ExecutorProbe(
            host=r["host"],
            python=r["python"],
            executable=r["executable"],
            persist_lib=r["persist_lib"],
            fingerprint=r["fingerprint"],
            missing=tuple(m for m in (r["missing"] or "").split(",") if m),
        )
        for r in rows
    ]


def _ship(spark: Any, path: str) -> None:
    if _is_connect(spark):
        spark.addArtifacts(path, pyfile=True)
    else:
        spark.sparkContext.addPyFile(path)


def _task_count(spark: Any) -> int:
    if _is_connect(spark):
        return 4
    return max(2, 2 * int(spark.sparkContext.defaultParallelism))


def prepare_executors(
    spark: Any,
    *,
    ship: str | None = None,
    blob_uri: str | None = None,
    modules: tuple[str, ...] = (),
    force: bool = False,
) -> ExecutorCheck:
    """Checks (once per application) that the executors can run this persist_lib; ships it if needed.

    Raises ``ExecutorEnvironmentError`` naming the executor, the missing module or the
    mismatch, and the fix. ``blob_uri``: an ``s3://`` blob adds boto3 to what must be
    installed; ``modules``: more binary modules the job needs (``confluent_kafka`` for a
    Kafka source); a module not checked yet in this application is probed for then. Local
    masters are skipped (their executors are the driver's processes).
    """
    mode = (ship or os.environ.get("PERSIST_SPARK_SHIP") or "auto").lower()
    if mode not in SHIP_MODES:
        raise InvalidUsage(f"ship={mode!r}: use one of {', '.join(SHIP_MODES)} (or set PERSIST_SPARK_SHIP)")
    key, master = _app_key(spark)
    required = tuple(
        dict.fromkeys(REQUIRED_MODULES + (("boto3",) if (blob_uri or "").find("s3://") >= 0 else ()) + tuple(modules))
    )
    with _lock:
        done = _prepared.get(key)
        if done is not None and not force:
            if done.skipped or set(required) <= set(done.modules):
                return done
            _raise_missing(_probe(spark, required, _task_count(spark)))  # (the code was checked already)
            done = dataclasses.replace(done, modules=tuple(dict.fromkeys(done.modules + required)))
            _prepared[key] = done
            return done
        if master.startswith("local") and mode != "always":
            check = ExecutorCheck(master=master, probes=(), shipped=None, skipped=True)
            _prepared[key] = check
            return check
        tasks = _task_count(spark)
        shipped: str | None = None
        if mode == "always":
            shipped = build_project_zip()
            _ship(spark, shipped)
        probes = _probe(spark, required, tasks)
        _raise_missing(probes)
        mine = fingerprint()
        stale = [p for p in probes if not _same_code(p, mine, shipped)]
        if stale and shipped is None and mode == "auto":
            first = stale[0]
            log.info(
                "Spark executors %s persist_lib (%s on %s): shipping the driver's copy",
                "lack" if first.persist_lib is None else "have a different",
                first.persist_lib or "not importable",
                first.host,
            )
            shipped = build_project_zip()
            _ship(spark, shipped)
            probes = _probe(spark, required, tasks)
            stale = [p for p in probes if not _same_code(p, mine, shipped)]
        if stale:
            p = stale[0]
            what = (
                "can't import persist_lib"
                if p.persist_lib is None
                else f"import a different persist_lib ({p.persist_lib}, code {str(p.fingerprint)[:12]}; "
                f"the driver's is {mine[:12]})"
            )
            raise ExecutorEnvironmentError(
                f"Spark executor {p.host} ({p.executable}) {what}. Install the driver's version of "
                "the project on the workers (same image), or let the driver ship it: "
                "ship='auto' / PERSIST_SPARK_SHIP=auto (the default)"
            )
        check = ExecutorCheck(master=master, probes=tuple(probes), shipped=shipped, modules=required)
        _prepared[key] = check
        log.info("Spark executors ready: %s", check.to_json())
        return check


def _same_code(p: ExecutorProbe, mine: str, shipped: str | None) -> bool:
    if shipped is not None and p.fingerprint == f"zip:{os.path.basename(shipped)}":
        return True
    return p.fingerprint == mine


def _raise_missing(probes: list[ExecutorProbe]) -> None:
    for p in probes:
        if p.missing:
            raise ExecutorEnvironmentError(
                f"Spark executor {p.host} ({p.executable}, Python {p.python}) lacks "
                f"{', '.join(p.missing)}: binary dependencies can't be shipped with the job; "
                f"install them in the workers' Python (pip install {' '.join(_PIP.get(m, m) for m in p.missing)})"
            )
