"""``benchmarks/bench_facade.py --quick`` runs and checks itself (sizes too small for targets)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_bench_facade_quick_runs_and_checks_itself():
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_facade.py"
    out = subprocess.run(
        [sys.executable, str(script), "--quick", "--repeats", "1"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    for figure in ("(a) construction", "(b) every list field", "(c) to_arrow()", "(d) to_arrow()"):
        assert figure in out.stdout, out.stdout
    assert out.stdout.count("(peer = floor)") == 3
    assert "largest / smallest N" in out.stdout and "False" not in out.stdout
