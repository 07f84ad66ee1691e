"""Planted transaction bugs, each caught by the transactions control (issue 27) and, in
the slow tier, by a transactions history (``persist_lib.testing.txn_history``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from persist_lib.testing.txn_control import SCENARIOS, txn_catches
from persist_lib.testing.txn_history import TXN_HISTORY_EXPECT, txn_history_catches


def test_the_control_passes_on_the_real_code() -> None:
    assert txn_catches(None) is None


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_planted_txn_bug_is_caught(name: str) -> None:
    assert txn_catches(name) is not None, f"the transactions control missed planted bug {name}"


@pytest.mark.slow  # (three histories of ~1 min each at most)
@pytest.mark.parametrize("name", sorted(TXN_HISTORY_EXPECT))
def test_planted_txn_bug_is_caught_by_a_transactions_history(name: str, tmp_path: Path) -> None:
    caught, detail = txn_history_catches(name, 700, str(tmp_path), lambda d: f"sqlite:///{d}/c.db")
    assert caught, f"the transactions history missed planted bug {name}: {detail}"
