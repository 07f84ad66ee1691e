"""Run config that Dagster checks when a run is launched, not when its step starts.

Dagster's config schema knows types (``Int``), not ranges, and a pydantic ``Field(ge=...)``
on a ``dg.Config`` is only enforced when the step builds its config object: a launch with
``num_shards: -3`` was accepted and the run then died with a pydantic traceback. A config
type's ``post_process`` (Dagster's hook for custom validation, raising
``PostProcessingError``) runs while the run config is resolved, which happens when the
run is created (``dagster job launch``, the launchpad, ``materialize``): a bad value is
refused there, no run starts, and the error names the field, the value and what is
allowed.
"""

from __future__ import annotations

from typing import Any

import dagster as dg
from dagster._config.config_type import ConfigScalar, ConfigScalarKind
from dagster._config.errors import PostProcessingError

MAX_SHARDS = 1024


class ShardCount(ConfigScalar):
    """An ``Int`` config value that must be a shard count: 0 (the source's default) or
    1..``MAX_SHARDS``."""

    def __init__(self) -> None:
        super().__init__(
            key="ShardCount",
            given_name="ShardCount",
            scalar_kind=ConfigScalarKind.INT,
            description=f"A number of shards: 1 to {MAX_SHARDS}, or 0 for the source's default.",
        )

    def post_process(self, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_SHARDS:
            raise PostProcessingError(
                f"num_shards must be a whole number from 1 to {MAX_SHARDS} (0 = the source's "
                f"default), got {value!r}"
            )
        return value


def rendition_config_schema(default_shards: int) -> dict[str, dg.Field]:
    """The config schema of a rendition backfill (``<src>_rendition``): ``num_shards``,
    defaulting to the source's ``rendition_shards`` so that *Materialize* in the UI (the
    implicit asset job, empty config) builds what the source is configured for and the
    launchpad shows it."""
    return {
        "num_shards": dg.Field(
            ShardCount(),
            default_value=default_shards,
            is_required=False,
            description=(
                f"Shards of the new rendition (default {default_shards}: the source's "
                f"rendition_shards; 0 also means that default; at most {MAX_SHARDS})."
            ),
        )
    }
