"""The ``persist`` CLI for people: tables with readable times by default, ``--json`` for
scripts, no rST markup in ``--help``, ``persist snapshot`` and ``persist tail``, progress
bars on a terminal. Every command runs against a real embedded location."""

from __future__ import annotations

import argparse
import io
import json
import os
import pty
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from persist_lib import PersistClient, PersistConfig, ShardId
from persist_lib.frontier import Antichain
from persist_lib.storage import StorageController
from persist_lib.timefmt import frontier_text, is_epoch_ms, iso_utc, parse_time, time_text

PERSIST = [sys.executable, "-m", "persist_lib.cli.main"]
REPO = Path(__file__).resolve().parents[1]
K = pa.schema([("id", pa.int64())])
V = pa.schema([("name", pa.string()), ("amount", pa.float64())])
T0 = 1767225600000  # 2026-01-01T00:00:00Z, in ms since the epoch
ISO0 = "2026-01-01T00:00:00"


def env_for(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PERSIST_")}
    env["PERSIST_HOME"] = str(home)
    env["PYTHONPATH"] = str(REPO)
    return env


def run(args: list[str], home: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(PERSIST + args, env=env_for(home), capture_output=True, text=True, timeout=120)


def ok(args: list[str], home: Path) -> str:
    out = run(args, home)
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    return out.stdout


def rows(i: int, n: int = 5) -> list[Any]:
    return [(((j,), (f"n{j}", j * 1.5)), T0 + i, 1) for j in range(i * n, i * n + n)]


def make_location(home: Path) -> tuple[PersistClient, StorageController, str]:
    """Collection ``orders`` at epoch-ms times: r0 (2 shards) for T0..T0+2, handed over to
    r1 (3 shards) at T0+3, one more record at T0+4 (upper T0+5); and a plain shard at
    logical times 0..2 (upper 3)."""
    client = PersistClient.default(home, PersistConfig.for_tests())
    ctl = StorageController(client)
    ctl.create_collection("orders", K, V, num_shards=2)
    w = ctl.open_writer("orders")
    for i in range(3):
        w.append(rows(i), 0 if i == 0 else T0 + i, T0 + i + 1)
    ctl.create_rendition("orders", "r1", 3)
    w1 = ctl.open_writer("orders", "r1")
    w1.append([(((j,), (f"n{j}", j * 1.5)), T0 + 2, 1) for j in range(15)], 0, T0 + 4)
    ctl.handover("orders", to="r1", at=T0 + 3)
    w1.append([(((99,), ("late", 1.0)), T0 + 4, 1)], T0 + 4, T0 + 5)
    w.expire()
    w1.expire()
    shard = ShardId.new()
    sw, sr = client.open(shard, K, pa.schema([]))
    sw.compare_and_append([(((1,), ()), 0, 1), (((2,), ()), 1, 1)], 0, 3)
    sw.expire()
    sr.expire()
    return client, ctl, str(shard)


def registrations(client: PersistClient) -> dict[str, tuple[list[str], list[str]]]:
    out = {}
    for s in client.list_shards():
        st = client.inspect(s)
        out[s] = (sorted(st.get("leased_readers", {})), sorted(st.get("writers", {})))
    return out


# ----- times ------------------------------------------------------------------------------


def test_times_for_people() -> None:
    assert is_epoch_ms(T0) and not is_epoch_ms(5) and not is_epoch_ms(10**9) and not is_epoch_ms(True)
    assert iso_utc(T0 + 123) == f"{ISO0}.123Z" and iso_utc(T0) == f"{ISO0}Z"
    assert time_text(7) == "7" and time_text(T0) == f"{T0} ({ISO0}Z)"
    assert frontier_text([]) == "closed" and frontier_text(None) == "-" and frontier_text([3]) == "3"
    assert parse_time("42") == 42 and parse_time(str(T0)) == T0
    assert parse_time(f"{ISO0}Z") == T0 == parse_time("2026-01-01") == parse_time(f"{ISO0}+00:00")
    assert parse_time("2026-01-01T02:00:00.5+02:00") == T0 + 500
    with pytest.raises(ValueError, match="ISO-8601"):
        parse_time("yesterday")
    with pytest.raises(ValueError, match=">= 0"):
        parse_time("-1")


# ----- help ---------------------------------------------------------------------------------


def _all_help(p: argparse.ArgumentParser) -> list[str]:
    out = [p.format_help()]
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            for child in a.choices.values():
                out += _all_help(child)
    return out


def test_help_has_no_rst_markup_and_every_command_takes_json() -> None:
    from persist_lib.cli.main import build_parser

    texts = _all_help(build_parser())
    assert len(texts) > 15  # every command and the ingest subcommands
    for t in texts:
        assert "``" not in t and ":class:" not in t and ":func:" not in t, t
        assert "--json" in t, t.splitlines()[0]
    out = subprocess.run([*PERSIST, "--help"], capture_output=True, text=True, env=env_for(Path("/nonexistent")))
    assert out.returncode == 0 and "snapshot" in out.stdout and "tail" in out.stdout
    assert "``" not in out.stdout


# ----- tables and --json -------------------------------------------------------------------------


def test_tables_by_default_json_for_scripts(tmp_path: Path) -> None:
    home = tmp_path / "home"
    client, ctl, shard = make_location(home)
    # describe: a table with the handover time as a timestamp beside the integer
    text = ok(["describe", "orders"], home)
    assert "renditions:" in text and "handovers (timeline):" in text
    assert f"{T0 + 3} ({ISO0}.003Z)" in text  # the handover, and r0's retired_at
    assert f"{T0 + 5} ({ISO0}.005Z)" in text  # r1's upper
    assert "retired" in text and "active" in text
    assert not text.lstrip().startswith("{")
    # --json is the document the library returns, before or after the command
    doc = json.loads(ok(["describe", "orders", "--json"], home))
    assert doc == json.loads(json.dumps(ctl.describe("orders")))
    assert json.loads(ok(["--json", "describe", "orders"], home)) == doc
    # collections and shards: tables that say what each shard is
    text = ok(["collections"], home)
    assert "orders" in text and "r1" in text and f"{ISO0}.005Z" in text
    assert json.loads(ok(["collections", "--json"], home)) == [
        {"name": "orders", "active_rendition": "r1", "renditions": ["r0", "r1"]}
    ]
    text = ok(["shards"], home)
    assert "orders / r1 / shard 2 of 3" in text and "orders / r0 / shard 0 of 2 (retired)" in text
    assert "orders / rendition metadata shard" in text and "STORAGE catalog" in text
    assert sorted(json.loads(ok(["shards", "--json"], home))) == client.list_shards()
    # a shard at small logical times: integers only, no 1970 dates
    text = ok(["inspect", shard], home)
    lines = dict(line.split(None, 1) for line in text.splitlines()[:10] if line.strip())
    assert lines["upper"].strip() == "3" and lines["since"].strip() == "0"
    assert "1970" not in text
    assert lines["walltime_ms"].strip().endswith("Z")  # wall-clock fields are always timestamps
    # ingest status, maintenance summaries: text by default, JSON with --json
    assert "no lease had lapsed" in ok(["expire-leases"], home)
    assert json.loads(ok(["expire-leases", "--json"], home)) == {}
    text = ok(["compact", shard], home)
    assert "merges applied" in text and "compaction debt" in text
    assert set(json.loads(ok(["compact", shard, "--json"], home))) >= {"merges_applied", "batches_after"}
    text = ok(["leaked-blobs", "--older-than-s", "0"], home)
    assert "leaked blob(s) found" in text
    ctl.close()


# ----- persist snapshot --------------------------------------------------------------------------


def _table_rows(text: str) -> list[list[str]]:
    lines = text.strip().splitlines()
    assert set(lines[1].replace(" ", "")) == {"-"}, lines[:2]
    return [line.split() for line in lines[2:]]


def test_snapshot_of_a_collection_and_a_shard(tmp_path: Path) -> None:
    home = tmp_path / "home"
    client, ctl, shard = make_location(home)
    before = registrations(client)
    # the latest time by default (upper - 1), through the active rendition r1
    out = run(["snapshot", "orders"], home)
    assert out.returncode == 0, out.stderr
    assert f"as of {T0 + 4} ({ISO0}.004Z), rendition r1" in out.stderr
    got = _table_rows(out.stdout)
    assert out.stdout.splitlines()[0].split() == ["id", "name", "amount", "diff"]
    assert sorted(int(r[0]) for r in got) == [*range(15), 99] and {r[3] for r in got} == {"+1"}
    # a time before the handover, as an ISO timestamp or an integer: the same rows, from r0
    iso = run(["snapshot", "orders", "--as-of", f"{ISO0}.001Z"], home)
    assert iso.returncode == 0 and "rendition r0" in iso.stderr, iso.stderr
    assert iso.stdout == ok(["snapshot", "orders", "--as-of", str(T0 + 1)], home)
    assert sorted(int(r[0]) for r in _table_rows(iso.stdout)) == list(range(10))
    # --json: one object per row with ts and diff; --limit
    lines = ok(["snapshot", "orders", "--as-of", str(T0 + 1), "--json"], home).splitlines()
    docs = [json.loads(x) for x in lines]
    assert sorted(d["id"] for d in docs) == list(range(10))
    assert {d["ts"] for d in docs} == {T0 + 1} and {d["diff"] for d in docs} == {1}
    assert set(docs[0]) == {"id", "name", "amount", "ts", "diff"}
    limited = run(["snapshot", "orders", "--limit", "3"], home)
    assert len(_table_rows(limited.stdout)) == 3 and "--limit 3" in limited.stderr
    assert len(ok(["snapshot", "orders", "--limit", "2", "--json"], home).splitlines()) == 2
    # a shard id, at a logical time
    assert _table_rows(ok(["snapshot", shard, "--as-of", "0"], home)) == [["1", "+1"]]
    assert len(_table_rows(ok(["snapshot", shard], home))) == 2
    # clear errors: a time not complete yet, before the since, an unknown name, a bad time
    bad = run(["snapshot", "orders", "--as-of", str(T0 + 9)], home)
    assert bad.returncode == 2 and "not complete yet" in bad.stderr and f"{ISO0}.004Z" in bad.stderr
    bad = run(["snapshot", "nope"], home)
    assert bad.returncode == 2 and "does not exist" in bad.stderr and "Traceback" not in bad.stderr
    bad = run(["snapshot", "orders", "--as-of", "tomorrow"], home)
    assert bad.returncode == 2 and "ISO-8601" in bad.stderr
    # a closed pipe (| head) ends it quietly
    with subprocess.Popen(
        [*PERSIST, "snapshot", "orders"], env=env_for(home), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    ) as p:
        assert p.stdout is not None and p.stderr is not None
        p.stdout.readline()
        p.stdout.close()
        err = p.stderr.read()
        assert p.wait(timeout=60) == 0 and "Traceback" not in err, err
    # nothing it registered is left behind
    assert registrations(client) == before
    ctl.close()


def test_snapshot_prints_progressively_from_the_stream(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows go out (and are flushed) batch by batch as ``snapshot_batches`` yields them,
    not after reading everything: here one shard stream after the other."""
    import persist_lib.cli.main as cli

    home = tmp_path / "home"
    client = PersistClient.default(home, PersistConfig.for_tests())
    ctl = StorageController(client)
    ctl.create_collection("big", K, V, num_shards=4)
    w = ctl.open_writer("big")
    w.append([(((j,), (f"n{j}", float(j))), 1, 1) for j in range(4000)], 0, 2)
    w.expire()
    ctl.close()

    class Recorder(io.StringIO):
        def __init__(self) -> None:
            super().__init__()
            self.rows_at_flush: list[int] = []

        def flush(self) -> None:
            self.rows_at_flush.append(self.getvalue().count("\n"))

    rec = Recorder()
    monkeypatch.setattr(sys, "stdout", rec)
    monkeypatch.setenv("PERSIST_HOME", str(home))
    monkeypatch.delenv("PERSIST_BLOB_URI", raising=False)
    monkeypatch.delenv("PERSIST_CONSENSUS_URI", raising=False)
    assert cli.main(["snapshot", "big", "--as-of", "1", "--json", "--memory-budget", "1"]) == 0
    lines = rec.getvalue().splitlines()
    assert sorted(json.loads(x)["id"] for x in lines) == list(range(4000))
    partial = sorted({n for n in rec.rows_at_flush if 0 < n < 4000})
    assert len(partial) >= 3, rec.rows_at_flush  # printed in pieces, before the end
    assert all(not r[0] for r in registrations(client).values())  # reader released
    client.close()


# ----- persist tail ------------------------------------------------------------------------------


def _wait(pred: Any, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _readers_with(client: PersistClient, purpose: str) -> int:
    n = 0
    for s in client.list_shards():
        for r in client.inspect(s).get("leased_readers", {}).values():
            n += purpose in (r.get("purpose") or "")
    return n


@pytest.mark.parametrize("as_json", [False, True])
def test_tail_prints_updates_as_they_arrive_and_ctrl_c_releases_the_reader(
    tmp_path: Path, as_json: bool
) -> None:
    home = tmp_path / "home"
    client, ctl, _ = make_location(home)
    before = registrations(client)
    args = ["tail", "orders"] + (["--json"] if as_json else [])
    with subprocess.Popen(
        PERSIST + args, env=env_for(home), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, bufsize=1,
    ) as p:
        assert p.stdout is not None and p.stderr is not None
        try:
            # its collection reader is registered and listening: a reader on the metadata
            # shard, and on r1's 3 shards once the listen reads (so its as_of is fixed)
            _wait(lambda: _readers_with(client, "storage-reader:orders") == 4, "the tail's readers")
            w = ctl.open_writer("orders")
            w.append([(((7,), ("changed", 70.0)), T0 + 5, 1), (((7,), ("n7", 10.5)), T0 + 5, -1)], T0 + 5, T0 + 6)
            w.append([(((500,), ("new", 5.0)), T0 + 6, 1)], T0 + 6, T0 + 7)
            got = [p.stdout.readline() for _ in range(3 if as_json else 5)]
            w.expire()
        finally:
            p.send_signal(signal.SIGINT)
            code = p.wait(timeout=60)
        err = p.stderr.read()
    assert code == 0 and "Traceback" not in err, err
    if as_json:
        docs = [json.loads(x) for x in got[:3]]
        assert sorted((d["ts"], d["id"], d["diff"]) for d in docs) == [
            (T0 + 5, 7, -1), (T0 + 5, 7, 1), (T0 + 6, 500, 1)
        ]
    else:
        assert got[0].split() == ["ts", "diff", "id", "name", "amount"]
        body = [x.split() for x in got[2:]]
        assert sorted((r[2], r[3], r[4]) for r in body) == [
            ("+1", "500", "new"), ("+1", "7", "changed"), ("-1", "7", "n7")
        ]
        assert sorted(r[0] + " " + r[1] for r in body)[0] == f"{T0 + 5} ({ISO0}.005Z)"
        assert "reader released" in err
    # Ctrl-C released everything it registered
    assert registrations(client) == before
    ctl.close()


def test_tail_from_a_time_across_a_handover_until_a_time(tmp_path: Path) -> None:
    home = tmp_path / "home"
    client, ctl, shard = make_location(home)
    out = run(["tail", "orders", "--from", f"{ISO0}.001Z", "--until", str(T0 + 4), "--json"], home)
    assert out.returncode == 0, out.stderr
    docs = [json.loads(x) for x in out.stdout.splitlines()]
    # r0's records at T0+2, nothing at the handover (same contents), the late one in r1
    assert sorted((d["ts"], d["id"]) for d in docs) == [(T0 + 2, j) for j in range(10, 15)] + [(T0 + 4, 99)]
    # --snapshot first prints the contents at the start time; a plain shard works too
    out = run(["tail", shard, "--from", "0", "--until", "1", "--snapshot", "--json"], home)
    assert [(d["id"], d["ts"]) for d in map(json.loads, out.stdout.splitlines())] == [(1, 0), (2, 1)]
    ctl.close()


# ----- progress bars ------------------------------------------------------------------------------


def test_progress_bars_on_a_terminal_only(tmp_path: Path) -> None:
    home = tmp_path / "home"
    client = PersistClient.default(home, PersistConfig.for_tests(writer_lease_ms=10**12))
    shard = ShardId.new()
    w, r = client.open(shard, K, V)
    for t in range(6):
        w.compare_and_append([(((i,), (f"v{t}", 1.0)), t, 1) for i in range(50)], t, t + 1)
    r.expire()
    # stderr is a pipe: no bar
    out = run(["compact", str(shard)], home)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    # stderr is a terminal: a bar, and stdout (a pipe) carries only the summary
    for args in (["gc"], ["leaked-blobs"], ["compact", str(shard)]):
        primary, secondary = pty.openpty()
        try:
            res = subprocess.run(
                PERSIST + args, env=env_for(home), stdout=subprocess.PIPE, stderr=secondary,
                text=True, timeout=120,
            )
            os.close(secondary)
            secondary = -1
            chunks = []
            while True:
                try:
                    data = os.read(primary, 4096)
                except OSError:
                    break
                if not data:
                    break
                chunks.append(data)
            bar = b"".join(chunks).decode()
        finally:
            os.close(primary)
            if secondary >= 0:
                os.close(secondary)
        assert res.returncode == 0
        assert "[" in bar and "]" in bar and "\r" in bar, (args, bar)
        assert {"gc": "shards", "leaked-blobs": "shards", "compact": "merges"}[args[0]] in bar
        assert "\r" not in res.stdout and "[#" not in res.stdout
    # --progress forces it (e.g. a CI log), --no-progress silences it
    assert "merges" in run(["compact", str(shard), "--progress"], home).stderr
    assert run(["gc", "--no-progress"], home).stderr == ""
    w.expire()
    client.close()


# ----- issue 30 items 6-8: readable times, bytes and errors; tables of 120 columns -----------------


def errors_collection(ctl: StorageController) -> None:
    """``errs``: a bytes field like ``orders.errors.raw`` at T0 (upper T0+1): a line that is
    text (with a newline and a tab), and one that is not UTF-8."""
    ctl.create_collection("errs", K, pa.schema([("raw", pa.binary())]), num_shards=1)
    w = ctl.open_writer("errs")
    w.append([(((1,), (b'{"id": oops}\n',)), T0, 1), (((2,), (b"\xff\xfe\tok",)), T0, 1)], 0, T0 + 1)
    w.expire()


def test_metrics_shows_times_finalized_shards_and_counts_from_zero(tmp_path: Path) -> None:
    home = tmp_path / "home"
    client, ctl, _ = make_location(home)
    shard = str(ShardId.new())  # a shard closed, released and finalized
    sw, sr = client.open(shard, K, pa.schema([]))
    sw.compare_and_append([(((1,), ()), 0, 1)], 0, Antichain.empty())
    sr.downgrade_since(Antichain.empty())
    sw.expire()
    sr.expire()
    client.finalize(shard)
    out = ok(["metrics"], home)
    lines = out.splitlines()
    assert max(len(x) for x in lines) <= 120, out
    # shards numbered from 0, as persist describe and the Dagster partitions number them
    assert "orders / r1 / shard 0 of 3" in out and "orders / r1 / shard 2 of 3" in out, out
    assert "shard 3 of 3" not in out and "[1/" not in out
    # the frontiers as wall-clock times; the finalized shard says so instead of -1
    assert iso_utc(T0 + 5) in out
    at = lines.index(shard)
    assert "closed (finalized)" in lines[at + 1], out
    assert " -1 " not in out and not any(x.rstrip().endswith("-1") for x in lines)


def test_sql_ts_and_bytes_read_as_text_and_a_malformed_query_points_at_the_users_text(tmp_path: Path) -> None:
    home = tmp_path / "home"
    client, ctl, _ = make_location(home)
    errors_collection(ctl)
    out = ok(["sql", "SELECT id, raw, ts FROM errs ORDER BY id"], home)
    assert '{"id": oops}\\n' in out and "\\xff\\xfe\\tok" in out, out  # text, escaped where not
    assert "b'" not in out and "7b22" not in out  # no Python repr, no hex
    assert f"{T0} ({ISO0}Z)" in out  # ts with its timestamp
    # --json keeps bytes as hex (lossless for scripts)
    doc = json.loads(ok(["sql", "--json", "SELECT raw FROM errs WHERE id = 2"], home))
    assert doc == [{"raw": "fffe096f6b"}]
    # persist snapshot and persist tail show the same text
    snap = ok(["snapshot", "errs"], home)
    assert '{"id": oops}\\n' in snap and "\\xff\\xfe\\tok" in snap, snap
    tail = ok(["tail", "errs", "--from", "0", "--until", str(T0), "--snapshot"], home)
    assert '{"id": oops}\\n' in tail, tail
    # a malformed query: DuckDB's error about the user's text, never the internal view
    query = "SELECT id FROM orders AS OF 1767225600003 WHERE"  # T0 + 3
    bad = run(["sql", query], home)
    assert bad.returncode == 2, bad.stderr
    assert "__persist" not in bad.stderr, bad.stderr
    (line,) = [x for x in bad.stderr.splitlines() if x.startswith("LINE 1: ")]
    assert line == f"LINE 1: {query}"
    caret = bad.stderr.splitlines()[bad.stderr.splitlines().index(line) + 1]
    assert caret.index("^") == len("LINE 1: ") + query.index("WHERE"), bad.stderr
    # a binder error names the user's table reference
    bad = run(["sql", "SELECT nope FROM orders AS OF 1767225600003"], home)
    assert bad.returncode == 2 and "__persist" not in bad.stderr, bad.stderr
    ctl.close()


def test_tables_fit_120_columns(tmp_path: Path) -> None:
    home = tmp_path / "home"
    client, ctl, shard = make_location(home)
    ctl.create_collection("wide", K, pa.schema([("note", pa.string()), ("more", pa.string())]), num_shards=1)
    w = ctl.open_writer("wide")
    w.append([(((1,), ("x" * 300, "y" * 200)), T0, 1)], 0, T0 + 1)
    w.expire()
    for args in (["sql", "SELECT * FROM wide"], ["snapshot", "wide"], ["collections"], ["describe", "orders"],
                 ["shards"], ["sql", "--tables"]):
        out = ok(args, home)
        assert max(len(x) for x in out.splitlines()) <= 120, (args, out)
    assert "xxxxxxxx…" in ok(["sql", "SELECT * FROM wide"], home)
    ctl.close()
