"""Teacher-forced scoring: every sample scores as it would alone, whatever shares its slice."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch
from transformers import ByT5Tokenizer, GPT2Config, GPT2LMHeadModel

from maxent_arrow import ReferenceLogprobs, SequenceScores
from maxent_arrow.errors import ComputeError, LayoutError
from maxent_arrow.ingest.packing import iter_chunks, sequence_layout
from maxent_arrow.ingest.score_batch import build_score_batch
from maxent_arrow.train.scoring import (
    ScoringOptions,
    reference_logprobs,
    score_tokens,
    sequence_scores,
    supports_packing,
)
from maxent_arrow.types import records_equal

EOS = 1
PAD = 0
K = 4
PROMPT_LENS = [3, 9, 1, 14]


def make_model(attn: str = "sdpa", seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=384,
        n_layer=2,
        n_embd=64,
        n_head=2,
        n_positions=128,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=EOS,
        eos_token_id=EOS,
    )
    config._attn_implementation = attn
    return GPT2LMHeadModel(config).eval()


@pytest.fixture(scope="module")
def model():
    return make_model()


@pytest.fixture(scope="module")
def eager_model():
    return make_model("eager")


def make_groups(seed: int = 1, *, eos_at: tuple[int, int] | None = None, empty: bool = False):
    """Group rows with mixed prompt lengths and ragged completions (no EOS unless asked)."""
    rng = np.random.default_rng(seed)
    prompts, completions = [], []
    for length in PROMPT_LENS:
        prompts.append(rng.integers(3, 384, size=length).tolist())
        group = [rng.integers(3, 384, size=int(rng.integers(1, 12))).tolist() for _ in range(K)]
        completions.append(group)
    if eos_at is not None:
        g, k = eos_at
        completions[g][k] = [50, 51, EOS, 52, 53, 54]
    if empty:
        completions[1][2] = []
    table = pa.table({"prompt_ids": prompts, "completion_ids": completions})
    flat = [(p, c) for p, group in zip(prompts, completions) for c in group]
    return table, flat


def alone(model, prompt, completion, temperature=1.0):
    """The sample scored by itself, no padding, default positions: per-token log-probs."""
    seq = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(seq).logits[0].double() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    start = max(len(prompt), 1)
    return (
        torch.stack([logp[t - 1, seq[0, t]] for t in range(start, seq.shape[1])]).float()
        if (seq.shape[1] > start)
        else torch.zeros(0)
    )


def assert_matches_alone(scores, flat, model, *, truncate=None, temperature=1.0):
    for i, (prompt, completion) in enumerate(flat):
        if truncate is not None:
            prompt, completion = truncate(prompt, completion)
        expected = alone(model, prompt, completion, temperature)
        got = scores.token_logp[i]
        assert int(scores.counts[i]) == expected.numel(), f"sample {i} count"
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6, msg=f"sample {i}")
        torch.testing.assert_close(
            scores.logp_sum[i], expected.double().sum().float(), rtol=1e-5, atol=1e-6
        )


N = K * len(PROMPT_LENS)


@pytest.mark.parametrize("slice_size", [1, 3, K, K + 1, N])
@pytest.mark.parametrize(
    "how", [("padded", "right"), ("padded", "left"), ("packed", "right")], ids=str
)
def test_each_sample_scores_as_if_alone(model, slice_size, how):
    table, flat = make_groups()
    sb = build_score_batch(table, pad_token_id=PAD, max_prompt_len=64, slice_size=slice_size)
    with torch.no_grad():
        options = ScoringOptions(packing=how[0], padding_side=how[1])
        scores = score_tokens(model, sb, options=options)
    assert scores.packed == (how[0] == "packed")
    assert_matches_alone(scores, flat, model)


@pytest.mark.parametrize("slice_size", [1, K, N])
def test_eager_attention_left_padding_and_packing(eager_model, slice_size):
    table, flat = make_groups(seed=4)
    sb = build_score_batch(table, pad_token_id=PAD, max_prompt_len=64, slice_size=slice_size)
    with torch.no_grad():
        for packing, side in (("padded", "left"), ("packed", "right")):
            options = ScoringOptions(packing=packing, padding_side=side)
            scores = score_tokens(eager_model, sb, options=options)
            assert_matches_alone(scores, flat, eager_model)


@pytest.mark.parametrize("budget", [5, 40])
def test_packed_rows_hold_several_sequences_and_match_padded(model, budget):
    table, flat = make_groups(seed=2)
    sb = build_score_batch(table, pad_token_id=PAD, max_prompt_len=64, slice_size=N)
    layout = sequence_layout(sb)
    chunks = list(
        iter_chunks(layout, slice_size=N, pad_token_id=PAD, mode="packed", pack_tokens=budget)
    )
    assert len(chunks) > 1
    longest = int(layout.tokens.lengths().max())
    assert all(c.num_tokens <= budget + longest for c in chunks)  # bounded rows
    if budget == 40:
        assert any(c.stop - c.start > 1 for c in chunks)
    assert sum(c.num_tokens for c in chunks) == layout.tokens.num_values  # no padding at all
    for c in chunks:
        assert c.cu_seqlens[-1] == c.input_ids.shape[1]
    with torch.no_grad():
        packed = score_tokens(
            model, sb, options=ScoringOptions(packing="packed", pack_tokens=budget)
        )
        padded = score_tokens(model, sb, options=ScoringOptions(packing="padded"))
    torch.testing.assert_close(packed.logp_sum, padded.logp_sum, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(
        packed.token_logp.values, padded.token_logp.values, rtol=1e-5, atol=1e-6
    )


def test_gpt2_supports_packing_and_auto_uses_it(model, eager_model):
    assert supports_packing(model) and supports_packing(eager_model)
    table, _ = make_groups()
    sb = build_score_batch(table, pad_token_id=PAD, max_prompt_len=64, slice_size=3)
    with torch.no_grad():
        assert score_tokens(model, sb).packed


class LogitsOnly(torch.nn.Module):
    """A causal LM without a separable head or transformers masking: scored padded."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, position_ids=None, attention_mask=None, use_cache=False):
        return self.inner(
            input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask
        )


def test_model_without_packing_support_falls_back_to_padded(model):
    wrapper = LogitsOnly(model)
    assert not supports_packing(wrapper)
    table, flat = make_groups(seed=3)
    sb = build_score_batch(table, pad_token_id=PAD, max_prompt_len=64, slice_size=K + 1)
    with torch.no_grad():
        scores = score_tokens(wrapper, sb, options=ScoringOptions(padding_side="left"))
        assert not scores.packed
        assert_matches_alone(scores, flat, model)
        with pytest.raises(ComputeError, match="cannot score packed rows"):
            score_tokens(wrapper, sb, options=ScoringOptions(packing="packed"))


def test_eos_inside_completion_stops_scoring(model):
    table, flat = make_groups(eos_at=(2, 1))
    sb = build_score_batch(
        table, pad_token_id=PAD, max_prompt_len=64, slice_size=N, eos_token_id=EOS
    )
    i = 2 * K + 1
    assert sb.completion_attention_mask[i].tolist()[:4] == [1, 1, 1, 0]
    with torch.no_grad():
        scores = score_tokens(model, sb)

    def cut_at_eos(prompt, completion):
        return prompt, completion[: completion.index(EOS) + 1] if EOS in completion else completion

    assert int(scores.counts[i]) == 3  # 50, 51 and the EOS itself
    assert_matches_alone(scores, flat, model, truncate=cut_at_eos)


@pytest.mark.parametrize("tail", [2, 5, 12])
def test_score_tail_tokens_scores_each_samples_own_tail(model, tail):
    table, flat = make_groups(seed=5)
    sb = build_score_batch(
        table, pad_token_id=PAD, max_prompt_len=64, slice_size=K + 1, score_tail_tokens=tail
    )
    with torch.no_grad():
        scores = score_tokens(model, sb)

    def window(prompt, completion):
        seq = (prompt + completion)[-tail:]
        n_prompt = max(len(seq) - len(completion), 0)
        return seq[:n_prompt], seq[n_prompt:]

    assert_matches_alone(scores, flat, model, truncate=window)
    assert int(scores.counts.max()) <= tail - 1


def test_head_truncation_to_max_prompt_len(model):
    table, flat = make_groups(seed=6)
    sb = build_score_batch(table, pad_token_id=PAD, max_prompt_len=4, slice_size=N)
    with torch.no_grad():
        scores = score_tokens(model, sb, options=ScoringOptions(packing="padded"))
    assert_matches_alone(scores, flat, model, truncate=lambda p, c: (p[:4], c))


def test_reference_logprobs_has_the_seeds_meanings(model):
    table, flat = make_groups(seed=7, empty=True)
    sb = build_score_batch(table, pad_token_id=PAD, max_prompt_len=64, slice_size=3)
    ref = reference_logprobs(model, sb, return_token_logp=True)
    assert isinstance(ref, ReferenceLogprobs)
    raw = torch.stack([alone(model, p, c).double().sum() for p, c in flat]).float()
    counts = torch.tensor([max(len(c), 1) for _, c in flat], dtype=torch.float32)
    torch.testing.assert_close(ref.ref_logp_sum_raw, raw, rtol=1e-5, atol=1e-6)
    assert ref.ref_tok_counts.dtype == torch.float32
    assert torch.equal(ref.ref_tok_counts, counts)  # the empty completion counts as 1
    assert float(ref.ref_logp_sum_raw[1 * K + 2]) == 0.0
    torch.testing.assert_close(ref.ref_logp_sum, raw / counts, rtol=1e-5, atol=1e-6)  # a mean
    assert ref.ref_logp_mean == pytest.approx(float(raw.double().mean()), rel=1e-5)
    assert ref.avg_completion_tokens == pytest.approx(float(counts.mean()))
    assert ref.ref_token_logp.shape == sb.completion_ids.shape
    for i, (p, c) in enumerate(flat):
        torch.testing.assert_close(
            ref.ref_token_logp[i, : len(c)], alone(model, p, c), rtol=1e-5, atol=1e-6
        )
        assert ref.ref_token_mask[i].tolist() == [1] * len(c) + [0] * (
            sb.completion_ids.shape[1] - len(c)
        )
    again = ReferenceLogprobs.from_arrow(ref.to_arrow())
    assert records_equal(again, ref)  # tensors: by value


def test_temperature_is_applied_to_policy_and_reference_alike(model):
    table, flat = make_groups(seed=8)
    sb = build_score_batch(table, pad_token_id=PAD, max_prompt_len=64, slice_size=N)
    tempered = ScoringOptions(temperature=0.7)
    ref = reference_logprobs(model, sb, options=tempered)
    ss = sequence_scores(model, sb, ref, options=tempered)
    raw = torch.stack([alone(model, p, c, 0.7).double().sum() for p, c in flat]).float()
    torch.testing.assert_close(ref.ref_logp_sum_raw, raw, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ss.log_ratio_train.detach(), torch.zeros(N), rtol=0, atol=1e-5)
    with pytest.raises(ComputeError, match="temperature"):
        ScoringOptions(temperature=0.0)
    with pytest.raises(ComputeError, match="token_chunk"):
        ScoringOptions(token_chunk=0)


def test_gradient_flows_from_cur_logp_sum_to_the_model():
    model = make_model(seed=3)
    table, flat = make_groups(seed=9)
    sb = build_score_batch(table, pad_token_id=PAD, max_prompt_len=64, slice_size=K)
    ref = reference_logprobs(model, sb)
    chunked = ScoringOptions(token_chunk=5)  # several checkpointed head chunks
    ss = sequence_scores(model, sb, ref, options=chunked)
    assert isinstance(ss, SequenceScores) and ss.cur_logp_sum.requires_grad
    assert not ss.behavior_logp_sum.requires_grad
    ss.cur_logp_sum.sum().backward()
    ours = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert all(g.abs().sum() > 0 for n, g in ours.items() if "wpe" not in n)
    model.zero_grad()
    total = 0
    for p, c in flat:  # the same objective, one sample at a time, plain autograd
        seq = torch.tensor([p + c])
        logp = torch.log_softmax(model(seq).logits[0], dim=-1)
        total = total + logp[torch.arange(len(p) - 1, seq.shape[1] - 1), seq[0, len(p) :]].sum()
    total.backward()
    for name, param in model.named_parameters():
        torch.testing.assert_close(ours[name], param.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_sequence_scores_fields_and_behavior_alignment(model):
    table, flat = make_groups(seed=10)
    tail = 6
    sb = build_score_batch(
        table, pad_token_id=PAD, max_prompt_len=64, slice_size=4, score_tail_tokens=tail
    )
    ref = reference_logprobs(model, sb)
    # Stored behaviour values: one per completion token, here i*100 + j to check alignment.
    rows = [[float(i * 100 + j) for j in range(len(c))] for i, (_, c) in enumerate(flat)]
    sizes = np.full(len(PROMPT_LENS), K)
    grouped = pa.ListArray.from_arrays(
        pa.array(np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)),
        pa.array(rows, type=pa.list_(pa.float32())),
    )
    behavior_sum = torch.full((N,), float("nan"))
    behavior_sum[0] = -3.5
    ss = sequence_scores(
        model,
        sb,
        ref,
        behavior_logp_sum=behavior_sum,
        behavior_token_logp=grouped,
        return_token_logp=True,
        return_entropy=True,
    )
    assert float(ss.behavior_logp_sum[0]) == -3.5
    # The same values as the group table stores them: list<double> per group, nulls allowed.
    column = pa.ListArray.from_arrays(
        pa.array(np.arange(0, N + 1, K, dtype=np.int32)),
        pa.array([-3.5] + [None] * (N - 1), type=pa.float64()),
    )
    from_arrow = sequence_scores(model, sb, ref, behavior_logp_sum=column)
    torch.testing.assert_close(from_arrow.behavior_logp_sum, ss.behavior_logp_sum)
    torch.testing.assert_close(ss.behavior_logp_sum[1:], ss.cur_logp_sum.detach()[1:])
    torch.testing.assert_close(ss.denom_tok_tensor, ref.ref_tok_counts)
    counts = ss.token_mask.sum(dim=1)
    for i, (_, c) in enumerate(flat):
        n = int(counts[i])
        skip = len(c) - n  # the scored tokens are the completion's last n
        assert ss.old_token_logp[i, :n].tolist() == rows[i][skip:]
        assert float(ss.token_logp.detach()[i, n:].abs().sum()) == 0.0
    assert ss.policy_entropy_sum.shape == (N,) and bool((ss.policy_entropy_sum > 0).all())
    assert not ss.policy_entropy_sum.requires_grad
    again = SequenceScores.from_arrow(ss.to_arrow())
    torch.testing.assert_close(again.token_logp, ss.token_logp.detach())
    short = pa.array(rows[:-1], type=pa.list_(pa.float32()))
    with pytest.raises(LayoutError, match=f"expected {N} rows"):
        sequence_scores(model, sb, ref, behavior_token_logp=short)


def test_exact_entropy_matches_direct_computation(model):
    table, flat = make_groups(seed=11)
    sb = build_score_batch(table, pad_token_id=PAD, max_prompt_len=64, slice_size=N)
    with torch.no_grad():
        scores = score_tokens(model, sb, return_entropy=True)
        for i, (p, c) in enumerate(flat):
            logits = model(torch.tensor([p + c])).logits[0].double()
            logp = torch.log_softmax(logits, -1)
            ent = -(logp.exp() * logp).sum(-1)[len(p) - 1 : len(p) + len(c) - 1].sum()
            assert float(scores.entropy_sum[i]) == pytest.approx(float(ent), rel=1e-5)


def test_logits_are_computed_one_token_chunk_at_a_time(model):
    table, _ = make_groups(seed=12)
    sb = build_score_batch(table, pad_token_id=PAD, max_prompt_len=64, slice_size=N)
    seen = []
    hook = model.lm_head.register_forward_hook(lambda m, a, out: seen.append(out.shape))
    try:
        with torch.no_grad():
            small = score_tokens(model, sb, options=ScoringOptions(token_chunk=7))
    finally:
        hook.remove()
    assert seen and all(s[0] <= 7 and len(s) == 2 for s in seen)  # never [rows, T, V]
    assert sum(s[0] for s in seen) == int(small.counts.sum())  # only scored positions
    with torch.no_grad():
        big = score_tokens(model, sb, options=ScoringOptions(token_chunk=4096))
    torch.testing.assert_close(small.logp_sum, big.logp_sum, rtol=1e-6, atol=1e-6)


def test_bfloat16_model_sums_accumulate_wide():
    model = make_model(seed=5).to(torch.bfloat16)
    table, _ = make_groups(seed=13)
    sb = build_score_batch(table, pad_token_id=PAD, max_prompt_len=64, slice_size=N)
    with torch.no_grad():
        scores = score_tokens(model, sb)
    assert scores.token_logp.values.dtype == torch.float32
    assert scores.logp_sum.dtype == torch.float32
    for i in range(N):
        expected = scores.token_logp[i].double().sum().float()
        assert float(scores.logp_sum[i]) == float(expected)


def test_mask_with_a_hole_is_refused(model):
    table, _ = make_groups()
    sb = build_score_batch(table, pad_token_id=PAD, max_prompt_len=64, slice_size=N)
    mask = sb.completion_attention_mask.clone()
    mask[4, 0] = 0
    mask[4, 1] = 1
    sb.completion_attention_mask = mask
    with pytest.raises(LayoutError, match="sample 4 is not ones then zeros"):
        reference_logprobs(model, sb)


def test_reference_length_mismatch_is_refused(model):
    table, _ = make_groups()
    sb = build_score_batch(table, pad_token_id=PAD, max_prompt_len=64, slice_size=N)
    ref = reference_logprobs(model, sb)
    other = build_score_batch(table.slice(0, 2), pad_token_id=PAD, max_prompt_len=64, slice_size=N)
    with pytest.raises(LayoutError, match=f"reference has {N} samples, expected {2 * K}"):
        sequence_scores(model, other, ref)


def test_prompts_from_text_score_like_stored_ids(model):
    tok = ByT5Tokenizer()
    texts = ["2+2=", "name a prime number:", "x"]
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    completions = [[[40, 41, 42], [43]], [[44, 45]], [[46, 47, 48, 49], [50, 51]]]
    by_text = pa.table({"prompt": texts, "completion_ids": completions})
    by_ids = pa.table({"prompt_ids": ids, "completion_ids": completions})
    a = build_score_batch(
        by_text, pad_token_id=None, max_prompt_len=64, slice_size=2, tokenizer=tok
    )
    b = build_score_batch(by_ids, pad_token_id=PAD, max_prompt_len=64, slice_size=5)
    with torch.no_grad():
        torch.testing.assert_close(score_tokens(model, a).logp_sum, score_tokens(model, b).logp_sum)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_scoring_matches_cpu(model):
    table, flat = make_groups(seed=14)
    gpu_model = make_model().cuda()
    sb = build_score_batch(table, pad_token_id=PAD, max_prompt_len=64, slice_size=K, device="cuda")
    assert sb.completion_ids.is_cuda
    ref = reference_logprobs(gpu_model, sb, return_token_logp=True)
    assert ref.ref_logp_sum_raw.is_cuda
    cpu_sb = build_score_batch(table, pad_token_id=PAD, max_prompt_len=64, slice_size=K)
    cpu_ref = reference_logprobs(model, cpu_sb, return_token_logp=True)
    torch.testing.assert_close(
        ref.ref_logp_sum_raw.cpu(), cpu_ref.ref_logp_sum_raw, rtol=1e-4, atol=1e-4
    )
    ss = sequence_scores(gpu_model, sb, ref)
    ss.cur_logp_sum.sum().backward()
    assert gpu_model.lm_head.weight.grad is not None
