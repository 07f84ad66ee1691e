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

from persist_lib.testing import planted
from persist_lib.testing.controls import (
    STATEFUL_BUGS,
    background_compaction_catches,
    corruption_catches,
    first_open_catches,
    stateful_catches,
)
from persist_lib.testing.runner import HistoryResult, default_config, run_history


def test_catalogue_is_complete() -> None:
    assert set(planted.PLANTED_BUGS) == set(planted.CAUGHT_BY)
    assert len(planted.PLANTED_BUGS) >= 6


# ----- caught by the stateful model test --------------------------------------------------


@pytest.mark.parametrize("name", STATEFUL_BUGS)
def test_stateful_catches(name: str) -> None:
    assert stateful_catches(name) is not None, f"the stateful test missed planted bug {name}"


# ----- caught by the corruption property ---------------------------------------------------


def test_corruption_property_catches_skipped_checksum() -> None:
    assert corruption_catches() is not None, "bit flips were never returned as data without the checksum"


# ----- caught by the history checker (real processes) --------------------------------------


def _caught(seed: int, root: Path, uri: str | None, bug: str, kinds: set[str], **kw: object) -> HistoryResult:
    """Runs up to two short histories with ``bug`` planted; returns the first that shows
    one of ``kinds`` (histories depend on OS scheduling, so one may miss by chance)."""
    res = None
    for attempt in range(2):
        d = root / f"a{attempt}"
        u = uri or "sqlite:///" + quote(str(d / "c.db"))
        cfg = default_config(seed + 100 * attempt, str(d), u, target_ops=120, time_limit_s=90, planted=[bug], **kw)
        res = run_history(cfg)
        if res.report.by_kind().keys() & kinds:
            return res
    assert res is not None
    return res


RACE_KINDS = {"consensus_fork", "acked_write_lost", "corruption_observed", "consensus_entry_rewritten"}
GC_KINDS = {"reachable_blob_deleted", "blob_not_found_with_lease"}


def test_history_catches_sqlite_cas_race(tmp_path: Path) -> None:
    res = _caught(7, tmp_path, None, "sqlite_cas_race", RACE_KINDS)
    assert res.report.by_kind().keys() & RACE_KINDS, res.describe()


@pytest.mark.slow  # (default suite's budget; test_reliability_long::test_planted_bugs_all_caught runs every planted bug)
@pytest.mark.postgres
def test_history_catches_pg_cas_not_exists(tmp_path: Path, pg_server: object) -> None:
    url = pg_server.create_database()  # type: ignore[attr-defined]
    res = _caught(8, tmp_path, url, "pg_cas_not_exists", RACE_KINDS)
    assert res.report.by_kind().keys() & RACE_KINDS, res.describe()


@pytest.mark.slow  # (default suite's budget; test_reliability_long::test_planted_bugs_all_caught runs every planted bug)
def test_history_catches_gc_ignoring_holds(tmp_path: Path) -> None:
    res = _caught(9, tmp_path, None, "gc_ignores_holds", GC_KINDS, inline_threshold=0)
    assert res.report.by_kind().keys() & GC_KINDS, res.describe()


# ----- issue 13: interrupts, skewed sweeps vs long writes, heartbeats, failing merges -----


@pytest.mark.slow  # (default suite's budget; test_reliability_long::test_planted_bugs_all_caught runs every planted bug)
def test_history_catches_sweeper_without_the_in_flight_guard(tmp_path: Path) -> None:
    kinds = GC_KINDS | {"part_missing"}
    res = _caught(
        11, tmp_path, None, "sweeper_no_inflight_guard", kinds,
        inline_threshold=0, long_write_rate=0.35, sweep_rate=0.6, long_write_pause_s=(0.1, 0.4),
    )
    assert res.report.by_kind().keys() & kinds, res.describe()


@pytest.mark.slow  # (default suite's budget; test_reliability_long::test_planted_bugs_all_caught runs every planted bug)
def test_history_catches_a_heartbeat_thread_that_dies(tmp_path: Path) -> None:
    kinds = {"heartbeat_thread_dead"}
    res = _caught(12, tmp_path, None, "heartbeat_thread_dies", kinds, heartbeat_fault_rate=0.5)
    assert res.report.by_kind().keys() & kinds, res.describe()


@pytest.mark.slow  # (default suite's budget; test_reliability_long::test_planted_bugs_all_caught runs every planted bug)
def test_history_catches_delete_on_any_exception(tmp_path: Path) -> None:
    kinds = GC_KINDS | {"part_missing", "snapshot_mismatch", "trace_contents_wrong"}
    res = _caught(13, tmp_path, None, "delete_on_any_exception", kinds, interrupt_rate=0.08, inline_threshold=0)
    assert res.report.by_kind().keys() & kinds, res.describe()


def test_history_catches_a_verified_append_that_skips_below_the_since(tmp_path: Path) -> None:
    """Issue 26: divergent verified appends (their reader's since moved into the
    replayed range) must stop; with the old skip-and-count one returns normally."""
    kinds = {"unverified_replay_accepted"}
    res = _caught(14, tmp_path, None, "verified_append_skips", kinds, verified_append_rate=0.3)
    assert res.report.by_kind().keys() & kinds, res.describe()


def test_background_compaction_control_catches_immediate_retry() -> None:
    assert background_compaction_catches(None) is None, "the real code hot-loops or never quarantines"
    assert background_compaction_catches("immediate_retry") is not None, "the hot loop went unnoticed"


def test_first_open_control_catches_an_open_without_retry() -> None:
    assert first_open_catches(None) is None, "a first open failed while a rival held the lock"
    assert first_open_catches("sqlite_first_open_no_retry") is not None, "the failing open went unnoticed"
