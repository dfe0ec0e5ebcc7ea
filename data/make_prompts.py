"""Write the demo's arithmetic prompts: data/arithmetic_train.jsonl and data/arithmetic_eval.jsonl.

Each line is {"prompt": ..., "answer": ...}: a one-operation integer question with its answer.
Seeded, so re-running writes the same files (the repository ships them).

    python data/make_prompts.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
OPERATIONS = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
}


def make_rows(count: int, rng: random.Random) -> list[dict[str, str]]:
    rows, seen = [], set()
    while len(rows) < count:
        op = rng.choice(sorted(OPERATIONS))
        a = rng.randint(0, 20 if op == "*" else 99)
        b = rng.randint(0, 20 if op == "*" else 99)
        question = f"{a} {op} {b}"
        if question in seen:
            continue
        seen.add(question)
        rows.append({"prompt": f"Q: {question} = ? A:", "answer": str(OPERATIONS[op](a, b))})
    return rows


def main() -> None:
    rng = random.Random(20261129)
    rows = make_rows(320, rng)
    splits = {"arithmetic_train.jsonl": rows[:256], "arithmetic_eval.jsonl": rows[256:]}
    for name, part in splits.items():
        with open(HERE / name, "w", encoding="utf-8") as out:
            for row in part:
                out.write(json.dumps(row) + "\n")
        print(f"wrote {len(part)} rows to {HERE / name}")


if __name__ == "__main__":
    main()
