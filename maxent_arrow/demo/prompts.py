"""The shipped arithmetic data: package data of :mod:`maxent_arrow.demo` (``data/*.jsonl``
beside this module, written by the repository's ``data/make_prompts.py``), read with
:mod:`importlib.resources`, so an installed wheel has it as a checkout does."""

from __future__ import annotations

import json
from importlib import resources
from importlib.resources.abc import Traversable

from maxent_arrow.errors import ArgumentError

__all__ = ["SPLITS", "data_file", "load_prompts"]

# sft: demonstrations {"prompt", "completion", "answer"} for the warm start; train: the RL
# prompts; eval: the held-out prompts ({"prompt", "answer"}). The three share no prompt.
SPLITS = ("sft", "train", "eval")


def data_file(split: str) -> Traversable:
    """The shipped file of ``split`` (``sft``, ``train`` or ``eval``): a resource of the
    installed package, not a path of the repository."""
    if split not in SPLITS:
        raise ArgumentError(f"load_prompts: split must be one of {SPLITS}, got {split!r}")
    return resources.files("maxent_arrow.demo").joinpath("data", f"arithmetic_{split}.jsonl")


def load_prompts(split: str = "train", *, limit: int | None = None) -> list[dict[str, str]]:
    """The rows of one split of the shipped arithmetic data (``sft``, ``train`` or ``eval``),
    the first ``limit`` of them when given."""
    text = data_file(split).read_text(encoding="utf-8")
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    return rows[:limit] if limit is not None else rows
