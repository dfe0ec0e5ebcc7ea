"""``maxent-arrow tail``: run as a process while commits land, its lines, its cursor, its
errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from maxent_arrow import RolloutStore
from maxent_arrow.cli import EXIT_DATA, EXIT_OK, EXIT_USAGE, main
from maxent_arrow.testing import CONFIG, make_batch

ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    path = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path)}


def test_tail_prints_each_commit_as_it_lands_as_json_lines(tmp_path):
    store = RolloutStore.create(tmp_path / "store", config=CONFIG, attempt="A")
    store.append(make_batch(0))
    tail = subprocess.Popen(
        [sys.executable, "-m", "maxent_arrow.cli", "tail", str(store.root), "--json"]
        + ["--since", "0", "--timeout", "3"],
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert tail.stdout is not None
        first = json.loads(tail.stdout.readline())  # the backlog, before any new commit
        assert first["event"] == "step" and first["step"] == 0
        for step in (1, 2):
            store.append(make_batch(step))
            line = json.loads(tail.stdout.readline())  # each line as its commit lands
            assert (line["step"], line["kind"], line["attempt"]) == (step, "train", "A")
        RolloutStore(store.root, attempt="B", resume_from=1).append(make_batch(1))
        gone = json.loads(tail.stdout.readline())
        again = json.loads(tail.stdout.readline())
        out, err = tail.communicate(timeout=30)
    finally:
        tail.kill()
    assert tail.returncode == EXIT_OK, err
    assert out == ""
    assert "(inotify)" in err and "--since VERSION" in err
    assert gone["event"] == "superseded" and gone["resume_from"] == 1
    assert [(u["step"], u["attempt"]) for u in gone["superseded"]] == [(1, "A"), (2, "A")]
    assert (again["step"], again["attempt"]) == (1, "B")
    assert again["version"] > gone["version"] > first["version"]


def test_tail_lines_the_cursor_and_the_kind(capsys, tmp_path):
    store = RolloutStore.create(tmp_path / "store", config=CONFIG, attempt="A")
    for step in range(3):
        store.append(make_batch(step))
    store.append(make_batch(1, kind="eval", groups=2))
    RolloutStore(store.root, attempt="B", resume_from=2).begin_attempt()
    assert main(["tail", str(store.root), "--since", "0", "--timeout", "0.1"]) == EXIT_OK
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 5
    assert lines[0].startswith("v2  step 0  rank 0  train  groups 3  num_samples ")
    assert "attempt A  step-0000000000.rank-00000.train.parquet" in lines[0]
    assert lines[3].startswith("v5  step 1  rank 0  eval  groups 2")
    assert lines[4] == "v6  superseded  1 unit(s), steps 2, by attempt B (resumed at step 2)"
    # Resume after a cursor; only one kind.
    assert main(["tail", str(store.root), "--since", "3", "--timeout", "0.1", "--json"]) == 0
    assert [json.loads(x)["version"] for x in capsys.readouterr().out.splitlines()] == [4, 5, 6]
    assert (
        main(["tail", str(store.root), "--since", "0", "--kind", "eval", "--timeout", "0.1"]) == 0
    )
    assert [x.split()[0] for x in capsys.readouterr().out.splitlines()] == ["v5"]


@pytest.mark.timeout(120)
def test_tail_errors(capsys, tmp_path):
    store = RolloutStore.create(tmp_path / "store", config=CONFIG)
    store.append(make_batch(0))
    assert main(["tail", str(store.root), "--since", "-1"]) == EXIT_USAGE
    assert "expected a log version >= 0" in capsys.readouterr().err
    assert main(["tail", str(store.root), "--since", "7", "--timeout", "0.1"]) == EXIT_DATA
    err = capsys.readouterr().err
    assert "error: " in err and "ends at version 2, before version 7" in err
    assert main(["tail", str(ROOT / "data" / "golden_v1"), "--timeout", "0.1"]) == EXIT_DATA
    assert "has no tail" in capsys.readouterr().err
    # Idle, it ends (the test's own timeout fails it, rather than hang, if it did not).
    assert main(["tail", str(store.root), "--timeout", "0.2"]) == EXIT_OK
