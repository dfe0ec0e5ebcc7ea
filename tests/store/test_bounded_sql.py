"""A step-bounded ``sql()`` (``steps=(first, last)``) reads only the files of its steps: it
gives what an unbounded query filtered to those steps gives (and what DuckDB gives over the
live files), keeps working when another step's file is damaged (which an unbounded query
refuses), still refuses damage in its own files, and follows the run's history."""

from __future__ import annotations

import duckdb
import pytest

from maxent_arrow.errors import ArgumentError, StoreError
from maxent_arrow.store import ReadOnlyStore
from maxent_arrow.testing import compacted_run, resume_run

MEANS = (
    "SELECT step, kind, count(*) AS n, round(avg(total_util), 9) AS reward FROM samples "
    "{where} GROUP BY step, kind ORDER BY step, kind"
)
STEPS = "SELECT step, rank, kind, num_groups FROM steps {where} ORDER BY step, kind, rank"


def _run(tmp_path):
    """Steps 0-29 of train compacted into segments of 10 steps, and loose files: evals every
    5th step, and train steps 30-34."""
    root = tmp_path / "run"
    compacted_run(root, steps=35, eval_every=5, merged=30, segment=10)
    return root


def _file_of(root, step: int, kind: str = "train"):
    """The live group file holding ``step`` of ``kind``."""
    hits = []
    for path, _ in ReadOnlyStore(root).live_files("groups"):
        query = f"SELECT count(*) FROM read_parquet('{path}') WHERE step = ? AND kind = ?"
        got = duckdb.connect().execute(query, [step, kind]).fetchone()
        if got and got[0]:
            hits.append(path)
    assert len(hits) == 1, hits
    return hits[0]


def _truncate(path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def test_a_bounded_query_is_the_unbounded_query_of_its_steps(tmp_path):
    root = _run(tmp_path)
    store = ReadOnlyStore(root)
    for first, last in ((12, 14), (9, 10), (28, 31), (0, 0), (34, 40)):
        where = f"WHERE step BETWEEN {first} AND {last}"
        bounded = store.sql(MEANS.format(where=""), steps=(first, last))
        assert bounded.equals(store.sql(MEANS.format(where=where)))
        assert store.sql(STEPS.format(where=""), steps=(first, last)).equals(
            store.sql(STEPS.format(where=where))
        )
        # From the outside: DuckDB over the live group files, filtered to the steps.
        files = [str(p) for p, _ in store.live_files("groups")]
        direct = (
            duckdb.connect()
            .execute(
                f"SELECT step, kind, count(*) FROM (SELECT step, kind, "
                f"unnest(generate_series(1, num_completions)) FROM read_parquet({files})) "
                f"{where} GROUP BY step, kind ORDER BY step, kind"
            )
            .fetchall()
        )
        assert [(r["step"], r["kind"], r["n"]) for r in bounded.to_pylist()] == direct
        assert {r["step"] for r in bounded.to_pylist()} == set(range(first, min(last, 34) + 1))


def test_damage_outside_the_bound_is_not_read_and_inside_it_is_refused(tmp_path):
    root = _run(tmp_path)
    before = ReadOnlyStore(root).sql(MEANS.format(where=""), steps=(12, 14))
    # The segment of steps 0-9, a loose train file, a loose eval file.
    for path in [_file_of(root, 3), _file_of(root, 32), _file_of(root, 20, "eval")]:
        _truncate(path)
    store = ReadOnlyStore(root)
    assert store.sql(MEANS.format(where=""), steps=(12, 14)).equals(before)
    with pytest.raises(StoreError):
        store.sql(MEANS.format(where=""))
    for bound in ((5, 5), (32, 33), (19, 21)):
        with pytest.raises(StoreError):
            store.sql(MEANS.format(where=""), steps=bound)
    # "skip" leaves the damaged file of the bound out, with a warning.
    with pytest.warns(UserWarning):
        skipped = store.sql(MEANS.format(where=""), steps=(30, 33), on_error="skip")
    assert sorted({r["step"] for r in skipped.to_pylist()}) == [30, 31, 33]


def test_a_bounded_query_follows_the_history(tmp_path):
    root = _run(tmp_path)
    # A resume at step 25 supersedes steps 25-34 of the first attempt (in part a segment).
    resume_run(root, resume_from=25, steps=(25, 26), seed=500)
    for history in ("effective", "all", "superseded"):
        store = ReadOnlyStore(root, attempts=history)
        for first, last in ((23, 27), (25, 25), (29, 33)):
            where = f"WHERE step BETWEEN {first} AND {last}"
            bounded = store.sql(MEANS.format(where=""), steps=(first, last))
            assert bounded.equals(store.sql(MEANS.format(where=where))), (history, first)
    effective = ReadOnlyStore(root).sql(MEANS.format(where=""), steps=(23, 27)).to_pylist()
    # Train steps 27-29 of the first attempt are superseded and were not written again.
    assert [r["step"] for r in effective if r["kind"] == "train"] == [23, 24, 25, 26]


@pytest.mark.parametrize("bad", [5, (5,), (5, 6, 7), (6, 5), (1.0, 2), (True, 3), "5-6"])
def test_a_bad_bound_is_an_argument_error(tmp_path, bad):
    root = _run(tmp_path)
    with pytest.raises(ArgumentError, match="steps"):
        ReadOnlyStore(root).sql("SELECT 1", steps=bad)
