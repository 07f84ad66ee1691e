"""Screenshots of the Dagster UI after ``make demo``, taken with headless Chromium.

    make demo                                  # leaves ./.dagster_home and ./.persist
    apt-get install -y chromium                # once (Debian package; run as root)
    .venv/bin/python scripts/screenshots.py    # -> docs/screenshots/*.png

It starts ``dagster-webserver -w workspace.yaml`` (the one next to this Python) on a free
loopback port against the demo's instance (``$DAGSTER_HOME``, default ``./.dagster_home``;
persist location ``$PERSIST_HOME``, default ``./.persist``), waits until the code location
is loaded, and takes, after the demo's handover (``orders`` now reads through the
8-shard rendition built by the backfill):

1. ``collection_asset.png``: the ``orders`` asset (its latest materialization: the
   active rendition, frontiers with their timestamps, the spine, renditions and timeline
   tables);
2. ``rendition_partitions.png``: the ``orders_rendition`` asset's partitions (only the
   live rendition; retired and dropped ones are not partitions) with the active one
   selected (``status: active``, ``previous_rendition``, ``handover_at``);
3. ``shard_partition.png``: the ``persist_shard`` asset's partitions with shard 0 of the
   active rendition selected (``shard_of: orders / r1 / shard 0 of 8`` and its state).

Unless ``--no-scenes``, it first plays two scenes on the demo's instance (no Spark), and
adds their pages:

4. a backfill to a new rendition (4 shards) while a collection reader holds the history
   before it (as ``persist tail`` would): ``checks_after_backfill.png`` is the ``orders``
   asset's Checks tab (``ge_contents`` evaluated and passed in that backfill run), and
   ``time_travel.png`` a terminal with ``persist collections`` and ``persist sql`` ``AS OF``
   the millisecond before the handover and ``AS OF`` the handover (the old rendition, then
   the new one: the same orders) and ``changes()`` across it;
5. a backfill whose decoding is broken on purpose (every amount negative): its blocking
   check fails and nothing is handed over: ``failing_check.png`` (the partition:
   ``handover: refused``, the failed check) and ``failing_check_checks.png`` (the
   ``orders_rendition`` Checks tab), and ``renditions_table.png``, a terminal with
   ``persist describe orders`` (the refused rendition ``ready``, the active one, the
   dropped ones, the handovers with their UTC times).

Terminal pages are HTML ``<pre>`` transcripts of the real commands (``PERSIST_TABLE_WIDTH=120``).

Each page is loaded twice by Chromium (``--headless --no-sandbox --disable-gpu
--disable-quic --no-first-run --disable-background-networking --disable-component-update
--disable-sync``, a fresh ``--user-data-dir``; the UI is a React app, so it runs with a
virtual time budget): once with ``--dump-dom`` to check the page shows what it should
(the script fails otherwise), once with ``--screenshot``. The webserver is stopped at the
end, whatever happens. Options: ``--out DIR``, ``--chromium PATH``, ``--budget-ms N``
(virtual time for the page to render, default 20000), ``--keep-server`` (leave the
webserver running and print its URL).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-default-apps",
    "--disable-extensions",
    "--hide-scrollbars",
    "--force-device-scale-factor=1",
]


@dataclass(frozen=True)
class Page:
    """One screenshot: where, and what the page must show."""

    file: str
    path: str  # URL path and query on the webserver
    must_show: tuple[str, ...]
    what: str
    window: str = "1600,1200"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def find_chromium(explicit: str | None) -> str:
    for name in ([explicit] if explicit else []) + ["chromium", "chromium-browser", "google-chrome"]:
        path = shutil.which(name) if name else None
        if path:
            return path
    sys.exit(
        "screenshots: no Chromium found; install the Debian package (as root: apt-get install -y "
        "chromium) or pass --chromium PATH"
    )


def graphql(base: str, query: str, variables: dict[str, Any] | None = None) -> dict[str, Any]:
    body = json.dumps({"query": query, "variables": variables or {}}).encode()
    req = urllib.request.Request(
        f"{base}/graphql", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        doc: dict[str, Any] = json.loads(resp.read())
    if doc.get("errors"):
        raise RuntimeError(f"GraphQL errors: {doc['errors']}")
    return doc["data"]


def wait_for_webserver(base: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    """Until the server answers and the code location's assets are loaded."""
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"screenshots: dagster-webserver exited ({proc.returncode}); see {log}")
        try:
            data = graphql(base, "{ assetNodes { assetKey { path } } }")
            keys = {"/".join(n["assetKey"]["path"]) for n in data["assetNodes"]}
            if {"orders", "orders_rendition", "persist_shard"} <= keys:
                return
        except (urllib.error.URLError, ConnectionError, RuntimeError, TimeoutError, OSError) as e:
            last = e
        time.sleep(1.0)
    sys.exit(f"screenshots: the webserver did not load the code location in {timeout_s:.0f}s ({last}); see {log}")


def demo_state(persist_home: Path) -> dict[str, Any]:
    """The active rendition of ``orders`` after the demo's handover, and its shard 0."""
    from persist_lib.handles.client import PersistClient, default_uris
    from persist_lib.storage import StorageController

    blob, consensus = default_uris(persist_home)
    with (
        PersistClient.open_existing(blob, consensus) as client,
        StorageController(client, read_only=True) as ctl,
    ):
        d = ctl.describe("orders")
    active = d["active_rendition"]
    if not d["timeline"] or len(d["timeline"]) < 2:
        sys.exit("screenshots: `orders` has not been handed over yet; run `make demo` first")
    info = d["renditions"][active]
    return {
        "active": active,
        "previous": d["timeline"][-1]["from"],
        "num_shards": info["num_shards"],
        "shard0": info["shards"][0],
    }


# ----- scenes: what the demo leaves out, played on its instance before the screenshots -----


def negative_amounts(t: Any) -> Any:
    """A decoding change gone wrong (every amount comes out negative): what the failing
    backfill applies, so that the blocking Great Expectations check fails."""
    import pyarrow.compute as pc

    i = t.schema.get_field_index("amount")
    return t.set_column(i, "amount", pc.negate(t.column("amount")))


def persist_cli(args: list[str], env: dict[str, str]) -> str:
    """``$ persist ARGS`` and what it printed (stdout and stderr), as a terminal shows it."""
    out = subprocess.run(
        [sys.executable, "-m", "persist_lib.cli.main", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    shown = " ".join(a if " " not in a and "'" not in a else f'"{a}"' for a in args)
    return f"$ persist {shown}\n{out.stdout}{out.stderr}"


CHANGED = "SELECT count(*) AS changed FROM changes(orders, {}, {})"


def play_scenes(persist_home: Path) -> dict[str, Any]:
    """On the demo's instance: (1) a backfill to a new rendition while a collection reader
    holds the history before it (as ``persist tail`` would), and ``persist sql`` time
    travel across that handover; (2) a backfill whose decoding breaks the rules: its
    blocking check fails and nothing is handed over. Returns the terminal transcripts
    and the renditions involved."""
    import dataclasses

    import dagster as dg

    from dagster_project.assets import build_source_assets
    from dagster_project.run_origin import recorded_in_workspace
    from dagster_project.sources import ORDERS
    from persist_lib.handles.client import PersistClient, default_uris
    from persist_lib.storage import StorageController
    from persist_lib.timefmt import iso_utc
    from scripts.run_pipeline import Pipeline

    env = {k: v for k, v in os.environ.items() if not k.startswith("PERSIST_")}
    env.update(PERSIST_HOME=str(persist_home), PYTHONPATH=str(ROOT), PERSIST_TABLE_WIDTH="120")
    pipe = Pipeline(argparse.Namespace(no_spark=True, log_level="WARNING"), persist_home)
    blob, consensus = default_uris(persist_home)
    client = PersistClient.open_existing(blob, consensus)
    ctl = StorageController(client)
    try:
        reader = ctl.acquire_read_handle("orders")  # holds the history before the handover
        held = pipe.backfill(num_shards=4)
        after = ctl.describe("orders")
        at = int(after["timeline"][-1]["at"])
        q = "SELECT count(*) AS orders, round(sum(amount), 2) AS amount FROM orders AS OF '{}'"
        travel = "\n".join(
            [
                persist_cli(["collections"], env),
                persist_cli(["sql", q.format(iso_utc(at - 1))], env),
                persist_cli(["sql", q.format(iso_utc(at))], env),
                persist_cli(["sql", CHANGED.format(at - 1, at)], env),
            ]
        )
        reader.expire()
        # the failing backfill: the rules catch the broken decoding before the handover
        broken = build_source_assets(dataclasses.replace(ORDERS, transform=negative_amounts))
        have = ctl.describe("orders")["renditions"]
        failed = f"r{max(int(r[1:]) for r in have if r[1:].isdigit()) + 1}"
        pipe.instance.add_dynamic_partitions("orders_renditions", [failed])
        with recorded_in_workspace(pipe.instance, ROOT / "workspace.yaml"):
            res = dg.materialize(
                [broken.rendition],
                resources=pipe.resources,
                instance=pipe.instance,
                partition_key=failed,
                run_config={"ops": {"orders_rendition": {"config": {"num_shards": 4}}}},
                raise_on_error=False,
            )
        if res.success:
            sys.exit("screenshots: the broken backfill passed its check; expected it to fail")
        renditions = persist_cli(["describe", "orders"], env)
    finally:
        ctl.close()
        client.close()
        pipe.instance.dispose()
    return {"held": held, "handover_at": at, "failed": failed, "travel": travel, "renditions": renditions}


def terminal_page(text: str, path: Path) -> int:
    """``text`` as a terminal (an HTML page, for Chromium); returns its height in pixels."""
    import html

    lines = text.rstrip("\n").splitlines()
    body = "\n".join(
        f'<span class="cmd">{html.escape(x)}</span>' if x.startswith("$ ") else html.escape(x) for x in lines
    )
    path.write_text(
        "<!doctype html><meta charset='utf-8'><style>body{margin:0;background:#1e1e1e;color:#d4d4d4}"
        "pre{font:14px/18px 'DejaVu Sans Mono',monospace;padding:16px;margin:0}"
        ".cmd{color:#8fd18f}</style><pre>" + body + "</pre>"
    )
    return 18 * len(lines) + 40


def chromium(binary: str, args: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    with tempfile.TemporaryDirectory(prefix="screenshots-chromium-") as profile:
        return subprocess.run(
            [
                binary,
                *CHROMIUM_FLAGS,
                f"--host-resolver-rules=MAP {UI_HOST} 127.0.0.1",
                f"--user-data-dir={profile}",
                *args,
            ],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )


def png_info(path: Path) -> tuple[int, int, int]:
    """(width, height, distinct scanlines): a blank page has a handful of distinct rows."""
    data = path.read_bytes()
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError(f"{path} is not a PNG")
    pos, idat, width, height, bpp = 8, b"", 0, 0, 4
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind = data[pos + 4 : pos + 8]
        chunk = data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            width, height = struct.unpack(">II", chunk[:8])
            bpp = {2: 3, 6: 4, 0: 1, 4: 2}.get(chunk[9], 4)
        elif kind == b"IDAT":
            idat += chunk
        pos += 12 + length
    raw = zlib.decompress(idat)
    stride = width * bpp + 1
    rows = {raw[i * stride + 1 : (i + 1) * stride] for i in range(height)}
    return width, height, len(rows)


#: The UI shows a "Join the Dagster community" dialog on http://127.0.0.1 and
#: http://localhost origins until dismissed (in the browser's storage, or on the instance
#: by a mutation): Chromium reaches the loopback webserver under this name instead, so the
#: dialog never covers a screenshot and the demo's instance is left as it was.
UI_HOST = "dagster-demo.test"


def shoot(binary: str, port: int, page: Page, out: Path, budget_ms: int) -> dict[str, Any]:
    url = page.path if page.path.startswith("file://") else f"http://{UI_HOST}:{port}{page.path}"
    timeout_s = budget_ms / 1000 + 90
    size = f"--window-size={page.window}"
    dom = chromium(binary, [size, f"--virtual-time-budget={budget_ms}", "--dump-dom", url], timeout_s)
    missing = [s for s in page.must_show if s not in dom.stdout]
    if missing:
        dump = out / f"{Path(page.file).stem}.dom.html"
        dump.write_text(dom.stdout)
        sys.exit(
            f"screenshots: {url} does not show {missing} (page saved in {dump}; chromium said: "
            f"{dom.stderr.strip()[-500:]})"
        )
    target = out / page.file
    shot = chromium(
        binary, [size, f"--virtual-time-budget={budget_ms}", f"--screenshot={target}", url], timeout_s
    )
    if not target.exists():
        sys.exit(f"screenshots: chromium wrote no {target}: {shot.stderr.strip()[-500:]}")
    width, height, rows = png_info(target)
    if rows < 100:
        sys.exit(f"screenshots: {target} looks blank ({rows} distinct rows)")
    return {
        "file": str(target.relative_to(ROOT) if target.is_relative_to(ROOT) else target),
        "url": page.path if not page.path.startswith("file://") else "(terminal)",
        "bytes": target.stat().st_size,
        "size": f"{width}x{height}",
        "shows": page.what,
    }


def scene_pages(scenes: dict[str, Any]) -> list[Page]:
    """The pages of ``play_scenes``: the checks after a backfill, the failing check that
    stopped a handover, the renditions table, time travel across a handover."""
    held, failed = scenes["held"], scenes["failed"]
    pages = [
        Page(
            "checks_after_backfill.png",
            "/assets/orders?view=checks",
            ("ge_contents",),
            f"asset `orders`, Checks: `ge_contents` evaluated (and passed) in the backfill run "
            f"that handed over to {held}, on what `orders` reads since the handover",
        ),
        Page(
            "failing_check.png",
            f"/assets/orders_rendition?view=partitions&partition={failed}",
            ("orders_rendition", failed, "refused"),
            f"asset `orders_rendition`, Partitions: {failed} (decoding broken on purpose: every "
            "amount negative) failed its blocking `ge_contents` check; `handover: refused`, "
            f"{held} stays active",
            window="1600,3000",  # down to the `handover` entry, below the spine and tables
        ),
        Page(
            "failing_check_checks.png",
            "/assets/orders_rendition?view=checks",
            ("ge_contents",),
            f"asset `orders_rendition`, Checks: the blocking `ge_contents` failed on {failed} "
            "(expect_column_values_to_be_between(amount)), not handed over",
        ),
    ]
    for name, key, what in (
        ("renditions_table.png", "renditions", "`persist describe orders`: the renditions "
         f"table (active {held}, {failed} ready: refused by its check, the older ones dropped) "
         "and the handovers with their UTC times"),
        ("time_travel.png", "travel", "`persist sql` time travel across the handover to "
         f"{held} at {scenes['handover_at']}: AS OF the millisecond before reads the old "
         "rendition, AS OF the handover the new one, the same orders; changes() across it: 0"),
    ):
        html_file = Path(tempfile.mkdtemp(prefix="screenshots-terminal-")) / f"{Path(name).stem}.html"
        height = terminal_page(scenes[key], html_file)
        pages.append(Page(name, html_file.as_uri(), ("$ persist",), what, window=f"1120,{height}"))
    return pages


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Screenshots of the Dagster UI after make demo.")
    p.add_argument("--out", default=str(ROOT / "docs" / "screenshots"), help="output directory")
    p.add_argument("--chromium", default=None, help="Chromium binary (default: found on PATH)")
    p.add_argument("--budget-ms", type=int, default=20000, help="virtual time to render a page")
    p.add_argument("--startup-timeout-s", type=float, default=300.0, help="webserver start limit")
    p.add_argument("--keep-server", action="store_true", help="leave the webserver running")
    p.add_argument(
        "--no-scenes",
        action="store_true",
        help="only the pages of the demo's own state (no extra backfills, no terminal pages)",
    )
    args = p.parse_args(argv)

    dagster_home = Path(os.environ.get("DAGSTER_HOME") or ROOT / ".dagster_home").resolve()
    persist_home = Path(os.environ.get("PERSIST_HOME") or ROOT / ".persist").resolve()
    if not (dagster_home / "dagster.yaml").exists():
        sys.exit(f"screenshots: no Dagster instance in {dagster_home}; run `make demo` first")
    binary = find_chromium(args.chromium)
    demo_state(persist_home)  # the demo handed over (else: run `make demo` first)
    os.environ.update(DAGSTER_HOME=str(dagster_home), PERSIST_HOME=str(persist_home))
    for var in ("PERSIST_BLOB_URI", "PERSIST_CONSENSUS_URI", "PERSIST_LANDING_URI"):
        os.environ.pop(var, None)  # the demo's embedded location
    scenes = None if args.no_scenes else play_scenes(persist_home)
    state = demo_state(persist_home)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)

    webserver = Path(sys.executable).with_name("dagster-webserver")
    if not webserver.exists():
        sys.exit(f"screenshots: {webserver} not found (install the project with its dagster extra)")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "DAGSTER_HOME": str(dagster_home), "PERSIST_HOME": str(persist_home)}
    for var in ("PERSIST_BLOB_URI", "PERSIST_CONSENSUS_URI", "PERSIST_LANDING_URI"):
        env.pop(var, None)  # the demo's embedded location
    log = Path(tempfile.gettempdir()) / f"screenshots-webserver-{port}.log"
    print(f"screenshots: dagster-webserver on {base} (DAGSTER_HOME={dagster_home}, log {log})", flush=True)
    with open(log, "wb") as logf:
        proc = subprocess.Popen(
            [str(webserver), "-w", "workspace.yaml", "-h", "127.0.0.1", "-p", str(port)],
            cwd=ROOT,
            env=env,
            stdout=logf,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its code server is its child: stop them together
        )
    try:
        wait_for_webserver(base, proc, log, args.startup_timeout_s)
        active, previous, n = state["active"], state["previous"], state["num_shards"]
        pages = [
            Page(
                "collection_asset.png",
                "/assets/orders",
                ("orders", "upper_time", active),
                f"asset `orders` after the handover {previous} -> {active}: latest materialization "
                "metadata (rendition, frontiers with timestamps, spine, renditions, timeline)",
                window="1600,1650",  # tall enough for the renditions and timeline tables
            ),
            Page(
                "rendition_partitions.png",
                f"/assets/orders_rendition?view=partitions&partition={active}",
                ("orders_rendition", active, "previous_rendition"),
                f"asset `orders_rendition`, Partitions tab: the live rendition {active} (status "
                f"active, previous_rendition {previous}, handover_at); {previous} is not a partition",
            ),
            Page(
                "shard_partition.png",
                f"/assets/persist_shard?view=partitions&partition={state['shard0']}",
                ("persist_shard", f"orders / {active} / shard 0 of {n}"),
                f"asset `persist_shard`, Partitions tab: shard 0 of {active} selected, its "
                f"`shard_of` (orders / {active} / shard 0 of {n}) and state",
            ),
        ]
        if scenes is not None:
            pages += scene_pages(scenes)
        taken = [shoot(binary, port, page, out, args.budget_ms) for page in pages]
        print(json.dumps(taken, indent=2))
        if args.keep_server:
            print(f"screenshots: the webserver keeps running on {base} (pid {proc.pid})")
            return 0
    finally:
        if not args.keep_server and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
