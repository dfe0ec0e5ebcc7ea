"""The supervised warm start on a real (tiny, seeded) transformers model."""

from __future__ import annotations

import pytest
import torch
from transformers import ByT5Tokenizer

from maxent_arrow.demo import tiny_model
from maxent_arrow.errors import ComputeError
from maxent_arrow.train.generation import SamplingOptions, sample_groups
from maxent_arrow.train.supervised import WarmStartOptions, supervised_warm_start

PROMPTS = ["12+30=", "21+17=", "40+9=", "33+33="]
COMPLETIONS = ["42", "38", "49", "66"]


def _manual_loss(model, tok, prompts, completions) -> float:
    """Mean NLL of completion + EOS tokens given the prompt, one example at a time."""
    total, count = 0.0, 0
    with torch.no_grad():
        for prompt, completion in zip(prompts, completions, strict=True):
            head = tok(prompt, add_special_tokens=False)["input_ids"]
            tail = tok(completion, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            ids = torch.tensor([head + tail])
            logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
            for j, token in enumerate(tail):
                total -= float(logp[len(head) + j - 1, token])
                count += 1
    return total / count


def test_the_loss_is_the_nll_of_completion_and_eos_tokens_only():
    tok = ByT5Tokenizer()
    model = tiny_model(5)
    expected = _manual_loss(model, tok, PROMPTS, COMPLETIONS)
    # One batch of all four examples, learning rate 0: the first loss is the untouched model's.
    once = WarmStartOptions(steps=1, batch_size=4, learning_rate=0.0)
    losses = supervised_warm_start(model, tok, PROMPTS, COMPLETIONS, options=once)
    assert losses[0] == pytest.approx(expected, rel=1e-5)
    # A prompt token is context, never a target: another prompt text changes the loss only
    # through the context, and the manual computation (which scores no prompt token) agrees.
    longer = [p + " " for p in PROMPTS]
    again = supervised_warm_start(tiny_model(5), tok, longer, COMPLETIONS, options=once)
    assert again[0] == pytest.approx(
        _manual_loss(tiny_model(5), tok, longer, COMPLETIONS), rel=1e-5
    )


def test_the_model_learns_the_demonstrations_and_generates_them():
    tok = ByT5Tokenizer()
    model = tiny_model(0)
    options = WarmStartOptions(steps=120, batch_size=4, learning_rate=1e-2, seed=1)
    losses = supervised_warm_start(model, tok, PROMPTS, COMPLETIONS, options=options)
    assert len(losses) == 120 and losses[-1] < 0.05 < losses[0]
    assert not model.training
    greedy = SamplingOptions(k=1, max_new_tokens=4, greedy=True)
    out = sample_groups(model, tok, PROMPTS, COMPLETIONS, options=greedy)
    assert [g[0] for g in out.generation.grouped_completions] == COMPLETIONS
    # Each completion ended with the EOS the demonstrations taught.
    assert all(
        info[0]["finish_reason"] == "stop" for info in out.generation.grouped_completion_info
    )


def test_the_pass_is_reproducible_for_a_seed():
    tok = ByT5Tokenizer()
    options = WarmStartOptions(steps=5, batch_size=3, seed=4)
    runs = [
        supervised_warm_start(tiny_model(2), tok, PROMPTS, COMPLETIONS, options=options)
        for _ in range(2)
    ]
    assert runs[0] == runs[1]
    other = supervised_warm_start(
        tiny_model(2),
        tok,
        PROMPTS,
        COMPLETIONS,
        options=WarmStartOptions(steps=5, batch_size=3, seed=5),
    )
    assert other != runs[0]  # the seed decides the batches


def test_zero_steps_change_nothing_and_bad_input_is_refused():
    tok = ByT5Tokenizer()
    model = tiny_model(0)
    before = [p.detach().clone() for p in model.parameters()]
    none = WarmStartOptions(steps=0)
    assert supervised_warm_start(model, tok, PROMPTS, COMPLETIONS, options=none) == []
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    one = WarmStartOptions(steps=1)
    with pytest.raises(ComputeError, match="4 prompts but 3 completions"):
        supervised_warm_start(model, tok, PROMPTS, COMPLETIONS[:3], options=one)
    with pytest.raises(ComputeError, match="no demonstrations"):
        supervised_warm_start(model, tok, [], [], options=one)
    with pytest.raises(ComputeError, match="batch_size >= 1"):
        WarmStartOptions(steps=1, batch_size=0)
