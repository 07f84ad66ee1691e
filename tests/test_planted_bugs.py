"""Negative controls: planted bugs that the reliability checks must catch (R12).

Each bug in ``persist_lib.testing.planted`` is activated for one test and the check
that should catch it must fail: the stateful model test for logic bugs in transitions
and compaction, the history checker for races and GC safety (which need real
processes), the corruption property for the skipped checksum. If one of these tests
fails, the corresponding checker has gone blind.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import quote

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import run_state_machine_as_test

from persist_lib.testing import planted
from persist_lib.testing.corruption import CorruptionFixture, flip_bit
from persist_lib.testing.runner import HistoryResult, default_config, run_history
from persist_lib.testing.stateful import ShardStateMachine

CONTROL = settings(
    max_examples=200,
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
)


def test_catalogue_is_complete() -> None:
    assert set(planted.PLANTED_BUGS) == set(planted.CAUGHT_BY)
    assert len(planted.PLANTED_BUGS) >= 6


# ----- caught by the stateful model test --------------------------------------------------


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


@pytest.mark.parametrize("name", STATEFUL_BUGS)
def test_stateful_catches(name: str) -> None:
    assert stateful_catches(name) is not None, f"the stateful test missed planted bug {name}"


# ----- caught by the corruption property ---------------------------------------------------


def corruption_catches(name: str = "skipped_checksum", examples: int = 300) -> str | None:
    """Runs the corruption property with ``name`` planted; returns the counterexample."""
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


def test_corruption_property_catches_skipped_checksum() -> None:
    assert corruption_catches() is not None, "bit flips were never returned as data without the checksum"


# ----- caught by the history checker (real processes) --------------------------------------


def _history(seed: int, root: Path, uri: str, bug: str, **kw: object) -> HistoryResult:
    cfg = default_config(seed, str(root), uri, target_ops=150, time_limit_s=90, planted=[bug], **kw)
    return run_history(cfg)


RACE_KINDS = {"consensus_fork", "acked_write_lost", "corruption_observed", "consensus_entry_rewritten"}


def test_history_catches_sqlite_cas_race(tmp_path: Path) -> None:
    res = _history(7, tmp_path, "sqlite:///" + quote(str(tmp_path / "c.db")), "sqlite_cas_race")
    assert res.report.by_kind().keys() & RACE_KINDS, res.describe()


@pytest.mark.postgres
def test_history_catches_pg_cas_not_exists(tmp_path: Path, pg_consensus_url: str) -> None:
    res = _history(8, tmp_path, pg_consensus_url, "pg_cas_not_exists")
    assert res.report.by_kind().keys() & RACE_KINDS, res.describe()


def test_history_catches_gc_ignoring_holds(tmp_path: Path) -> None:
    res = _history(9, tmp_path, "sqlite:///" + quote(str(tmp_path / "c.db")), "gc_ignores_holds", inline_threshold=0)
    kinds = res.report.by_kind().keys()
    assert kinds & {"reachable_blob_deleted", "blob_not_found_with_lease"}, res.describe()
