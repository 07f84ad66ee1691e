"""Stateful property test of the shard API against a pure model (Hypothesis).

The state machine (``persist_lib.testing.stateful.ShardStateMachine``) covers writes
with good and bad bounds, definite appends, snapshots, listens, since downgrades,
heartbeats, compaction, GC, an injected clock with lease expiry, scripted
compare-and-set faults and restarts; the invariants compare the shard with the model
after every step. Default: 100 examples x <= 30 steps; ``STATEFUL_EXAMPLES`` /
``STATEFUL_STEPS`` raise it (the long tier does).
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from persist_lib.testing.stateful import ShardStateMachine

EXAMPLES = int(os.environ.get("STATEFUL_EXAMPLES", "100"))
STEPS = int(os.environ.get("STATEFUL_STEPS", "30"))

SETTINGS = settings(
    max_examples=EXAMPLES,
    stateful_step_count=STEPS,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    print_blob=True,
)


def test_shard_api_matches_model() -> None:
    run_state_machine_as_test(ShardStateMachine, settings=SETTINGS)
