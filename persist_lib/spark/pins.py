"""Pinned parts: a read's part files hard-linked aside, so a lazy DataFrame outlives the
reader's hold (issue 28).

A DataFrame is lazy: its rows are fetched each time an action runs, possibly long after
``read_snapshot`` returned. The parts it reads must exist then, but the reader's seqno
hold is what keeps garbage collection from deleting them, and the default read releases
that hold before returning. Until now the default therefore materialized the rows
(``localCheckpoint``: every row computed, written to the block manager, and read back by
the caller's action), which is most of the cost of a Spark read.

On a local-directory blob (``file://``) the parts can instead be *pinned*: while the hold
is still taken, every part file the read needs is hard-linked under
``<blob root>/.spark-pins/<pin>/`` with its own key path. A hard link is a second name for
the same immutable file: when garbage collection deletes the part's own name, the pinned
name still reaches the same bytes, and no writer ever changes a part's bytes in place
(``FileBlob.set`` renames a new file over a name). The DataFrame then reads the pinned
names lazily (through a ``FileBlob`` rooted at the pin, or Spark's Parquet reader on the
pinned paths), with every part's checksum verified as before, and the hold is released
at once. Linking costs a few system calls per part and no copy.

Listing the blob skips the pin directory (hidden names are never keys), so pins are never
mistaken for parts or leaked blobs. A pin keeps a part's bytes on disk after garbage
collection deletes the part, so pins are removed again: all of this process's pins at its
exit (``atexit``) or on ``release_pins()``, and any pin older than ``PIN_TTL_S`` (any
process's) by the next pin taken under the same root. An action on a DataFrame whose pin
was removed fails: ``PinExpired`` from the general path's executors, Spark's
``FileNotFoundException`` naming the pinned path from the Parquet reader; never other
rows.

When linking fails (another filesystem under the root, no permission, a file system
without hard links) ``pin_parts`` says None and the caller materializes as before.
"""

from __future__ import annotations

import atexit
import os
import shutil
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from persist_lib.config_rules import Rule
from persist_lib.errors import ConfigProblem, InvalidConfig, LeaseExpired
from persist_lib.location.file_blob import FileBlob, validate_key
from persist_lib.shard.batch_meta import PartMeta

# The directory under a file blob's root that holds the pins (hidden: never listed as keys).
PIN_DIR = ".spark-pins"

# A pin older than this is removed by the next pin taken under the same root: the backstop
# for processes that did not exit cleanly. Env ``PERSIST_SPARK_PIN_TTL_S`` overrides it.
PIN_TTL_S = 24 * 3600.0

_lock = threading.Lock()
_ours: set[str] = set()
_registered = False


class PinExpired(LeaseExpired):
    """A lazy Spark read's pinned parts were removed (``release_pins``, the process that
    read exited, or the pin outlived ``PIN_TTL_S``): read the shard again."""


@dataclass(frozen=True)
class Pin:
    """One read's pinned part files: a directory laid out as the blob (same keys)."""

    root: str

    @property
    def uri(self) -> str:
        return "file://" + self.root

    def blob(self) -> FileBlob:
        return FileBlob(self.root, fsync=False)

    def release(self) -> None:
        """Removes this pin (a read that ended up not reading through it)."""
        with _lock:
            _ours.discard(self.root)
        shutil.rmtree(self.root, ignore_errors=True)


#: The environment variable that overrides ``PIN_TTL_S``.
PIN_TTL_ENV = "PERSIST_SPARK_PIN_TTL_S"
_TTL_RULE = Rule(
    "float", lo=0, lo_open=True, unit="seconds",
    meaning="how long a Spark read's pinned parts may live before any new pin removes them",
)


def pin_ttl_s() -> float:
    """``PIN_TTL_S``, or ``$PERSIST_SPARK_PIN_TTL_S`` (seconds, a positive number); a bad
    value is an ``InvalidConfig`` naming the variable."""
    raw = os.environ.get(PIN_TTL_ENV, "").strip()
    if not raw:
        return PIN_TTL_S
    try:
        ttl = float(raw)
    except ValueError:
        ttl = float("nan")
    if _TTL_RULE.is_bad(ttl):
        raise InvalidConfig([ConfigProblem(
            "ttl_s", raw, f"${PIN_TTL_ENV} {_TTL_RULE.allowed()}",
            f"fix: set it to a number of seconds (e.g. 86400), or unset it for the default {PIN_TTL_S:.0f}",
            source=f"${PIN_TTL_ENV}",
        )], what="Spark pin TTL")
    return ttl


def _checked_ttl(ttl_s: object) -> float:
    """``sweep``'s ``ttl_s``: a zero, negative or non-number TTL would remove the pins that
    running reads still use (every pin is older than that)."""
    problem = _TTL_RULE.check("ttl_s", ttl_s, PIN_TTL_S)
    if problem is not None:
        raise InvalidConfig([problem], what="Spark pin TTL")
    return float(ttl_s)  # type: ignore[arg-type]


def _pin_age_s(name: str, now: float) -> float | None:
    stamp, _, _ = name.partition("-")
    return now - int(stamp) if stamp.isdigit() else None


def sweep(root: str, ttl_s: float | None = None) -> int:
    """Removes the pins under the blob directory ``root`` older than ``ttl_s`` (default
    ``pin_ttl_s()``); returns how many."""
    ttl = pin_ttl_s() if ttl_s is None else _checked_ttl(ttl_s)
    base = os.path.join(root, PIN_DIR)
    try:
        names = os.listdir(base)
    except OSError:
        return 0
    now = time.time()
    n = 0
    for name in names:
        age = _pin_age_s(name, now)
        if age is not None and age > ttl:
            shutil.rmtree(os.path.join(base, name), ignore_errors=True)
            n += 1
    return n


def pin_parts(root: str, parts: Sequence[PartMeta]) -> Pin | None:
    """Hard-links the blob parts among ``parts`` (inline parts need no file) of the blob
    directory ``root`` into a new pin; None when a link can't be made (nothing is left
    behind). The caller must hold the parts (a seqno hold) while this runs."""
    sweep(root)
    d = os.path.join(root, PIN_DIR, f"{int(time.time())}-{os.getpid()}-{uuid.uuid4().hex}")
    try:
        os.makedirs(d)
        for p in parts:
            if p.key is None:
                continue
            segs = validate_key(p.key)
            dst = os.path.join(d, *segs)
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            os.link(os.path.join(root, *segs), dst, follow_symlinks=False)
    except OSError:
        shutil.rmtree(d, ignore_errors=True)
        return None
    global _registered
    with _lock:
        _ours.add(d)
        if not _registered:
            atexit.register(release_pins)
            _registered = True
    return Pin(d)


def release_pins() -> int:
    """Removes every pin this process took (the lazy DataFrames read through them fail
    from then on); returns how many. A forked child inherits the parent's list of pins
    and its ``atexit`` hook, but the pins are the parent's: only pins whose name carries
    this process's pid are removed."""
    mine = f"-{os.getpid()}-"
    with _lock:
        taken = [d for d in _ours if mine in os.path.basename(d)]
        _ours.clear()
    for d in taken:
        shutil.rmtree(d, ignore_errors=True)
    return len(taken)


def check_pin(blob_uri: str, shard: str) -> None:
    """Raises ``PinExpired`` when ``blob_uri`` is a pin that no longer exists (an
    executor's check before it fetches through a pin)."""
    marker = os.sep + PIN_DIR + os.sep
    if blob_uri.startswith("file://") and marker in blob_uri and not os.path.isdir(blob_uri[len("file://"):]):
        raise PinExpired(
            f"shard {shard}: this Spark DataFrame's pinned parts were removed (release_pins(), the "
            f"reading process exited, or the pin was older than {pin_ttl_s():.0f} s); read the shard again"
        )
