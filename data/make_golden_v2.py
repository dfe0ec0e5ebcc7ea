"""Write ``data/golden_v2/``: a small schema-2.0 rollout store that every later version must read.

It pins the 2.0 layout on disk: per-append Parquet pairs (group file + sealed step file with
chunk CRCs), an IPC cache copy, a compacted segment, an ``eval`` step, a reward function added
mid-run (rows before it have one reward name), a batch given without the ``weights`` column
(written as nulls: every file has one schema), and chat prompts and completions in the message
columns beside plain ones. ``golden_v2_expected.json`` records what a reader must find;
``tests/integration/test_store_golden.py`` checks it. Run once; the files are committed::

    python data/make_golden_v2.py
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import json
import shutil
import sys
from pathlib import Path

import pyarrow as pa

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from maxent_arrow import RolloutBatch, RolloutStore  # noqa: E402
from maxent_arrow.compute import compute_rewards  # noqa: E402
from maxent_arrow.testing import make_parts  # noqa: E402

OUT = HERE / "golden_v2"
CREATED = dt.datetime(2026, 11, 30, 12, 0, tzinfo=dt.UTC)


def _fixed_time(batch: RolloutBatch) -> RolloutBatch:
    """The batch with a fixed ``created_at`` so the golden files are reproducible."""
    row = batch.step_row
    at = row.schema.get_field_index("created_at")
    stamp = pa.array([CREATED], row.schema.field(at).type)
    return RolloutBatch(batch.groups, row.set_column(at, row.schema.field(at), stamp))


def _digest(values: list) -> str:
    return hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()[:16]


def _chat_batch(step: int, rank: int) -> RolloutBatch:
    """A batch whose second group has a chat prompt and chat completions."""
    parts = make_parts(seed=step * 1000 + rank, groups=3, max_tokens=12)
    gen = parts["generation"]
    prompts = list(gen.prompts)
    prompts[1] = [
        {"role": "system", "content": "Answer with a number."},
        {"role": "user", "content": prompts[1], "name": "tester"},
    ]
    grouped = [list(g) for g in gen.grouped_completions]
    grouped[1] = [[{"role": "assistant", "content": text}] for text in grouped[1]]
    chat = dataclasses.replace(gen, prompts=prompts, grouped_completions=grouped)
    names = ["accuracy", "format"]
    rewards = compute_rewards(
        chat,
        [
            lambda completions, answers: [float(len(str(c)) % 2) for c in completions],
            lambda completions, answers: [0.5 if isinstance(c, list) else 0.0 for c in completions],
        ],
        weights=[1.0, 0.5],
        reward_names=names,
    )
    return RolloutBatch.from_parts(
        step,
        rank=rank,
        generation=chat,
        rewards=rewards,
        score_batch=parts["score_batch"],
        reference=parts["reference"],
        length_stats=parts["length_stats"],
        config=parts["config"],
    )


def main() -> None:
    if OUT.exists():
        shutil.rmtree(OUT)
    store = RolloutStore.create(OUT, config={"run": "golden-v2", "model": "tiny-gpt2"})
    for step in range(2):
        for rank in range(2):
            parts = make_parts(
                seed=step * 1000 + rank, groups=3, max_tokens=12, reward_names=("accuracy",)
            )
            if (step, rank) == (1, 1):
                parts.pop("weights", None)  # given without weights: written as nulls
            batch = RolloutBatch.from_parts(step, rank=rank, **parts)
            store.append(_fixed_time(batch))
    store.append(_fixed_time(_chat_batch(2, 0)))
    parts = make_parts(seed=2001, groups=3, max_tokens=12)
    store.append(_fixed_time(RolloutBatch.from_parts(2, rank=1, **parts)))
    parts = make_parts(seed=2500, groups=2, max_tokens=12)
    store.append(_fixed_time(RolloutBatch.from_parts(2, rank=0, kind="eval", **parts)))
    store.build_cache(steps=[2], kind="train")
    store.compact(kind="train", steps=[0, 1])  # both ranks of steps 0-1 -> one segment
    table = store.read()
    expected = {
        "schema_version": "2.0",
        "units": [
            [s, r, k]
            for s, r, k in zip(
                *store.read_steps(columns=["step", "rank", "kind"]).to_pydict().values()
            )
        ],
        "groups": table.num_rows,
        "columns": table.column_names,
        "reward_names": sorted(
            {n for row in table.column("reward_names").to_pylist() for n in row}
        ),
        "rows_without_format": sum(
            1 for n in table.column("reward_names").to_pylist() if "format" not in n
        ),
        "chat_prompts": sum(1 for m in table.column("prompt_messages").to_pylist() if m),
        "rows_without_weights": table.column("weights").null_count,
        "completion_ids_sha": _digest(table.column("completion_ids").to_pylist()),
        "reward_values_sha": _digest(table.column("reward_values").to_pylist()),
        "q_sha": _digest(table.column("q").to_pylist()),
        "ref_token_logp_sha": _digest(table.column("ref_token_logp").to_pylist()),
        "prompt_messages_sha": _digest(table.column("prompt_messages").to_pylist()),
        "samples": store.sql("SELECT count(*) AS n FROM samples").column("n")[0].as_py(),
        "reward_mean": store.read_steps(columns=["reward_mean"]).column("reward_mean").to_pylist(),
    }
    (HERE / "golden_v2_expected.json").write_text(json.dumps(expected, indent=1) + "\n")
    (OUT / ".lock").unlink(missing_ok=True)
    print(f"wrote {OUT} ({sum(p.stat().st_size for p in OUT.rglob('*') if p.is_file())} bytes)")


if __name__ == "__main__":
    main()
