"""The real explorer for the tests: ``maxent-arrow view RUN --port 0`` in a subprocess, its
URL read from what it prints, stopped with SIGINT afterwards; and a fingerprint of a store's
files (names, sizes, SHA-256, modification times) to show that nothing was written."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def served(root: Path, *args: str, timeout: float = 60.0) -> Iterator[tuple[str, subprocess.Popen]]:
    """The URL of the explorer of ``root`` and its process."""
    cmd = [sys.executable, "-m", "maxent_arrow.cli", "view", str(root), "--port", "0", *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    url = None
    deadline = time.monotonic() + timeout
    try:
        assert proc.stdout is not None
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            if line.strip().startswith("open http"):
                url = line.split()[-1]
                break
        if url is None:
            proc.kill()
            raise AssertionError(
                f"the explorer did not start: {proc.stderr.read() if proc.stderr else ''}"
            )
        yield url.rstrip("/"), proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def fingerprint(root: Path) -> dict[str, tuple[int, str, int]]:
    """Every file under ``root``: size, SHA-256 and mtime (ns)."""
    out = {}
    for path in sorted(Path(root).rglob("*")):
        if path.is_file():
            st = path.stat()
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
            out[str(path.relative_to(root))] = (st.st_size, digest, st.st_mtime_ns)
    return out
