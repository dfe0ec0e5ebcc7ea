"""The shipped arithmetic data (``data/``, written by ``data/make_prompts.py``)."""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["DATA_DIR", "SPLITS", "load_prompts"]

DATA_DIR = Path(__file__).resolve().parents[2] / "data"
# sft: demonstrations {"prompt", "completion", "answer"} for the warm start; train: the RL
# prompts; eval: the held-out prompts ({"prompt", "answer"}). The three share no prompt.
SPLITS = ("sft", "train", "eval")


def load_prompts(split: str = "train", *, limit: int | None = None) -> list[dict[str, str]]:
    """The rows of one split of the shipped arithmetic data (``sft``, ``train`` or ``eval``),
    the first ``limit`` of them when given."""
    if split not in SPLITS:
        raise ValueError(f"load_prompts: split must be one of {SPLITS}, got {split!r}")
    path = DATA_DIR / f"arithmetic_{split}.jsonl"
    with open(path, encoding="utf-8") as lines:
        rows = [json.loads(line) for line in lines if line.strip()]
    return rows[:limit] if limit is not None else rows
