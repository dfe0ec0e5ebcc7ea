"""Training tensors from a batch of Arrow group rows: the collate step of a data loader.

:class:`GroupCollator` turns a ``pyarrow`` Table (or RecordBatch) of group rows, as Ray Data's
``iter_torch_batches`` hands it over, into a dict of tensors in one vectorised pass: the
padded or packed ``[prompt | completion]`` model inputs (the same code as local ingestion,
:func:`~maxent_arrow.ingest.build_score_batch` then :mod:`maxent_arrow.ingest.packing`), the
completion ids and mask, the group offsets, and the per-completion and per-token columns
(zero-copy views of the Arrow buffers where the batch is one chunk).

Ray's default collate refuses ragged columns ("Numpy array of object dtype cannot be converted
to a Torch Tensor", ``ray/air/_internal/torch_utils.py``); the usual user-written workaround
converts each row to
Python lists and calls ``pad_sequence``, a Python loop over samples that this replaces.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import pyarrow as pa
import torch

from maxent_arrow.arrow import Ragged, arrow_to_torch, list_offsets
from maxent_arrow.arrow import registry as R
from maxent_arrow.arrow.ragged import prefix_mask
from maxent_arrow.errors import LayoutError, SchemaError
from maxent_arrow.ingest.score_batch import build_score_batch

__all__ = ["GroupCollator", "SAMPLE_COLUMNS", "TOKEN_COLUMNS"]

# Collated by default: the MaxEnt-GRPO layout's per-completion numbers (list<T>) and its
# per-token floats (list<list<float>>; token ids go into the score batch).
SAMPLE_COLUMNS = R.numbers(level="completion", families=(R.CORE, R.MAXENT))
TOKEN_COLUMNS = tuple(
    n for n in R.numbers(level="token", families=(R.CORE, R.MAXENT)) if n != "completion_ids"
)
_NO_LIMIT = 2**31 - 1


def _as_batch(batch: pa.Table | pa.RecordBatch) -> pa.RecordBatch:
    if isinstance(batch, pa.RecordBatch):
        return batch
    if not isinstance(batch, pa.Table):
        raise SchemaError(
            f"GroupCollator: expected a pyarrow Table or RecordBatch of group rows, got "
            f"{type(batch).__name__}"
        )
    # One chunk per column, so every tensor below is a view of one contiguous buffer.
    batches = batch.combine_chunks().to_batches()
    if not batches:
        return pa.RecordBatch.from_pylist([], schema=batch.schema)
    return batches[0]


def _present(batch: pa.RecordBatch, name: str) -> pa.Array | None:
    """The column, or None when absent or null in every row (a file written before it
    existed); null in some rows only is an error naming the first such group."""
    if name not in batch.schema.names:
        return None
    column = batch.column(name)
    if column.null_count == len(column):
        return None
    if column.null_count:
        row = int(np.flatnonzero(~column.is_valid().to_numpy(zero_copy_only=False))[0])
        raise LayoutError(f"GroupCollator: {name}: null at group {row} (set in other groups)")
    return column


@dataclass(frozen=True)
class GroupCollator:
    """A callable ``pa.Table -> dict[str, torch.Tensor]`` over group rows.

    Parameters
    ----------
    pad_token_id:
        Pad id of the padded tensors.
    mode:
        ``"padded"``: ``input_ids``/``position_ids``/``attention_mask`` ``[N, W]`` with the
        batch's N samples right-padded to the longest ``[prompt | completion]``;
        ``"packed"``: ``input_ids``/``position_ids`` ``[1, T]`` (no padding) with
        ``cu_seqlens`` int32 ``[N + 1]``; ``"completions"``: completion tensors only (no
        prompt ids needed).
    max_prompt_len, max_completion_len:
        Keep the first so many prompt / completion tokens (default: all).
    eos_token_id:
        Makes the completion mask EOS-aware (a token counts up to the first EOS).
    sample_columns, token_columns:
        Which per-completion columns to return as ``[N]`` tensors and per-token columns as
        ``[N, L]`` tensors padded with 0 (aligned with ``completion_ids``); absent or all-null
        columns are left out.

    Returns (keys)
    --------------
    ``group_offsets`` int64 ``[P + 1]``; ``completion_ids``, ``completion_mask`` int64
    ``[N, L]`` (as :func:`~maxent_arrow.ingest.build_score_batch` makes them); in the padded
    and packed modes ``input_ids``, ``position_ids`` (real positions, restarting per sequence
    when packed), ``loss_mask`` (bool: the completion tokens whose log-prob counts, i.e. that
    have a left context; the logits predicting token ``t`` are at ``t - 1``), and
    ``attention_mask`` (padded) or ``cu_seqlens`` int32 ``[N + 1]`` (packed); plus the sample
    and token columns by name. The tensors equal what ``packing.sequence_layout`` and
    ``packing.iter_chunks`` build for one chunk of the same samples.
    """

    pad_token_id: int = 0
    mode: Literal["padded", "packed", "completions"] = "padded"
    max_prompt_len: int | None = None
    max_completion_len: int | None = None
    eos_token_id: int | None = None
    sample_columns: tuple[str, ...] = SAMPLE_COLUMNS
    token_columns: tuple[str, ...] = TOKEN_COLUMNS

    def __post_init__(self) -> None:
        if self.mode not in ("padded", "packed", "completions"):
            raise LayoutError(
                f"GroupCollator: mode must be 'padded', 'packed' or 'completions', got "
                f"{self.mode!r}"
            )

    def __call__(self, batch: pa.Table | pa.RecordBatch) -> dict[str, torch.Tensor]:
        rows = _as_batch(batch)
        if "completion_ids" not in rows.schema.names:
            raise SchemaError("GroupCollator: the group rows have no 'completion_ids' column")
        prompt_limit = _NO_LIMIT if self.max_prompt_len is None else self.max_prompt_len
        if self.mode == "completions":
            # build_score_batch needs prompt ids it will not use here: give it empty ones.
            rows = rows.drop_columns(
                [c for c in ("prompt_ids", "prompt") if c in rows.schema.names]
            )
            empty = pa.array([[]] * rows.num_rows, pa.list_(pa.int32()))
            rows = rows.append_column("prompt_ids", empty)
        score = build_score_batch(
            rows,
            pad_token_id=self.pad_token_id,
            max_prompt_len=prompt_limit,
            slice_size=0,
            eos_token_id=self.eos_token_id,
            max_completion_len=self.max_completion_len,
        )
        out: dict[str, torch.Tensor] = {
            "group_offsets": torch.from_numpy(list_offsets(rows.column("completion_ids"))),
            "completion_ids": score.completion_ids,
            "completion_mask": score.completion_attention_mask,
        }
        if self.mode != "completions":
            samples = rows.column("completion_ids").flatten()
            out.update(self._model_inputs(score, samples))
        width = int(score.completion_ids.shape[1])
        for name in self.sample_columns:
            column = _present(rows, name)
            if column is not None:
                out[name] = arrow_to_torch(column.flatten(), field=name)
        for name in self.token_columns:
            column = _present(rows, name)
            if column is not None:
                tokens = Ragged.from_arrow(column.flatten())
                out[name], _ = tokens.to_padded(0, max_len=width)
        return out

    def _model_inputs(self, score, samples: pa.Array) -> dict[str, torch.Tensor]:
        """``[prompt | completion]`` model inputs in numpy index arithmetic, a handful of
        passes over the tokens (the loader's hot path; ``packing.sequence_layout`` gives the
        same tensors through a pad/unpad round trip that costs several times more)."""
        prompts = score.column("prompt_ids")
        p_off = list_offsets(prompts)
        p_vals = np.asarray(prompts.flatten().to_numpy(zero_copy_only=False))
        c_off = list_offsets(samples)
        c_vals = np.asarray(samples.flatten().to_numpy(zero_copy_only=False))
        p_len = np.diff(p_off)
        # Completion tokens that count: EOS-aware and width-capped, as ingestion masked them.
        # (numpy, one thread: a torch row sum waits for a free core on a busy machine,
        # 5 ms instead of 0.1 ms measured by benchmarks/bench_distributed.py)
        c_len = score.completion_attention_mask.numpy().sum(1)
        lengths = p_len + c_len
        n = len(lengths)
        c_cum = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(c_len, out=c_cum[1:])
        kept = np.arange(int(c_cum[-1]), dtype=np.int64)
        # Source of kept completion token j: its sample's start plus its place in the sample.
        if np.array_equal(c_len, np.diff(c_off)):
            c_src = c_vals
        else:
            c_src = c_vals[np.repeat(c_off[:-1] - c_cum[:-1], c_len) + kept]
        first_scored = np.maximum(p_len, 1)  # a window's first token has no context
        if self.mode == "padded":
            width = max(int(lengths.max()) if n else 0, 1)
            # Two boolean-mask scatters, prompt tokens then completion tokens, each in row
            # order (cheaper than scatters through int64 index arrays).
            real = prefix_mask(lengths, width)
            in_prompt = prefix_mask(p_len, width)
            completion = real & ~in_prompt
            ids = np.full((n, width), self.pad_token_id, dtype=np.int64)
            ids[in_prompt] = p_vals
            ids[completion] = c_src
            # The scored tokens are the completion's, except a first token with no context.
            loss = completion
            no_prompt = np.flatnonzero(first_scored > p_len)
            if no_prompt.size:
                loss = completion.copy()
                loss[no_prompt, 0] = False
            attention = np.empty((n, width), dtype=np.int64)
            np.copyto(attention, real)
            return {
                "input_ids": torch.from_numpy(ids),
                # Right padding: every row's real positions are 0..len-1, so one arange
                # row, expanded (a view; a device copy materialises it).
                "position_ids": torch.arange(width).expand(n, width),
                "attention_mask": torch.from_numpy(attention),
                "loss_mask": torch.from_numpy(loss),
            }
        t_off = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(lengths, out=t_off[1:])
        ids = np.empty(int(t_off[-1]), dtype=np.int64)
        ids[np.repeat(t_off[:-1] - p_off[:-1], p_len) + np.arange(len(p_vals))] = p_vals
        ids[np.repeat(t_off[:-1] + p_len - c_cum[:-1], c_len) + kept] = c_src
        positions = np.arange(len(ids), dtype=np.int64) - np.repeat(t_off[:-1], lengths)
        return {
            "input_ids": torch.from_numpy(ids[None, :]),
            "position_ids": torch.from_numpy(positions[None, :]),
            "cu_seqlens": torch.from_numpy(t_off.astype(np.int32)),
            "loss_mask": torch.from_numpy((positions >= np.repeat(first_scored, lengths))[None]),
        }
