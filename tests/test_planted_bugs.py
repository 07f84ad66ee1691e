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
from persist_lib.testing.controls import STATEFUL_BUGS, corruption_catches, stateful_catches
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
