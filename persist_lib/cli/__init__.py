"""Every ``persist`` subcommand (shards, maintenance, reads, SQL, metrics, collections,
ingestion) and the output helpers they share. ``persist_lib.cli.main:main`` is the
console-script entry point; ``main`` here forwards to it for older installs.
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    from persist_lib.cli.main import main as _main

    return _main(argv)
