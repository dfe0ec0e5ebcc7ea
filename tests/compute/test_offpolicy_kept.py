"""Kept-set renormalisation and the kept-mass audit (``docs/formulas.md`` §3.11): on known
distributions, sampled for real (seeded ``torch.multinomial``) from their top-p / top-k cuts.

The bias trl#7269 measured (a mean vLLM importance ratio of 0.896 at ``top_p=0.8``) is the
kept mass: the sampler draws from the cut distribution and reports its renormalised
(``processed``) log-prob, the trainer divides the full policy's probability by it, so the
ratio's mean is ``E[S]`` < 1. Against the policy renormalised over the same set it is 1.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from maxent_arrow import Ragged
from maxent_arrow.compute import kept_mass_audit, kept_set_log_mass, kept_set_ratio
from maxent_arrow.errors import ComputeError

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _top_p_sets(probs: np.ndarray, top_p: float) -> np.ndarray:
    """The nucleus of each row (vLLM / HF rule: the most likely tokens until their mass
    reaches ``top_p``, the one that crosses it included) as a boolean ``[T, V]`` mask."""
    order = np.argsort(-probs, axis=1, kind="stable")
    sorted_p = np.take_along_axis(probs, order, axis=1)
    before = np.cumsum(sorted_p, axis=1) - sorted_p
    keep_sorted = before < top_p
    keep = np.zeros_like(keep_sorted)
    np.put_along_axis(keep, order, keep_sorted, axis=1)
    return keep


def _top_k_sets(probs: np.ndarray, k: int) -> np.ndarray:
    keep = np.zeros(probs.shape, dtype=bool)
    np.put_along_axis(keep, np.argsort(-probs, axis=1)[:, :k], True, axis=1)
    return keep


def _fixture(seed: int, tokens: int, vocab: int, *, drift: float):
    """Behaviour logits and a drifted policy, both float64. LLM-like: each position's logits
    have their own scale (1 to 14), so some positions are near-deterministic (a top token above
    0.8, kept alone by top_p=0.8) and others spread."""
    g = torch.Generator().manual_seed(seed)
    scale = 1.0 + 13.0 * torch.rand(tokens, 1, generator=g, dtype=torch.float64)
    behaviour = torch.randn(tokens, vocab, generator=g, dtype=torch.float64) * scale
    policy = behaviour + drift * torch.randn(tokens, vocab, generator=g, dtype=torch.float64)
    return behaviour, policy, g


def _simulate(keep: np.ndarray, behaviour: torch.Tensor, policy: torch.Tensor, g, device):
    """Draw one token per position from μ cut to its kept set; the per-token log-probs a
    trainer and a sampler would report, and the kept sets as ``Ragged`` rows."""
    keep_t = torch.from_numpy(keep)
    mu_full = torch.log_softmax(behaviour, dim=1)
    mu_cut = torch.log_softmax(behaviour.masked_fill(~keep_t, -math.inf), dim=1)  # processed
    pi_full = torch.log_softmax(policy, dim=1)
    y = torch.multinomial(mu_cut.exp(), 1, generator=g).squeeze(1)
    rows = torch.arange(len(y))
    ids = torch.nonzero(keep_t)[:, 1]  # row-major: each token's ids ascending
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), keep_t.sum(1).cumsum(0)])
    kept = Ragged(ids.to(device), offsets.to(device))
    return (
        pi_full.to(device),
        pi_full[rows, y].to(device),
        mu_cut[rows, y].to(device),
        mu_full[rows, y].to(device),
        kept,
    )


@pytest.mark.parametrize("device", DEVICES)
def test_kept_mass_audit_equals_log_s_of_the_full_distributions(device):
    behaviour, policy, g = _fixture(0, tokens=600, vocab=300, drift=0.3)
    probs = torch.softmax(policy, dim=1).numpy()
    for keep in (_top_p_sets(torch.softmax(behaviour, 1).numpy(), 0.8),
                 _top_k_sets(torch.softmax(behaviour, 1).numpy(), 20)):  # fmt: skip
        pi_full, _, _, _, kept = _simulate(keep, behaviour, policy, g, device)
        log_s = kept_set_log_mass(pi_full, kept)
        expected = np.log((probs * keep).sum(axis=1))  # float64, from the full distribution
        np.testing.assert_allclose(log_s.cpu().numpy(), expected, rtol=0, atol=1e-9)
        offsets = torch.arange(0, 601, 50, device=device)  # 12 completions of 50 tokens
        audit = kept_mass_audit(log_s, offsets=offsets)
        assert abs(audit.mean_log - expected.mean()) <= 1e-6
        assert abs(audit.mean - np.exp(expected).mean()) <= 1e-6
        assert abs(audit.min - np.exp(expected).min()) <= 1e-6
        assert abs(audit.seq_mean_log - expected.reshape(12, 50).sum(1).mean()) <= 1e-6
        assert audit.tokens == 600


@pytest.mark.parametrize("device", DEVICES)
def test_renormalised_ratio_is_unbiased_where_the_full_one_is_biased_at_top_p_0_8(device):
    """20 000 tokens sampled from μ cut at top_p=0.8; π drifted from μ. The unrenormalised
    ratio's mean is E[S^π], far below 1 (trl#7269: 0.896); the renormalised one's is 1
    within 4 standard errors."""
    behaviour, policy, g = _fixture(1, tokens=20_000, vocab=256, drift=0.2)
    keep = _top_p_sets(torch.softmax(behaviour, dim=1).numpy(), 0.8)
    pi_full, pi_y, mu_y, _, kept = _simulate(keep, behaviour, policy, g, device)
    log_s = kept_set_log_mass(pi_full, kept)
    offsets = torch.arange(0, 20_001, dtype=torch.int64, device=device)  # one token each
    naive = torch.exp(pi_y - mu_y)  # what TRL's token ratio computes against the full π
    fixed = kept_set_ratio(pi_y, mu_y, log_s, offsets=offsets)
    n = naive.numel()

    def mean_se(x: torch.Tensor) -> tuple[float, float]:
        return float(x.mean()), float(x.std()) / math.sqrt(n)

    m_fixed, se_fixed = mean_se(fixed)
    m_naive, se_naive = mean_se(naive)
    expected_bias = float(log_s.exp().mean())  # E[S^π]: the naive ratio's expected mean
    print(f"top_p=0.8: mean ratio {m_naive:.4f} ± {se_naive:.4f} unrenormalised "
          f"(E[S] = {expected_bias:.4f}), {m_fixed:.4f} ± {se_fixed:.4f} renormalised")  # fmt: skip
    assert abs(m_fixed - 1.0) <= 4 * se_fixed
    assert abs(m_naive - expected_bias) <= 4 * se_naive
    assert 0.85 <= m_naive <= 0.95 and (1.0 - m_naive) > 20 * se_naive


@pytest.mark.parametrize("device", DEVICES)
def test_sequence_ratio_and_raw_behaviour_log_probs(device):
    """Sequence level: the product of renormalised ratios over 8-token completions has mean 1
    within its error; with ``raw`` behaviour log-probs (the sampler's full distribution) its
    own kept mass renormalises them to the same ratio."""
    behaviour, policy, g = _fixture(2, tokens=16_000, vocab=128, drift=0.1)
    keep = _top_k_sets(torch.softmax(behaviour, dim=1).numpy(), 16)
    pi_full, pi_y, mu_y, mu_raw_y, kept = _simulate(keep, behaviour, policy, g, device)
    log_s = kept_set_log_mass(pi_full, kept)
    offsets = torch.arange(0, 16_001, 8, device=device)
    seq = kept_set_ratio(pi_y, mu_y, log_s, offsets=offsets, level="sequence")
    assert seq.shape == (2000,)
    se = float(seq.std()) / math.sqrt(seq.numel())
    assert abs(float(seq.mean()) - 1.0) <= 4 * se
    mu_log_s = kept_set_log_mass(torch.log_softmax(behaviour, 1).to(device), kept)
    raw = kept_set_ratio(pi_y, mu_raw_y, log_s, offsets=offsets, level="sequence",
                         behaviour_log_mass=mu_log_s)  # fmt: skip
    torch.testing.assert_close(raw, seq, rtol=1e-9, atol=0)


def test_kept_mass_from_stored_log_probs_and_bad_input():
    # Flat log-probs of the kept ids themselves (a stored top-k that covers each set).
    values = torch.log(torch.tensor([0.5, 0.25, 0.2, 0.1], dtype=torch.float64))
    log_s = kept_set_log_mass(values, None, set_offsets=torch.tensor([0, 2, 4]))
    torch.testing.assert_close(log_s, torch.log(torch.tensor([0.75, 0.3], dtype=torch.float64)))
    with pytest.raises(ComputeError, match=r"an id outside the vocabulary \[0, 4\)"):
        kept_set_log_mass(torch.zeros(2, 4), Ragged(torch.tensor([1, 4]), torch.tensor([0, 1, 2])))
    with pytest.raises(ComputeError, match=r"expected one kept set per token \(3\), got 2"):
        kept_set_log_mass(torch.zeros(3, 4), Ragged(torch.tensor([1, 2]), torch.tensor([0, 1, 2])))
