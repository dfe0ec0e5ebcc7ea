"""``RolloutStore.next_attempt``: a trainer run of its own in one process (resumed, re-run or
refused), and the superseded history of record tables."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from maxent_arrow import RolloutStore  # noqa: E402
from maxent_arrow.errors import ArgumentError, StoreError  # noqa: E402
from maxent_arrow.testing import make_batch  # noqa: E402


def figures(store: RolloutStore, steps: list[int]) -> int:
    return store.append_records(
        "my_figures", pa.table({"step": steps, "x": [float(s) for s in steps]})
    )


def test_each_next_attempt_is_a_run_of_its_own(tmp_path):
    root = tmp_path / "run"
    store = RolloutStore.create(root, if_exists="error")
    first = store.next_attempt()
    for step in range(4):
        first.append(make_batch(step, seed=step))
    figures(first, [0, 1, 2, 3])
    # The same process runs again: an attempt of its own (not the first one continued), so
    # a fresh run is refused before it writes anything ...
    fresh = store.next_attempt()
    assert fresh.attempt_spec.id != first.attempt_spec.id
    assert fresh.attempt_spec.id.startswith(first.attempt_spec.id.split(".")[0])
    with pytest.raises(StoreError, match="new run directory"):
        fresh.begin_attempt()
    # ... and a resume supersedes the steps it writes again.
    resumed = store.next_attempt(resume_from=2)
    assert resumed.begin_attempt() == resumed.attempt_spec.id
    resumed.append(make_batch(2, seed=20))
    figures(resumed, [2])
    assert RolloutStore(root).steps() == [0, 1, 2]
    assert RolloutStore(root, attempts="superseded").steps() == [2, 3]
    effective = RolloutStore(root).read_records("my_figures")
    assert effective.select(["step", "attempt"]).to_pylist() == [
        {"step": s, "attempt": first.attempt_spec.id} for s in (0, 1)
    ] + [{"step": 2, "attempt": resumed.attempt_spec.id}]
    # Superseded records are the earlier attempt's from the resume point on, and only those
    # (the latest attempt's are not superseded: they were returned here too).
    superseded = RolloutStore(root).read_records("my_figures", attempts="superseded")
    assert superseded.select(["step", "attempt"]).to_pylist() == [
        {"step": s, "attempt": first.attempt_spec.id} for s in (2, 3)
    ]
    assert RolloutStore(root).read_records("my_figures", attempts="all").num_rows == 5


def test_next_attempt_keeps_the_objects_choice_and_one_resume_point(tmp_path):
    root = tmp_path / "run"
    RolloutStore.create(root, if_exists="error").append(make_batch(0))
    spec = RolloutStore(root, resume_from=3).next_attempt().attempt_spec
    assert (spec.if_exists, spec.resume_from) == ("resume", 3)
    assert (
        RolloutStore(root, resume_from=3).next_attempt(resume_from=3).attempt_spec.resume_from == 3
    )
    with pytest.raises(ArgumentError, match="resumes at step 3, the run at step 2"):
        RolloutStore(root, resume_from=3).next_attempt(resume_from=2)
    spec = RolloutStore(root, if_exists="new_attempt").next_attempt().attempt_spec
    assert (spec.if_exists, spec.resume_from) == ("new_attempt", 0)
    spec = RolloutStore(root).next_attempt(if_exists="new_attempt").attempt_spec
    assert spec.if_exists == "new_attempt"
    # A checkpoint's resume point wins over the object's choice for a fresh run.
    spec = RolloutStore(root, if_exists="new_attempt").next_attempt(resume_from=1).attempt_spec
    assert (spec.if_exists, spec.resume_from) == ("resume", 1)
    # The object's options travel with it.
    opened = RolloutStore(root, compression="lz4", compact_every=None, attempts="all")
    again = opened.next_attempt()
    assert (again.compression, again.compact_every) == ("lz4", None)
    assert again.catalog.history == "all"


def test_a_resume_asked_of_an_attempt_that_began_is_refused_not_ignored(tmp_path):
    """One process is one attempt; a writer of it that asks for a resume point the attempt
    did not begin with is refused, naming the way out (next_attempt), never silently
    continued; a plain continuation of the same attempt is fine."""
    root = tmp_path / "s"
    first = RolloutStore.create(root)
    first.append(make_batch(0))
    first.append(make_batch(1))
    with pytest.raises(StoreError, match=r"asks for 'resume' at step 1.*next_attempt"):
        RolloutStore(root, resume_from=1).append(make_batch(1))
    with pytest.raises(StoreError, match=r"asks for 'new_attempt'"):
        RolloutStore(root, if_exists="new_attempt").begin_attempt()
    RolloutStore(root, if_exists="resume").append(make_batch(2))
    assert RolloutStore(root).steps() == [0, 1, 2]
    resumed = first.next_attempt(resume_from=1)
    resumed.append(make_batch(1, seed=5))
    assert RolloutStore(root).steps() == [0, 1]


def test_an_elastic_restart_of_a_torchrun_launch_is_an_attempt_of_its_own():
    """torchrun --max-restarts runs new workers under the same run id: a restart is a new
    attempt (it resumes), the ranks of one restart share it."""
    script = (
        "from maxent_arrow.store.history.attempts import default_attempt_id; "
        "print(default_attempt_id())"
    )
    ids = []
    for restart in ("0", "0", "1"):
        environ = {k: v for k, v in os.environ.items() if k != "MAXENT_ARROW_ATTEMPT"}
        environ.update(TORCHELASTIC_RUN_ID="job7", TORCHELASTIC_RESTART_COUNT=restart)
        done = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, env=environ, check=True
        )
        ids.append(done.stdout.strip())
    assert ids[0] == ids[1] == "torchrun-job7" and ids[2] == "torchrun-job7.restart-1"
