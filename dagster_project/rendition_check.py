"""The blocking Great Expectations check of a rebuilt rendition, run before its handover.

A rendition backfill exists to apply new decoding logic, so what it built must be
validated before anyone reads it: ``backfill_rendition(check=...)`` runs the source's
GE suite (``checks.validate_collection``, the same as ``<src>/ge_contents``) on the new
rendition at the time it would be handed over at, after it caught up and before the
handover. A failure stops the handover (``RenditionCheckFailed``). The outcome is
recorded as the check ``<src>_rendition/ge_contents`` of the backfilled partition
(blocking), and, once handed over, as an evaluation of ``<src>/ge_contents`` in the same
run as the handover's materialization of ``<src>``: the collection's check is evaluated
on what it now reads, and the downstream sensor, which wants a passing blocking check in
the run of each materialization, only runs on a checked rendition.
"""

from __future__ import annotations

from typing import Any

import dagster as dg

from dagster_project.checks import CollectionRules, ValidationOutcome, validate_collection
from dagster_project.metadata import time_point
from dagster_project.renditions import RenditionCheck
from dagster_project.resources import PersistResource
from persist_lib.timefmt import time_text

CHECK_NAME = "ge_contents"


def rendition_check_spec(rendition_key: dg.AssetKey, collection: str) -> dg.AssetCheckSpec:
    return dg.AssetCheckSpec(
        CHECK_NAME,
        asset=rendition_key,
        blocking=True,
        description=(
            f"Great Expectations on the rebuilt rendition of {collection!r} at the handover "
            "time, run before the handover: a failure stops the handover."
        ),
    )


def make_rendition_check(
    persist: PersistResource, collection: str, rules: CollectionRules
) -> RenditionCheck:
    """``check(rendition, at)`` for ``backfill_rendition``."""

    def check(rendition: str, at: int) -> tuple[bool, Any, str]:
        outcome = validate_collection(persist, collection, rules, at, rendition=rendition)
        return outcome.passed, outcome, failure_reason(outcome)

    return check


def failure_reason(outcome: ValidationOutcome) -> str:
    """One line naming each failed expectation, its column and how many rows failed."""
    if outcome.passed:
        return "passed"
    parts = []
    for f in outcome.failures:
        col = f["kwargs"].get("column") or ",".join(f["kwargs"].get("column_list") or [])
        n = f.get("unexpected_count")
        parts.append(f"{f['expectation']}({col})" + (f": {n} row(s)" if n is not None else ""))
    return "failed: " + "; ".join(parts)


def check_metadata(outcome: ValidationOutcome | None, rendition: str, at: int | None) -> dict[str, Any]:
    meta: dict[str, Any] = {"rendition": dg.MetadataValue.text(rendition)}
    if at is not None:
        meta.update(time_point("as_of", int(at)))
    if outcome is not None:
        meta.update(outcome.metadata())
    return meta


def rendition_check_result(
    outcome: ValidationOutcome | None, rendition: str, at: int | None, *, note: str = ""
) -> dg.AssetCheckResult:
    """The result of ``<src>_rendition/ge_contents`` for the backfilled partition."""
    passed = outcome is None or outcome.passed
    meta = check_metadata(outcome, rendition, at)
    if note:
        meta["note"] = dg.MetadataValue.text(note)
    return dg.AssetCheckResult(
        check_name=CHECK_NAME,
        passed=passed,
        severity=dg.AssetCheckSeverity.ERROR,
        metadata=meta,
        description=None
        if passed
        else f"rendition {rendition} {failure_reason(outcome)}: not handed over"  # type: ignore[arg-type]
        if outcome is not None
        else None,
    )


def collection_check_evaluation(
    data_key: dg.AssetKey, outcome: ValidationOutcome, rendition: str, at: int
) -> dg.AssetCheckEvaluation:
    """``<src>/ge_contents`` evaluated on the rendition the collection reads since the
    handover (logged in the backfill run, after the handover's materialization)."""
    return dg.AssetCheckEvaluation(
        asset_key=data_key,
        check_name=CHECK_NAME,
        passed=outcome.passed,
        severity=dg.AssetCheckSeverity.ERROR,
        blocking=True,
        metadata=check_metadata(outcome, rendition, at),
        description=f"checked on rendition {rendition} before the handover at {time_text(at)}",
    )
