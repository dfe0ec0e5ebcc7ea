"""Evaluation through ValidationContext, stored as eval steps in a real store."""

from __future__ import annotations

import pytest
from transformers import ByT5Tokenizer

from maxent_arrow.demo import tiny_model
from maxent_arrow.demo.rewards import accuracy_reward, format_reward
from maxent_arrow.errors import LayoutError
from maxent_arrow.store.store import RolloutStore
from maxent_arrow.train.evaluation import evaluate, greedy_generator, should_evaluate
from maxent_arrow.types.rewards import ValidationContext
from maxent_arrow.types.settings import EvaluationSettings, LoggingHandles, RewardSpec

ROWS = [{"prompt": "Q: 1 + 1 = ? A:", "answer": "2"}, {"prompt": "Q: 2 * 5 = ? A:", "answer": "10"}]


def _ctx(store, generator, *, every=2, log=None):
    model = tiny_model(1)
    return ValidationContext(
        evaluation=EvaluationSettings(enabled=True, rows=ROWS, batch_size=1, every_n_steps=every),
        accelerator=None,
        model=model,
        tokenizer=ByT5Tokenizer(),
        reward=RewardSpec([accuracy_reward, format_reward], [1.0, 0.5], ["accuracy", "format"]),
        generator=generator,
        logging=LoggingHandles(log_metrics=log, store=store),
    )


def test_should_evaluate_every_n_steps(tmp_path):
    ctx = _ctx(None, None, every=3)
    assert [s for s in range(7) if should_evaluate(ctx, s)] == [0, 3, 6]
    ctx.evaluation.enabled = False
    assert not should_evaluate(ctx, 0)


def test_evaluate_scores_greedy_completions_and_stores_an_eval_step(tmp_path):
    store = RolloutStore.create(tmp_path / "run")
    logged = {}
    model = tiny_model(1)
    gen = greedy_generator(model, ByT5Tokenizer(), max_new_tokens=5, max_prompt_len=32)
    ctx = _ctx(store, gen, log=lambda metrics, step: logged.setdefault(step, metrics))
    ctx.model = model
    batch = evaluate(ctx, step=4)
    assert batch.kind == "eval" and batch.step == 4 and batch.num_samples == 2
    assert store.steps(kind="eval") == [4] and store.steps(kind="train") == []
    rc = batch.reward_computation
    texts = batch.generation_batch.grouped_completions
    expected = [
        1.0 * a + 0.5 * f
        for a, f in zip(
            accuracy_reward([t[0] for t in texts], ["2", "10"]),
            format_reward([t[0] for t in texts], ["2", "10"]),
        )
    ]
    assert rc.total_utils == pytest.approx(expected)
    assert logged[4]["eval/reward_mean"] == pytest.approx(sum(expected) / 2)
    assert set(rc.per_reward_values) == {"accuracy", "format"}


def test_a_generator_that_drops_prompts_is_refused(tmp_path):
    store = RolloutStore.create(tmp_path / "run")
    ctx = _ctx(store, lambda prompts, n: ([], []))
    with pytest.raises(LayoutError, match="returned 0 groups for 2 prompts"):
        evaluate(ctx, step=0)
    assert store.steps(kind="eval") == []
