"""Each script in examples/ runs to completion as a user would run it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


def test_there_is_an_example_per_use():
    assert {p.stem for p in EXAMPLES} >= {"ingestion", "replay", "analytics"}


@pytest.mark.slow
@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.stem)
def test_example_runs(script, tmp_path):
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert done.stdout.strip()


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("examples") / "run"
    done = subprocess.run(
        [sys.executable, "-m", "maxent_arrow.cli", "demo", "--out", str(out), "--steps", "2",
         "--prompts", "4", "--k", "3", "--sft-steps", "3", "--eval-prompts", "4",
         "--offline-steps", "0"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", ["replay", "analytics"])
def test_an_example_takes_the_run_directory_or_its_store(demo_run, tmp_path, name):
    """One way to name a run: RUN and RUN/store both work (the examples took the run
    directory only), anything else is one line and exit 2; the run is not written to."""
    script = ROOT / "examples" / f"{name}.py"
    report = (demo_run / "report" / "index.html").read_bytes()
    outputs = []
    for given in (demo_run, demo_run / "store"):
        done = subprocess.run([sys.executable, str(script), str(given)], cwd=tmp_path,
                              capture_output=True, text=True, timeout=600)  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        outputs.append(done.stdout.splitlines()[:4])
    assert outputs[0] == outputs[1]
    assert (demo_run / "report" / "index.html").read_bytes() == report
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "nowhere")],
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert f"{name}.py: error: {tmp_path / 'nowhere'}: not a run" in done.stderr
