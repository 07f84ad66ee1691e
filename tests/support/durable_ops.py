"""Source text for kill -9 children: every durable operation on a file blob or a SQLite
consensus prints ``op N`` once it returned, so the parent can kill right after a chosen
one (each kill then lands after work started). Children splice it into their script at a
``# @COUNT_DURABLE_OPS`` line (``with_durable_op_counter``)."""

from __future__ import annotations

import textwrap

COUNT_DURABLE_OPS = textwrap.dedent(
    """
    import sys
    import threading
    from persist_lib.location.file_blob import FileBlob
    from persist_lib.location.sqlite_consensus import SqliteConsensus
    ops = [0]
    lock = threading.Lock()  # (uploads run on several threads)
    def counted(cls, name):
        real = getattr(cls, name)
        def op(self, *a, **kw):
            out = real(self, *a, **kw)
            with lock:
                ops[0] += 1
                sys.stdout.write(f"op {ops[0]}\\n")
                sys.stdout.flush()
            return out
        setattr(cls, name, op)
    for cls, name in ((FileBlob, "set"), (FileBlob, "delete"),
                      (SqliteConsensus, "compare_and_set"), (SqliteConsensus, "truncate")):
        counted(cls, name)
    """
).lstrip("\n")


def with_durable_op_counter(script: str) -> str:
    """``script`` (dedented) with its ``# @COUNT_DURABLE_OPS`` line replaced by the counter."""
    marker = "# @COUNT_DURABLE_OPS\n"
    assert script.count(marker) == 1, "the script must hold the marker line once"
    return script.replace(marker, COUNT_DURABLE_OPS)
