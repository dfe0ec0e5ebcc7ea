"""Per-step policy snapshots (safetensors, no pickle): the weights each logged loss was computed
with, so an offline replay re-scores the stored tokens with exactly those weights."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from maxent_arrow.errors import StoreError

__all__ = ["snapshot_loader", "snapshot_path"]


def snapshot_path(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "snapshots" / f"step-{step:010d}.safetensors"


def snapshot_loader(run_dir: Path, make_model: Callable[[], Any]) -> Callable[[int], Any]:
    """``load_policy`` for :func:`replay_losses` over the trainer's safetensors snapshots."""
    from safetensors.torch import load_model

    model = make_model().eval()

    def load(step: int) -> Any:
        path = snapshot_path(run_dir, step)
        if not path.exists():
            raise StoreError(f"no policy snapshot for step {step}: {path}")
        load_model(model, str(path))
        return model

    return load
