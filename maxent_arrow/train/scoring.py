"""Teacher-forced scoring of a :class:`~maxent_arrow.ScoreBatch` with a ``transformers`` causal
LM: :func:`reference_logprobs` (no grad) and :func:`sequence_scores` (with grad).

What differs from the original pipeline (``docs/formulas.md`` §3.7-3.8, ``docs/seed-bugs.md``
§4-7):

- every sample is scored exactly as it would be alone: sequences are assembled ragged
  (:mod:`maxent_arrow.ingest.packing`), padded slices carry real ``position_ids`` (GPT-2's absolute
  position embeddings included), and only completion tokens are scored, whatever the prompt
  lengths sharing a slice (the seed scored pad/prompt tokens there, seed-bugs §5);
- packed, padding-free forwards when the model supports them (``packing="auto"``);
- the logits never exist for a whole batch: the base model returns hidden states, and the
  output head, log-softmax and entropy run on chunks of ``token_chunk`` predicted positions
  (recomputed in backward under gradient checkpointing, so memory stays one chunk wide);
- per-token values are float32 and per-sequence sums accumulate in float64 (seed-bugs §6);
- one ``temperature`` (of :class:`ScoringOptions`) divides the logits the same way for policy
  and reference (the seed divided only the reference's, seed-bugs §7);
- per-token outputs are left-aligned on the scored completion tokens, and stored behaviour
  per-token log-probs are aligned the same way (the seed right-aligned them, seed-bugs §4).
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import pyarrow as pa
import torch
from torch.utils.checkpoint import checkpoint

from maxent_arrow.arrow import Ragged, arrow_to_torch
from maxent_arrow.errors import ComputeError, LayoutError, SchemaError
from maxent_arrow.ingest import ModelChunk, SequenceLayout, iter_chunks, sequence_layout
from maxent_arrow.types import ReferenceLogprobs, ScoreBatch, SequenceScores

__all__ = [
    "ScoringOptions",
    "TokenScores",
    "score_tokens",
    "reference_logprobs",
    "sequence_scores",
    "supports_packing",
]

Packing = Literal["auto", "packed", "padded"]

# Attention implementations whose transformers mask/varlen code turns position_ids that restart
# at 0 into per-sequence attention (masking_utils.find_packed_sequence_indices, flash varlen).
_PACKABLE_ATTENTION = ("sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3")


@dataclass(frozen=True, kw_only=True)
class ScoringOptions:
    """How a scoring pass runs its forwards: the same for the policy and the reference
    (:func:`score_tokens`, :func:`reference_logprobs`, :func:`sequence_scores`).

    Parameters
    ----------
    temperature:
        Logits are divided by it before the softmax (the generation temperature, to score
        what the sampler sampled); the same for policy and reference.
    packing:
        ``"auto"`` packs when :func:`supports_packing` says the model can, ``"packed"``
        insists (``ComputeError`` otherwise), ``"padded"`` never packs.
    pack_tokens:
        Token budget of a packed forward (default: ``slice_size`` x the longest sequence).
    padding_side:
        Padding of padded slices; both give the same scores (positions count real tokens).
    token_chunk:
        Predicted positions per output-head chunk: the logits held at once are at most
        ``token_chunk x V``.
    """

    temperature: float = 1.0
    packing: Packing | bool = "auto"
    pack_tokens: int | None = None
    padding_side: Literal["right", "left"] = "right"
    token_chunk: int = 1024

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ComputeError(f"temperature: expected > 0, got {self.temperature}")
        if self.token_chunk < 1:
            raise ComputeError(f"token_chunk: expected >= 1, got {self.token_chunk}")


_DEFAULT = ScoringOptions()


@dataclass
class TokenScores:
    """Per-sample results of one scoring pass.

    Attributes
    ----------
    logp_sum:
        ``[N]`` float32, sum of the scored tokens' log-probs (accumulated in float64).
    counts:
        ``[N]`` int64, scored tokens per sample (not clamped).
    token_logp:
        ``Ragged`` float32 of the scored tokens' log-probs, one row per sample, in order.
    entropy_sum:
        ``[N]`` float32, sum over scored positions of the predictive entropy, or ``None``.
    packed:
        Whether the forwards were packed (padding-free).
    """

    logp_sum: torch.Tensor
    counts: torch.Tensor
    token_logp: Ragged
    entropy_sum: torch.Tensor | None
    packed: bool

    def token_matrix(self, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(values [N, width] float32, mask [N, width] int64)``, left-aligned, 0-padded."""
        values, mask = self.token_logp.to_padded(0.0, max_len=width, dtype=torch.float32)
        return values, mask.to(torch.int64)


def supports_packing(model: Any) -> bool:
    """Whether ``model`` scores packed rows (positions restarting at 0) as separate sequences.

    True for ``transformers`` models whose modelling code builds its causal mask with
    ``masking_utils.create_causal_mask`` (which detects packed ``position_ids`` and makes the
    mask block-diagonal, or uses varlen flash attention) under an attention implementation
    that honours it. Anything else is scored padded.
    """
    base = getattr(model, "base_model", model)
    config = getattr(model, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    if impl not in _PACKABLE_ATTENTION:
        return False
    module = sys.modules.get(type(base).__module__)
    if module is None or getattr(module, "create_causal_mask", None) is None:
        return False
    try:
        params = inspect.signature(base.forward).parameters
    except (TypeError, ValueError):
        return False
    return "position_ids" in params


def _model_device(model: Any) -> torch.device:
    try:
        return next(model.parameters()).device
    except (StopIteration, AttributeError):
        return torch.device("cpu")


def _logit_transform(config: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """The final-logit post-processing some architectures apply after the output head."""
    scale = getattr(config, "logit_scale", None)  # Cohere multiplies
    divide = getattr(config, "logits_scaling", None)  # Granite divides
    cap = getattr(config, "final_logit_softcapping", None)  # Gemma 2/3 soft-caps

    def apply(logits: torch.Tensor) -> torch.Tensor:
        if isinstance(scale, int | float) and scale != 1:
            logits = logits * scale
        if isinstance(divide, int | float) and divide != 1:
            logits = logits / divide
        if isinstance(cap, int | float) and cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    return apply


def _token_stats(
    head: torch.nn.Module,
    transform: Callable,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    with_entropy: bool,
) -> torch.Tensor:
    """log p(target) (and entropy) of one chunk of positions, in float32: ``[m]`` or ``[m, 2]``."""
    logits = transform(head(hidden)).float()
    if temperature != 1.0:
        logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, targets[:, None]).squeeze(-1) - lse
    if not with_entropy:
        return logp
    probs = torch.softmax(logits, dim=-1)
    entropy = lse - (probs * logits).sum(-1)
    return torch.stack([logp, entropy], dim=-1)


def _resolve_packing(model: Any, packing: Packing | bool) -> bool:
    if packing is True or packing == "packed":
        if not supports_packing(model):
            raise ComputeError(
                f"packing='packed': {type(model).__name__} with attention "
                f"{getattr(getattr(model, 'config', None), '_attn_implementation', None)!r} "
                "cannot score packed rows; use packing='auto' or 'padded'"
            )
        return True
    if packing is False or packing == "padded":
        return False
    if packing == "auto":
        return supports_packing(model)
    raise ComputeError(f"packing: expected 'auto', 'packed' or 'padded', got {packing!r}")


def score_tokens(
    model: Any,
    score_batch: ScoreBatch,
    *,
    options: ScoringOptions = _DEFAULT,
    return_entropy: bool = False,
    layout: SequenceLayout | None = None,
) -> TokenScores:
    """Log-probs of every scored completion token of ``score_batch`` under ``model``.

    Gradients flow when grad mode is on. The model's train/eval mode is left as it is (dropout
    makes scores random in train mode).

    Parameters
    ----------
    options:
        How the forwards run (:class:`ScoringOptions`: temperature, packing, padding, the
        output head's chunk).
    return_entropy:
        Also sum the predictive entropy over each sample's scored positions.
    layout:
        A precomputed :func:`~maxent_arrow.ingest.sequence_layout` (to share between the
        policy and reference passes).
    """
    device = _model_device(model)
    if layout is None:
        layout = sequence_layout(score_batch, device=device)
    packed = _resolve_packing(model, options.packing)
    scorer = _ChunkScorer.of(model, options.temperature, return_entropy, options.token_chunk)
    targets_all = layout.tokens.values
    scored_all = layout.scored
    offsets = layout.tokens.offsets.tolist()
    pieces: list[torch.Tensor] = []
    chunks = iter_chunks(
        layout,
        slice_size=score_batch.slice_size,
        pad_token_id=score_batch.pad_token_id,
        mode="packed" if packed else "padded",
        padding_side=options.padding_side,
        pack_tokens=options.pack_tokens,
    )
    for chunk in chunks:
        lo, hi = offsets[chunk.start], offsets[chunk.stop]
        scored = scored_all[lo:hi]
        if not bool(scored.any()):
            continue
        targets = targets_all[lo:hi][scored]
        source = chunk.slots[scored] - 1  # the logits at t score the token at t + 1
        pieces.extend(scorer.score(chunk, source, targets))
    return _assemble(layout, pieces, return_entropy, packed, device)


@dataclass(frozen=True)
class _ChunkScorer:
    """One forward per chunk, then the per-token statistics of its scored positions, computed
    ``token_chunk`` positions at a time (:func:`_token_stats`)."""

    model: Any
    base: Any  # the base model returning hidden states, or None: no separable output head
    head: Any
    transform: Callable[[torch.Tensor], torch.Tensor]
    temperature: float
    with_entropy: bool
    token_chunk: int

    @classmethod
    def of(
        cls, model: Any, temperature: float, with_entropy: bool, token_chunk: int
    ) -> _ChunkScorer:
        base = getattr(model, "base_model", None)
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        separable = base is not None and base is not model and head is not None
        return cls(
            model,
            base if separable else None,
            head if separable else None,
            _logit_transform(getattr(model, "config", None)),
            temperature,
            with_entropy,
            token_chunk,
        )

    def score(
        self, chunk: ModelChunk, source: torch.Tensor, targets: torch.Tensor
    ) -> list[torch.Tensor]:
        """Statistics of the positions ``source`` (predicting ``targets``) of ``chunk``."""
        kwargs = {"position_ids": chunk.position_ids, "use_cache": False}
        if chunk.attention_mask is not None:
            kwargs["attention_mask"] = chunk.attention_mask
        if self.base is not None:
            return self._from_hidden(chunk, kwargs, source, targets)
        return self._from_logits(chunk, kwargs, source, targets)

    def _from_hidden(
        self,
        chunk: ModelChunk,
        kwargs: dict[str, Any],
        source: torch.Tensor,
        targets: torch.Tensor,
    ) -> list[torch.Tensor]:
        hidden = self.base(input_ids=chunk.input_ids, **kwargs)[0]
        hidden = hidden.reshape(-1, hidden.shape[-1])[source]
        grad = torch.is_grad_enabled()
        pieces = []
        for a in range(0, hidden.shape[0], self.token_chunk):
            b = a + self.token_chunk
            args = (self.head, self.transform, hidden[a:b], targets[a:b])
            if grad:
                # Recompute this chunk's logits in backward instead of keeping them.
                out = checkpoint(
                    _token_stats, *args, self.temperature, self.with_entropy, use_reentrant=False
                )
            else:
                out = _token_stats(*args, self.temperature, self.with_entropy)
            pieces.append(out)
        return pieces

    def _from_logits(
        self,
        chunk: ModelChunk,
        kwargs: dict[str, Any],
        source: torch.Tensor,
        targets: torch.Tensor,
    ) -> list[torch.Tensor]:
        # No separable output head: the slice's logits are materialised (one slice only).
        logits = self.model(input_ids=chunk.input_ids, **kwargs).logits
        logits = logits.reshape(-1, logits.shape[-1])[source]
        identity = _Identity()
        return [
            _token_stats(
                identity,
                lambda x: x,
                logits[a : a + self.token_chunk],
                targets[a : a + self.token_chunk],
                self.temperature,
                self.with_entropy,
            )
            for a in range(0, logits.shape[0], self.token_chunk)
        ]


class _Identity(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def _assemble(
    layout: SequenceLayout,
    pieces: list[torch.Tensor],
    with_entropy: bool,
    packed: bool,
    device: torch.device,
) -> TokenScores:
    n = len(layout)
    counts = layout.scored_counts().to(device)
    if pieces:
        stats = torch.cat(pieces, dim=0)
    else:
        stats = torch.zeros((0, 2) if with_entropy else (0,), device=device)
    logp = stats[:, 0] if with_entropy else stats
    sample = layout.tokens.row_ids()[layout.scored].to(device)
    sums = torch.zeros(n, dtype=torch.float64, device=device).index_add(0, sample, logp.double())
    entropy = None
    if with_entropy:
        ent = stats[:, 1].detach().double()
        entropy = torch.zeros(n, dtype=torch.float64, device=device).index_add(0, sample, ent)
        entropy = entropy.float()
    token_logp = Ragged.from_lengths(logp, counts)
    return TokenScores(sums.float(), counts, token_logp, entropy, packed)


# ---------------------------------------------------------------------------- seed records
def reference_logprobs(
    model: Any,
    score_batch: ScoreBatch,
    *,
    options: ScoringOptions = _DEFAULT,
    return_token_logp: bool = False,
) -> ReferenceLogprobs:
    """Frozen-reference log-probs, with the seed's field meanings (``docs/formulas.md`` §2.10,
    §3.7).

    ``ref_logp_sum_raw`` is the sum R_i over scored completion tokens; ``ref_tok_counts`` the
    count T_i clamped to >= 1 (float32); ``ref_logp_sum`` is **a per-token mean** R_i / T_i
    despite its name (kept for compatibility); ``ref_logp_mean`` the mean of the raw sums;
    ``avg_completion_tokens`` the mean of T_i. With ``return_token_logp``, ``ref_token_logp``
    ``[N, L_c]`` float32 and ``ref_token_mask`` int64 hold the per-token values, left-aligned
    on the scored tokens. Runs under ``torch.no_grad``; tensors stay on the model's device.
    ``options``: how the forwards run (:class:`ScoringOptions`), as for the policy's scores.
    """
    with torch.no_grad():
        scores = score_tokens(model, score_batch, options=options)
    return reference_from_scores(
        scores, width=score_batch.completion_ids.shape[1] if return_token_logp else None
    )


def reference_from_scores(scores: TokenScores, *, width: int | None = None) -> ReferenceLogprobs:
    """``ReferenceLogprobs`` from a scoring pass (``width``: also the per-token matrix)."""
    raw = scores.logp_sum.detach()
    counts = scores.counts.clamp(min=1).to(torch.float32)
    token_logp = token_mask = None
    if width is not None:
        token_logp, token_mask = scores.token_matrix(int(width))
        token_logp = token_logp.detach()
    n = raw.shape[0]
    return ReferenceLogprobs(
        ref_logp_sum=raw / counts,
        ref_tok_counts=counts,
        ref_logp_sum_raw=raw,
        ref_logp_mean=float(raw.double().mean()) if n else 0.0,
        avg_completion_tokens=float(counts.double().mean()) if n else 0.0,
        ref_token_logp=token_logp,
        ref_token_mask=token_mask,
    )


def sequence_scores(
    model: Any,
    score_batch: ScoreBatch,
    reference: ReferenceLogprobs,
    *,
    behavior_logp_sum: Any = None,
    behavior_token_logp: Any = None,
    return_token_logp: bool = False,
    return_entropy: bool = False,
    options: ScoringOptions = _DEFAULT,
) -> SequenceScores:
    """Policy scores with gradients, combined with ``reference`` as the seed does
    (``docs/formulas.md`` §3.8).

    Parameters
    ----------
    reference:
        The reference log-probs of the same samples: ``log_ratio_train`` = S - R_raw and
        ``denom_tok_tensor`` = its token counts clamped to >= 1.
    behavior_logp_sum:
        Stored behaviour (rollout) log-prob sums, ``[N]`` (tensor, list, Arrow ``double``
        array or the group table's ``list<double>`` column). NaN entries fall back to the
        detached policy sum; without it ``behavior_logp_sum`` is ``cur_logp_sum.detach()``.
    behavior_token_logp:
        Stored behaviour per-token log-probs, one row per sample covering the whole
        completion (``Ragged``, or the group table's ``list<list<float>>`` column). They are
        aligned on the scored tokens like ``token_logp`` and returned as ``old_token_logp``.
    return_token_logp:
        Also return ``token_logp`` / ``token_mask`` ``[N, L_c]`` (left-aligned, 0-padded)
        and ``old_token_logp``.
    return_entropy:
        Also return ``policy_entropy_sum`` (exact entropy summed over scored positions,
        detached).
    options:
        How the forwards run (:class:`ScoringOptions`): the same as the reference's, so the
        log-ratio compares like with like.
    """
    n = score_batch.total_sequences
    ref_n = reference.ref_logp_sum_raw.shape[0]
    if ref_n != n:
        raise LayoutError(f"sequence_scores: reference has {ref_n} samples, expected {n}")
    need_tokens = return_token_logp or behavior_token_logp is not None
    scores = score_tokens(model, score_batch, options=options, return_entropy=return_entropy)
    device = scores.logp_sum.device
    cur = scores.logp_sum
    behavior = _behavior_sums(behavior_logp_sum, cur.detach(), n)
    ref_raw = reference.ref_logp_sum_raw.to(device=device, dtype=torch.float32)
    denom = reference.ref_tok_counts.to(device=device, dtype=torch.float32).clamp(min=1)
    token_logp = token_mask = old = None
    if need_tokens:
        token_logp, token_mask, old = _token_outputs(scores, score_batch, behavior_token_logp)
        if not return_token_logp:
            # old_token_logp keeps its mask: without it the per-token rows have no lengths.
            token_logp = None
    return SequenceScores(
        cur_logp_sum=cur,
        behavior_logp_sum=behavior,
        log_ratio_train=cur - ref_raw,
        denom_tok_tensor=denom,
        policy_entropy_sum=scores.entropy_sum,
        token_logp=token_logp,
        token_mask=token_mask,
        old_token_logp=old,
    )


def _behavior_sums(stored: Any, detached: torch.Tensor, n: int) -> torch.Tensor:
    """Stored behaviour sums, NaN entries (and no stored sums at all) replaced by the detached
    policy sums: a missing behaviour value means "the policy that is being scored"."""
    if stored is None:
        return detached
    values = _flat_vector("behavior_logp_sum", stored, n).to(detached.device)
    return torch.where(torch.isnan(values), detached, values)


def _token_outputs(
    scores: TokenScores, score_batch: ScoreBatch, behavior_token_logp: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(token_logp, token_mask, old_token_logp)`` ``[N, L_c]``, left-aligned on the scored
    tokens; ``old_token_logp`` is the stored behaviour rows aligned the same way, or the
    detached policy values."""
    width = int(score_batch.completion_ids.shape[1])
    token_logp, token_mask = scores.token_matrix(width)
    if behavior_token_logp is None:
        return token_logp, token_mask, token_logp.detach()
    device = scores.logp_sum.device
    old = _aligned_behavior(behavior_token_logp, score_batch, scores, width, device)
    return token_logp, token_mask, old


def _flat_vector(field: str, value: Any, n: int) -> torch.Tensor:
    if isinstance(value, pa.ChunkedArray):
        value = value.combine_chunks()
    if isinstance(value, pa.Array):
        if pa.types.is_list(value.type) or pa.types.is_large_list(value.type):
            value = value.flatten()
        value = arrow_to_torch(value.fill_null(float("nan")), field=field)
    tensor = torch.as_tensor(value).detach().to(torch.float32).reshape(-1)
    if tensor.shape[0] != n:
        raise LayoutError(f"{field}: expected {n} values (one per sample), got {tensor.shape[0]}")
    return tensor


def _behavior_ragged(value: Any) -> Ragged:
    if isinstance(value, Ragged):
        return value
    if isinstance(value, pa.ChunkedArray):
        value = value.combine_chunks()
    if isinstance(value, pa.Array):
        inner = value.type.value_type if pa.types.is_list(value.type) else None
        if inner is not None and (pa.types.is_list(inner) or pa.types.is_large_list(inner)):
            value = value.flatten()  # per group -> per sample
        return Ragged.from_arrow(value)
    raise SchemaError(
        "behavior_token_logp: expected a Ragged or an Arrow list column, got "
        f"{type(value).__name__}"
    )


def _aligned_behavior(
    value: Any, score_batch: ScoreBatch, scores: TokenScores, width: int, device: torch.device
) -> torch.Tensor:
    """Behaviour per-token log-probs cut to the scored tokens and left-aligned like ours."""
    behavior = _behavior_ragged(value).to(device)
    n = score_batch.total_sequences
    if len(behavior) != n:
        raise LayoutError(
            f"behavior_token_logp: expected {n} rows (one per sample), got {len(behavior)}"
        )
    completion = (score_batch.completion_attention_mask != 0).sum(dim=1).to(device)
    lengths = behavior.lengths()
    bad = lengths != completion
    if bool(bad.any()):
        i = int(torch.nonzero(bad)[0, 0])
        raise LayoutError(
            f"behavior_token_logp: sample {i} has {int(lengths[i])} values, expected "
            f"{int(completion[i])} (its completion tokens)"
        )
    # Scored tokens are the last counts[i] completion tokens of each sample.
    skip = completion - scores.counts.to(device)
    keep = behavior.positions() >= torch.repeat_interleave(
        skip, lengths, output_size=behavior.num_values
    )
    kept = Ragged.from_lengths(behavior.values[keep].to(torch.float32), scores.counts.to(device))
    values, _ = kept.to_padded(0.0, max_len=width, dtype=torch.float32)
    return values
