"""The background compactor's merges never import polars inline (``kernels.no_polars_import``):
the import holds the GIL for ~0.1 s, and the first merge big enough to want polars' gather
(>= ``MIN_POLARS_ROWS`` rows) ran it in the middle of a writer's burst of commits. The
compactor imports polars once a shard has settled (``kernels.warm``), and ``wait_idle``
waits for that.

Each case runs in a fresh interpreter: the test process has long imported polars."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from persist_lib.shard import kernels

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(
    kernels.polars() is None, reason="polars is not installed (or PERSIST_KERNELS=numpy)"
)

_PRELUDE = """
import sys
from collections import Counter
from pathlib import Path

import pyarrow as pa

from persist_lib import PersistClient, PersistConfig, ShardId
from persist_lib.handles.merge_deferral import DeferralPolicy
from persist_lib.shard import kernels
from persist_lib.shard.spine import compaction_requests

d = Path(sys.argv[1])
(d / "blob").mkdir()
client = PersistClient.open(
    f"file://{d / 'blob'}", f"sqlite:///{d / 'consensus.db'}",
    PersistConfig.for_tests(compaction_enabled=True, compaction_workers=1),
)
KEY = pa.schema([("k", pa.int64())])
VAL = pa.schema([("v", pa.string())])
ROWS = kernels.MIN_POLARS_ROWS // 2 + 1000  # two batches: a merge that wants polars' gather

def batch(t):
    keys = pa.array([(i * 7919 + t) % (4 * ROWS) for i in range(ROWS)], pa.int64())
    return pa.table({"k": keys, "v": pa.array([f"v{t}-{i}" for i in range(ROWS)]),
                     "ts": pa.array([t] * ROWS, pa.int64()), "diff": pa.array([1] * ROWS, pa.int64())})

def expect(n):
    return Counter((k, v, 1) for t in range(n) for k, v in zip(batch(t)["k"].to_pylist(), batch(t)["v"].to_pylist()))

bg = client.background_compactor()
shard = ShardId.new()
w, r = client.open(shard, KEY, VAL)
assert "polars" not in sys.modules, "imported before any merge"
"""


def _run(body: str, tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("PERSIST_KERNELS", None)
    code = textwrap.dedent(_PRELUDE) + textwrap.dedent(body)
    p = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], env=env, capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0, p.stdout + p.stderr


def test_a_background_merge_that_wants_polars_does_not_import_it(tmp_path: Path) -> None:
    """The small-append bench's pattern (commits of 1,000 random keys), with a quiet
    period longer than the test (no settle, so no warm-up): the background merges that
    grow past ``MIN_POLARS_ROWS`` (and asked for polars: counted) run with the
    numpy/pyarrow kernels and leave polars unimported; the shard reads back exactly.
    (Before, the first such merge imported it.)"""
    _run(
        """
        import random
        asked = []
        _orig = kernels.polars
        def counting():
            if "polars" not in sys.modules:
                asked.append(1)
            return _orig()
        kernels.polars = counting
        bg.deferral = DeferralPolicy(quiet_s=3600.0)
        rng = random.Random(7)
        n, rows = 40, 1000
        data = [[rng.randrange(10_000_000) for _ in range(rows)] for _ in range(n)]
        for t in range(n):
            ks = pa.array(data[t], pa.int64())
            w.compare_and_append(pa.table({"k": ks, "v": pa.array([f"val_{k}" for k in data[t]]),
                                           "ts": pa.array([t] * rows, pa.int64()),
                                           "diff": pa.array([1] * rows, pa.int64())}), t, t + 1)
        with bg._idle:  # the merges that ran (the held-back ones wait for the quiet period)
            assert bg._idle.wait_for(lambda: not bg._pending, 60)
        assert bg.stats()["applied"] > 0
        assert asked, "no merge asked for polars: the test does not exercise the path"
        assert "polars" not in sys.modules, "a background merge imported polars"
        got = {(x["k"], x["v"]): x["diff"] for x in r.snapshot(n - 1).to_pylist()}
        assert got == dict(Counter((k, f"val_{k}") for t in range(n) for k in data[t]))
        client.close()
        """,
        tmp_path,
    )


def test_the_compactor_warms_polars_once_a_shard_settles(tmp_path: Path) -> None:
    """With burst deferral on, the held-back merge runs once the shard is quiet, and the
    compactor then imports polars in its pool; ``wait_idle`` returns only after that."""
    _run(
        """
        bg.deferral = DeferralPolicy(quiet_s=0.05, max_fanin=8, max_updates=1_000_000)
        for t in range(2):
            w.compare_and_append(batch(t), t, t + 1)
        assert bg.wait_idle(60)
        assert "polars" in sys.modules, "the settled compactor did not warm polars"
        assert kernels.polars() is not None
        st = client.machine(shard).fetch_latest()
        assert compaction_requests(st) == [] and len(st.trace_batches()) == 1
        got = Counter((x["k"], x["v"], x["diff"]) for x in r.snapshot(1).to_pylist())
        assert got == expect(2)
        client.close()
        """,
        tmp_path,
    )


def test_no_polars_import_is_per_thread_and_warm_imports() -> None:
    """Under ``no_polars_import`` a fresh process's ``polars()`` is None (on that thread
    only) and the exact kernels run; ``warm`` imports polars."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("PERSIST_KERNELS", None)
    code = textwrap.dedent(
        """
        import sys, threading
        import numpy as np
        import pyarrow as pa
        from persist_lib.shard import kernels
        t = pa.table({"s": pa.array([f"x{i % 977}" for i in range(kernels.MIN_POLARS_ROWS + 5)])})
        idx = np.arange(t.num_rows - 1, -1, -3, dtype=np.int64)
        with kernels.no_polars_import():
            assert kernels.polars() is None
            assert kernels.take_rows(t, idx).equals(t.take(pa.array(idx)))
            assert "polars" not in sys.modules
            seen = []
            th = threading.Thread(target=lambda: seen.append(kernels.polars() is not None))
            th.start(); th.join()
            assert seen == [True], "another thread was bound by this thread's policy"
            assert kernels.polars() is not None  # imported now (by the other thread): used
        assert kernels.warm()
        """
    )
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
