"""The MaxEnt trainer's own records: the policy version of each stored step and one
``trainer_metrics`` record per optimizer step, of the layout TRL's recorder writes."""

from __future__ import annotations

import math

import duckdb
import torch
from transformers import ByT5Tokenizer

from maxent_arrow import RolloutStore, RunConfig
from maxent_arrow.demo import tiny_model
from maxent_arrow.demo.rewards import accuracy_reward, format_reward
from maxent_arrow.rollout import trainer_metrics_table
from maxent_arrow.train.trainer import MaxEntTrainer


def test_each_step_writes_its_policy_version_and_a_trainer_metrics_record(tmp_path):
    torch.manual_seed(0)
    config = RunConfig(
        reward_names=("accuracy", "format"),
        reward_weights=(1.0, 0.5),
        num_generations=3,
        max_prompt_len=32,
        max_completion_len=6,
        tau=0.5,
        beta=0.04,
        prompts_per_step=2,
        learning_rate=1e-3,
    )
    store = RolloutStore.create(tmp_path / "store")
    trainer = MaxEntTrainer(
        tiny_model(0),
        ByT5Tokenizer(),
        store,
        config=config,
        reward_funcs=[accuracy_reward, format_reward],
    )
    rows = [
        {"prompt": "Q: 1 + 1 = ? A:", "answer": "2"},
        {"prompt": "Q: 2 + 3 = ? A:", "answer": "5"},
    ]
    for step in (0, 1):
        trainer.step(step, rows)
    steps = store.read_steps().to_pylist()
    assert [(r["step"], r["policy_version"]) for r in steps] == [(0, 0), (1, 1)]
    # Each completion's version and sampling parameters, as a plain reader sees the files.
    files = [str(p) for p in (tmp_path / "store").rglob("*.parquet") if "groups" in p.parts]
    seen = duckdb.execute(
        "SELECT step, v, t, p, k, m FROM read_parquet($files) , "
        "unnest(completion_policy_version) AS a(v), unnest(sampling_temperature) AS b(t), "
        "unnest(sampling_top_p) AS c(p), unnest(sampling_top_k) AS d(k), "
        "unnest(sampling_min_p) AS e(m) GROUP BY ALL ORDER BY step",
        {"files": files},
    ).fetchall()
    assert seen == [(s, s, config.gen_temperature, config.top_p, 0, 0.0) for s in (0, 1)]
    records = trainer_metrics_table(trainer.metrics_records).to_pylist()
    # The update of step s is optimizer step s + 1 and trained on rollout step s (TRL's rule).
    assert [(r["optimizer_step"], r["step"], r["first_step"]) for r in records] == [
        (1, 0, 0),
        (2, 1, 1),
    ]
    for record, row in zip(records, steps):
        assert (record["averaged_steps"], record["loss_batches"], record["rounds"]) == (1, 1, 1)
        assert record["loss"] == row["total_loss"] and record["kl"] == row["kl_value"]
        assert record["learning_rate"] == 1e-3
        assert math.isfinite(record["grad_norm"]) and record["grad_norm"] > 0
        assert record["clip_ratio_low_mean"] is None  # the seed's are not PPO clip ratios
        figures = dict(zip(record["metric_names"], record["metric_values"]))
        assert figures["policy_loss"] == row["policy_loss"]
        assert figures["diagnostics/clip_ratio_low_mean"] == row["clip_ratio_low_mean"]
