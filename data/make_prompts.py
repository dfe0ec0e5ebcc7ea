"""Write the demo's arithmetic data: three disjoint splits of the sums a + b, 10 <= a, b <= 49.

- ``arithmetic_sft.jsonl`` (the rest, 946 rows): demonstrations for the supervised warm
  start, written by a careless teacher: in a sum that needs a carry (the units add up to 10
  or more) it forgets the carry 70% of the time (``23+48=61`` instead of ``71``). Each row
  holds the ``prompt``, the teacher's ``completion`` and the true ``answer``.
- ``arithmetic_train.jsonl`` (400 rows): the RL prompts, ``prompt`` and ``answer``.
- ``arithmetic_eval.jsonl`` (128 rows): held-out prompts, ``prompt`` and ``answer``; no
  held-out sum is in the other splits, in either order (``a+b`` or ``b+a``).

Why a careless teacher: a model fine-tuned on these demonstrations answers in the format,
adds well, and samples the right answer of a carry sum about 40% of the time, yet its greedy
answer to a carry sum is mostly the teacher's mistake. The accuracy reward is what teaches it
to carry: GRPO has a signal in every carry group and held-out accuracy rises, which a perfect
teacher would leave no room for, and a random model no signal for. Every sum is two digits
(20..98), so a carry changes a digit, never the length of the answer.

They are package data of ``maxent_arrow.demo`` (``maxent_arrow/demo/data/``: the wheel ships
them; the demo reads them with ``importlib.resources``). Seeded, so re-running writes the same
files::

    python data/make_prompts.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
# Package data of maxent_arrow.demo (pyproject.toml's package-data): the wheel ships them.
OUT = HERE.parent / "maxent_arrow" / "demo" / "data"
LOW, HIGH = 10, 49
SPLITS = {"eval": 128, "train": 400}  # the SFT split takes what is left
FORGET_CARRY = 0.7
SEED = 20261129


def needs_carry(a: int, b: int) -> bool:
    """Whether the units of ``a + b`` carry into the tens."""
    return a % 10 + b % 10 >= 10


def teacher_answer(a: int, b: int, rng: random.Random) -> int:
    """The careless teacher's answer: the sum, or without its carry (``FORGET_CARRY`` of the
    carry sums)."""
    if needs_carry(a, b) and rng.random() < FORGET_CARRY:
        return a + b - 10
    return a + b


def make_splits(seed: int = SEED) -> dict[str, list[dict[str, str]]]:
    """The three splits, from one seeded shuffle of every sum. The held-out sums are taken
    first, and neither they nor their mirror images (``b+a`` of a held-out ``a+b``) appear in
    the other two splits."""
    rng = random.Random(seed)
    pairs = [(a, b) for a in range(LOW, HIGH + 1) for b in range(LOW, HIGH + 1)]
    rng.shuffle(pairs)
    held: list[tuple[int, int]] = []
    taken: set[tuple[int, int]] = set()
    for a, b in pairs:
        if len(held) == SPLITS["eval"]:
            break
        if (a, b) not in taken:
            held.append((a, b))
            taken |= {(a, b), (b, a)}
    rest = [pair for pair in pairs if pair not in taken]
    train, sft = rest[: SPLITS["train"]], rest[SPLITS["train"] :]
    return {
        "eval": [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in held],
        "train": [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in train],
        "sft": [
            {
                "prompt": f"{a}+{b}=",
                "completion": str(teacher_answer(a, b, rng)),
                "answer": str(a + b),
            }
            for a, b in sft
        ],
    }


def main() -> None:
    for name, rows in make_splits().items():
        path = OUT / f"arithmetic_{name}.jsonl"
        with open(path, "w", encoding="utf-8") as out:
            for row in rows:
                out.write(json.dumps(row) + "\n")
        print(f"wrote {len(rows)} rows to {path}")


if __name__ == "__main__":
    main()
