"""The persist command line: inspect, read and maintain shards and collections.

Location options default to ``$PERSIST_BLOB_URI`` / ``$PERSIST_CONSENSUS_URI``, else the
embedded default under ``$PERSIST_HOME`` (``./.persist``). Output is for people by
default (tables; times in ms since the epoch shown as ISO-8601 UTC timestamps beside the
integer, ``persist_lib.timefmt``); ``--json`` prints the JSON documents scripts rely on
(unchanged from version to version; streaming commands print one JSON object per line).
Errors print one line to stderr and exit with status 2 (usage) or 1 (anything else).
Commands never create a location (run from the wrong directory they fail with
``LocationNotFound`` instead of reading an empty ``./.persist``), except those registered
with ``creates_location`` (``persist ingest files|postgres``).

A command is a function ``(client, ns) -> JSON document | None`` registered with
``@command(name, help, add_arguments)``; ``human=`` gives it a text renderer (default:
``cli_output.render`` of the document). A command that streams (``snapshot``, ``tail``)
prints itself and returns None.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

from persist_lib.allocator import configure_bounded_allocator

# Before anything imports pyarrow: memory budgets hold in RSS too (persist_lib/allocator.py).
configure_bounded_allocator()

from persist_lib.config import PersistConfig  # noqa: E402
from persist_lib.errors import InvalidConfig, InvalidUsage, LocationNotFound, PersistError  # noqa: E402
from persist_lib.handles.client import PersistClient, default_uris  # noqa: E402
from persist_lib.location.check import require_existing_location  # noqa: E402
from persist_lib.location.uri import redact  # noqa: E402

Command = Callable[[PersistClient, argparse.Namespace], Any]
#: Renders a command's JSON document for people: ``(client, ns, doc) -> text``.
Human = Callable[[PersistClient, argparse.Namespace, Any], str]
_COMMANDS: dict[str, tuple[Command, str, Callable[[argparse.ArgumentParser], None]]] = {}
#: Commands that may create the location they are pointed at (given the parsed arguments).
_CREATES_LOCATION: dict[str, Callable[[argparse.Namespace], bool]] = {}
#: Text renderers of commands (commands without one use ``cli_output.render``).
_HUMAN: dict[str, Human] = {}

EPILOG = (
    "Output is a table for people; add --json (before or after the command) for the "
    "JSON documents scripts use. Times in ms since the epoch are shown as ISO-8601 UTC "
    "timestamps beside the integer; small times are logical times, shown as integers. "
    "Read-only commands never create a location and release every reader they register."
)


def command(
    name: str,
    help_: str,
    args: Callable[[argparse.ArgumentParser], None] = lambda p: None,
    *,
    creates_location: bool | Callable[[argparse.Namespace], bool] = False,
    human: Human | None = None,
) -> Callable[[Command], Command]:
    """Registers a subcommand; other modules (maintenance, storage) add theirs this way.

    A command runs only against an existing location unless ``creates_location`` (a bool,
    or a function of the parsed arguments) says it may create one. Its return value is
    printed as JSON with ``--json``, else with ``human`` (default ``cli_output.render``).
    """

    def deco(fn: Command) -> Command:
        _COMMANDS[name] = (fn, help_, args)
        flag = creates_location
        _CREATES_LOCATION[name] = flag if callable(flag) else (lambda ns: bool(flag))
        if human is not None:
            _HUMAN[name] = human
        return fn

    return deco


def progress_args(p: argparse.ArgumentParser) -> None:
    """``--progress`` / ``--no-progress``: a bar on stderr (default: when it is a terminal)."""
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--progress", dest="progress", action="store_true", default=None,
        help="show a progress bar on stderr (default: only when stderr is a terminal)",
    )
    g.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")


def _json_arg(p: argparse.ArgumentParser, *, top: bool) -> None:
    # On the main parser and on every subcommand, so both ``persist --json shards`` and
    # ``persist shards --json`` work (SUPPRESS: a subcommand never resets the main flag).
    p.add_argument(
        "--json",
        action="store_true",
        default=False if top else argparse.SUPPRESS,
        help="print JSON for scripts instead of tables",
    )


def _shard_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("shard", help="shard id (s<uuid>)")


def _human_shards(client: PersistClient, ns: argparse.Namespace, doc: Any) -> str:
    from persist_lib.cli.human import shards_table

    return shards_table(client, list(doc))


def _human_inspect(client: PersistClient, ns: argparse.Namespace, doc: Any) -> str:
    from persist_lib.cli.human import inspect_text

    return inspect_text(doc)


@command("shards", "list every shard in the consensus location", human=_human_shards)
def _cmd_shards(client: PersistClient, ns: argparse.Namespace) -> Any:
    return client.list_shards()


@command(
    "inspect",
    "a shard's state: seqno, frontiers, batches, readers, writers, rollups, spine",
    _shard_arg,
    human=_human_inspect,
)
def _cmd_inspect(client: PersistClient, ns: argparse.Namespace) -> Any:
    return client.inspect(ns.shard)


def _load_plugins() -> None:
    # Subcommands defined next to the features they drive.
    import importlib

    for mod in (
        "persist_lib.cli.maintenance",
        "persist_lib.cli.storage",
        "persist_lib.cli.ingest",
        "persist_lib.cli.read",
        "persist_lib.cli.sql",
        "persist_lib.cli.metrics",
        "persist_lib.cli.insert",
        "persist_lib.cli.txns",
        "persist_lib.cli.schema",
    ):
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name != mod:
                raise


def build_parser() -> argparse.ArgumentParser:
    _load_plugins()
    blob, consensus = default_uris()
    p = argparse.ArgumentParser(
        prog="persist",
        description="The persist command line: inspect, read and maintain shards and collections.",
        epilog=EPILOG,
    )
    p.add_argument("--blob", default=blob, help="blob URI (default: $PERSIST_BLOB_URI or the embedded default)")
    p.add_argument(
        "--consensus",
        default=consensus,
        help="consensus URI (default: $PERSIST_CONSENSUS_URI or the embedded default)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=30.0,
        help="seconds to keep retrying an unavailable location before giving up (default 30)",
    )
    _json_arg(p, top=True)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (_, help_, add_args) in sorted(_COMMANDS.items()):
        sp = sub.add_parser(name, help=help_, description=help_)
        add_args(sp)
        _json_everywhere(sp)
    return p


def _json_everywhere(p: argparse.ArgumentParser) -> None:
    """``--json`` on ``p`` and on its own subcommands (``persist ingest files ... --json``).
    A command that declares its own ``--json`` keeps it; its default is suppressed so
    that ``persist --json COMMAND`` still applies."""
    own = [a for a in p._actions if "--json" in a.option_strings]
    for a in own:
        a.default = argparse.SUPPRESS
    if not own:
        _json_arg(p, top=False)
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            for child in a.choices.values():
                _json_everywhere(child)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    fn = _COMMANDS[ns.command][0]
    try:
        # Background heartbeats: a long merge (compact), query (sql) or read (snapshot,
        # tail, a slow pipe) keeps its leases, instead of being expired and redone.
        config = cli_config(ns)
        if _CREATES_LOCATION.get(ns.command, lambda ns: False)(ns):
            client = PersistClient.open(ns.blob, ns.consensus, config)
        else:
            # Never creates anything: a missing local location is a LocationNotFound.
            require_existing_location(ns.blob, ns.consensus, command=ns.command)
            client = PersistClient.open_existing(ns.blob, ns.consensus, config)
        with client:
            out = fn(client, ns)
            if out is not None:
                if ns.json:
                    text = json.dumps(out, indent=2, sort_keys=False, default=str)
                else:
                    human = _HUMAN.get(ns.command)
                    text = human(client, ns, out) if human is not None else _render(out)
                sys.stdout.write(text + "\n")
            sys.stdout.flush()
    except LocationNotFound as e:
        print(f"persist {ns.command}: {type(e).__name__}: {redact(str(e))}", file=sys.stderr)
        return 2
    except InvalidUsage as e:
        print(f"persist {ns.command}: error: {redact(str(e))}", file=sys.stderr)
        return 2
    except PersistError as e:
        print(f"persist {ns.command}: {type(e).__name__}: {redact(str(e))}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        # ``persist snapshot ... | head``: the reader is gone; what was registered has
        # been released on the way out. Silence the interpreter's flush at exit.
        _quiet_stdout()
        return 0
    except KeyboardInterrupt:
        print(f"persist {ns.command}: interrupted", file=sys.stderr)
        return 130
    return 0


#: The command-line options that set a ``PersistConfig`` field (named in its errors).
CONFIG_OPTIONS = {"retry_deadline_s": "--timeout"}


def cli_config(ns: argparse.Namespace) -> PersistConfig:
    """The client configuration the options ask for; a bad value (``--timeout -1``) is an
    ``InvalidConfig`` naming the option (exit status 2)."""
    try:
        return PersistConfig(retry_deadline_s=ns.timeout)
    except InvalidConfig as e:
        fixes = {"retry_deadline_s": "fix: give --timeout a number of seconds > 0 (default 30)"}
        raise e.with_sources(CONFIG_OPTIONS, what="persist options", fixes=fixes) from None


def _render(doc: Any) -> str:
    from persist_lib.cli.output import render

    return render(doc)


def _quiet_stdout() -> None:
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


if __name__ == "__main__":  # pragma: no cover
    # Run the registry of the importable module (plugins register there), not __main__'s.
    from persist_lib.cli.main import main as _main

    sys.exit(_main())
