"""Sampling K completions per prompt with a real (tiny, seeded) transformers model."""

from __future__ import annotations

import pytest
import torch
from transformers import ByT5Tokenizer

from maxent_arrow.demo import tiny_model
from maxent_arrow.ingest.score_batch import build_score_batch
from maxent_arrow.train.generation import (
    SamplingOptions,
    _eos_cut_lengths,
    decode_completions,
    sample_groups,
)
from maxent_arrow.train.scoring import ScoringOptions, reference_logprobs

PROMPTS = ["Q: 1 + 2 = ? A:", "Q: 12 * 3 = ? A:", "Q: 7 - 9 = ? A:"]
ANSWERS = ["3", "36", "-2"]


@pytest.fixture(scope="module")
def model_and_tokenizer():
    return tiny_model(3).eval(), ByT5Tokenizer()


def test_eos_cut_keeps_the_first_eos_and_marks_rows_without_one():
    ids = torch.tensor([[5, 1, 7, 1], [5, 6, 7, 8], [1, 0, 0, 0]])
    lengths, found = _eos_cut_lengths(ids, 1)
    assert lengths.tolist() == [2, 4, 1]
    assert found.tolist() == [True, False, True]


def test_groups_are_prompt_major_with_exact_ids_and_info(model_and_tokenizer):
    model, tok = model_and_tokenizer
    options = SamplingOptions(k=4, max_new_tokens=10, generator_seed=0)
    out = sample_groups(model, tok, PROMPTS, ANSWERS, options=options)
    gen = out.generation
    assert gen.prompts == PROMPTS and gen.answers == ANSWERS
    assert [len(g) for g in gen.grouped_completions] == [4, 4, 4]
    assert len(out.completion_ids) == 12
    for g, infos in enumerate(gen.grouped_completion_info):
        for k, info in enumerate(infos):
            ids = out.completion_ids[g * 4 + k].tolist()
            assert info["token_ids"] == ids and info["token_count"] == len(ids)
            assert 1 <= len(ids) <= 10
            ended = ids[-1] == tok.eos_token_id
            assert info["finish_reason"] == ("stop" if ended else "length")
            assert tok.eos_token_id not in ids[:-1]
            assert gen.grouped_completions[g][k] == tok.decode(ids, skip_special_tokens=True)


def test_behaviour_logprobs_equal_teacher_forced_scores_of_the_sampled_tokens(
    model_and_tokenizer,
):
    model, tok = model_and_tokenizer
    options = SamplingOptions(k=3, max_new_tokens=8, temperature=0.7, generator_seed=1)
    out = sample_groups(model, tok, PROMPTS, ANSWERS, options=options)
    batch = build_score_batch(
        out.generation,
        pad_token_id=tok.pad_token_id,
        max_prompt_len=64,
        slice_size=0,
        tokenizer=tok,
    )
    tempered = ScoringOptions(temperature=0.7)
    ref = reference_logprobs(model, batch, options=tempered, return_token_logp=True)
    sums = torch.stack([row.sum() for row in out.behavior_token_logp]).double()
    assert torch.allclose(sums, ref.ref_logp_sum_raw.double(), rtol=1e-4, atol=1e-4)


def test_greedy_generation_is_deterministic(model_and_tokenizer):
    model, tok = model_and_tokenizer
    greedy = SamplingOptions(k=1, max_new_tokens=6, greedy=True)
    a = sample_groups(model, tok, PROMPTS, ANSWERS, options=greedy)
    b = sample_groups(model, tok, PROMPTS, ANSWERS, options=greedy)
    assert a.completion_ids.equal(b.completion_ids)


def test_decoding_drops_special_tokens_exactly_as_batch_decode_does():
    # ByT5 is a slow tokenizer with 125 extra ids, the case decode_completions speeds up.
    tok = ByT5Tokenizer()
    gen = torch.Generator().manual_seed(0)
    special = sorted(tok.all_special_ids)
    rows = []
    for _ in range(300):
        length = int(torch.randint(0, 9, (1,), generator=gen))
        # Bytes, pad/EOS/UNK and extra ids mixed in every row.
        pool = torch.cat([torch.arange(3, 259), torch.tensor(special)])
        rows.append(pool[torch.randint(0, len(pool), (length,), generator=gen)].tolist())
    assert any(t in special for row in rows for t in row)
    assert decode_completions(tok, rows) == tok.batch_decode(rows, skip_special_tokens=True)
