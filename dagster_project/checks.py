"""Data-quality checks on collection contents with Great Expectations 1.x.

There is no Dagster integration for GE 1.x (``dagster-ge`` needs ``great-expectations<1``),
so the check is written here: the collection's contents at its latest decided time
(``upper - 1``) are read through a STORAGE read handle, turned into a pandas frame and
validated against a suite built from ``CollectionRules`` in an *ephemeral* GE context
(nothing is written to disk). The checks are **blocking**: a failure fails the run and
stops downstream assets.

Expectations:
- every key column (and each ``not_null`` column) is not null;
- each ``ranges`` column lies within its bounds;
- the accumulated diff of every record is positive (``>= 1``), i.e. the collection never
  holds a negative multiplicity (a retraction without its insertion);
- upsert collections (``unique_key``): each key appears at most once with diff exactly 1.
"""

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import dagster as dg

from dagster_project.resources import PersistResource

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

os.environ.setdefault("GX_ANALYTICS_ENABLED", "False")


@dataclass(frozen=True)
class CollectionRules:
    """What a collection's contents must satisfy (see the module docstring)."""

    key_columns: tuple[str, ...]
    not_null: tuple[str, ...] = ()
    ranges: Mapping[str, tuple[float | None, float | None]] = field(default_factory=dict)
    unique_key: bool = False


@dataclass
class ValidationOutcome:
    """The result of one GE validation, as Dagster check metadata."""

    passed: bool
    rows: int
    statistics: dict[str, Any]
    failures: list[dict[str, Any]]

    def metadata(self) -> dict[str, Any]:
        return {
            "rows": self.rows,
            "evaluated": int(self.statistics.get("evaluated_expectations", 0)),
            "successful": int(self.statistics.get("successful_expectations", 0)),
            "success_percent": float(self.statistics.get("success_percent") or 0.0),
            "failures": dg.MetadataValue.json(self.failures),
        }


def _suite(rules: CollectionRules) -> Any:
    import great_expectations as gx

    ex = gx.expectations
    exps: list[Any] = []
    for col in dict.fromkeys((*rules.key_columns, *rules.not_null)):
        exps.append(ex.ExpectColumnValuesToNotBeNull(column=col))
    for col, (lo, hi) in rules.ranges.items():
        exps.append(ex.ExpectColumnValuesToBeBetween(column=col, min_value=lo, max_value=hi))
    exps.append(
        ex.ExpectColumnValuesToBeBetween(
            column="diff", min_value=1, max_value=1 if rules.unique_key else None
        )
    )
    if rules.unique_key:
        if len(rules.key_columns) == 1:
            exps.append(ex.ExpectColumnValuesToBeUnique(column=rules.key_columns[0]))
        else:
            exps.append(ex.ExpectCompoundColumnsToBeUnique(column_list=list(rules.key_columns)))
    return gx.ExpectationSuite(name="collection_contents", expectations=exps)


def validate_frame(df: "pd.DataFrame", rules: CollectionRules) -> ValidationOutcome:
    """Validates a collection snapshot (key/value columns, ``ts``, ``diff``) with GE."""
    import great_expectations as gx
    from great_expectations.data_context.types.base import ProgressBarsConfig

    ctx = gx.get_context(mode="ephemeral")
    ctx.variables.progress_bars = ProgressBarsConfig(globally=False)
    batch_def = (
        ctx.data_sources.add_pandas("collection")
        .add_dataframe_asset(name="contents")
        .add_batch_definition_whole_dataframe("latest")
    )
    res = batch_def.get_batch(batch_parameters={"dataframe": df}).validate(
        _suite(rules), result_format="SUMMARY"
    )
    failures = []
    for r in res.results:
        if r.success:
            continue
        cfg = r.expectation_config
        kwargs = {k: v for k, v in cfg.kwargs.items() if k != "batch_id"}
        failures.append(
            {
                "expectation": cfg.type,
                "kwargs": kwargs,
                "unexpected_count": r.result.get("unexpected_count"),
                "sample": [_plain(v) for v in (r.result.get("partial_unexpected_list") or [])[:5]],
            }
        )
    return ValidationOutcome(bool(res.success), len(df), dict(res.statistics), failures)


def _plain(v: Any) -> Any:
    """JSON-able form of a GE sample value (numpy scalars, NaN)."""
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and v != v:
        return None
    if isinstance(v, str | int | float | bool) or v is None:
        return v
    return str(v)


def read_latest(persist: PersistResource, collection: str) -> tuple["pd.DataFrame", int | None]:
    """The collection's contents at ``upper - 1`` as pandas (empty before the first write)."""
    import pandas as pd

    ctl = persist.controller()
    desc = ctl.describe(collection)
    upper = desc["metadata_upper"]
    active = desc["active_rendition"]
    r_upper = desc["renditions"][active]["upper"] if active else None
    if not upper or not r_upper or min(upper[0], r_upper[0]) == 0:
        return pd.DataFrame(), None
    as_of = min(upper[0], r_upper[0]) - 1
    with ctl.acquire_read_handle(collection) as reader:
        table = reader.snapshot(as_of)
    return table.to_pandas(), as_of


def build_collection_check(
    asset: dg.AssetKey | dg.AssetsDefinition | str,
    collection: str,
    rules: CollectionRules,
    *,
    name: str = "ge_contents",
) -> dg.AssetChecksDefinition:
    """A blocking GE asset check on the latest contents of ``collection``."""

    @dg.asset_check(
        asset=asset,
        name=name,
        blocking=True,
        description=(
            f"Great Expectations on {collection!r} at its latest time: keys not null, value "
            "ranges, positive accumulated diffs" + (", unique keys" if rules.unique_key else "")
        ),
    )
    def _check(persist: PersistResource) -> dg.AssetCheckResult:
        df, as_of = read_latest(persist, collection)
        if as_of is None:
            return dg.AssetCheckResult(
                passed=True, metadata={"rows": 0, "note": "the collection holds no data yet"}
            )
        outcome = validate_frame(df, rules)
        return dg.AssetCheckResult(
            passed=outcome.passed,
            severity=dg.AssetCheckSeverity.ERROR,
            metadata={"as_of": as_of, **outcome.metadata()},
            description=None
            if outcome.passed
            else "failed: " + ", ".join(f["expectation"] for f in outcome.failures),
        )

    return _check


def build_errors_check(
    asset: dg.AssetKey | str, collection: str, *, name: str = "no_decode_errors"
) -> dg.AssetChecksDefinition:
    """A non-blocking (WARN) check: the errors collection holds no records."""

    @dg.asset_check(
        asset=asset,
        name=name,
        blocking=False,
        description=f"Warns when {collection!r} holds records that failed to decode.",
    )
    def _check(persist: PersistResource) -> dg.AssetCheckResult:
        df, as_of = read_latest(persist, collection)
        count = int(df["diff"].sum()) if len(df) else 0
        sample = []
        if count:
            sample = [
                {"address": a, "kind": k, "reason": r[:200]}
                for a, k, r in df[["address", "kind", "reason"]].head(5).itertuples(index=False)
            ]
        return dg.AssetCheckResult(
            passed=count == 0,
            severity=dg.AssetCheckSeverity.WARN,
            metadata={"error_records": count, "sample": dg.MetadataValue.json(sample)},
        )

    return _check


def rules_for(
    key_columns: Sequence[str],
    *,
    not_null: Sequence[str] = (),
    ranges: Mapping[str, tuple[float | None, float | None]] | None = None,
    unique_key: bool = False,
) -> CollectionRules:
    """``CollectionRules`` from plain sequences."""
    return CollectionRules(tuple(key_columns), tuple(not_null), dict(ranges or {}), unique_key)
