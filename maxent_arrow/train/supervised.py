"""A supervised warm start: teacher-forced NLL of demonstration completions.

Every RL recipe starts from a model that already answers in the task's format, most often one
fine-tuned on demonstrations (SFT). :func:`supervised_warm_start` is that pass for a
``transformers`` causal LM: the loss is the mean negative log-likelihood of the completion
tokens (and the EOS that ends them) given the prompt, with the prompt tokens encoded exactly
as :func:`~maxent_arrow.train.generation.sample_groups` encodes them, so the model learns to
continue the very token rows it is later sampled from.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from maxent_arrow.arrow import Ragged
from maxent_arrow.errors import ComputeError

__all__ = ["WarmStartOptions", "supervised_warm_start"]


@dataclass(frozen=True, kw_only=True)
class WarmStartOptions:
    """How :func:`supervised_warm_start` trains.

    Parameters
    ----------
    steps:
        Optimizer steps (0: no update, an empty list).
    batch_size:
        Demonstrations per step.
    learning_rate:
        AdamW's, decayed linearly to 0 over ``steps``.
    max_prompt_len:
        Prompts are cut to their first ``max_prompt_len`` tokens, as generation cuts them.
    seed:
        Seeds the shuffle; with the model's own seeded weights the pass is reproducible.
    """

    steps: int
    batch_size: int = 64
    learning_rate: float = 3e-3
    max_prompt_len: int = 32
    seed: int = 0

    def __post_init__(self) -> None:
        if self.steps < 0 or self.batch_size < 1:
            raise ComputeError(
                f"WarmStartOptions: expected steps >= 0 and batch_size >= 1, got {self.steps} "
                f"and {self.batch_size}"
            )


def _encode(
    tokenizer: Any, prompts: Sequence[str], completions: Sequence[str], max_prompt_len: int
) -> tuple[Ragged, Ragged]:
    """Per example, ``[prompt | completion | EOS]`` token ids and a 0/1 row marking the
    completion tokens and the EOS (the positions the loss predicts)."""
    eos = tokenizer.eos_token_id
    ids, targets = [], []
    for prompt, completion in zip(prompts, completions, strict=True):
        head = tokenizer(prompt, add_special_tokens=False)["input_ids"][:max_prompt_len]
        tail = tokenizer(completion, add_special_tokens=False)["input_ids"]
        if eos is not None:
            tail = [*tail, eos]
        ids.append(head + tail)
        targets.append([0] * len(head) + [1] * len(tail))
    return Ragged.from_lists(ids, dtype=torch.int64), Ragged.from_lists(targets, dtype=torch.bool)


def supervised_warm_start(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[str],
    completions: Sequence[str],
    *,
    options: WarmStartOptions,
    on_step: Callable[[int, float], None] | None = None,
) -> list[float]:
    """Fine-tune ``model`` in place on ``(prompt, completion)`` pairs; the loss of each step.

    Batches are drawn without replacement from a seeded shuffle of the pairs (reshuffled each
    epoch), right-padded, and scored in one forward; the loss is the mean NLL over the
    completion tokens and their EOS (the prompt is context, never a target). AdamW with a
    linear decay of the learning rate to 0 over ``options.steps``, so the last updates are
    small and the model handed to RL is not mid-jump. The model is left in eval mode.

    Parameters
    ----------
    model, tokenizer:
        A ``transformers`` causal LM and its tokenizer (``eos_token_id`` ends every
        completion, ``pad_token_id`` pads).
    prompts, completions:
        The demonstrations, as texts; the completion follows the prompt directly (include a
        leading space if the task wants one).
    options:
        Steps, batch size, learning rate, prompt cut and seed (:class:`WarmStartOptions`).
    on_step:
        ``on_step(step, loss)`` after each update (a progress bar).
    """
    if len(prompts) != len(completions):
        raise ComputeError(
            f"supervised_warm_start: {len(prompts)} prompts but {len(completions)} completions"
        )
    steps, batch_size = options.steps, options.batch_size
    if steps and not prompts:
        raise ComputeError("supervised_warm_start: no demonstrations to learn from")
    ids, targets = _encode(tokenizer, prompts, completions, options.max_prompt_len)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    device = next(model.parameters()).device
    optimizer = torch.optim.AdamW(model.parameters(), lr=options.learning_rate)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 - s / max(steps, 1))
    rng = random.Random(options.seed)
    order: list[int] = []
    losses: list[float] = []
    model.train()
    for step in range(steps):
        if len(order) < batch_size:
            fresh = list(range(len(ids)))
            rng.shuffle(fresh)
            order += fresh
        chosen, order = order[:batch_size], order[batch_size:]
        index = torch.tensor(chosen)
        loss = _batch_loss(model, ids, targets, index, pad, device)
        loss.backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if on_step is not None:
            on_step(step, losses[-1])
    model.eval()
    return losses


def _batch_loss(
    model: Any,
    ids: Ragged,
    targets: Ragged,
    index: torch.Tensor,
    pad: int,
    device: torch.device,
) -> torch.Tensor:
    """Mean NLL of the target tokens of the examples ``index``: the logits at position t
    predict the token at t + 1, so a target at t is scored from position t - 1."""
    rows = _take(ids, index)
    tokens, mask = rows.to_padded(pad, dtype=torch.int64)
    wanted, _ = _take(targets, index).to_padded(False)
    tokens, mask, wanted = tokens.to(device), mask.to(device), wanted.to(device)
    # Right padding: positions 0..L-1 are the real positions, the mask hides the pad tail.
    logits = model(input_ids=tokens, attention_mask=mask.to(torch.int64)).logits
    predicted = logits[:, :-1][wanted[:, 1:]].float()
    return torch.nn.functional.cross_entropy(predicted, tokens[:, 1:][wanted[:, 1:]])


def _take(rows: Ragged, index: torch.Tensor) -> Ragged:
    """The rows ``index`` of ``rows``, in that order, as a new ``Ragged``."""
    lengths = rows.lengths()[index]
    starts = rows.offsets[:-1][index]
    within = torch.arange(int(lengths.sum())) - torch.repeat_interleave(
        torch.cumsum(lengths, 0) - lengths, lengths
    )
    gather = torch.repeat_interleave(starts, lengths) + within
    return Ragged.from_lengths(rows.values[gather], lengths)
