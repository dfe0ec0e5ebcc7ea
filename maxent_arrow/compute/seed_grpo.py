"""SEED-GRPO semantic-entropy scaling of advantages (``docs/formulas.md`` §3.3).

Per prompt group: extract each completion's final answer, cluster the completions by exact
answer string (no answer: a singleton cluster), weigh each cluster by the softmax mass of the
completions' (length-normalised) log-likelihoods, take the entropy ``H_g`` of that cluster
distribution, and scale the group's advantages by ``s_g = 1 / (1 + α_eff H_g)``.

Not InfoSeed (the pre-2026-03 contrastive auxiliary loss that reused the name "seed").

Answer extraction is one RE2 pass over the Arrow string array (``pyarrow.compute``), the
clustering one ``torch.unique`` over (group, answer id) keys, and the masses and entropies are
segment sums: no Python loop over groups or samples.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import torch

from maxent_arrow.arrow import Ragged
from maxent_arrow.compute.segments import Segments, work_dtype
from maxent_arrow.errors import ComputeError, SchemaError

__all__ = [
    "SeedGrpoSettings",
    "SeedGrpoStats",
    "extract_answers",
    "answer_clusters",
    "seed_grpo_statistics",
]

# The last `\boxed{...}` whose braces balance, up to 4 levels of nesting (RE2 has no
# recursion; `\boxed{\frac{a}{b^{2}}}` is 3 levels). The greedy `.*` selects the last one.
_BOXED = r"(?s).*\\boxed\{(?P<ans>(?:[^{}]|\{(?:[^{}]|\{(?:[^{}]|\{[^{}]*\})*\})*\})*)\}"
_ANSWER_TAG = r"(?s).*<answer>(?P<ans>.*?)</answer>"


@dataclass(frozen=True)
class SeedGrpoSettings:
    """The SEED-GRPO knobs of the original (``seed_grpo_*``), with its defaults."""

    alpha: float = 0.0417
    normalize_by_max_entropy: bool = True
    length_normalize: bool = True


@dataclass(frozen=True)
class SeedGrpoStats:
    """Per-group SEED-GRPO results.

    ``semantic_entropy`` ``H_g`` and ``scales`` ``s_g`` are ``[P]``; ``alpha_effective`` and
    ``max_possible_entropy`` are the batch scalars of ``RewardComputation`` (for ragged groups,
    those of the largest K; ``alpha_per_group`` holds each group's own ``α_eff``).
    ``clusters`` gives each completion's cluster index within its group.
    """

    semantic_entropy: torch.Tensor
    scales: torch.Tensor
    alpha_per_group: torch.Tensor
    alpha_effective: float
    max_possible_entropy: float
    clusters: Ragged


def _strings(value: Any, where: str) -> pa.Array:
    if isinstance(value, pa.ChunkedArray):
        value = value.combine_chunks()
    elif isinstance(value, Sequence) and not isinstance(value, str | bytes):
        value = pa.array(value, type=pa.string())
    # pyarrow is untyped to a checker, so `isinstance` does not narrow `value` to an array.
    if not isinstance(value, pa.Array) or not (
        pa.types.is_string(value.type)  # pyright: ignore[reportAttributeAccessIssue]
        or pa.types.is_large_string(value.type)  # pyright: ignore[reportAttributeAccessIssue]
    ):
        raise SchemaError(f"{where}: expected a list or Arrow array of strings")
    return value


def extract_answers(completions: Any) -> pa.Array:
    """Final answer of each completion: the last ``\\boxed{...}`` content, else the last
    ``<answer>...</answer>`` content, whitespace-stripped; null when there is none (or it is
    empty)."""
    texts = _strings(completions, "extract_answers: completions")
    found = []
    for pattern in (_BOXED, _ANSWER_TAG):
        match = pc.extract_regex(texts, pattern=pattern)
        # A non-matching row is a null struct whose child still holds "": mask it.
        found.append(pc.if_else(match.is_valid(), match.field("ans"), pa.scalar(None, pa.string())))
    answers = pc.utf8_trim_whitespace(pc.coalesce(*found))
    return pc.if_else(pc.equal(answers, ""), pa.scalar(None, pa.string()), answers)


def answer_clusters(answers: pa.Array, segments: Segments) -> tuple[torch.Tensor, torch.Tensor]:
    """Cluster ids: equal answers within a group share one; null answers are singletons.

    Returns ``(cluster_of_sample [N], group_of_cluster [C])``; clusters are numbered in order
    of (group, first key), so a group's clusters are contiguous.
    """
    device = segments.offsets.device
    encoded = (
        pc.dictionary_encode(answers).combine_chunks()
        if isinstance(answers, pa.ChunkedArray)
        else pc.dictionary_encode(answers)
    )
    distinct = len(encoded.dictionary)
    ids = torch.from_numpy(
        pc.fill_null(encoded.indices, -1).to_numpy(zero_copy_only=False).astype("int64")
    ).to(device)
    rows = segments.row_ids
    n = segments.num_values
    # Keys sort by group first: group * (distinct + n) + answer id, or + distinct + sample
    # index for a missing answer (unique, so a singleton).
    span = distinct + n
    sample = torch.arange(n, device=device)
    offset_in_group = torch.where(ids >= 0, ids, distinct + sample)
    keys = rows * span + offset_in_group
    unique, cluster = torch.unique(keys, sorted=True, return_inverse=True)
    return cluster, torch.div(unique, span, rounding_mode="floor")


def seed_grpo_statistics(
    completions: Any,
    logprob_sum: torch.Tensor,
    token_count: torch.Tensor | None,
    *,
    offsets: torch.Tensor,
    settings: SeedGrpoSettings | None = None,
) -> SeedGrpoStats:
    """Semantic entropy and advantage scale per group (§3.3).

    Parameters
    ----------
    completions:
        The N completion texts, prompt-major (list, Arrow string array or grouped view).
    logprob_sum, token_count:
        Behaviour (generation) log-likelihood sums and token counts per completion; with
        ``length_normalize`` the likelihood is ``logprob_sum / max(token_count, 1)``. A
        missing (NaN) log-likelihood raises :class:`ComputeError` naming the group.
    offsets:
        Group offsets (``P + 1``).
    """
    settings = settings or SeedGrpoSettings()
    where = "seed_grpo_statistics"
    alpha = float(settings.alpha)
    if not math.isfinite(alpha) or alpha < 0:
        raise ComputeError(f"{where}: alpha must be finite and >= 0, got {settings.alpha!r}")
    lp = torch.as_tensor(logprob_sum)
    seg = Segments(offsets.to(lp.device), num_values=int(lp.shape[0]), where=f"{where}: offsets")
    if len(seg) == 0:
        raise ComputeError(f"{where}: expected at least one group, got an empty batch")
    texts = _strings(completions, f"{where}: completions")
    if len(texts) != seg.num_values:
        raise ComputeError(
            f"{where}: completions: expected {seg.num_values} texts (one per log-prob), got "
            f"{len(texts)}"
        )
    ell = _log_likelihoods(lp, token_count, seg, settings.length_normalize, where)
    cluster, cluster_group = answer_clusters(extract_answers(texts), seg)
    entropy = _cluster_entropy(ell, cluster, cluster_group, seg)
    k = seg.lengths.to(ell.dtype)
    if settings.normalize_by_max_entropy:
        alpha_g = torch.where(k > 1, alpha / torch.log(k).clamp(min=1e-12), alpha)
    else:
        alpha_g = torch.full_like(k, alpha)
    # The record's batch scalars are those of the largest group (each group uses its own α_g).
    k_max = int(seg.lengths.max())
    max_entropy = math.log(k_max) if k_max > 1 else 0.0
    use_norm = settings.normalize_by_max_entropy and k_max > 1
    # Cluster ids within each group: a group's clusters are numbered contiguously.
    starts = torch.searchsorted(cluster_group, torch.arange(len(seg), device=ell.device))
    local = cluster - starts.index_select(0, seg.row_ids)
    return SeedGrpoStats(
        semantic_entropy=entropy,
        scales=1.0 / (1.0 + alpha_g * entropy),
        alpha_per_group=alpha_g,
        alpha_effective=alpha / max_entropy if use_norm else alpha,
        max_possible_entropy=max_entropy,
        clusters=Ragged(local, seg.offsets, validate=False),
    )


def _log_likelihoods(
    logprob_sum: torch.Tensor,
    token_count: torch.Tensor | None,
    seg: Segments,
    length_normalize: bool,
    where: str,
) -> torch.Tensor:
    """``ℓ_i``: the sums, divided by ``max(token_count, 1)`` when ``length_normalize``; a
    missing (non-finite) one is refused, naming the group and sample."""
    ell = logprob_sum.to(work_dtype(logprob_sum.dtype))
    if length_normalize:
        if token_count is None:
            raise ComputeError(f"{where}: token_count: required when length_normalize is on")
        counts = torch.as_tensor(token_count, device=ell.device).to(ell.dtype)
        if counts.shape != ell.shape:
            raise ComputeError(
                f"{where}: token_count: expected {seg.num_values} values, got {tuple(counts.shape)}"
            )
        ell = ell / counts.clamp(min=1.0)
    bad = ~torch.isfinite(ell)
    if bool(bad.any()):
        i = int(torch.nonzero(bad)[0, 0])
        g, k = seg.locate(i)
        raise ComputeError(
            f"{where}: logprob_sum: missing or non-finite generation log-likelihood "
            f"({float(ell[i])}) at group {g}, sample {k}; SEED-GRPO needs the generation "
            "metadata of every completion"
        )
    return ell


def _cluster_entropy(
    ell: torch.Tensor, cluster: torch.Tensor, cluster_group: torch.Tensor, seg: Segments
) -> torch.Tensor:
    """``H_g = -Σ_c p_c ln p_c`` per group ``[P]``, with the cluster mass
    ``p_c = Σ_{i∈c} e^{ℓ_i} / Σ_{j∈g} e^{ℓ_j}`` (max-subtracted per group)."""
    e = torch.exp(ell - seg.expand(seg.max(ell)))
    z = seg.sum(e)
    mass = torch.zeros(cluster_group.numel(), dtype=ell.dtype, device=ell.device)
    mass.index_add_(0, cluster, e)
    p = mass / z.index_select(0, cluster_group)
    entropy = torch.zeros(len(seg), dtype=ell.dtype, device=ell.device)
    entropy.index_add_(0, cluster_group, -torch.special.xlogy(p, p))
    return entropy
