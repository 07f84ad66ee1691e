"""Negative controls: run a check with a planted bug and report whether it failed.

Shared by the default tier (``tests/test_planted_bugs.py``) and the soak
(``tests/test_reliability_long.py``). Hypothesis runs derandomized, without shrinking
and without the example database, so a control is reproducible and bounded in time.
"""

from __future__ import annotations

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import run_state_machine_as_test

from persist_lib.testing import planted
from persist_lib.testing.corruption import CorruptionFixture, flip_bit
from persist_lib.testing.stateful import ShardStateMachine

# A planted bug stops the search at its first failure, so the budget only costs when a
# bug is missed; 600 leaves margin for bugs that need a specific rule order (since_regress
# needs a forward then a backward downgrade of the same reader).
CONTROL = settings(
    max_examples=600,
    stateful_step_count=30,
    deadline=None,
    database=None,
    derandomize=True,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=list(HealthCheck),
)

STATEFUL_BUGS = (
    "caa_no_idempotency_token",
    "compaction_drops_part",
    "truncate_deletes_head",
    "lease_expiry_ignores_hb",
    "since_regress",
    "delete_on_any_exception",
)


def stateful_catches(name: str) -> BaseException | None:
    """Runs the state machine with ``name`` planted; returns the failure (None: missed)."""

    class Planted(ShardStateMachine):
        planted_consensus = tuple(n for n in (name,) if n in planted.CONSENSUS_BUGS)

    with planted.activate([name]):
        try:
            run_state_machine_as_test(Planted, settings=CONTROL)
        except Exception as e:  # noqa: BLE001 - any failure of the check counts
            return e
    return None


def corruption_catches(name: str = "skipped_checksum", examples: int = 300) -> str | None:
    """Runs the corruption property over part bit flips with ``name`` planted; returns
    the counterexample (None: every flip was still detected)."""
    fx = CorruptionFixture()
    parts = [t for t in fx.targets if t.kind == "part"]
    found: list[str] = []

    @settings(CONTROL, max_examples=examples)
    @given(i=st.integers(0, len(parts) - 1), pos=st.integers(0, 1 << 40))
    def prop(i: int, pos: int) -> None:
        out = fx.read_corrupted(parts[i], flip_bit(pos))
        if out not in ("detected", "unchanged"):
            found.append(f"{parts[i]} bit {pos}: {out}")
            raise AssertionError(found[-1])

    with planted.activate([name]):
        try:
            prop()
        except AssertionError:
            return found[-1]
    return None


def background_compaction_catches(name: str | None = "immediate_retry", window_s: float = 1.5) -> str | None:
    """A corrupt input part met by background compaction: the merge must back off and be
    quarantined, not retried in a hot loop. Runs with ``name`` planted (None: the real
    code); returns what went wrong (None: behaved)."""
    import time
    import uuid

    import pyarrow as pa

    from persist_lib.config import PersistConfig
    from persist_lib.handles.client import PersistClient
    from persist_lib.ids import ShardId

    key_s, val_s = pa.schema([("k", pa.int64())]), pa.schema([("v", pa.int64())])
    loc = f"mem://{uuid.uuid4().hex}"
    ctx = planted.activate([name]) if name else planted.activate([])
    with ctx:
        client = PersistClient.open(loc, loc, PersistConfig.for_tests(
            compaction_enabled=True, compaction_workers=1, inline_threshold=0,
            compaction_retry_backoff_s=0.1, compaction_retry_backoff_max_s=1.0,
        ))
        try:
            shard = ShardId.new()
            w, _ = client.open(shard, key_s, val_s)
            w.compare_and_append([(((i,), (i,)), 0, 1) for i in range(100)], 0, 1)
            m = client.machine(shard)
            part = next(iter(m.fetch_latest().batches.values())).parts[0]
            assert part.key is not None
            data = client.blob.get(part.key) or b""
            client.raw_blob.set(part.key, data[: len(data) // 2])
            gets = [0]
            orig_get = client.blob.get

            def counting(k: str) -> bytes | None:
                if k == part.key:
                    gets[0] += 1
                return orig_get(k)

            client.blob.get = counting  # type: ignore[method-assign]
            w.compare_and_append([(((i,), (i,)), 1, 1) for i in range(100)], 1, 2)
            time.sleep(window_s)
            attempts = gets[0]
            quarantined = bool(m.fetch_latest().quarantined_merges)
            client.background_compactor().close()
        finally:
            client.close()
    # Two attempts (then quarantine); allow a few more for backoff timers under load.
    if attempts > 6:
        return f"{attempts} merge attempts of a corrupt input in {window_s} s (a hot loop)"
    if not quarantined:
        return f"no quarantine after {attempts} deterministic failures"
    return None


def first_open_catches(name: str | None = "sqlite_first_open_no_retry", hold_s: float = 0.3) -> str | None:
    """Concurrent first opens of a fresh embedded location: while a rival opener holds
    the new file's write lock (as it does while switching it to WAL), another process's
    open must wait, not fail. Runs with ``name`` planted (None: the real code); returns
    what went wrong (None: the open succeeded and works)."""
    import sqlite3
    import tempfile
    import threading
    from pathlib import Path

    from persist_lib.location.base import CaSResult, VersionedData
    from persist_lib.location.sqlite_consensus import SqliteConsensus

    d = Path(tempfile.mkdtemp(prefix="persist-first-open-"))
    path = d / "fresh.db"
    rival = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    rival.execute("BEGIN IMMEDIATE")
    def let_go() -> None:
        rival.execute("COMMIT")
        rival.close()

    release = threading.Timer(hold_s, let_go)
    release.start()
    ctx = planted.activate([name]) if name else planted.activate([])
    try:
        with ctx:
            c = SqliteConsensus(path)
            try:
                res = c.compare_and_set("k", None, VersionedData(1, b"x"))
                if res is not CaSResult.COMMITTED:
                    return f"the first CAS on a freshly opened location answered {res}"
            finally:
                c.close()
    except Exception as e:  # noqa: BLE001 - the failure is the finding
        return f"{type(e).__name__}: {e}"
    finally:
        release.join()
    return None


TXN_STATEFUL_BUGS = ("txn_apply_without_commit", "txn_tidy_before_apply", "txn_reader_skips_apply")
TXN_CONTROL = settings(CONTROL, max_examples=200, stateful_step_count=15)


def txn_stateful_catches(name: str) -> BaseException | None:
    """The transactional-collections state machine with ``name`` planted; returns the
    failure (None: missed)."""
    from persist_lib.testing.txn_stateful import TxnStateMachine

    with planted.activate([name]):
        try:
            run_state_machine_as_test(TxnStateMachine, settings=TXN_CONTROL)
        except Exception as e:  # noqa: BLE001 - any failure of the check counts
            return e
    return None
