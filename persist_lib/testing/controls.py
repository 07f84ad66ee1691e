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
