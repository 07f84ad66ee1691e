"""The transactional-collections state machine (``persist_lib.testing.txn_stateful``):
inserts, multi-collection transactions, compare-and-appends, committers killed at every
step, maintenance, handovers and reads from other controllers, against a pure model.
It catches each planted ``txn_*`` bug (a few seconds each: no shrinking); the slow tier
runs it longer."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from persist_lib.testing.controls import TXN_STATEFUL_BUGS, txn_stateful_catches
from persist_lib.testing.txn_stateful import TxnStateMachine


def _run(examples: int, steps: int) -> None:
    run_state_machine_as_test(
        TxnStateMachine,
        settings=settings(
            max_examples=examples, stateful_step_count=steps, deadline=None, database=None,
            suppress_health_check=list(HealthCheck),
        ),
    )


def test_transactional_collections_follow_the_model() -> None:
    _run(int(os.environ.get("TXN_STATEFUL_EXAMPLES", "6")), 10)


@pytest.mark.slow
def test_transactional_collections_follow_the_model_long() -> None:
    _run(int(os.environ.get("TXN_STATEFUL_LONG_EXAMPLES", "100")), 20)


@pytest.mark.parametrize("name", TXN_STATEFUL_BUGS)
def test_the_state_machine_catches_planted_txn_bug(name: str) -> None:
    assert txn_stateful_catches(name) is not None, f"the txn state machine missed planted bug {name}"
