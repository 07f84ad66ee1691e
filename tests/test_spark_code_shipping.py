"""The persist_lib zip shipped to Spark executors can't be swapped (issue 26, defect 5).

The driver used to write it as ``{tmp}/persist_lib-<fingerprint[:16]>.zip`` in the
shared temp directory and reuse any file of that name; executors accepted a zip by its
name. Now: a private (0700) directory, a name that is the sha256 of the bytes, a reused
file re-hashed, and the executor's probe hashing the zip before anything imports it.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import pytest

from persist_lib.spark import executors as ex

REPO = Path(__file__).resolve().parents[1]
pytest.importorskip("pyspark")


def _evil_zip(path: Path, marker: Path) -> None:
    """A zip whose persist_lib, once imported, leaves ``marker`` behind."""
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("persist_lib/__init__.py", f"open({str(marker)!r}, 'w').write('pwned')\n")


def _sha(p: Path | str) -> str:
    return hashlib.sha256(Path(p).read_bytes()).hexdigest()


@pytest.fixture()
def tmpdir_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``tempfile.gettempdir()`` is ``tmp_path`` (the shared temp dir of this test)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(ex, "_fallback_dir", None, raising=False)
    return tmp_path


def test_a_planted_or_tampered_zip_is_never_shipped(tmpdir_only: Path) -> None:
    tmp = tmpdir_only
    marker = tmp / "pwned"
    # Another local user plants a zip under the name the driver used to use.
    planted = tmp / f"persist_lib-{ex.fingerprint()[:16]}.zip"
    _evil_zip(planted, marker)
    path = Path(ex.build_project_zip())
    assert path != planted and path.parent == tmp / f"persist_lib-code-{os.geteuid()}"
    st = os.lstat(path.parent)
    assert st.st_uid == os.geteuid() and (st.st_mode & 0o777) == 0o700
    digest = _sha(path)
    assert path.name == f"persist_lib-{digest}.zip" and ex.zip_digest(path) == digest
    with zipfile.ZipFile(path) as z:  # the driver's own sources, nothing else
        names = set(z.namelist())
        assert names == {f"persist_lib/{p.relative_to(ex.package_dir()).as_posix()}" for p in ex._sources(ex.package_dir())}
        assert z.read("persist_lib/spark/executors.py") == Path(ex.__file__).read_bytes()
    assert Path(ex.build_project_zip()) == path and _sha(path) == digest  # reproducible, reused
    # The file is swapped in place: it is rebuilt, not reused.
    _evil_zip(path, marker)
    assert Path(ex.build_project_zip()) == path and _sha(path) == digest
    # A symlink in its place is replaced, its target left alone.
    path.unlink()
    path.symlink_to(planted)
    assert Path(ex.build_project_zip()) == path and not path.is_symlink() and _sha(path) == digest
    assert not marker.exists()


def test_a_code_directory_of_someone_else_is_not_used(tmpdir_only: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to create a directory owned by another user")
    d = tmpdir_only / f"persist_lib-code-{os.geteuid()}"
    d.mkdir(mode=0o777)
    os.chown(d, 65534, 65534)  # created first by "nobody"
    path = Path(ex.build_project_zip())
    assert path.parent != d and not any(d.iterdir())
    assert (os.lstat(path.parent).st_mode & 0o777) == 0o700 and _sha(path) == ex.zip_digest(path)


_RUN_PROBE = r"""
import importlib, json, pickle, sys
out = []
for zip_path, probe_file in json.loads(sys.argv[1]):
    sys.path.insert(1, zip_path)  # where PySpark's worker puts a job's py-files
    importlib.invalidate_caches()
    probe = pickle.load(open(probe_file, "rb"))
    rows = [r for b in probe(iter([])) for r in b.to_pylist()]
    out.append({"rows": rows, "imported": "persist_lib" in sys.modules})
    sys.path.remove(zip_path)
print(json.dumps(out))
"""


def _run_probe_as_executor(cases: list[tuple[Path, str | None]], tmp: Path) -> list[dict[str, Any]]:
    """The probe, pickled as Spark pickles it, run by a fresh interpreter that has each
    case's zip on its path the way a Python worker has a job's py-files (and no other
    persist_lib ahead of it); ``None``: the driver shipped nothing it expects."""
    from pyspark import cloudpickle

    args = []
    for i, (zip_path, expected) in enumerate(cases):
        pickled = tmp / f"probe{i}.pkl"
        pickled.write_bytes(cloudpickle.dumps(ex._probe_fn(("pyarrow",), expected)))
        args.append((str(zip_path), str(pickled)))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(
        [sys.executable, "-c", _RUN_PROBE, json.dumps(args)],
        capture_output=True, text=True, cwd=tmp, env=env, timeout=120, check=True,
    )
    return list(json.loads(out.stdout.strip().splitlines()[-1]))


def test_the_executor_refuses_a_tampered_zip_before_importing_it(tmpdir_only: Path) -> None:
    tmp = tmpdir_only
    good = Path(ex.build_project_zip())
    digest = ex.zip_digest(good)
    # What reaches the executor under the same name has other bytes.
    marker = tmp / "pwned"
    swapped = tmp / "executor" / good.name
    swapped.parent.mkdir()
    _evil_zip(swapped, marker)
    # the genuine zip; the swapped one against the driver's digest, and against its name
    ok, *bad = _run_probe_as_executor([(good, digest), (swapped, digest), (swapped, None)], tmp)
    assert ok["rows"][0]["fingerprint"] == f"zip:{digest}" and ok["rows"][0]["refused"] is None
    assert str(good) in ok["rows"][0]["persist_lib"]
    for seen in bad:
        (row,) = seen["rows"]
        assert row["refused"] and "not the" in row["refused"] and _sha(swapped) in row["refused"]
        assert not seen["imported"] and not marker.exists()  # checked before any import
    # The driver turns a refusal into a typed error naming the executor; nothing runs.
    probe = ex.ExecutorProbe("w1", "3.11.0", "/py", str(swapped), row["fingerprint"], (), row["refused"])
    with pytest.raises(ex.ExecutorEnvironmentError, match="w1 .*refused the persist_lib zip.*nothing was run"):
        ex._raise_refused([probe])
    assert not ex._same_code(probe, ex.fingerprint(), str(good))


_LOCAL_SPARK = r"""
import json, sys
import pyarrow as pa
from persist_lib import PersistClient, PersistConfig, ShardId
from persist_lib.spark import read_snapshot, write_batch
from persist_lib.spark.executors import prepare_executors
from persist_lib.spark.session import local_session

spark = local_session("local[2]", "ship-test", {"spark.ui.enabled": "false", "spark.sql.shuffle.partitions": "2"})
check = prepare_executors(spark, ship="always")
client = PersistClient.open("file://" + sys.argv[1] + "/blob", "sqlite:///" + sys.argv[1] + "/c.db", PersistConfig.for_tests())
w, r = client.open(ShardId.new(), pa.schema([("k", pa.int64())]), pa.schema([("v", pa.int64())]))
df = spark.range(100).selectExpr("id AS k", "id * 2 AS v", "0L AS ts", "1L AS diff")
write_batch(df, w, 0, 1)
got = sorted(tuple(x) for x in read_snapshot(spark, r, 0).select("k", "v").collect())
print(json.dumps({"shipped": check.shipped, "fingerprints": sorted({p.fingerprint for p in check.probes}),
                  "refused": [p.refused for p in check.probes], "rows": len(got),
                  "ok": got == [(i, 2 * i) for i in range(100)]}))
spark.stop()
"""


@pytest.mark.slow  # its own JVM (the shipped zip must not stay on the shared session's workers)
def test_shipping_to_local_spark_executors_still_works(tmpdir_only: Path) -> None:
    """A real local[2] application with ship='always': the executors' probe verifies the
    shipped zip (the workers import persist_lib from it: the working directory, first on
    their path, holds no other), and a write and a read run on it."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(tmpdir_only)}
    out = subprocess.run(
        [sys.executable, "-c", _LOCAL_SPARK, str(tmpdir_only)],
        capture_output=True, text=True, env=env, cwd=tmpdir_only, timeout=600, check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    shipped = Path(got["shipped"])
    assert shipped.parent == tmpdir_only / f"persist_lib-code-{os.geteuid()}"
    assert got["fingerprints"] == [f"zip:{_sha(shipped)}"] and got["refused"] == [None] * len(got["refused"])
    assert got["ok"] and got["rows"] == 100


def test_probe_pickles_by_value() -> None:
    """The probe (with its zip check) travels by value: no persist_lib import needed."""
    from pyspark import cloudpickle

    data = cloudpickle.dumps(ex._probe_fn(("pyarrow",), "0" * 64))
    assert b"persist_lib.spark" not in data and pickle.loads(data).__name__ == "probe"
