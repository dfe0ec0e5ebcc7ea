"""benchmarks/readme_timings.py: the README's first-hour figures, measured on a fresh clone."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import readme_timings  # noqa: E402

DOC = {
    "quick": False,
    "date": "2026-12-01",
    "commit": "0123456789abcdef",
    "seconds": {"venv": 372.0, "demo": 288.0, "demo_rerun": 210.5, "test": 1260.0},
    "first_demo": 660.0,
    "machine": {"cpu": "AMD EPYC", "cores": 2, "memory_gib": 23.5, "python": "3.11.7"},
    "load": {"min": 1.2, "median": 2.4, "max": 3.1, "samples": 300},
}


def test_the_block_states_each_measured_time_and_how_it_was_measured():
    block = readme_timings.render(DOC)
    assert "make demo   # " in block and "(first run 11.0 min, then 3.5 min)" in block
    assert "make test   # " in block and "(21.0 min on 2 cores)" in block
    assert "6.2 min of it building `.venv`" in block
    assert "commit `0123456789`" in block and "AMD EPYC, 2 cores" in block
    # The load exceeded the cores: the figures are said to be upper bounds.
    assert "median 2.40, peak 3.10 on 2 cores" in block and "upper bounds" in block
    calm = readme_timings.render({**DOC, "load": {**DOC["load"], "median": 0.3, "max": 0.9}})
    assert "upper bounds" not in calm
    assert "smoke run" in readme_timings.render({**DOC, "quick": True})


def test_the_readme_block_is_replaced_and_nothing_else(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(
        f"# x\n\nintro\n\n{readme_timings.START}\nold\n{readme_timings.END}\n\n## Next\nkept\n"
    )
    text = readme_timings.replace_between_markers(
        readme.read_text(),
        readme_timings.render(DOC),
        start=readme_timings.START,
        end=readme_timings.END,
    )
    assert text.startswith(f"# x\n\nintro\n\n{readme_timings.START}\n```bash\nmake demo")
    assert text.endswith(f"{readme_timings.END}\n\n## Next\nkept\n") and "old" not in text


def test_the_readme_has_the_first_hour_block():
    text = (ROOT / "README.md").read_text()
    block = text[text.index(readme_timings.START) : text.index(readme_timings.END)]
    assert "make demo" in block and "make test" in block and "readme_timings.py" in block


def test_quick_figures_never_reach_the_readme(tmp_path):
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "readme_timings.py"), "--quick", "--readme",
         str(tmp_path / "README.md")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2 and "drop --readme" in done.stderr


@pytest.mark.slow
def test_a_quick_run_clones_times_each_step_and_writes_its_figures(tmp_path):
    """The machinery end to end on a fresh clone of HEAD (a tiny demo twice, one test file):
    about a minute. The full run is the same with `make venv`, `make demo` twice and
    `make test`."""
    if not (ROOT / ".venv" / "bin" / "python").exists():
        pytest.skip("no .venv to run the quick mode with (make venv)")
    out = tmp_path / "figures.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "readme_timings.py"), "--quick", "--json",
         str(out)],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    doc = json.loads(out.read_text())
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    assert doc["commit"] == head and doc["quick"] is True
    assert set(doc["seconds"]) == {"venv", "demo", "demo_rerun", "test"}
    assert all(v >= 0 for v in doc["seconds"].values()) and doc["seconds"]["demo"] > 1
    assert doc["block"] == readme_timings.render({k: v for k, v in doc.items() if k != "block"})
    assert doc["work"] is None  # the clone is removed
