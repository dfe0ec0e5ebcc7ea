"""Model inputs for teacher-forced scoring: ragged ``[prompt | completion]`` sequences, then
padded slices or packed (padding-free) rows, with the ``position_ids`` that make every sample's
score independent of its neighbours.

The original pipeline left-padded prompts to the slice's widest prompt, right-padded
completions, and masked labels on the first ``L_p(i)`` columns only, so in a slice mixing
prompt lengths pad and prompt tokens were scored as completion tokens (``docs/seed-bugs.md``
§5).
Here the sequences stay ragged: :func:`sequence_layout` concatenates each sample's prompt
(head-truncated to ``max_prompt_len``) and completion (its attention mask, EOS-aware) in one
vectorised pass, cuts the ``score_tail_tokens`` window per sample, and marks the tokens to score
(completion tokens that have a left context). :func:`iter_chunks` then cuts the samples into
forwards: padded slices of ``slice_size`` rows (right or left padding; ``position_ids`` count
real tokens only, so absolute position embeddings see the same positions as the sample scored
alone) or packed rows (sequences concatenated, ``position_ids`` restarting at 0, ``cu_seqlens``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import torch

from maxent_arrow.arrow import Ragged
from maxent_arrow.errors import LayoutError

__all__ = ["SequenceLayout", "ModelChunk", "sequence_layout", "iter_chunks", "concat_rows"]


@dataclass(frozen=True)
class SequenceLayout:
    """The token sequences of a score batch, ragged, one row per flat sample.

    Attributes
    ----------
    tokens:
        ``Ragged`` int64 token ids: each row is the window the model sees (prompt then
        completion, cut to the last ``score_tail_tokens`` tokens when that is set).
    scored:
        ``bool [tokens.num_values]``: True on the tokens whose log-prob counts: completion
        tokens (within the attention mask) that are not the first token of their window.
    completion_width:
        Width ``L_c`` of the score batch's completion tensors (width of per-token outputs).
    """

    tokens: Ragged
    scored: torch.Tensor
    completion_width: int

    def __len__(self) -> int:
        return len(self.tokens)

    def scored_counts(self) -> torch.Tensor:
        """Scored tokens per sample, int64 ``[N]``."""
        counts = torch.zeros(len(self), dtype=torch.int64, device=self.scored.device)
        return counts.index_add_(0, self.tokens.row_ids(), self.scored.to(torch.int64))


@dataclass(frozen=True)
class ModelChunk:
    """One forward's inputs, covering the contiguous samples ``[start, stop)``.

    ``slots[j]`` is where flat token ``j`` of those samples sits in ``input_ids.view(-1)``;
    the logits predicting it are at ``slots[j] - 1`` (the previous token of the same sequence,
    for every scored token). ``cu_seqlens`` (int32, packed rows only) bounds each sequence in
    the flattened row, for varlen attention kernels.
    """

    start: int
    stop: int
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    slots: torch.Tensor
    packed: bool
    cu_seqlens: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        """Token positions the forward computes (padding included)."""
        return int(self.input_ids.numel())


def concat_rows(first: Ragged, second: Ragged) -> tuple[Ragged, torch.Tensor]:
    """Row-wise concatenation ``[first_i | second_i]`` in one scatter per input.

    Returns the ragged result and a bool tensor, True on the values that came from ``second``.
    """
    if len(first) != len(second):
        raise LayoutError(
            f"concat_rows: expected equal row counts, got {len(first)} and {len(second)}"
        )
    device = first.values.device
    second = second.to(device)
    la, lb = first.lengths(), second.lengths()
    offsets = _offsets(la + lb)
    total = int(offsets[-1])
    dtype = torch.promote_types(first.values.dtype, second.values.dtype)
    values = torch.empty(total, dtype=dtype, device=device)
    from_second = torch.ones(total, dtype=torch.bool, device=device)
    starts = offsets[:-1]
    dest_a = torch.repeat_interleave(starts, la, output_size=first.num_values) + first.positions()
    dest_b = torch.repeat_interleave(starts + la, lb, output_size=second.num_values)
    dest_b = dest_b + second.positions()
    values[dest_a] = first.values.to(dtype)
    values[dest_b] = second.values.to(dtype)
    from_second[dest_a] = False
    return Ragged(values, offsets, validate=False), from_second


def _offsets(lengths: torch.Tensor) -> torch.Tensor:
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths, 0, out=offsets[1:])
    return offsets


def _completion_ragged(ids: torch.Tensor, mask: torch.Tensor) -> Ragged:
    """Completion rows from right-padded ``ids`` and a ones-then-zeros ``mask``."""
    valid = mask != 0
    lengths = valid.sum(dim=1)
    width = valid.shape[1]
    prefix = torch.arange(width, device=valid.device) < lengths[:, None]
    bad = (prefix != valid).any(dim=1)
    if bool(bad.any()):
        row = int(torch.nonzero(bad)[0, 0])
        raise LayoutError(
            f"ScoreBatch.completion_attention_mask: sample {row} is not ones then zeros "
            "(completions are right-padded; a 0 before a 1 has no scoring meaning)"
        )
    return Ragged.from_lengths(ids[valid].to(torch.int64), lengths)


def _prompt_ragged(score_batch, device: torch.device) -> Ragged:
    limit = max(1, int(score_batch.max_prompt_len))  # the seed clamps to >= 1
    ids = score_batch.ragged("prompt_ids")
    masks = score_batch.ragged("prompt_attention_mask")
    keep = ids.positions() < limit  # head truncation: the first max_prompt_len tokens
    if masks.num_values == ids.num_values:
        keep &= masks.values != 0  # tokens the prompt's own mask drops do not exist
    lengths = torch.zeros(len(ids), dtype=torch.int64).index_add_(
        0, ids.row_ids(), keep.to(torch.int64)
    )
    return Ragged.from_lengths(ids.values[keep].to(torch.int64), lengths).to(device)


def sequence_layout(score_batch, *, device: torch.device | str | None = None) -> SequenceLayout:
    """The ragged ``[prompt | completion]`` sequences of ``score_batch`` and what to score.

    Parameters
    ----------
    score_batch:
        A :class:`~maxent_arrow.ScoreBatch`. Its completion mask must be ones then zeros per
        row (as :func:`maxent_arrow.ingest.build_score_batch` makes it, EOS-aware).
    device:
        Where the layout lives (default: the completion tensors' device).
    """
    ids, mask = score_batch.completion_ids, score_batch.completion_attention_mask
    device = torch.device(device) if device is not None else ids.device
    completions = _completion_ragged(ids.to(device), mask.to(device))
    prompts = _prompt_ragged(score_batch, device)
    tokens, is_completion = concat_rows(prompts, completions)
    positions = tokens.positions()
    tail = score_batch.score_tail_tokens
    if tail:
        # The window is cut per sample from its own tokens, so it cannot depend on the
        # slice (the seed cut the last T columns of the padded slice).
        lengths = tokens.lengths()
        start = torch.repeat_interleave(
            (lengths - tail).clamp(min=0), lengths, output_size=tokens.num_values
        )
        keep = positions >= start
        tokens = Ragged(tokens.values[keep], _offsets(lengths.clamp(max=tail)), validate=False)
        is_completion = is_completion[keep]
        positions = tokens.positions()
    scored = is_completion & (positions > 0)
    return SequenceLayout(tokens, scored, int(ids.shape[1]))


def _padded_chunk(
    layout: SequenceLayout, start: int, stop: int, pad_token_id: int, side: Literal["right", "left"]
) -> ModelChunk:
    rows = layout.tokens[start:stop]
    device = rows.values.device
    lengths = rows.lengths()
    width = int(lengths.max()) if len(rows) else 0
    width = max(width, 1)
    input_ids, mask = rows.to_padded(pad_token_id, max_len=width, dtype=torch.int64, side=side)
    columns = torch.arange(width, device=device)
    row_ids = rows.row_ids()
    pos = rows.positions()
    if side == "right":
        # Causal attention never looks right, so right padding needs no attention mask and the
        # default-style positions 0..width-1 are the real positions of every real token.
        position_ids = columns.expand(len(rows), width).contiguous()
        slots = row_ids * width + pos
        attention_mask = None
    else:
        lead = width - lengths
        position_ids = (columns[None, :] - lead[:, None]).clamp(min=0)
        slots = row_ids * width + lead[row_ids] + pos
        attention_mask = mask.to(torch.int64)
    return ModelChunk(start, stop, input_ids, position_ids, attention_mask, slots, False)


def _packed_chunk(layout: SequenceLayout, start: int, stop: int) -> ModelChunk:
    rows = layout.tokens[start:stop]
    device = rows.values.device
    positions = rows.positions()
    slots = torch.arange(rows.num_values, device=device)
    return ModelChunk(
        start,
        stop,
        rows.values[None, :],
        positions[None, :],
        None,
        slots,
        True,
        rows.offsets.to(torch.int32),
    )


def _pack_bounds(lengths: torch.Tensor, budget: int) -> list[int]:
    """Sample boundaries of packed rows: a sample joins the row in which it starts.

    Vectorised (no greedy loop): row = start offset // budget, so a row holds at most
    ``budget`` tokens plus the one sequence that crosses its end.
    """
    starts = torch.cumsum(lengths, 0) - lengths
    bucket = (starts // max(budget, 1)).cpu()
    if bucket.numel() == 0:
        return [0]
    change = torch.nonzero(bucket[1:] != bucket[:-1]).flatten() + 1
    return [0, *change.tolist(), int(lengths.numel())]


def iter_chunks(
    layout: SequenceLayout,
    *,
    slice_size: int,
    pad_token_id: int,
    mode: Literal["padded", "packed"] = "padded",
    padding_side: Literal["right", "left"] = "right",
    pack_tokens: int | None = None,
) -> Iterator[ModelChunk]:
    """Cut the layout into forwards.

    Parameters
    ----------
    slice_size:
        Samples per padded forward (``ScoreBatch.slice_size``).
    mode:
        ``"padded"``: ``slice_size`` samples per forward, padded to the slice's longest window.
        ``"packed"``: samples concatenated into one row of about ``pack_tokens`` tokens with
        ``position_ids`` restarting at 0 per sequence; no padding is computed. The model must
        turn restarting positions into a block-diagonal causal mask or varlen attention
        (``transformers`` models built on ``masking_utils.create_causal_mask`` do).
    pack_tokens:
        Token budget of a packed row (default: ``slice_size`` times the longest window, the
        tokens of a padded slice).
    """
    n = len(layout)
    if n == 0:
        return
    slice_size = max(1, int(slice_size))
    if mode == "padded":
        if padding_side not in ("right", "left"):
            raise LayoutError(f"padding_side: expected 'right' or 'left', got {padding_side!r}")
        for start in range(0, n, slice_size):
            yield _padded_chunk(
                layout, start, min(start + slice_size, n), pad_token_id, padding_side
            )
        return
    if mode != "packed":
        raise LayoutError(f"mode: expected 'padded' or 'packed', got {mode!r}")
    lengths = layout.tokens.lengths()
    if pack_tokens is None:
        pack_tokens = slice_size * int(lengths.max())
    bounds = _pack_bounds(lengths, int(pack_tokens))
    for start, stop in zip(bounds[:-1], bounds[1:]):
        yield _packed_chunk(layout, start, stop)
