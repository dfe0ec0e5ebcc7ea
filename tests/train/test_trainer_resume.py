"""The MaxEnt trainer as an attempt of its run: begun when the trainer is built, so a fresh
trainer on a store that holds an earlier run is refused before any step; ``resume_from``
supersedes the steps the resumed run writes again; ``if_exists="new_attempt"`` re-runs."""

from __future__ import annotations

import pyarrow as pa
import pytest
from transformers import ByT5Tokenizer

from maxent_arrow import RolloutStore, RunConfig
from maxent_arrow.demo import tiny_model
from maxent_arrow.demo.rewards import accuracy_reward, format_reward
from maxent_arrow.errors import StoreError
from maxent_arrow.train.snapshots import snapshot_loader
from maxent_arrow.train.trainer import MaxEntTrainer

ROWS = [
    {"prompt": "Q: 1 + 1 = ? A:", "answer": "2"},
    {"prompt": "Q: 2 + 3 = ? A:", "answer": "5"},
]


def config(seed: int) -> RunConfig:
    return RunConfig(
        reward_names=("accuracy", "format"),
        reward_weights=(1.0, 0.5),
        num_generations=3,
        max_prompt_len=32,
        max_completion_len=6,
        tau=0.5,
        beta=0.04,
        prompts_per_step=2,
        learning_rate=1e-3,
        seed=seed,
    )


def trainer(model, store: RolloutStore, *, seed: int = 0, **options) -> MaxEntTrainer:
    return MaxEntTrainer(
        model,
        ByT5Tokenizer(),
        store,
        config=config(seed),
        reward_funcs=[accuracy_reward, format_reward],
        **options,
    )


def stored(table: pa.Table) -> list:
    return table.column("completion_ids").to_pylist()


def log_entries(root) -> list[str]:
    return sorted(p.name for p in (root / "log").glob("*.json"))


def test_a_resumed_trainer_supersedes_what_it_runs_again_and_a_fresh_one_is_refused(tmp_path):
    root = tmp_path / "store"
    first = trainer(tiny_model(0), RolloutStore.create(root, if_exists="error"), run_dir=tmp_path)
    first_batches = [first.step(step, ROWS) for step in range(3)]

    # A fresh trainer on the run's store is refused when it is built: no step, no commit.
    entries = log_entries(root)
    with pytest.raises(StoreError, match="refused.*new run directory"):
        trainer(tiny_model(0), RolloutStore(root))
    assert log_entries(root) == entries

    # Resumed at step 1 with the weights step 1 trained with (its snapshot), another seed.
    model = snapshot_loader(tmp_path, lambda: tiny_model(0))(1)
    resumed = trainer(model, RolloutStore(root), seed=1, resume_from=1)
    assert resumed.attempt is not None and resumed.attempt != first.attempt
    resumed_batches = {step: resumed.step(step, ROWS) for step in (1, 2)}

    store = RolloutStore(root)
    assert store.steps() == [0, 1, 2] and store.verify().problems == []
    assert (
        stored(store.read(steps=[0]))
        == first_batches[0].groups.column("completion_ids").to_pylist()
    )
    for step, batch in resumed_batches.items():
        assert stored(store.read(steps=[step])) == batch.groups.column("completion_ids").to_pylist()
        row = store.read_steps(steps=[step]).to_pylist()[0]
        assert row["total_loss"] == batch.step_row.column("total_loss")[0].as_py()
    superseded = RolloutStore(root, attempts="superseded")
    assert superseded.steps() == [1, 2]
    for step in (1, 2):
        old = first_batches[step].groups.column("completion_ids").to_pylist()
        assert stored(superseded.read(steps=[step])) == old
        assert old != resumed_batches[step].groups.column("completion_ids").to_pylist()
    # The trainer's records follow: optimizer steps 2 and 3 are the resumed run's.
    records = store.read_records("trainer_metrics").sort_by("optimizer_step").to_pylist()
    assert [(r["optimizer_step"], r["attempt"]) for r in records] == [
        (1, first.attempt),
        (2, resumed.attempt),
        (3, resumed.attempt),
    ]
    assert [r["loss"] for r in records[1:]] == [r["loss"] for r in resumed.metrics_records]


def test_a_new_attempt_reruns_the_whole_run(tmp_path):
    root = tmp_path / "store"
    first = trainer(tiny_model(0), RolloutStore.create(root, if_exists="error"))
    first.step(0, ROWS)
    rerun = trainer(tiny_model(0), RolloutStore(root), seed=1, if_exists="new_attempt")
    batch = rerun.step(0, ROWS)
    store = RolloutStore(root)
    assert stored(store.read()) == batch.groups.column("completion_ids").to_pylist()
    assert RolloutStore(root, attempts="superseded").steps() == [0]
    records = store.read_records("trainer_metrics").to_pylist()
    assert [(r["optimizer_step"], r["attempt"]) for r in records] == [(1, rerun.attempt)]
    assert (
        records[0]["loss"] == rerun.metrics_records[0]["loss"] != first.metrics_records[0]["loss"]
    )
