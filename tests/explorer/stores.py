"""A small run for the explorer's tests, written through the public append API: text and chat
prompts, per-function rewards with a NaN, q and MaxEnt weights, per-token behaviour and
reference log-probs, lifecycle records (trained and dropped), an eval step, and a resumed
attempt that supersedes the last steps of the first."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pyarrow as pa

from maxent_arrow import RolloutBatch, RolloutStore
from maxent_arrow.arrow import registry as R

K = 4
GROUPS = 5
FUNCTIONS = ("accuracy", "format")
CHAT_GROUP = 1  # the chat-message prompt of every step
NAN_GROUP = 2  # completion 1 of this group: no reward function scored it (NaN)
DROPPED_GROUP = 4  # dropped (zero_std) in the lifecycle records


def _typed(columns: dict, table: str = R.GROUP) -> pa.Table:
    return pa.table({n: pa.array(v, R.column(n, table).type) for n, v in columns.items()})


def batch(step: int, *, kind: str = "train", seed: int = 0, groups: int = GROUPS) -> RolloutBatch:
    """One step of one rank: ``groups`` groups of K completions."""
    rng = np.random.default_rng(seed * 100 + step + (1000 if kind == "eval" else 0))
    data: dict[str, list] = {}
    for g in range(groups):
        a, b = int(rng.integers(1, 9)), int(rng.integers(1, 9))
        text = f"What is {a}+{b}? (step {step}, group {g})"
        lengths = rng.integers(3, 10, size=K)
        ids = [rng.integers(3, 250, size=n).tolist() for n in lengths]
        completions = [f"{a + b + (i % 2)} is my answer #{i}" for i in range(K)]
        acc = [float((i + g + step) % 2) for i in range(K)]
        fmt = [round(float(rng.random()), 3) for _ in range(K)]
        values = [[acc[i], fmt[i]] for i in range(K)]
        if g == NAN_GROUP:
            values[1] = [math.nan, math.nan]
        if g == DROPPED_GROUP:
            values = [[0.5, 0.5]] * K
        totals = [sum(v) for v in values]
        finite = [t for t in totals if not math.isnan(t)]
        mean = sum(finite) / len(finite)
        adv = [t - mean if not math.isnan(t) else 0.0 for t in totals]
        q = list(np.full(K, 1 / K))
        behaviour = [(-rng.random(n) * 3).astype(np.float32).tolist() for n in lengths]
        ref = [[v - 0.1 * (j % 3) for j, v in enumerate(row)] for row in behaviour]
        row = {
            "step": step, "rank": 0, "kind": kind, "group_index": g, "group_id": f"{step}.0.{g}",
            "group_size": K, "num_completions": K, "answer": str(a + b),
            "completions": completions, "completion_ids": ids,
            "completion_info": [
                {"finish_reason": "length" if n >= 9 else "stop", "stop_reason": None,
                 "truncated": bool(n >= 9), "token_count": int(n), "extra": None}
                for n in lengths
            ],
            "total_utils": totals, "reward_names": list(FUNCTIONS), "reward_values": values,
            "advantages": adv, "q": q, "weights": [1.0 + 0.1 * i for i in range(K)],
            "ref_tok_counts": [int(n) for n in lengths],
            "behavior_token_logp": behaviour, "ref_token_logp": ref,
            "example_id": str(g), "stream_index": step * groups + g,
        }  # fmt: skip
        if g == CHAT_GROUP:
            row["prompt"] = None
            row["prompt_messages"] = [
                {"role": "system", "content": "You add numbers.", "extra": None},
                {"role": "user", "content": text, "extra": None},
            ]
        else:
            row["prompt"] = text
            row["prompt_messages"] = None
        for n, v in row.items():
            data.setdefault(n, []).append(v)
    table = _typed(data)
    n = groups * K
    totals = [t for r in data["total_utils"] for t in r if not math.isnan(t)]
    step_row = _typed(
        {
            "step": [step], "rank": [0], "kind": [kind], "num_groups": [groups],
            "num_samples": [n], "reward_mean": [float(np.mean(totals))],
            "reward_std": [float(np.std(totals))],
            "mean_length": [float(np.mean([len(x) for r in data["completion_ids"] for x in r]))],
            "kl_value": [0.01 * (step + 1)], "total_loss": [1.0 / (step + 1)],
            "num_scored": [len(totals)],
        },
        R.STEP,
    )  # fmt: skip
    return RolloutBatch(table, step_row)


def demo_like_store(
    root: Path, *, steps: int = 5, resume: bool = True, lifecycle: bool = True
) -> dict:
    """Steps 0..steps-1 (train), an eval step, lifecycle records; then a second attempt that
    resumes from step ``steps - 2`` and writes that step again: the first attempt's last two
    steps are superseded (``resume=False``: no second attempt; ``lifecycle=False``: no
    lifecycle records). Returns the attempts' ids."""
    RolloutStore.create(root, config={"model": "tiny-gpt2", "max_completion_len": 9},
                        if_exists="error")  # fmt: skip
    first = RolloutStore(root).next_attempt()
    for step in range(steps):
        first.append(batch(step))
        if not lifecycle:
            continue
        rows = RolloutStore(root).read(steps=step, kind="train")
        keep = rows.filter(pa.compute.not_equal(rows.column("group_index"), DROPPED_GROUP))
        first.record_lifecycle(keep, step=step, event="trained")
        dropped = rows.filter(pa.compute.equal(rows.column("group_index"), DROPPED_GROUP))
        first.record_lifecycle(dropped, step=step, event="dropped", reason="zero_std")
    first.append(batch(steps - 1, kind="eval"))
    if not resume:
        return {"first": first.attempt_spec.id}
    resumed = RolloutStore(root).next_attempt(resume_from=steps - 2)
    resumed.begin_attempt()
    resumed.append(batch(steps - 2, seed=7))
    return {"first": first.attempt_spec.id, "resumed": resumed.attempt_spec.id}


# ---------------------------------------------------------------------- a run to read
TOKENIZER = {"class": "ByT5Tokenizer", "name_or_path": "", "vocab_size": 256}
SOURCES = ("gsm8k", "math")
VERDICTS = ("right", "wrong")
UPDATES = 2  # optimizer steps per stored step in the trainer's log (TRL's num_iterations)


def loss_at(step: int) -> float:
    """The step rows' loss: negative, as a GRPO loss often is."""
    return -0.0665 + 0.004 * step


def update_loss(step: int, update: int) -> float:
    """The trainer's logged loss of update ``update`` (0, 1) on step ``step``'s rollouts:
    the second update of a round lower than the first (it alternates)."""
    return loss_at(step) + (0.02 if update == 0 else -0.02)


def read_batch(step: int) -> RolloutBatch:
    """Step ``step`` of :func:`reading_store`: :func:`batch` with a dataset column
    (``ds_source``), a ``log_extra`` column (``extra_verdict``), the run config with its
    tokenizer, a negative loss, a length that is constant but for rounding."""
    made = batch(step)
    table = pa.Table.from_batches([made.groups])
    n = table.num_rows
    table = table.append_column("ds_source", pa.array([SOURCES[g % 2] for g in range(n)]))
    verdicts = [[VERDICTS[(g + i) % 2] for i in range(K)] for g in range(n)]
    table = table.append_column("extra_verdict", pa.array(verdicts, pa.list_(pa.string())))
    row = pa.Table.from_batches([made.step_row])
    config = {"model": "tiny-gpt2", "trainer": "maxent-arrow", "tokenizer": TOKENIZER,
              "max_completion_len": 9, "extra": {"trl": {"num_iterations": UPDATES}}}  # fmt: skip
    for name, value in (("mean_length", 3.0 + 0.01 * (step % 2)), ("total_loss", loss_at(step))):
        row = row.set_column(row.schema.get_field_index(name), name, pa.array([value]))
    row = row.append_column("config", pa.array([json.dumps(config)]))
    return RolloutBatch(table, row)


def reading_store(root: Path, *, steps: int = 4) -> dict:
    """A finished trainer run to read: train steps 0..steps-1 of :func:`read_batch`, each
    trained (lifecycle records of the trainer), and the trainer's log (``trainer_metrics``:
    its KL the step rows' own, its loss for :data:`UPDATES` optimizer steps per stored
    step); then a second policy trained from it by the replay sampler as the role
    ``sampler``, which drops the zero-spread group (:data:`DROPPED_GROUP`). Both end
    (checkpoint). Returns the attempts' ids."""
    from maxent_arrow.rollout import trainer_metrics_table
    from maxent_arrow.store import ReplaySampler

    RolloutStore.create(root, config={}, if_exists="error")
    trainer = RolloutStore(root)
    logged = []
    for step in range(steps):
        trainer.append(read_batch(step))
        rows = trainer.read(steps=step, kind="train")
        trainer.record_lifecycle(rows, step=step, event="trained")
        for update in range(UPDATES):
            logged.append({"optimizer_step": UPDATES * step + update + 1, "kind": "train",
                           "step": step, "first_step": step, "kl": 0.01 * (step + 1),
                           "loss": update_loss(step, update)})  # fmt: skip
    trainer.append_records("trainer_metrics", trainer_metrics_table(logged))
    trainer.checkpoint()
    source = RolloutStore(root, role="sampler")
    sampler = ReplaySampler(source, batch_groups=GROUPS, seed=0, epochs=None, drop_zero_std=True)
    for step in range(steps):
        sampler.sample(current_version=step, step=step)
    source.checkpoint()
    return {"trainer": trainer.attempt_spec.id, "sampler": source.attempt_spec.id}
