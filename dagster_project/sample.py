"""Sample landing-zone data for the demo pipeline and the tests.

``write_orders_file(dir, batch, n)`` writes ``orders-<batch>.jsonl`` the way a producer
should: under a temporary name, then renamed into place (the landing zone ignores
``.``-prefixed files). Order ids repeat across batches, so later batches update earlier
orders (the upsert envelope keeps the latest). ``bad_rows`` appends lines that do not
decode (they land in ``orders.errors``).
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

STATUSES = ("new", "paid", "shipped", "delivered", "cancelled")
CUSTOMERS = ("alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi")


def order_rows(batch: int, n: int, *, seed: int = 7, id_space: int | None = None) -> list[dict]:
    """``n`` order records of one batch (deterministic for ``(seed, batch)``)."""
    rng = random.Random(seed * 1_000_003 + batch)
    space = id_space or max(n * 2, 10)
    rows = []
    for _ in range(n):
        rows.append(
            {
                "order_id": rng.randrange(1, space + 1),
                "customer": rng.choice(CUSTOMERS),
                "amount": round(rng.uniform(1, 500), 2),
                "status": rng.choice(STATUSES),
            }
        )
    return rows


def write_orders_file(
    directory: str | os.PathLike[str],
    batch: int,
    n: int,
    *,
    seed: int = 7,
    id_space: int | None = None,
    bad_rows: int = 0,
    rows: list[dict] | None = None,
) -> Path:
    """Writes one JSON-lines batch atomically; returns its final path."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    final = d / f"orders-{batch:06d}.jsonl"
    tmp = d / f".{final.name}.tmp"
    data = rows if rows is not None else order_rows(batch, n, seed=seed, id_space=id_space)
    lines = [json.dumps(r, sort_keys=True) for r in data]
    lines += ['{"order_id": "not-a-number", "amount": 1}' for _ in range(bad_rows)]
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, final)
    return final
