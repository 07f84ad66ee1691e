"""Planted transaction bugs, each caught by the transactions control (issue 27)."""

from __future__ import annotations

import pytest

from persist_lib.testing.txn_control import SCENARIOS, txn_catches


def test_the_control_passes_on_the_real_code() -> None:
    assert txn_catches(None) is None


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_planted_txn_bug_is_caught(name: str) -> None:
    assert txn_catches(name) is not None, f"the transactions control missed planted bug {name}"
