"""Every canned post-mortem query runs over a store made by the simulator + real detectors."""
import pytest

from stepwatch.storage import queries
from stepwatch.storage.views import connect
from stepwatch.storage.views import query as views_query

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def store(query_store):
    root, counts = query_store          # (tests/conftest.py: 256 ranks, 480 steps, shared with test_report)
    assert counts["alerts"] >= 2
    return root


def test_every_query_returns_rows(store):
    con = connect(store)
    step = con.execute("SELECT step_first FROM alerts WHERE kind='regression'").fetchall()[0][0]
    for name in queries.QUERIES:
        cols, rows = queries.run(con, name, job="bench-hour", step=step)
        assert rows, name
        assert len(cols) == len(rows[0])


def test_queries_find_the_injected_faults(store):
    con = connect(store)
    cols, rows = queries.run(con, "slowest_ranks", job="bench-hour")
    assert rows[0][cols.index("rank")] == 256 // 3            # the injected slow rank is on top
    cols, rows = queries.run(con, "change_points", job="bench-hour")
    reg = [r for r in rows if r[cols.index("kind")] == "regression"]
    assert reg and abs(reg[0][cols.index("step_first")] - 2 * 480 // 3) <= 10
    assert reg[0][cols.index("cause")] == "communication"
    cols, rows = queries.run(con, "before_after", job="bench-hour", step=2 * 480 // 3)
    before, after = (dict(zip(cols, r)) for r in rows)
    assert before["side"] == "before" and after["comm_ms"] > before["comm_ms"] * 1.3
    cols, rows = queries.run(con, "card_hours_lost", job="bench-hour")
    assert {r[0] for r in rows} >= {"computation", "communication"}


def test_unknown_query_and_missing_parameter_are_clear(store):
    con = connect(store)
    with pytest.raises(ValueError, match="unknown query 'nope'"):
        queries.run(con, "nope", job="x")
    with pytest.raises(ValueError, match="--step"):
        queries.run(con, "before_after", job="bench-hour")


def test_per_step_queries_read_the_summary_and_match_the_step_rows(store):
    """jitter_per_hour and card_hours_lost read step_summary (one row per step and flush); over the
    whole job they give what the same SQL over the step rows gives."""
    con = connect(store)
    assert "step_summary" in queries.QUERIES["jitter_per_hour"].sql
    assert con.execute("SELECT count(*) FROM step_summary").fetchone()[0] < \
        con.execute("SELECT count(*) FROM steps").fetchone()[0] / 100
    for name in ("jitter_per_hour", "card_hours_lost"):
        q = queries.QUERIES[name]
        by_rows = q.sql.replace("max(step_ms_max)", "max(step_ms)").replace("FROM step_summary", "FROM steps")
        args = {p: queries.DEFAULTS[p] for p in q.params if p != "job"}
        _, want = views_query(con, by_rows.replace("$t_from", "CAST($t_from AS TIMESTAMPTZ)")
                                .replace("$t_to", "CAST($t_to AS TIMESTAMPTZ)"), dict(args, job="bench-hour"))
        _, got = queries.run(con, name, job="bench-hour")
        assert got == want and got, name
