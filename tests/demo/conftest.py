"""Fixtures of the demo's tests.

- ``fresh_shell``: runs the "look further" commands of a demo's closing lines as a user
  would paste them into a new terminal: ``bash -c`` with a bare environment (no activated
  venv, no ``maxent-arrow`` on ``PATH``), from the directory the demo ran in; a server
  command (``view``) passes when the URL it prints answers with a page.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
import urllib.request
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
            (serve if " view " in f" {command} " else finish)(command, cwd) for command in commands
        ]

    return run


def finish(command: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``command`` run to its end in a fresh shell."""
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=bare_env(), capture_output=True,
                          text=True, timeout=300)  # fmt: skip


def serve(command: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """A server command (``view``) started in a fresh shell: it succeeds when it prints its
    URL and that URL answers 200 with a page; then it is stopped (SIGINT, as Ctrl-C)."""
    process = subprocess.Popen(
        ["bash", "-c", f"exec {command}"], cwd=cwd, env=bare_env(),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    code, seen = 1, []
    try:
        assert process.stdout is not None
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = process.stdout.readline()
            if not line:
                break
            seen.append(line)
            found = re.search(r"https?://\S+", line)
            if found:
                with urllib.request.urlopen(found.group(0), timeout=60) as page:
                    body = page.read().decode()
                code = 0 if page.status == 200 and "<html" in body.lower() else 1
                break
    finally:
        process.send_signal(signal.SIGINT)
        try:
            _, err = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            _, err = process.communicate()
    return subprocess.CompletedProcess(process.args, code, "".join(seen), err)
