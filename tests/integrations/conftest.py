"""Fixtures the TRL tests share: one real tiny ``trl.GRPOTrainer`` run (``trl_runs``), trained
once per session, which ``test_trl.py`` checks the store of and ``test_trl_contract.py`` checks
TRL's surface on."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # trl_runs, next to the tests


@pytest.fixture(scope="session")
def plain_run(tmp_path_factory: pytest.TempPathFactory):
    """Three optimizer steps, β > 0 and two iterations per generation round (so TRL computes
    old and reference log-probs): rounds at steps 0 and 2. ``(root, probe)``: the run's
    directory (``root / "store"``, TRL's output under ``root / "out"``) and the trained
    :class:`trl_runs.Probe`."""
    pytest.importorskip("trl")
    import trl_runs

    root = tmp_path_factory.mktemp("trl_plain")
    probe = trl_runs.trainer(root)
    probe.train()
    return root, probe
