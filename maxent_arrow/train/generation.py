"""Sampling K completions per prompt with a ``transformers`` causal LM, into a ``GenerationBatch``.

``sample_groups`` runs ``model.generate`` once for all prompts, as its :class:`SamplingOptions`
say (left-padded, ``num_return_sequences = K``), cuts each completion after its first EOS
(inclusive), and keeps what a replayable step needs (``docs/formulas.md`` §4.2): the exact
generated token ids, finish reason, token count, and the behaviour policy's per-token
log-probs under the sampling temperature, as a ``Ragged`` (one row per completion,
prompt-major).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from maxent_arrow.arrow import Ragged
from maxent_arrow.types import GenerationBatch

__all__ = ["Rollouts", "SamplingOptions", "decode_completions", "sample_groups"]


@dataclass
class Rollouts:
    """What one generation call produced.

    ``generation`` holds texts, answers and completion info (with ``token_ids``);
    ``prompt_ids`` the prompt token rows (one per group); ``behavior_token_logp`` the sampling
    policy's log-probs of each generated token (one row per completion, float32).
    """

    generation: GenerationBatch
    prompt_ids: Ragged
    completion_ids: Ragged
    behavior_token_logp: Ragged


@dataclass(frozen=True, kw_only=True)
class SamplingOptions:
    """How :func:`sample_groups` samples.

    Parameters
    ----------
    k:
        Completions per prompt (1 with ``greedy``, for evaluation).
    max_new_tokens:
        The completion cap.
    max_prompt_len:
        Prompts are cut to their first ``max_prompt_len`` tokens (the seed's head truncation).
    temperature, top_p:
        The sampler's; no top-k cut. Ignored with ``greedy``.
    greedy:
        Greedy decoding instead of sampling.
    generator_seed:
        Seeds torch's generator before sampling (a reproducible step); ``None`` leaves it.
    """

    k: int
    max_new_tokens: int
    max_prompt_len: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    greedy: bool = False
    generator_seed: int | None = None


def _eos_cut_lengths(
    ids: torch.Tensor, eos_token_id: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the length up to and including the first EOS (or the full width), and whether
    an EOS was found. Vectorised: the first EOS is the argmax of the EOS indicator."""
    width = ids.shape[1]
    if eos_token_id is None or width == 0:
        return torch.full((ids.shape[0],), width, dtype=torch.int64), torch.zeros(
            ids.shape[0], dtype=torch.bool
        )
    is_eos = ids == eos_token_id
    found = is_eos.any(dim=1)
    first = is_eos.to(torch.int8).argmax(dim=1)
    lengths = torch.where(found, first + 1, torch.full_like(first, width))
    return lengths.to(torch.int64), found


@torch.no_grad()
def sample_groups(
    model: Any,
    tokenizer: Any,
    prompts: list[str],
    answers: list[str],
    *,
    options: SamplingOptions,
) -> Rollouts:
    """Generate ``options.k`` completions for each prompt (:class:`SamplingOptions`).

    Prompts are tokenized without special tokens and cut to their first ``max_prompt_len``
    tokens (the seed's head truncation). ``behavior_token_logp`` is ``log_softmax(logits /
    temperature)`` at each sampled token: the distribution the tokens were drawn from.
    """
    k, greedy, temperature = options.k, options.greedy, options.temperature
    device = next(model.parameters()).device
    prompt_rows = _encode_prompts(tokenizer, prompts, options.max_prompt_len)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    input_ids, mask = prompt_rows.to_padded(pad_id, side="left")
    if options.generator_seed is not None:
        torch.manual_seed(options.generator_seed)
    output = model.generate(
        input_ids=input_ids.to(device),
        attention_mask=mask.to(device=device, dtype=torch.int64),
        do_sample=not greedy,
        temperature=temperature if not greedy else None,
        top_p=options.top_p if not greedy else None,
        top_k=0 if not greedy else None,
        num_return_sequences=k,
        max_new_tokens=options.max_new_tokens,
        min_new_tokens=1,
        pad_token_id=pad_id,
        eos_token_id=tokenizer.eos_token_id,
        return_dict_in_generate=True,
        output_logits=True,
    )
    completion = output.sequences[:, input_ids.shape[1] :].cpu()
    token_logp = _sampled_logp(output.logits, completion, 1.0 if greedy else float(temperature))
    lengths, found_eos = _eos_cut_lengths(completion, tokenizer.eos_token_id)
    keep = torch.arange(completion.shape[1]) < lengths[:, None]
    completion_rows = Ragged.from_lengths(completion[keep].to(torch.int32), lengths)
    behavior = Ragged.from_lengths(token_logp[keep], lengths)
    texts = decode_completions(tokenizer, completion_rows.tolist())
    generation = _generation_batch(
        prompts, answers, texts, completion_rows, found_eos.tolist(), k=k
    )
    return Rollouts(generation, prompt_rows, completion_rows, behavior)


def decode_completions(tokenizer: Any, rows: list[list[int]]) -> list[str]:
    """The texts of token rows without special tokens: ``batch_decode(rows,
    skip_special_tokens=True)``, made fast for slow (Python) tokenizers.

    A slow tokenizer rebuilds ``all_special_ids`` for every row it decodes (it sorts every
    added token for each lookup); with ``ByT5Tokenizer`` and its 125 extra ids that is ~7 ms
    a row, and it was ~85% of a demo training step. Here the special ids are looked up once
    and dropped before decoding, which is exactly what ``skip_special_tokens`` does in
    ``convert_ids_to_tokens``. A fast tokenizer skips them in Rust and keeps its own path.
    """
    if getattr(tokenizer, "is_fast", False):
        return tokenizer.batch_decode(rows, skip_special_tokens=True)
    special = set(tokenizer.all_special_ids)
    kept = [[token for token in row if token not in special] for row in rows]
    return tokenizer.batch_decode(kept, skip_special_tokens=False)


def _encode_prompts(tokenizer: Any, prompts: list[str], max_prompt_len: int) -> Ragged:
    """Prompt token rows, without special tokens, each cut to its first ``max_prompt_len``."""
    encoded = [
        tokenizer(p, add_special_tokens=False)["input_ids"][:max_prompt_len] for p in prompts
    ]
    return Ragged.from_lists(encoded, dtype=torch.int64)


def _sampled_logp(
    logits: tuple[torch.Tensor, ...], completion: torch.Tensor, temperature: float
) -> torch.Tensor:
    """``log_softmax(logits / temperature)`` at each generated token ``[N, T]``, float32: the
    distribution the sampler drew from (``generate`` returns the raw logits per step)."""
    stacked = torch.stack(logits, dim=1).float().cpu()  # [N, T, V]
    logp = torch.log_softmax(stacked / temperature, dim=-1)
    return logp.gather(-1, completion[..., None])[..., 0]


def _generation_batch(
    prompts: list[str],
    answers: list[str],
    texts: list[str],
    completion_rows: Ragged,
    found_eos: list[bool],
    *,
    k: int,
) -> GenerationBatch:
    """The seed's ``GenerationBatch``: texts grouped by prompt, with each completion's info
    (exact token ids, count, finish reason; no EOS within the cap means "length")."""
    ids = completion_rows.tolist()
    grouped_texts, grouped_info = [], []
    for g in range(len(prompts)):
        rows = range(g * k, (g + 1) * k)
        grouped_texts.append([texts[i] for i in rows])
        grouped_info.append(
            [
                {
                    "token_ids": ids[i],
                    "token_count": len(ids[i]),
                    "finish_reason": "stop" if found_eos[i] else "length",
                    "truncated": not found_eos[i],
                }
                for i in rows
            ]
        )
    return GenerationBatch(
        prompts=list(prompts),
        answers=list(answers),
        grouped_completions=grouped_texts,
        grouped_ref_meta=None,
        grouped_completion_info=grouped_info,
    )
