"""``analytics.jsonsafe.finite``: the one rule that turns non-finite floats into JSON null,
shared by the off-policy report, the explorer's page data and the command line's JSON."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np

from maxent_arrow.analytics.jsonsafe import finite


def test_non_finite_floats_become_null_at_every_depth_and_strict_json_takes_the_result():
    value = {
        "a": math.nan,
        "b": [1.0, math.inf, (2, -math.inf)],
        "c": {"d": np.float64("nan"), "e": "nan", "f": np.float64(0.5)},
        "g": 3,
        "h": None,
        "i": True,
    }
    out = finite(value)
    text = json.dumps(out, allow_nan=False)  # raises on any NaN or infinity left
    assert json.loads(text) == {
        "a": None,
        "b": [1.0, None, [2, None]],
        "c": {"d": None, "e": "nan", "f": 0.5},
        "g": 3,
        "h": None,
        "i": True,
    }
    assert value["a"] != value["a"]  # the input is not changed


def test_the_rule_imports_nothing_heavy():
    """Every command that prints JSON imports it (``inspect --json`` among the fast ones):
    it must cost only the standard library."""
    script = (
        "import sys; from maxent_arrow.analytics.jsonsafe import finite; "
        "print(sorted(m for m in ('numpy', 'pyarrow', 'torch', 'pandas') if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120
    )
    assert done.stdout.strip() == "[]"
