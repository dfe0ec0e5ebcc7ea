"""Reward functions for the arithmetic prompt set shipped in ``data/`` (used by the demo).

Each follows the seed's reward-function contract: ``f(completions, answers) -> list[float]``, one
value per completion, given the completion texts and the gold answers (flat, prompt-major).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

__all__ = ["final_number", "accuracy_reward", "format_reward"]

_NUMBER = re.compile(r"-?\d+")
_ANSWER_ONLY = re.compile(r"^\s*-?\d+\s*$")


def final_number(text: str) -> str | None:
    """The last integer in ``text`` (what an answer extractor would grade), or None."""
    found = _NUMBER.findall(text)
    return found[-1] if found else None


def accuracy_reward(completions: Sequence[str], answers: Sequence[str], **_) -> list[float]:
    """1.0 when the completion's final integer equals the gold answer, else 0.0."""
    out = []
    for text, answer in zip(completions, answers, strict=True):
        number = final_number(text)
        out.append(1.0 if number is not None and int(number) == int(answer) else 0.0)
    return out


def format_reward(completions: Sequence[str], answers: Sequence[str], **_) -> list[float]:
    """How much the completion looks like a bare number: 1.0 for exactly one integer, otherwise
    the fraction of its characters that are digits, spaces or a minus sign (a graded signal a
    randomly initialised model can climb)."""
    out = []
    for text in completions:
        if _ANSWER_ONLY.match(text):
            out.append(1.0)
        elif not text:
            out.append(0.0)
        else:
            out.append(sum(ch.isdigit() or ch in " -" for ch in text) / len(text) * 0.5)
    return out
