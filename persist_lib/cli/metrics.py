"""``persist metrics``: persist's metrics per shard (``persist_lib.shard.metrics``).

Without ``--url`` it reads every shard's state from the location and prints the state
gauges (frontiers, batches, bytes, compaction debt, readers, writers); counters
(commits, CAS retries, blob requests and their cost, bytes and parts moved, lease
expiries) belong to the process that did the work, so ``--url`` reads them from a
process serving its metrics (``PERSIST_METRICS_PORT``). Read-only: it registers nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.request
from typing import Any

from persist_lib.cli.main import command
from persist_lib.cli.output import id_table
from persist_lib.errors import InvalidUsage
from persist_lib.handles.client import PersistClient
from persist_lib.shard import metrics
from persist_lib.timefmt import short_time_text

EPILOG = """\
Counters are per process: a process serves its own at http://127.0.0.1:PORT/metrics
when PERSIST_METRICS_PORT=PORT is set (PERSIST_METRICS_ADDR picks the address; a
Dagster run worker, an ingestion, a notebook). Blob requests are counted as S3 bills
them and priced at AWS S3 Standard list prices: PUT/LIST $0.005 per 1,000 requests,
GET $0.0004 per 1,000, DELETE free.

Examples:
  persist metrics                                   shard states of the location
  persist metrics --url 127.0.0.1:9464              a running process's metrics, per shard
  persist metrics --url 127.0.0.1:9464 --prometheus the raw Prometheus text
"""

STATE = ["upper", "since", "batches", "bytes", "debt", "readers", "writers"]
ACTIVITY = [
    "commits", "cas_retries", "put", "get", "list", "delete", "cost_usd",
    "bytes_written", "bytes_read", "parts_written", "parts_read", "lease_expiries", "listen_lag",
]


def _args(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = EPILOG
    p.add_argument(
        "--url",
        default=None,
        help="read the metrics a process serves (HOST:PORT or a URL; default: the shard "
        "states of the location, no counters)",
    )
    g = p.add_mutually_exclusive_group()
    g.add_argument("--json", action="store_true", help="print {shard: {metric: value}} as JSON")
    g.add_argument("--prometheus", action="store_true", help="print the Prometheus text format")


def _url(u: str) -> str:
    if "://" not in u:
        u = "http://" + u
    scheme, _, rest = u.partition("://")
    if "/" not in rest:
        u += "/metrics"
    if scheme not in ("http", "https"):
        raise InvalidUsage(f"--url {u!r}: only http(s) URLs can be scraped")
    return u


def _scrape(url: str, timeout_s: float) -> str:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:  # noqa: S310 - http(s) only
            return bytes(resp.read()).decode("utf-8")
    except OSError as e:
        raise InvalidUsage(
            f"could not read metrics from {url}: {e} (is a process serving them there? set "
            "PERSIST_METRICS_PORT in it)"
        ) from None


def _roles(client: PersistClient) -> dict[str, str]:
    """What each shard is: ``orders / r1 / shard 0 of 8``, ``orders (metadata)``; shards
    numbered from 0, as everywhere else (``persist describe``, the Dagster partitions)."""
    from persist_lib.storage import StorageController

    out: dict[str, str] = {}
    with StorageController(client, read_only=True) as ctl:
        out[str(ctl.catalog.shard)] = "(catalog)"
        for name in ctl.list_collections():
            d = ctl.describe(name)
            out[d["metadata_shard"]] = f"{name} (metadata)"
            for r, info in d["renditions"].items():
                n = len(info["shards"])
                for i, s in enumerate(info["shards"]):
                    out[s] = f"{name} / {r} / shard {i} of {n}"
    return out


@command(
    "metrics",
    "print persist's metrics per shard: state gauges, or a process's counters (--url)",
    _args,
)
def _cmd_metrics(client: PersistClient, ns: argparse.Namespace) -> Any:
    try:
        if ns.url or ns.prometheus:
            import prometheus_client  # noqa: F401
    except ModuleNotFoundError:
        raise InvalidUsage(
            "--url / --prometheus need prometheus-client: pip install 'persist-platform[metrics]'"
        ) from None
    if ns.url:
        url = _url(ns.url)
        text = _scrape(url, ns.timeout)
        if ns.prometheus:
            sys.stdout.write(text)
            return None
        values = metrics.parse_exposition(text)
        columns = STATE + ACTIVITY
    else:
        machines = [client.machine(s) for s in client.list_shards()]  # kept: the cache is weak
        for m in machines:
            m.fetch_latest()
        if ns.prometheus:
            sys.stdout.write(metrics.exposition())
            return None
        values = metrics.state_samples()
        columns = STATE
    rows = metrics.by_shard(values)
    roles = _roles(client)
    if ns.json:
        doc = {
            sid: {"role": roles.get(sid, ""), **{c: _num(row.get(c, 0.0), c) for c in columns}}
            for sid, row in sorted(rows.items())
        }
        json.dump(doc, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return None
    order = sorted(rows, key=_shard_order(roles))
    print(_state_table(order, roles, rows))
    print(f"({len(order)} shard{'s' if len(order) != 1 else ''})")
    if ns.url:
        active = [s for s in order if any(rows[s].get(c) for c in ACTIVITY)]
        tot = {c: sum(rows[s].get(c, 0.0) for s in active) for c in ACTIVITY if c != "listen_lag"}
        # two tables (requests and their cost; data moved) so that each fits 120 columns
        for part in (ACTIVITY[:7], ACTIVITY[7:]):
            act = [(roles.get(s) or "-", *(_fmt(rows[s].get(c, 0.0), c) for c in part)) for s in active]
            act.append(("", *(_fmt(tot[c], c) if c in tot else "-" for c in part)))
            print()
            print(id_table("shard", [*active, "total"], ["role", *part], act))
    else:
        print(
            "(counters - commits, blob requests and their cost - are per process:\n"
            " `persist metrics --url HOST:PORT` reads a process serving them, see --help)"
        )
    return None


def _shard_order(roles: dict[str, str]) -> Any:
    """Shards by role, a rendition's shards by their number (0, 1, ..., 10), then by id."""

    def key(sid: str) -> tuple[str, int, str]:
        role = roles.get(sid, "~")
        head, sep, tail = role.rpartition(" / shard ")
        if sep:
            num = tail.split(" of ")[0]
            return (head, int(num) if num.isdigit() else 0, sid)
        return (role, 0, sid)

    return key


def _state_table(order: list[str], roles: dict[str, str], rows: dict[str, dict[str, float]]) -> str:
    """The state gauges, one shard per two lines (``output.id_table``: the shard id, then
    its role and gauges); times as ISO-8601 UTC timestamps, a closed frontier in words."""
    body = [(roles.get(s) or "-", *(_state_cell(rows[s].get(c, 0.0), c) for c in STATE)) for s in order]
    return id_table("shard", order, ["role", *STATE], body, keys=["role", "upper_short", "since_short", *STATE[2:]])


def _state_cell(v: float, col: str) -> str | int:
    """A state gauge for the table: frontiers as times (an epoch-ms time as its ISO-8601
    UTC timestamp, ``--json`` has the integer), a closed frontier (the gauge's -1) in
    words: a finalized shard's upper is ``closed (finalized)``, a released since
    ``closed``."""
    if col in ("upper", "since"):
        if v < 0:
            return "closed (finalized)" if col == "upper" else "closed"
        return short_time_text(int(v))
    return int(v)


def _num(v: float, col: str) -> float | int:
    return v if col == "cost_usd" else int(v)


def _fmt(v: float, col: str) -> str | int:
    return f"${v:.6f}" if col == "cost_usd" else int(v)
