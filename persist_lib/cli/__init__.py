"""Every ``persist`` subcommand (shards, maintenance, reads, SQL, metrics, collections,
ingestion) and the output helpers they share. The console script ``persist`` is
``persist_lib.cli.main:main``.
"""
