"""How far an ingestion has bound a landing zone, read from its remap shard.

The arrival sensor used to judge arrivals by its own cursor alone: an ingestion launched
by hand (``dagster job launch -j ingest_orders_job``, the UI) took the new files, the
cursor stayed behind, and the next tick requested a run that ingested nothing. The remap
shard is the truth: it accumulates to the source frontier bound so far, ``(file, row)``
(every file named before ``file`` and its first ``row`` rows), and its ``file`` notes
record each completed file's row count. A landed file is *bound* when the frontier is past
it, or at its end. Reading it registers a leased reader that is expired right after;
nothing is created (no remap shard yet = nothing bound).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from persist_lib.ingest.addresses import decode_address
from persist_lib.ingest.landing_zone.files import PARTITION
from persist_lib.ingest.outputs import shard_id_for
from persist_lib.ingest.remap import NOTE_PARTITION, REMAP_KEY, REMAP_VAL


@dataclass(frozen=True)
class LandingProgress:
    """The bound frontier ``(file, row)`` of a landing zone and the row count of every
    file the ingestion completed."""

    position: tuple[str, int] = ("", 0)
    rows: dict[str, int] = field(default_factory=dict)

    def bound(self, name: str) -> bool:
        """Whether the landed file ``name`` is bound (ingested, or recorded as an error)."""
        f, r = self.position
        if name != f:
            return name < f
        return name in self.rows and r >= self.rows[name]

    def text(self) -> str:
        f, r = self.position
        return f"{f}, row {r}" if f else "nothing bound yet"


def landing_progress(client: Any, source: str) -> LandingProgress:
    """What the ingestion of ``source`` has bound so far (its remap shard at upper - 1)."""
    shard = str(shard_id_for(source, "remap"))
    machine = client.machine(shard)
    state = machine.fetch_latest()
    if not state.exists or not state.upper.time:
        return LandingProgress()
    reader = client.open_leased_reader(shard, REMAP_KEY, REMAP_VAL, purpose="arrival-sensor")
    try:
        t = machine.fetch_latest().upper.time
        assert t is not None and t > 0
        acc: Counter[tuple[str, str]] = Counter()
        for row in reader.snapshot(t - 1).to_pylist():
            acc[(row["partition"], row["address"])] += int(row["diff"])
    finally:
        reader.expire()
    position: tuple[str, int] = ("", 0)
    rows: dict[str, int] = {}
    for (partition, address), diff in acc.items():
        if diff <= 0:
            continue
        if partition == PARTITION:
            f, r = decode_address(address)
            position = (str(f), int(r))
        elif partition == NOTE_PARTITION:
            note = json.loads(address)
            if note.get("kind") == "file":
                rows[str(note["file"])] = int(note["rows"])
    return LandingProgress(position, rows)
