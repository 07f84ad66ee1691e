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

**The shipped zip can't be swapped.** The driver builds it in a private directory
(``{tmp}/persist_lib-code-{uid}``, mode 0700, owned by this user: a directory that is
not, or a symlink, is never used -- a fresh ``mkdtemp`` is), byte for byte reproducible
and named after the sha256 of its bytes (``persist_lib-<sha256>.zip``). An existing
file of that name is reused only if its bytes still hash to its name; otherwise it is
rebuilt. The digest travels with the job (in the file name, and in the probe, which
is pickled by value): on each executor the probe hashes the zip it would import
``persist_lib`` from -- before anything imports it -- and reports a zip whose bytes do
not hash to its name or to the driver's digest as *refused*; ``prepare_executors`` then
raises instead of running any task.

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
import io
import logging
import os
import re
import stat
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
    fingerprint: str | None  # sha256 of its sources (a zip: "zip:" + sha256 of its bytes)
    missing: tuple[str, ...]
    refused: str | None = None  # why the zip it would import from failed its sha256 check


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


_ZIP_NAME = re.compile(r"persist_lib-([0-9a-f]{64})\.zip")
_fallback_dir: Path | None = None
_fallback_lock = threading.Lock()  # (not _lock: prepare_executors holds that one)


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def zip_digest(path: str | Path) -> str:
    """The sha256 a shipped zip's name says its bytes have."""
    m = _ZIP_NAME.fullmatch(os.path.basename(str(path)))
    if m is None:
        raise InvalidUsage(f"{path} is not a shipped persist_lib zip (persist_lib-<sha256>.zip)")
    return m.group(1)


def _zip_bytes(root: Path) -> bytes:
    """The zip of ``root``'s sources, the same bytes for the same sources (fixed
    timestamps and modes, sorted entries)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for p in _sources(root):
            info = zipfile.ZipInfo((Path("persist_lib") / p.relative_to(root)).as_posix(), (1980, 1, 1, 0, 0, 0))
            info.external_attr = 0o644 << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(info, p.read_bytes())
    return buf.getvalue()


def _private(d: Path) -> bool:
    """Whether ``d`` is a real directory (not a symlink) of this user that no one else
    can write to (its mode is tightened to 0700 if it is ours)."""
    try:
        st = os.lstat(d)
    except FileNotFoundError:
        return False
    if not stat.S_ISDIR(st.st_mode) or (hasattr(os, "geteuid") and st.st_uid != os.geteuid()):
        return False
    if st.st_mode & 0o077:
        os.chmod(d, 0o700)
    return True


def code_dir() -> Path:
    """The private directory the driver builds its zip in: ``{tmp}/persist_lib-code-{uid}``
    (0700), or, when that path is someone else's or not a directory, a fresh private one
    for this process."""
    global _fallback_dir
    uid = os.geteuid() if hasattr(os, "geteuid") else "user"
    d = Path(tempfile.gettempdir()) / f"persist_lib-code-{uid}"
    try:
        d.mkdir(mode=0o700)
    except FileExistsError:
        pass
    if _private(d):
        return d
    with _fallback_lock:
        if _fallback_dir is None or not _private(_fallback_dir):
            log.warning("%s is not a private directory of this user: building the persist_lib zip elsewhere", d)
            _fallback_dir = Path(tempfile.mkdtemp(prefix="persist_lib-code-"))
        return _fallback_dir


def build_project_zip(dest_dir: str | None = None) -> str:
    """A zip of the driver's persist_lib (sources only) in ``dest_dir`` (default: the
    private ``code_dir()``), named after the sha256 of its bytes. A file already there
    under that name is reused only if its bytes still have that digest."""
    data = _zip_bytes(package_dir())
    digest = hashlib.sha256(data).hexdigest()
    d = Path(dest_dir) if dest_dir else code_dir()
    dest = d / f"persist_lib-{digest}.zip"
    if dest.is_file() and not dest.is_symlink() and file_sha256(dest) == digest:
        return str(dest)
    if dest.exists() or dest.is_symlink():
        log.warning("%s does not hold the bytes its name says: rebuilding it", dest)
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".persist_lib-", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, dest)  # replaces a file, or a symlink itself (never its target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return str(dest)


# The probe runs where persist_lib may not be importable: its source is compiled in a
# namespace that isn't an importable module, so cloudpickle ships it by value (with
# REQUIRED, the modules to check, and EXPECTED, the sha256 of the zip the driver
# shipped, or None). It never imports persist_lib: it checks a zip's bytes first.
_PROBE_SRC = r'''
def check_zip(path, expected):
    """(fingerprint, why it is refused or None) of the zip at path: its bytes must hash
    to the digest in its name (persist_lib-<sha256>.zip) and to expected (if given)."""
    import hashlib, os, re
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    got = h.hexdigest()
    m = re.fullmatch(r"persist_lib-([0-9a-f]{64})\.zip", os.path.basename(path))
    if m is not None and m.group(1) != got:
        return "zip:" + got, "%s: its bytes have sha256 %s, not the %s its name says" % (path, got, m.group(1))
    if expected is not None and got != expected:
        return "zip:" + got, "%s: its bytes have sha256 %s, not the driver's %s" % (path, got, expected)
    return "zip:" + got, None


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
    where = fp = refused = None
    try:
        spec = importlib.util.find_spec("persist_lib")
    except Exception:
        spec = None
    if spec is not None and spec.origin:
        where = os.path.dirname(spec.origin)
        if ".zip" in where:
            fp, refused = check_zip(where.split(".zip")[0] + ".zip", EXPECTED)
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
        "refused": [refused],
    })
'''


def _probe_fn(required: tuple[str, ...], expected: str | None = None) -> Any:
    """The probe executors run (``expected``: the sha256 of the zip the driver shipped)."""
    ns: dict[str, Any] = {"__name__": "persist_executor_probe", "REQUIRED": required, "EXPECTED": expected}
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


def _probe(spark: Any, required: tuple[str, ...], tasks: int, shipped: str | None = None) -> list[ExecutorProbe]:
    schema = (
        "host string, python string, executable string, persist_lib string, fingerprint string, "
        "missing string, refused string"
    )
    expected = zip_digest(shipped) if shipped else None
    df = spark.range(tasks, numPartitions=tasks).mapInArrow(_probe_fn(required, expected), schema)
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
            refused=r["refused"],
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
        probes = _probe(spark, required, tasks, shipped)
        _raise_refused(probes)
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
            probes = _probe(spark, required, tasks, shipped)
            _raise_refused(probes)
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
    if shipped is not None and p.fingerprint == f"zip:{zip_digest(shipped)}" and p.refused is None:
        return True
    return p.fingerprint == mine


def _raise_refused(probes: list[ExecutorProbe]) -> None:
    for p in probes:
        if p.refused:
            raise ExecutorEnvironmentError(
                f"Spark executor {p.host} ({p.executable}) refused the persist_lib zip it would "
                f"import: {p.refused}. The file was changed after the driver built it (or another "
                "zip shadows it on the executors' Python path); nothing was run. Check who can "
                "write to the driver's code directory and the workers' Spark directories, then rerun"
            )


def _raise_missing(probes: list[ExecutorProbe]) -> None:
    for p in probes:
        if p.missing:
            raise ExecutorEnvironmentError(
                f"Spark executor {p.host} ({p.executable}, Python {p.python}) lacks "
                f"{', '.join(p.missing)}: binary dependencies can't be shipped with the job; "
                f"install them in the workers' Python (pip install {' '.join(_PIP.get(m, m) for m in p.missing)})"
            )
