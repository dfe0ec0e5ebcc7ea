"""One MaxEntTrainer step on a real (tiny, seeded) model: what it stores beyond the loss."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_model
from transformers import ByT5Tokenizer

from maxent_arrow.demo import accuracy_reward, format_reward, tiny_model
from maxent_arrow.rollout import RunConfig
from maxent_arrow.store import RolloutStore
from maxent_arrow.train import MaxEntTrainer, snapshot_path

ROWS = [{"prompt": "12+30=", "answer": "42"}, {"prompt": "21+17=", "answer": "38"}]


def _entropy_sum(model, prompt_ids: list[int], completion_ids: list[int]) -> float:
    """Σ over the completion's tokens of the entropy of the model's next-token distribution
    at the position that predicts it (temperature 1), computed directly from the logits."""
    ids = torch.tensor([prompt_ids + completion_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0].double(), dim=-1)
    rows = logp[len(prompt_ids) - 1 : len(prompt_ids) - 1 + len(completion_ids)]
    return float(-(rows.exp() * rows).sum())


@pytest.fixture(scope="module")
def stepped(tmp_path_factory):
    run = tmp_path_factory.mktemp("trainer")
    config = RunConfig(
        reward_names=("accuracy", "format"),
        reward_weights=(1.0, 0.5),
        tau=0.5,
        beta=0.01,
        num_generations=3,
        max_prompt_len=16,
        max_completion_len=5,
        seed=7,
    )
    store = RolloutStore.create(run / "store", config=config.to_dict())
    trainer = MaxEntTrainer(
        tiny_model(7),
        ByT5Tokenizer(),
        store,
        config=config,
        reward_funcs=[accuracy_reward, format_reward],
        run_dir=run,
    )
    trainer.step(0, ROWS)
    return run, store


def test_policy_entropy_sum_is_the_policys_entropy_over_each_completion(stepped):
    run, store = stepped
    rows = store.read(
        kind="train", columns=["prompt_ids", "completion_ids", "policy_entropy_sum"]
    ).to_pylist()
    # The weights the step scored with: its snapshot, saved before the update.
    policy = tiny_model(0).eval()
    load_model(policy, str(snapshot_path(run, 0)))
    checked = 0
    for row in rows:
        assert len(row["policy_entropy_sum"]) == len(row["completion_ids"]) == 3
        for ids, stored in zip(row["completion_ids"], row["policy_entropy_sum"], strict=True):
            # The first completion token is scored too (the prompt is its left context).
            assert stored == pytest.approx(_entropy_sum(policy, row["prompt_ids"], ids), rel=1e-4)
            assert stored > 0
            checked += 1
    assert checked == 6


def test_the_entropy_column_is_queryable_and_never_null(stepped):
    _, store = stepped
    got = store.sql(
        "SELECT count(*) AS n, count(policy_entropy_sum) AS filled FROM samples "
        "WHERE kind = 'train'"
    ).to_pylist()[0]
    assert got == {"n": 6, "filled": 6}


def test_an_unknown_keyword_is_refused_as_python_refuses_one():
    # The optional keywords are a TypedDict (TrainerOptions): a misspelt one is not dropped.
    with pytest.raises(TypeError, match="unexpected keyword argument 'run_dri'"):
        MaxEntTrainer(None, None, None, config=None, reward_funcs=[], run_dri="run")
