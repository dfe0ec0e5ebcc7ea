"""RolloutBatch.from_parts on a real model's scoring output, with and without per-token data."""

from __future__ import annotations

import pytest
import torch
from transformers import ByT5Tokenizer

from maxent_arrow.demo import tiny_model
from maxent_arrow.errors import LayoutError
from maxent_arrow.ingest.score_batch import build_score_batch
from maxent_arrow.rollout.batch import RolloutBatch
from maxent_arrow.train.generation import SamplingOptions, sample_groups
from maxent_arrow.train.scoring import reference_logprobs, sequence_scores


@pytest.fixture(scope="module")
def scored():
    model, tok = tiny_model(0), ByT5Tokenizer()
    rollouts = sample_groups(
        model,
        tok,
        ["Q: 1 + 1 = ? A:", "Q: 22 + 2 = ? A:"],
        ["2", "24"],
        options=SamplingOptions(k=3, max_new_tokens=6, generator_seed=0),
    )
    batch = build_score_batch(
        rollouts.generation, pad_token_id=0, max_prompt_len=32, slice_size=0, tokenizer=tok
    )
    return model, rollouts, batch


@pytest.mark.parametrize("per_token_reference", [False, True])
def test_behaviour_rows_keep_each_completions_length(scored, per_token_reference):
    model, rollouts, score_batch = scored
    reference = reference_logprobs(model, score_batch, return_token_logp=per_token_reference)
    scores = sequence_scores(
        model, score_batch, reference, behavior_token_logp=rollouts.behavior_token_logp
    )
    assert scores.token_logp is None and scores.token_mask is not None
    batch = RolloutBatch.from_parts(
        0,
        generation=rollouts.generation,
        score_batch=score_batch,
        reference=reference,
        scores=scores,
    )
    stored = batch.ragged("behavior_token_logp")
    assert stored.lengths().tolist() == rollouts.completion_ids.lengths().tolist()
    assert torch.allclose(stored.values, rollouts.behavior_token_logp.values)
    back = batch.reference_logprobs
    assert torch.equal(back.ref_logp_sum_raw, reference.ref_logp_sum_raw)
    assert (back.ref_token_logp is not None) == per_token_reference


def test_the_samplers_own_rows_are_stored_when_given(scored):
    model, rollouts, score_batch = scored
    reference = reference_logprobs(model, score_batch)
    scores = sequence_scores(model, score_batch, reference)  # no behaviour: policy rows
    batch = RolloutBatch.from_parts(
        0,
        generation=rollouts.generation,
        score_batch=score_batch,
        reference=reference,
        scores=scores,
        behavior_token_logp=rollouts.behavior_token_logp,
    )
    assert batch.ragged("behavior_token_logp").equal(rollouts.behavior_token_logp)
    wrong = rollouts.behavior_token_logp[:3]
    with pytest.raises(LayoutError, match="behavior_token_logp expected 6 rows"):
        RolloutBatch.from_parts(0, generation=rollouts.generation, behavior_token_logp=wrong)
