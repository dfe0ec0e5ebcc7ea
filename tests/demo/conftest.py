"""Fixtures of the demo's tests.

- ``fresh_shell``: runs the "look further" commands of a demo's closing lines as a user
  would paste them into a new terminal: ``bash -c`` with a bare environment (no activated
  venv, no ``maxent-arrow`` on ``PATH``), from the directory the demo ran in.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

BARE_PATH = "/usr/local/bin:/usr/bin:/bin"


def bare_env() -> dict[str, str]:
    """The environment of a new login shell: none of the venv's variables or paths."""
    return {"PATH": BARE_PATH, "HOME": os.environ.get("HOME", "/tmp"), "LANG": "C.UTF-8"}


def look_further(printed: str) -> list[str]:
    """The command lines under the closing lines' ``look further`` heading."""
    lines = printed.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("look further"))
    commands = []
    for line in lines[start + 1 :]:
        if not line.startswith("  "):
            break
        commands.append(line.strip())
    return commands


@pytest.fixture
def fresh_shell() -> Callable[[str, Path], list[subprocess.CompletedProcess[str]]]:
    """``run(printed, cwd)``: each "look further" command of ``printed`` run in a fresh shell
    from ``cwd``; the completed processes, in order."""
    probe = subprocess.run(
        ["bash", "-c", "command -v maxent-arrow"], env=bare_env(), capture_output=True
    )
    assert probe.returncode != 0, "maxent-arrow is on the bare PATH: the check would prove nothing"

    def run(printed: str, cwd: Path) -> list[subprocess.CompletedProcess[str]]:
        commands = look_further(printed)
        assert commands, printed
        return [
            subprocess.run(
                ["bash", "-c", command],
                cwd=cwd,
                env=bare_env(),
                capture_output=True,
                text=True,
                timeout=300,
            )
            for command in commands
        ]

    return run
