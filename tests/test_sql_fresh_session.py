"""What a new ``SqlSession`` pays before its first query (issue 28: one ``persist sql``
command is one session): its DuckDB connection opens on a thread while the tables are
opened and their parts copied, and a query without a filter is not planned to look for
one (``rewrite.may_filter``)."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pyarrow as pa
import pytest

from persist_lib import PersistClient, PersistConfig, ShardId
from persist_lib.errors import InvalidUsage
from persist_lib.sql.engine import SqlSession
from persist_lib.sql.pushdown import scan_filters
from persist_lib.sql.rewrite import may_filter

pytest.importorskip("duckdb")

KEY = pa.schema([("id", pa.int64())])
VAL = pa.schema([("name", pa.string())])
SUM_OF = "SELECT count(*), sum(id) FROM {}"
COUNT_OF = "SELECT count(*) FROM {}"


def setup() -> tuple[PersistClient, ShardId]:
    name = uuid.uuid4().hex
    client = PersistClient.open(f"mem://{name}", f"mem://{name}", PersistConfig.for_tests(inline_threshold=0))
    sid = ShardId.new()
    w, r = client.open(sid, KEY, VAL)
    for i in range(3):  # three key-disjoint parts, one time each
        ids = list(range(i * 10, i * 10 + 10))
        w.compare_and_append(
            pa.table({"id": ids, "name": [f"n{j % 4}" for j in ids], "ts": [i] * 10, "diff": [1] * 10}), i, i + 1
        )
    w.expire()
    r.expire()
    return client, sid


# Queries over the table ``t`` with no clause that filters it, and with one.
UNFILTERED = [
    "SELECT count(*), sum(id * diff) FROM t",
    "SELECT * FROM t ORDER BY id LIMIT 3",
    "SELECT DISTINCT name FROM t",
    "SELECT name, sum(diff) FROM t GROUP BY name ORDER BY 1",
    "SELECT id, row_number() OVER (PARTITION BY name ORDER BY id) FROM t",
    "SELECT id FROM t UNION ALL SELECT id + 1 FROM t",
    "SELECT (SELECT max(id) FROM t) AS m",
    "SELECT 'where id = 1' AS note, count(*) FROM t",
    'SELECT id AS "where" FROM t',
    "WITH x AS (SELECT id FROM t) SELECT count(*) FROM x",
]
FILTERED = [
    "SELECT * FROM t WHERE id < 5",
    "SELECT name, sum(diff) FROM t GROUP BY name HAVING name = 'n1'",
    "SELECT a.id FROM t a JOIN t b ON a.id = b.id AND b.id > 20",
    "SELECT * FROM t QUALIFY row_number() OVER (ORDER BY id) < 3",
    "SELECT count(*) FILTER (WHERE id > 3) FROM t",
    "select * from t where id between 1 and 3",
]


def test_may_filter_is_false_only_where_duckdbs_plan_has_no_filter_above_the_scan() -> None:
    """``may_filter`` False must mean: the plan DuckDB makes has no ``FILTER`` right above
    the table's scan, so ``sql`` may skip planning it (nothing could be pushed down)."""
    client, sid = setup()
    with SqlSession(client, direct_reads=False) as s:
        s.register("t", s.snapshot(str(sid), 2))  # an Arrow stream: the plan shows its scan
        for q in UNFILTERED:
            assert not may_filter(q), q
            plan = s.connection.sql("EXPLAIN (FORMAT json) " + q).fetchall()
            filters = scan_filters(str(plan[0][1]))
            assert filters and not any(filters), (q, filters)
        pushed = 0
        for q in FILTERED:
            assert may_filter(q), q
            plan = s.connection.sql("EXPLAIN (FORMAT json) " + q).fetchall()
            pushed += any(scan_filters(str(plan[0][1])) or [])
        assert pushed >= 4  # the word list is not just longer than it needs: these do filter scans
    client.close()


def test_a_fresh_session_prunes_parts_of_a_filtered_query_and_reads_all_of_an_unfiltered_one() -> None:
    client, sid = setup()
    for q, n_copies, want in (
        (SUM_OF.format(sid) + " WHERE id >= 20", 1, (10, sum(range(20, 30)))),
        (SUM_OF.format(sid), 3, (30, sum(range(30)))),
    ):
        with SqlSession(client, as_of=2) as s:
            assert s.sql(q).fetchall()[0] == want
            copies = Path(s._copies or "")
            assert sum(len(os.listdir(d)) for d in copies.iterdir()) == n_copies, q
    client.close()


def test_a_session_closed_while_its_connection_opens_leaves_nothing() -> None:
    client, sid = setup()
    s = SqlSession(client, as_of=2)
    with pytest.raises(InvalidUsage, match="no collection or shard named"):
        s.sql("SELECT * FROM orders AS OF 1")  # fails after the connection started opening
    scratch = s._scratch
    assert scratch is not None and os.path.isdir(scratch)
    s.close()
    assert not os.path.exists(scratch)
    with pytest.raises(InvalidUsage, match="closed"):
        s.sql(COUNT_OF.format(sid))
    # A session whose first use is its connection opens it there (no thread left behind).
    with SqlSession(client, as_of=2) as s2:
        assert s2.connection.sql("SELECT 1").fetchall() == [(1,)]
        assert s2.sql(COUNT_OF.format(sid)).fetchall() == [(30,)]
    client.close()
