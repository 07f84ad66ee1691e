"""The engine rows of the scaling table: Spark and ``persist sql`` over a shard, against the
same engine reading the shard's part files as plain Parquet (issue 28).

Both run over the shard ``bench.scaling`` compacted (key-sorted parts, times 0..3 kept:
the reader holds the since at 0), with one aggregate over every column weighted by the
diff, so that the persist side and the raw side must agree on three of its four figures
(``count(*)`` differs: persist returns one row per distinct ``(key, value)``, the raw
files one per update):

    count(*), sum(key * diff), sum(length(value) * diff), sum(diff)

- **Spark** (``local[2]``): ``persist_lib.spark.read_snapshot(spark, reader, 3)`` (fetched,
  verified and consolidated on the executors; on this ``file://`` blob the parts are
  pinned and the DataFrame is lazy, ``spark.pins``; before that, materialized) and the
  aggregate, against
  ``spark.read.parquet(<the part files>)`` and the same aggregate (Spark's vectorized
  Parquet reader: no checksum, no consolidation, no materialization). Goal >= 0.8x of
  the raw read's speed. The CPU of each side counts the JVM and the Python workers
  (``spark_floor.tree_cpu_s``), and the row with history also gives the ``mapInArrow``
  hand-off floor (``bench.spark_floor``): what a Python read costs before persist's work.
- **SQL**: ``SqlSession(client).sql("SELECT <the aggregate> FROM <shard>")`` (the query
  ``persist sql`` runs: DuckDB over the streamed snapshot) against DuckDB's
  ``read_parquet([<the part files>])``. Goal >= 0.8x.

Median of 3 rounds for Spark, 7 for SQL (each round persist then the anchor, so that both
see the same load), warm page cache, one Spark session for every size.

Then the same rows once the reader's since reached the as-of and the shard was
compacted again (``no_history_figures``: every key at one time, the parts need no
consolidation): Spark's default ``read_snapshot`` (the pinned parts verified, then read
lazily by Spark's Parquet reader), ``read_snapshot(materialize=False)`` (the parts' own
files, the reader keeping its hold) and ``persist sql``, each against the same raw reads
of the new part files.
The no-history SQL row is measured twice: one session repeating the query (a direct
view's verified part copies are made once and reused) and a new client and session
per query (``sql_nh_fresh``: what one ``persist sql`` command pays, copies included).
"""

from __future__ import annotations

import inspect
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import spark_floor
from bench.common import KEY_SCHEMA, VAL_SCHEMA, persist_file_client

REPS = 3
SQL_REPS = 7
AS_OF = 3

_AGG_SQL = "count(*), sum({k} * {d}), sum(length({v}) * {d}), sum({d})"


def part_files_of(d: Path, shard: Any) -> list[str]:
    """The paths of the shard's part files in the file blob of ``persist_file_client(d)``
    (one file per blob key)."""
    client = persist_file_client(d)
    try:
        state = client.machine(shard).fetch_latest()
        return [
            os.path.join(d / "blob", *p.key.split("/"))
            for _, b in state.trace_batches()
            for p in b.parts
            if p.key is not None
        ]
    finally:
        client.close()


def interleaved(
    ours: Callable[[], Any], anchor: Callable[[], Any], reps: int, *, warm: bool = False
) -> tuple[float, float, Any, Any]:
    """Median wall seconds of ``ours`` and ``anchor`` run in alternation (``reps`` rounds,
    after one untimed call of each with ``warm``), and their last results: on a loaded
    machine, both sides then see the same load."""
    got = paired(ours, anchor, reps, warm=warm)
    return got["ours_s"], got["anchor_s"], got["ours_out"], got["anchor_out"]


def paired(
    ours: Callable[[], Any], anchor: Callable[[], Any], reps: int, *, warm: bool = False,
    cpu: Callable[[], float] = time.process_time,
) -> dict[str, Any]:
    """``interleaved``, with the median CPU seconds of each side too (every thread of the
    process: persist's pools and DuckDB's threads alike; ``cpu``: another clock, e.g.
    ``spark_floor.tree_cpu_s`` for Spark's JVM and Python workers). On a loaded machine the wall
    times swing 2-4x from run to run; the CPU a query costs swings far less, so its
    ratio tells what a change did when the wall ratio can't."""
    got = sides({"ours": ours, "anchor": anchor}, reps, warm=warm, cpu=cpu)
    return {
        "ours_s": got["ours"]["s"], "anchor_s": got["anchor"]["s"],
        "ours_cpu_s": got["ours"]["cpu_s"], "anchor_cpu_s": got["anchor"]["cpu_s"],
        "ours_out": got["ours"]["out"], "anchor_out": got["anchor"]["out"],
    }


def sides(
    fns: dict[str, Callable[[], Any]], reps: int, *, warm: bool = False,
    cpu: Callable[[], float] = time.process_time,
) -> dict[str, dict[str, Any]]:
    """Each of ``fns`` ``reps`` times in alternation (after one untimed call of each
    with ``warm``): per name, the median wall (``s``) and ``cpu`` seconds (``cpu_s``)
    and the last result (``out``)."""
    if warm:
        for fn in fns.values():
            fn()
    wall: dict[str, list[float]] = {k: [] for k in fns}
    used: dict[str, list[float]] = {k: [] for k in fns}
    out: dict[str, Any] = dict.fromkeys(fns)
    for _ in range(reps):
        for side, fn in fns.items():
            t0, c0 = time.perf_counter(), cpu()
            out[side] = fn()
            wall[side].append(time.perf_counter() - t0)
            used[side].append(cpu() - c0)
    return {
        k: {"s": statistics.median(wall[k]), "cpu_s": statistics.median(used[k]), "out": out[k]} for k in fns
    }


def _check(what: str, ours: tuple[Any, ...], raw: tuple[Any, ...]) -> None:
    if tuple(int(x) for x in ours[1:]) != tuple(int(x) for x in raw[1:]):
        raise AssertionError(f"{what}: persist {ours} != raw Parquet {raw}")


_SPARK: list[Any] = []


def spark_session() -> Any:
    """One ``local[2]`` session for every size (started on first use)."""
    if not _SPARK:
        from persist_lib.spark import local_session

        s = local_session("local[2]", "bench-scaling", {"spark.driver.memory": "6g"})
        s.sparkContext.setLogLevel("ERROR")
        _SPARK.append(s)
    return _SPARK[0]


def stop_spark() -> None:
    while _SPARK:
        _SPARK.pop().stop()


def spark_figures(
    d: Path, shard: Any, files: list[str], *, materialize: bool = True, floor: bool = False
) -> dict[str, Any]:
    """One Spark row: ``read_snapshot`` + the aggregate against ``spark.read.parquet`` +
    the same aggregate, interleaved, wall and CPU (the JVM and Python workers too:
    ``spark_floor.tree_cpu_s``). ``floor``: also the ``mapInArrow`` hand-off floor of as
    many rows (``spark_floor.floor_query``)."""
    from pyspark.sql import functions as F

    from persist_lib.spark import read_snapshot
    from persist_lib.spark.pins import release_pins

    spark = spark_session()
    client = persist_file_client(d)
    r = client.open_leased_reader(shard, KEY_SCHEMA, VAL_SCHEMA)

    kw: dict[str, Any] = {} if materialize else {"materialize": False}

    def persist() -> tuple[Any, ...]:
        r.release_splits()  # the previous lazy read's hold (materialize=False)
        df = read_snapshot(spark, r, AS_OF, **kw)
        row = df.agg(
            F.count("*"), F.sum(F.col("key") * F.col("diff")),
            F.sum(F.length("value") * F.col("diff")), F.sum("diff"),
        ).collect()[0]
        return tuple(row)

    def raw() -> tuple[Any, ...]:
        df = spark.read.parquet(*files)
        row = df.agg(
            F.count("*"), F.sum(F.col("k.key") * F.col("d")),
            F.sum(F.length("v.value") * F.col("d")), F.sum("d"),
        ).collect()[0]
        return tuple(row)

    try:
        raw()  # warm the JVM's Parquet path and the page cache once, as persist's first run
        fns = {"persist": persist, "raw": raw}
        if floor:
            fns["floor"] = spark_floor.floor_query(spark, int(persist()[0]))
            fns["floor"]()  # the workers build their rows once
        got = sides(fns, REPS, cpu=spark_floor.tree_cpu_s)
    finally:
        release_pins()  # the default reads' pinned part files (spark.pins), if any
        r.expire()
        client.close()
    p_out, a_out = got["persist"]["out"], got["raw"]["out"]
    _check("spark", p_out, a_out)
    out = {
        "persist_s": got["persist"]["s"], "raw_s": got["raw"]["s"], "persist_cpu_s": got["persist"]["cpu_s"],
        "raw_cpu_s": got["raw"]["cpu_s"], "rows": int(p_out[0]), "raw_rows": int(a_out[0]),
    }
    if floor:
        out |= {"floor_s": got["floor"]["s"], "floor_cpu_s": got["floor"]["cpu_s"]}
    return out


def sql_figures(d: Path, shard: Any, files: list[str], *, fresh: bool = False) -> dict[str, Any]:
    """The SQL row: one session's repeated query (``fresh=False``: what a session caches
    across queries, e.g. the verified part copies of a direct view, is reused), or a new
    client and session per query (``fresh=True``: what one ``persist sql`` command pays)."""
    import duckdb

    from persist_lib.sql.engine import SqlSession

    q = "SELECT " + _AGG_SQL.format(k="key", v="value", d="diff") + f" FROM {shard}"  # noqa: S608 - our own shard id
    flist = ", ".join(f"'{f}'" for f in files)
    q_raw = (
        "SELECT " + _AGG_SQL.format(k='k.key', v='v.value', d="d") # noqa: S608 - our own file paths
        + f" FROM read_parquet([{flist}])"
    )

    def one_session() -> Any:
        c = persist_file_client(d)
        try:
            with SqlSession(c, as_of=AS_OF) as s1:
                return s1.sql(q).fetchall()[0]
        finally:
            c.close()

    con = duckdb.connect()
    client = persist_file_client(d)
    try:
        if fresh:
            got = paired(one_session, lambda: con.sql(q_raw).fetchall()[0], SQL_REPS, warm=True)
        else:
            with SqlSession(client, as_of=AS_OF) as s:
                got = paired(
                    lambda: s.sql(q).fetchall()[0], lambda: con.sql(q_raw).fetchall()[0], SQL_REPS, warm=True
                )
    finally:
        con.close()
        client.close()
    p_out, a_out = got["ours_out"], got["anchor_out"]
    _check("sql", p_out, a_out)
    return {
        "persist_s": got["ours_s"], "raw_s": got["anchor_s"], "persist_cpu_s": got["ours_cpu_s"],
        "raw_cpu_s": got["anchor_cpu_s"], "rows": int(p_out[0]), "raw_rows": int(a_out[0]),
    }


def drop_history(d: Path, shard: Any) -> None:
    """Advances the shard's since to the as-of and compacts it again: every key at one
    time, parts that need no consolidation."""
    client = persist_file_client(d)
    try:
        r = client.open_leased_reader(shard, KEY_SCHEMA, VAL_SCHEMA)
        r.downgrade_since(AS_OF)
        client.compact(shard)
        r.expire()
    finally:
        client.close()


def no_history_figures(d: Path, shard: Any, *, spark: bool = True) -> dict[str, dict[str, Any]]:
    """Advances the shard's since to the as-of, compacts it again (every key at one
    time: parts that need no consolidation) and measures Spark (default and lazy) and
    SQL over it, against the raw reads of its new part files (``spark=False``: SQL only).
    Run last: it changes the shard."""
    drop_history(d, shard)
    files = part_files_of(d, shard)
    out: dict[str, dict[str, Any]] = {}
    if spark:
        from persist_lib.spark import read_snapshot

        out["spark_nh"] = spark_figures(d, shard, files)
        if "materialize" in inspect.signature(read_snapshot).parameters:  # not before issue 28's direct reads
            out["spark_nh_lazy"] = spark_figures(d, shard, files, materialize=False)
    out["sql_nh"] = sql_figures(d, shard, files)
    out["sql_nh_fresh"] = sql_figures(d, shard, files, fresh=True)
    return out
