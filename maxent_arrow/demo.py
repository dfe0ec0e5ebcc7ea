"""The demo that ``make demo`` runs.

It takes a few prompts of the shipped arithmetic set (``data/arithmetic_train.jsonl``), samples K
candidate completions per prompt (seeded), tokenizes them with the file-free ``ByT5Tokenizer``,
builds the seed's ``GenerationBatch`` over Arrow, writes it to a Parquet file, reads it back
through ``GenerationBatch.from_arrow`` and prints what came back.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from maxent_arrow.types.rewards import GenerationBatch

DATA_DIR = Path(__file__).resolve().parent.parent / "data"


def load_prompts(split: str = "train", *, limit: int | None = None) -> list[dict[str, str]]:
    """Rows ``{"prompt", "answer"}`` of the shipped arithmetic set (``train`` or ``eval``)."""
    path = DATA_DIR / f"arithmetic_{split}.jsonl"
    with open(path, encoding="utf-8") as lines:
        rows = [json.loads(line) for line in lines if line.strip()]
    return rows[:limit] if limit is not None else rows


def sample_completions(answer: str, k: int, rng: random.Random) -> list[str]:
    """K candidate completions: the right number, near misses, and unformatted text."""
    value = int(answer)
    out = []
    for _ in range(k):
        kind = rng.random()
        if kind < 0.4:
            out.append(f" {value}")
        elif kind < 0.8:
            out.append(f" {value + rng.choice([-2, -1, 1, 2, 10])}")
        else:
            out.append(" I think it is " + rng.choice(["big", "small", str(value)]))
    return out


def build_generation_batch(
    rows: list[dict[str, str]], *, k: int, seed: int = 0, tokenizer=None
) -> GenerationBatch:
    """A ``GenerationBatch`` of ``len(rows)`` groups of K completions, with token ids in the info."""
    rng = random.Random(seed)
    grouped = [sample_completions(row["answer"], k, rng) for row in rows]
    infos = []
    for completions in grouped:
        group_info = []
        for text in completions:
            info: dict = {"finish_reason": "stop"}
            if tokenizer is not None:
                ids = tokenizer(text, add_special_tokens=False)["input_ids"]
                info["token_ids"] = ids + [tokenizer.eos_token_id]
                info["token_count"] = len(info["token_ids"])
            group_info.append(info)
        infos.append(group_info)
    return GenerationBatch(
        prompts=[row["prompt"] for row in rows],
        answers=[row["answer"] for row in rows],
        grouped_completions=grouped,
        grouped_ref_meta=None,
        grouped_completion_info=infos,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="maxent-arrow demo", description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("runs/demo"), help="output directory")
    parser.add_argument("--prompts", type=int, default=4, help="prompt groups to build")
    parser.add_argument("--k", type=int, default=4, help="completions per prompt")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    from transformers import ByT5Tokenizer

    started = time.perf_counter()
    rows = load_prompts("train", limit=args.prompts)
    batch = build_generation_batch(rows, k=args.k, seed=args.seed, tokenizer=ByT5Tokenizer())
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "generation.parquet"
    pq.write_table(pa.Table.from_batches([batch.to_arrow()]), path, compression="zstd")
    back = GenerationBatch.from_arrow(pq.read_table(path))
    if back != batch:
        print("error: the batch read back differs from the one written")
        return 1
    print(f"wrote {len(back.prompts)} groups x {args.k} completions to {path}")
    print(f"({path.stat().st_size} bytes, read back equal, {time.perf_counter() - started:.2f}s)")
    for g, (prompt, answer) in enumerate(zip(back.prompts, back.answers)):
        print(f"\ngroup {g}: {prompt!r} (answer {answer})")
        infos = back.grouped_completion_info[g]
        for text, info in zip(back.grouped_completions[g], infos):
            print(f"  {text!r:28} tokens={info.get('token_count')} ids={info.get('token_ids')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
