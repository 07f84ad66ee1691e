"""The ``persist`` command line: inspect and maintain shards.

Location options default to ``$PERSIST_BLOB_URI`` / ``$PERSIST_CONSENSUS_URI``, else the
embedded default under ``$PERSIST_HOME`` (``./.persist``). Output is JSON, so it can
be piped into ``jq``. Errors print one line to stderr and exit with status 2 (usage)
or 1 (anything else). Commands never create a location (run from the wrong directory
they fail with ``LocationNotFound`` instead of reading an empty ``./.persist``), except
those registered with ``creates_location`` (``persist ingest files|postgres``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

from persist_lib.client import PersistClient, default_uris
from persist_lib.config import PersistConfig
from persist_lib.errors import InvalidUsage, LocationNotFound, PersistError
from persist_lib.location.uri import redact
from persist_lib.location_check import require_existing_location

Command = Callable[[PersistClient, argparse.Namespace], Any]
_COMMANDS: dict[str, tuple[Command, str, Callable[[argparse.ArgumentParser], None]]] = {}
#: Commands that may create the location they are pointed at (given the parsed arguments).
_CREATES_LOCATION: dict[str, Callable[[argparse.Namespace], bool]] = {}


def command(
    name: str,
    help_: str,
    args: Callable[[argparse.ArgumentParser], None] = lambda p: None,
    *,
    creates_location: bool | Callable[[argparse.Namespace], bool] = False,
) -> Callable[[Command], Command]:
    """Registers a subcommand; other modules (maintenance, storage) add theirs this way.

    A command runs only against an existing location unless ``creates_location`` (a bool,
    or a function of the parsed arguments) says it may create one.
    """

    def deco(fn: Command) -> Command:
        _COMMANDS[name] = (fn, help_, args)
        flag = creates_location
        _CREATES_LOCATION[name] = flag if callable(flag) else (lambda ns: bool(flag))
        return fn

    return deco


def _shard_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("shard", help="shard id (s<uuid>)")


@command("shards", "list every shard in the consensus location")
def _cmd_shards(client: PersistClient, ns: argparse.Namespace) -> Any:
    return client.list_shards()


@command("inspect", "print a shard's state as JSON", _shard_arg)
def _cmd_inspect(client: PersistClient, ns: argparse.Namespace) -> Any:
    return client.inspect(ns.shard)


def _load_plugins() -> None:
    # Subcommands defined next to the features they drive.
    import importlib

    for mod in (
        "persist_lib.maintenance_cli",
        "persist_lib.storage.cli",
        "persist_lib.ingest.cli",
        "persist_lib.sql_cli",
        "persist_lib.metrics_cli",
    ):
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name != mod:
                raise


def build_parser() -> argparse.ArgumentParser:
    _load_plugins()
    blob, consensus = default_uris()
    p = argparse.ArgumentParser(prog="persist", description=__doc__.split("\n")[0])
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
    sub = p.add_subparsers(dest="command", required=True)
    for name, (_, help_, add_args) in sorted(_COMMANDS.items()):
        sp = sub.add_parser(name, help=help_, description=help_)
        add_args(sp)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    fn = _COMMANDS[ns.command][0]
    try:
        config = PersistConfig(retry_deadline_s=ns.timeout, background_heartbeats=False)
        if not _CREATES_LOCATION.get(ns.command, lambda ns: False)(ns):
            require_existing_location(ns.blob, ns.consensus, command=ns.command)
        with PersistClient.open(ns.blob, ns.consensus, config) as client:
            out = fn(client, ns)
    except LocationNotFound as e:
        print(f"persist {ns.command}: {type(e).__name__}: {redact(str(e))}", file=sys.stderr)
        return 2
    except InvalidUsage as e:
        print(f"persist {ns.command}: error: {redact(str(e))}", file=sys.stderr)
        return 2
    except PersistError as e:
        print(f"persist {ns.command}: {type(e).__name__}: {redact(str(e))}", file=sys.stderr)
        return 1
    if out is not None:
        json.dump(out, sys.stdout, indent=2, sort_keys=False, default=str)
        sys.stdout.write("\n")
    return 0


if __name__ == "__main__":  # pragma: no cover
    # Run the registry of the importable module (plugins register there), not __main__'s.
    from persist_lib.cli import main as _main

    sys.exit(_main())
