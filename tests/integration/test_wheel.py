"""The wheel is the product (issue 39, snag 1): a wheel built from this tree, installed on its
own into a fresh directory and run from another one, holds the demo's data as package data
and runs the demo, the Quickstart's reads and the store's checks, with no file of the
repository on its path.

The installed copy is found first on ``PYTHONPATH`` (the development install of the test
venv is an editable finder consulted after the path); the test asserts the package it ran is
the installed one. The third-party dependencies are the test venv's (``--no-deps``: no
registry at test time)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("wheel")
    # Built from a copy of what the wheel is made of: a build in the tree would leave build/
    # and egg-info there (and a stale build/lib in the next wheel).
    source = work / "source"
    shutil.copytree(ROOT / "maxent_arrow", source / "maxent_arrow",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))  # fmt: skip
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(work / "dist"), str(source)],
        capture_output=True, text=True, timeout=600, cwd=work,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = (work / "dist").glob("maxent_arrow-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert any(n.startswith("maxent_arrow/demo/data/") and n.endswith(".jsonl") for n in names)
    assert not any(n.startswith(("tests/", "data/", "benchmarks/")) for n in names), names
    target = work / "site"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target),
         str(wheel)],
        capture_output=True, text=True, timeout=600, cwd=work,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return target


def _run(site: Path, cwd: Path, script: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(site)}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        capture_output=True, text=True, timeout=900, cwd=cwd, env=env,
    )  # fmt: skip


@pytest.mark.slow
def test_the_installed_wheel_runs_its_demo_from_another_directory(installed, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    done = _run(
        installed,
        elsewhere,
        """
        import sys
        import maxent_arrow
        from maxent_arrow.cli import main
        print("package:", maxent_arrow.__file__)
        code = main(["demo", "--out", "run", "--steps", "2", "--prompts", "4", "--k", "3",
                     "--sft-steps", "3", "--eval-prompts", "4", "--offline-steps", "0",
                     "--no-report"])
        from maxent_arrow.store import ReadOnlyStore
        store = ReadOnlyStore("run/store")
        print("steps:", store.steps(kind="train"))
        print("verified:", store.verify().ok)
        print("rows:", store.sql("SELECT count(*) AS n FROM samples")["n"][0])
        sys.exit(code)
        """,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = dict(line.split(": ", 1) for line in done.stdout.splitlines() if ": " in line)
    assert Path(lines["package"]).is_relative_to(installed), lines["package"]
    assert lines["steps"] == "[0, 1]" and lines["verified"] == "True"
    assert int(lines["rows"]) > 0
    assert not (ROOT / "run").exists()  # (written where it ran, not in the repository)
